"""bf16/fp16/fp32 GEMV for decode steps: y = x @ W.T (+ bias) for x of at most GEMV_MAX_M rows
and an ``nn.Linear`` weight W (N, K), with the layer's elementwise op before the GEMM done in
the GEMV's loads of x (``ModelRunner(decode_gemv=True)``, issue #38).

At 1-8 rows a projection is a weight stream: cuBLAS's small-M kernels leave HBM bandwidth
unused at these shapes, and the decode layer's norms and SiLU-and-multiply are separate
launches. This is :mod:`sched_lab.backend.quant_gemv`'s 8-bit branch without the unpacking:
a (BLOCK_N, BLOCK_K) tile of W contiguous along K, float32 products, K split over programs
until the grid fills the GPU and the partials summed in split order by the tile's last
program (its ``_split_k_store`` epilogue: deterministic, one launch, CUDA-graph safe). The
prologues (``PROLOGUE``) give the x the GEMM multiplies:

* ``silu_mul``: X is gate_up's output (M, 2K), x = silu(gate) * up, rounded where
  :func:`sched_lab.backend.triton_ops.silu_and_mul` rounds (down_proj);
* ``rms_norm``: x = RMSNorm(X [+ residual]) * w, rounded where
  :func:`sched_lab.backend.triton_ops.rms_norm` rounds; each program first sums the squares
  of the whole row (M <= 8 rows of K <= ~8k: an L2-resident pass); the sum X + residual is
  written once, by the programs of N tile 0 (each its own K range) (qkv_proj, gate_up_proj).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sched_lab.backend.quant_gemv import GEMV_MAX_M, GemvConfig, _split_k_store

#: the prologues: what x the GEMM multiplies, from what the kernel loads
PROLOGUES = {"none": 0, "silu_mul": 1, "rms_norm": 2}


@triton.jit
def _load_x(X, R, NW, rm, rk, m_ok, k_ok, K, stride_xm, stride_rm, inv,
            PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """x[rm, rk] (BLOCK_M, BLOCK_K) float32 after the prologue (0 outside the masks)."""
    mask = m_ok[:, None] & k_ok[None, :]
    DTYPE: tl.constexpr = X.dtype.element_ty
    ptr = X + rm[:, None] * stride_xm + rk[None, :]
    if PROLOGUE == 1:  # silu(gate) * up, as _silu_and_mul_kernel
        gate = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptr + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
        x = (act * up).to(DTYPE).to(tl.float32)
    elif PROLOGUE == 2:  # w * norm(s), as _rms_norm_kernel
        s = _load_sum(X, R, rm, rk, mask, stride_xm, stride_rm, HAS_RES).to(tl.float32)
        normed = (s * inv[:, None]).to(DTYPE).to(tl.float32)
        w = tl.load(NW + rk, mask=k_ok, other=0.0).to(tl.float32)
        x = (w[None, :] * normed).to(DTYPE).to(tl.float32)
    else:
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _load_sum(X, R, rm, rk, mask, stride_xm, stride_rm, HAS_RES: tl.constexpr):
    """s = X [+ R] at (rm, rk), rounded to X's dtype (as the eager residual add)."""
    x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rm[:, None] * stride_rm + rk[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return x


@triton.jit
def _dense_gemv_kernel(
    X, R, RO, NW, W, Bias, Out, WS, CNT, M, N, K, stride_xm, stride_rm, stride_rom, stride_w0,
    stride_om, K_PER_SPLIT, NUM_SPLITS, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Out[m, n] = sum_k x[m, k] W[n, k] (+ Bias[n]) for m < M, x = the prologue of X; the
    program (n tile, split) covers K_PER_SPLIT of K (a multiple of BLOCK_K). With the
    rms_norm prologue and a residual, N tile 0's programs write X + R to RO."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk0 = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 2:  # the whole row's sum of squares (float32), then 1 / rms
        ss = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + rk0
            mask = m_ok[:, None] & (rk < K)[None, :]
            s = _load_sum(X, R, rm, rk, mask, stride_xm, stride_rm, HAS_RES).to(tl.float32)
            ss += s * s
        inv = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
        if HAS_RES:
            if pid == 0:  # the summed residual, once: this split's K range
                for k0 in range(k_start, k_end, BLOCK_K):
                    rk = k0 + rk0
                    mask = m_ok[:, None] & (rk < k_end)[None, :]
                    s = _load_sum(X, R, rm, rk, mask, stride_xm, stride_rm, HAS_RES)
                    tl.store(RO + rm[:, None] * stride_rom + rk[None, :], s, mask=mask)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + rk0
        k_ok = rk < k_end
        w = tl.load(W + rn[:, None] * stride_w0 + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        x = _load_x(X, R, NW, rm, rk, m_ok, k_ok, K, stride_xm, stride_rm, inv, PROLOGUE,
                    HAS_RES)  # fmt: skip
        acc3 += x[:, None, :] * w[None, :, :]
    acc = tl.sum(acc3, axis=2)
    _split_k_store(acc, Out, WS, CNT, Bias, rm, rn, m_ok, n_ok, M, N, stride_om, pid, split,
                   NUM_SPLITS, SPLIT_K, HAS_BIAS)  # fmt: skip


def dense_gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """The bf16 tiles: 16 columns, a K tile of 512 / the padded rows (at least 64), so the
    (rows, N, K) float32 products stay 8k a program; split until 2 programs per SM. A
    guess from the 8-bit winner (16, 512) until benchmarks/decode_gemv.py sweeps it."""
    block_m = max(1, triton.next_power_of_2(m))
    return GemvConfig(16, max(64, 512 // block_m), 2, 4, 2)


def _plan(m: int, n: int, k: int, sms: int, c: GemvConfig) -> tuple[int, int, int]:
    """(block_m, splits, k_per_split): K split in powers of 2 while the grid has fewer than
    ``c.split_sms`` programs per SM, each split keeping >= 2 K tiles."""
    if m > GEMV_MAX_M:
        raise ValueError(f"decode GEMV: {m} rows; at most {GEMV_MAX_M}")
    tiles = triton.cdiv(n, c.block_n)
    k_tiles = triton.cdiv(k, c.block_k)
    split = 1
    while tiles * split < c.split_sms * sms and split * 2 * 2 <= k_tiles:
        split *= 2
    steps = triton.cdiv(k_tiles, split)
    return max(1, triton.next_power_of_2(m)), triton.cdiv(k_tiles, steps), steps * c.block_k


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, s): y = p(x) @ weight.T (+ bias), (M, N) in x's dtype, for x (M <= GEMV_MAX_M,
    K_x) and weight (N, K) contiguous along K, float32 accumulation.

    ``prologue`` p: "none" (K_x = K), "silu_mul" (x = [gate | up], K_x = 2K: silu(gate) * up),
    "rms_norm" (K_x = K: norm_weight * RMSNorm(x [+ residual]) with ``eps``). s is x +
    residual (M, K) for "rms_norm" with a residual, else None. ``config``:
    :func:`dense_gemv_config`'s when None. The first split call on a device must not be
    inside a CUDA graph capture (the split-K counters are made then)."""
    from sched_lab.backend.quant_kernels import _num_sms, _split_counters

    if prologue not in PROLOGUES:
        raise ValueError(f"decode GEMV: prologue {prologue!r}; expected one of {list(PROLOGUES)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    n, k = weight.shape
    want_k = 2 * k if prologue == "silu_mul" else k
    if x.shape[1] != want_k or weight.stride(1) != 1:
        raise ValueError(f"decode GEMV: x {tuple(x.shape)} for weight {tuple(weight.shape)} "
                         f"with prologue {prologue!r}; expected K_x = {want_k}, W contiguous")  # fmt: skip
    if prologue == "rms_norm" and norm_weight is None:
        raise ValueError("decode GEMV: prologue 'rms_norm' needs norm_weight")
    c = config or dense_gemv_config(m, n, k)
    block_m, splits, k_per_split = _plan(m, n, k, _num_sms(x.device), c)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_res = prologue == "rms_norm" and residual is not None
    summed = torch.empty(m, k, dtype=x.dtype, device=x.device) if has_res else None
    r = residual.contiguous() if has_res else x
    ro = summed if summed is not None else out
    if splits > 1:
        ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = out
    _dense_gemv_kernel[(triton.cdiv(n, c.block_n), splits)](
        x, r, ro, x if norm_weight is None else norm_weight, weight,
        out if bias is None else bias, out, ws, counters, m, n, k, x.stride(0), r.stride(0),
        ro.stride(0), weight.stride(0), out.stride(0), k_per_split, splits, eps,
        PROLOGUE=PROLOGUES[prologue], HAS_RES=has_res, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=splits > 1,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out, summed
