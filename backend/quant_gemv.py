"""Quantized GEMMs for decode-sized x: the GEMV (M <= GEMV_MAX_M rows, CUDA cores) and the
swapped-operand tensor-core kernels of fp8/int8 weights (:func:`small_m_gemm`, M <=
SMALL_M_MAX) and int4 weights (:func:`small_m_int4_gemm`, any M in token tiles), described in
their sections below; and, for steps too large for those, :func:`dequant_int4_matmul`
and :func:`dequant_int8_matmul` (the weight dequantized for cuBLAS, act-order GPTQ too). The
kernels stream the weight once from HBM.

The GEMV: y = x @ W.T on CUDA cores, the weight unpacked by bit moves.

At one to a few rows a GEMM reads each weight once and does 2M flops per weight: the time is
the weight bytes over the HBM rate, if the unpacking keeps up. :mod:`quant_kernels`' tiled
kernel pads M to 16 rows and feeds ``tl.dot``: the unpacked tile goes through shared memory
into the tensor-core layout, and on the H200 its int4 GEMMs ran at ~1 TB/s (BENCHMARKS.md,
2026-12-03). This kernel never leaves registers:

* int4 (GPTQ's (K/8, N) layout, AWQ after :func:`~sched_lab.backend.quant_formats.repack_awq`):
  a tile is (BLOCK_K / 8, BLOCK_N) int32 words, coalesced along N, inside one group. For
  nibble j of every word (a static loop of 8), ``((w >> 4j) & 0xF) | 0x4B000000`` read as a
  float32 is 2^23 + q exactly; minus 2^23 + z it is q - z, with no int-to-float
  conversion instruction (a slow one). The products with x[k0 + 8r + j] accumulate per
  (row, word row, column); the group scale multiplies once per tile. One row can instead
  unpack the 8 nibbles as one (rows, 8, N) tensor against x loaded as (rows, 8)
  (``GemvConfig.nibbles_3d``; the faster on the H200).
* int8 / fp8 ((N, K) bytes, contiguous along K): a (BLOCK_N, BLOCK_K) tile; int8 through
  the same float32 trick (``(b ^ 0x80) | 0x4B000000`` minus 2^23 + 128), fp8 e4m3 by the
  hardware conversion on CUDA (``FP8_CVT``) or, in the interpreter, by bit moves into a
  float16 holding value / 2^8. One scale per output column at the end.

K is split over programs until the grid fills the GPU (``GemvConfig.split_sms``); the
partials of a tile go to a float32 workspace and the tile's last program (counted with an
atomic, per-device counters of :func:`sched_lab.backend.quant_kernels._split_counters`) sums
them in split order and writes the output: one launch per GEMM, deterministic, CUDA-graph
safe. The tiles come from :func:`gemv_config` (benchmarks/quant_gemv.py sweeps them on the
GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sched_lab.backend.attention.triton_backend import interpreting
from sched_lab.backend.quant_formats import QuantSpec, awq_is_repacked
from sched_lab.backend.quant_kernels import (
    MAX_TILES,
    SMALL_M_MAX,
    SmallMConfig,
    small_m_config,
    small_m_supported,
)

GEMV_MAX_M = 8  # rows the kernel takes (BLOCK_M = M rounded up to a power of 2)
MAGIC = 8388608.0  # 2^23: float32 0x4B000000; its low 23 mantissa bits hold an integer


@triton.jit
def _gemv_kernel(
    X, QW, QZ, S, Out, WS, CNT, M, N, K, stride_xm, stride_qw0, stride_qz0, stride_s0,
    stride_om, K_PER_SPLIT, NUM_SPLITS,
    INT4: tl.constexpr, FP8: tl.constexpr, FP8_CVT: tl.constexpr, ZERO_PLUS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, NIBBLES_3D: tl.constexpr = False,
):  # fmt: skip
    """Out[m, n] = sum_k X[m, k] W[n, k] for m < M; program (n tile, split) covers K_PER_SPLIT
    of K (a multiple of BLOCK_K; int4: BLOCK_K divides GROUP, so a tile is in one group)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if INT4:
        ROWS: tl.constexpr = BLOCK_K // 8
        rr = tl.arange(0, ROWS)
        acc3 = tl.zeros((BLOCK_M, ROWS, BLOCK_N), dtype=tl.float32)
        col_shift = (rn % 8) * 4
        for k0 in range(k_start, k_end, BLOCK_K):
            words = tl.load(QW + (k0 // 8 + rr)[:, None] * stride_qw0 + rn[None, :],
                            mask=n_ok[None, :], other=0)  # fmt: skip
            g = k0 // GROUP
            zw = tl.load(QZ + g * stride_qz0 + rn // 8, mask=n_ok, other=0)
            zf = (((zw >> col_shift) & 0xF) + ZERO_PLUS).to(tl.float32) + 8388608.0
            s = tl.load(S + g * stride_s0 + rn, mask=n_ok, other=0.0).to(tl.float32)
            if NIBBLES_3D:  # (ROWS, 8, BLOCK_N) codes; x as (ROWS, 8), one load a row
                jj = tl.arange(0, 8)
                bits = ((words[:, None, :] >> (jj * 4)[None, :, None]) & 0xF) | 0x4B000000
                q = bits.to(tl.float32, bitcast=True) - zf[None, None, :]
                x = tl.load(X + k0 + rr[:, None] * 8 + jj[None, :]).to(tl.float32)
                part = tl.sum(x[:, :, None] * q, axis=1)
                acc3 += (part * s[None, :])[None, :, :]
            else:
                part = tl.zeros((BLOCK_M, ROWS, BLOCK_N), dtype=tl.float32)
                for j in tl.static_range(8):
                    xj = tl.load(X + rm[:, None] * stride_xm + (k0 + rr * 8 + j)[None, :],
                                 mask=m_ok[:, None], other=0.0).to(tl.float32)  # fmt: skip
                    bits = ((words >> (4 * j)) & 0xF) | 0x4B000000
                    qj = bits.to(tl.float32, bitcast=True) - zf[None, :]
                    part += xj[:, :, None] * qj[None, :, :]
                acc3 += part * s[None, None, :]
        acc = tl.sum(acc3, axis=1)
    else:
        rk0 = tl.arange(0, BLOCK_K)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            rk = k0 + rk0
            k_ok = rk < k_end
            raw = tl.load(QW + rn[:, None] * stride_qw0 + rk[None, :],
                          mask=n_ok[:, None] & k_ok[None, :], other=0)  # fmt: skip
            if FP8 and FP8_CVT:
                w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            elif FP8:  # e4m3 bits into a float16's: value / 2^8, exactly
                b = raw.to(tl.uint16)
                w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
                w = w.to(tl.float32)
            else:  # int8 q: (q + 128) | 0x4B000000 is 2^23 + 128 + q
                b = (raw.to(tl.int32) & 0xFF) ^ 0x80
                w = (b | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            x = tl.load(X + rm[:, None] * stride_xm + rk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
            acc3 += x[:, None, :] * w[None, :, :]
        acc = tl.sum(acc3, axis=2)
        s = tl.load(S + rn, mask=n_ok, other=0.0).to(tl.float32)
        if FP8 and not FP8_CVT:
            s = s * 256.0
        acc = acc * s[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    out_ptr = Out + rm[:, None] * stride_om + rn[None, :]
    if not SPLIT_K:
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=o_mask)
    else:  # partial to the workspace; the tile's last program sums all, in split order
        ws = WS + rm[:, None] * N + rn[None, :]
        tl.store(ws + split * M * N, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is written before the count
        arrived = tl.atomic_add(CNT + pid, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(NUM_SPLITS):
                total += tl.load(ws + i * M * N, mask=o_mask, other=0.0, cache_modifier=".cv")
            tl.store(out_ptr, total.to(Out.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(CNT + pid, 0)


@dataclass(frozen=True)
class GemvConfig:
    """Launch choices: ``block_n`` output columns and ``block_k`` inputs per program step
    (int4: cut to the group's largest power-of-2 divisor), K split in powers of 2 while the
    grid has fewer than ``split_sms`` programs per SM (each split keeps >= 2 K tiles),
    ``num_warps``, ``num_stages``; ``nibbles_3d`` (int4, one row): the 8 nibbles of a word
    as one (rows, 8, N) tensor, x loaded as (rows, 8), rather than a static loop of 8."""

    block_n: int
    block_k: int
    split_sms: int
    num_warps: int
    num_stages: int
    nibbles_3d: bool = False


def gemv_config(m: int, n: int, k: int, spec: QuantSpec) -> GemvConfig:
    """The tiles the engine uses: the winners of ``benchmarks/quant_gemv.py`` on the H200 for
    the Llama-3.1-8B projections at M = 1 (BENCHMARKS.md, 2026-12-04; the runners-up were
    within 1-8%): int4 (256, 64) split until 8 programs per SM for a wide N (gate_up),
    (128, 128) until 2 otherwise, nibbles as one tensor; 8 bits (16, 512) until 2."""
    if spec.method in ("awq", "gptq"):
        if n >= 16384:
            return GemvConfig(256, 64, 8, 4, 2, nibbles_3d=True)
        return GemvConfig(128, 128, 2, 4, 2, nibbles_3d=True)
    return GemvConfig(16, 512, 2, 4, 2)


@dataclass(frozen=True)
class GemvPlan:
    """One launch: ``splits`` programs per N tile over ``k_per_split`` inputs each."""

    block_m: int
    block_k: int
    splits: int
    k_per_split: int


def gemv_plan(m: int, n: int, k: int, spec: QuantSpec, sms: int, c: GemvConfig) -> GemvPlan:
    """The split of K for config ``c`` on ``sms`` SMs (int4: splits on whole groups)."""
    if m > GEMV_MAX_M:
        raise ValueError(f"quantized GEMV: {m} rows; at most {GEMV_MAX_M}")
    int4 = spec.method in ("awq", "gptq")
    block_k = min(c.block_k, spec.group_size & -spec.group_size) if int4 else c.block_k
    if int4 and k % block_k:
        raise ValueError(f"quantized GEMV: K={k} is not a multiple of the K tile {block_k}")
    tiles = triton.cdiv(n, c.block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < c.split_sms * sms and split * 2 * 2 <= k_tiles:
        split *= 2
    steps = triton.cdiv(k_tiles, split)
    if int4:  # a split starts on a group boundary (one scale row per K tile)
        per_group = spec.group_size // block_k
        steps = triton.cdiv(steps, per_group) * per_group
    splits = triton.cdiv(k_tiles, steps)
    return GemvPlan(max(1, triton.next_power_of_2(m)), block_k, splits, steps * block_k)


def gemv_supported(spec: QuantSpec, m: int) -> bool:
    """Whether :func:`quant_gemv` takes this step: at most GEMV_MAX_M rows, and no act-order
    (its rows' groups follow g_idx: the tiled kernel's path)."""
    return m <= GEMV_MAX_M and not spec.act_order


def quant_gemv(
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    spec: QuantSpec,
    out_features: int,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x (M <= GEMV_MAX_M, K) bf16/fp16/fp32 @ W.T for a gptq, awq (repacked), int8 or fp8 W
    (fp8 weight-only: x is not quantized): (M, N) in x's dtype. ``config``:
    :func:`gemv_config`'s when None. The first call on a device must not be inside a CUDA
    graph capture (the split-K counters are made then)."""
    from sched_lab.backend.quant_kernels import _num_sms, _split_counters

    if spec.act_order:
        raise ValueError("quant_gemv: act-order GPTQ runs the tiled kernel")
    x = x.contiguous()
    m, k = x.shape
    n = out_features
    c = config or gemv_config(m, n, k, spec)
    plan = gemv_plan(m, n, k, spec, _num_sms(x.device), c)
    int4 = spec.method in ("awq", "gptq")
    if int4:
        if spec.method == "awq" and not awq_is_repacked(tensors):
            raise ValueError("quant_gemv: awq tensors in the checkpoint layout; "
                             "repack them with quant_formats.repack_awq first")  # fmt: skip
        qw, qz, s = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    else:
        qw = tensors["weight"]
        qw = qw.view(torch.uint8) if spec.method == "fp8" else qw
        qz, s = qw, tensors["weight_scale"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if plan.splits > 1:
        ws = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = out
    tiles = triton.cdiv(n, c.block_n)
    _gemv_kernel[(tiles, plan.splits)](
        x, qw, qz, s, out, ws, counters, m, n, k, x.stride(0), qw.stride(0), qz.stride(0),
        s.stride(0), out.stride(0), plan.k_per_split, plan.splits,
        INT4=int4, FP8=spec.method == "fp8", FP8_CVT=not interpreting(),
        ZERO_PLUS=1 if spec.method == "gptq" else 0,
        GROUP=spec.group_size if int4 else 1, BLOCK_M=plan.block_m, BLOCK_N=c.block_n,
        BLOCK_K=plan.block_k, SPLIT_K=plan.splits > 1, NIBBLES_3D=c.nibbles_3d and m == 1,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- the small-M kernel
# Weight-only fp8 / int8 for steps of M <= SMALL_M_MAX rows on tensor cores, the operands
# swapped: y.T = W @ x.T. An MMA pads a few tokens on its M side (16 rows with mma.sync, 64
# with Hopper's wgmma), and cuBLAS's fp8 W8A8 ``_scaled_mm`` read the 8B projections'
# weights at 1.0-2.5 TB/s at M = 2-16 on an H200 (BENCHMARKS.md, 2026-12-06). Here the
# weight's output rows are the MMA's M side (BLOCK_N of them) and the tokens its N side (M
# rounded up to 16, 32 or 64). Each program streams a (BLOCK_N, K split) slab of W once and
# turns each (BLOCK_N, BLOCK_K) tile into float16 in registers: fp8 e4m3 by the hardware's
# e4m3x2 -> f16x2 conversion (``FP8_CVT``; the interpreter moves the bits into a float16
# holding value / 2^8, exactly), int8 q as ``(q ^ 0x80) | 0x6400`` read as a float16 (1024 +
# 128 + q) minus 1152. ``tl.dot`` with x.T in float16 accumulates in float32; one scale per
# output row at the end.
#
# Numerics: the weights are exact in float16 and the sums float32, so the result is the
# float32 reference's for x rounded to float16 (bf16 x is exact in float16 from 2^-14 to
# 65504; |x| above 65504 overflows: the caller's contract).
#
# K is split over programs until the grid fills the GPU, and the partials are summed by each
# tile's last program as in the GEMV above: one launch, deterministic, CUDA-graph safe.


@triton.jit
def _store_transposed(acc, Out, WS, CNT, M, N, stride_om, rm, rn, pid, split, NUM_SPLITS,
                      SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Write ``acc`` (BLOCK_N output columns rn, BLOCK_M rows rm) to Out[rm, rn] (rows below
    M). SPLIT_K: store it as split ``split``'s partial in the float32 workspace WS (NUM_SPLITS,
    M, N); the tile's last program (counted in CNT[pid], reset after) sums the partials in
    split order and writes Out."""
    o_mask = (rm < M)[None, :] & (rn < N)[:, None]
    out_ptr = Out + rm[None, :] * stride_om + rn[:, None]
    if not SPLIT_K:
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=o_mask)
    else:
        ws = WS + rm[None, :] * N + rn[:, None]
        tl.store(ws + split * M * N, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial is written before the count
        arrived = tl.atomic_add(CNT + pid, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in range(NUM_SPLITS):
                total += tl.load(ws + i * M * N, mask=o_mask, other=0.0, cache_modifier=".cv")
            tl.store(out_ptr, total.to(Out.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(CNT + pid, 0)


@triton.jit
def _small_m_kernel(
    X, W, S, Out, WS, CNT, M, N, K, stride_xm, stride_w, stride_om, K_PER_SPLIT, NUM_SPLITS,
    FP8: tl.constexpr, FP8_CVT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Out[m, n] = S[n] * sum_k X[m, k] W[n, k] for m < M; program (n tile, split) covers
    K_PER_SPLIT of K. N is a multiple of BLOCK_N and K of BLOCK_K (the caller checks)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + (k_start + rk)[None, :]
    x_ptr = X + rm[:, None] * stride_xm + (k_start + rk)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(k_start, k_end, BLOCK_K):
        raw = tl.load(w_ptr)
        if FP8 and FP8_CVT:
            w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        elif FP8:  # e4m3 bits into a float16's: value / 2^8, exactly
            b = raw.to(tl.uint16)
            w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
        else:  # int8 q: (q ^ 0x80) | 0x6400 is float16 1024 + 128 + q
            b = ((raw.to(tl.int32) & 0xFF) ^ 0x80) | 0x6400
            w = b.to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
        x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0).to(tl.float16)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    s = tl.load(S + rn).to(tl.float32)
    if FP8 and not FP8_CVT:
        s = s * 256.0
    acc = acc * s[:, None]
    _store_transposed(acc, Out, WS, CNT, M, N, stride_om, rm, rn, pid, split, NUM_SPLITS,
                      SPLIT_K, BLOCK_N, BLOCK_M)  # fmt: skip


def split_of(n: int, k: int, sms: int, c: SmallMConfig, m_tiles: int = 1) -> tuple[int, int]:
    """(splits, k_per_split): K split in powers of 2 while the grid (``m_tiles`` token tiles
    of ``n // c.block_n`` output tiles) has fewer than ``c.split_sms * sms`` programs and
    each split keeps >= ``c.min_k_tiles`` K tiles."""
    tiles, k_tiles = m_tiles * (n // c.block_n), k // c.block_k
    split = 1
    while tiles * split < c.split_sms * sms and k_tiles >= split * 2 * c.min_k_tiles:
        split *= 2
    steps = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, steps), steps * c.block_k


def small_m_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    method: str,
    config: SmallMConfig | None = None,
) -> torch.Tensor:
    """x (M <= SMALL_M_MAX, K) bf16/fp16/fp32 @ (weight * weight_scale).T for an fp8 (e4m3) or
    int8 weight (N, K), contiguous along K, with weight_scale (N, 1) float32 contiguous:
    (M, N) in x's dtype. x is multiplied in float16: rounded (fp32 x), exact (bf16 x from
    2^-14 to 65504), inf where |x| > 65504. ``config``: :func:`small_m_config`'s when None.
    Raises ValueError for a shape :func:`small_m_supported` refuses or operands off this
    contract. The first call on a device must not be inside a CUDA graph capture (the
    split-K counters are made then)."""
    from sched_lab.backend.quant_kernels import _num_sms, _split_counters

    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    c = config or small_m_config(m, n, k, method)
    if method not in ("fp8", "int8") or not small_m_supported(method, m, n, k, c):
        raise ValueError(
            f"small_m_gemm: {method} M={m} N={n} K={k}; takes fp8/int8, M <= {SMALL_M_MAX}, "
            f"N a multiple of {c.block_n}, K of {c.block_k}"
        )
    if weight.shape[1] != k or weight.stride(1) != 1 or weight_scale.numel() != n:
        raise ValueError(
            f"small_m_gemm: weight {tuple(weight.shape)} (stride {weight.stride()}) and "
            f"weight_scale of {weight_scale.numel()} values for x (M, {k}); expected ({n}, {k}) "
            f"contiguous along K and {n} scales"
        )
    weight_scale = weight_scale.reshape(-1).contiguous()
    splits, k_per_split = split_of(n, k, _num_sms(x.device), c)
    w = weight.view(torch.uint8) if method == "fp8" else weight
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if splits > 1:
        ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = out
    _small_m_kernel[(n // c.block_n, splits)](
        x, w, weight_scale, out, ws, counters, m, n, k, x.stride(0), w.stride(0),
        out.stride(0), k_per_split, splits, FP8=method == "fp8", FP8_CVT=not interpreting(),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        SPLIT_K=splits > 1, num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- the small-M int4 kernel
# The same swap for int4 weights in GPTQ's layout (AWQ after ``repack_awq``): qweight (K/8,
# N) int32, row k of the weight in nibble k % 8 of word row k // 8. A program loads a
# (BLOCK_N, BLOCK_K / 8) tile of words (one group: BLOCK_K divides the group size) and makes
# each nibble j of the words its own (BLOCK_N, BLOCK_K / 8) operand, against x's columns k0
# + 8r + j: eight dots a tile, each over BLOCK_K / 8 >= 16 inputs, and no reshape. Nibbles j
# and j + 4 come out of a word together: ``(w >> 4j) & 0x000F000F | 0x64006400`` holds two
# float16s, 1024 + q each; minus the float16 1024 + zero they are q - zero, exactly (|q -
# zero| <= 16). The sums are float32, and the group's scale multiplies each tile's sum.
# Numerics as the fp8 kernel's: x rounded to float16, float32 sums.
#
# On an H100 (8B projections, BENCHMARKS.md 2026-12-06) this way of unpacking was as fast as
# or faster (by up to 18%) than three others: one mask per nibble; the zero point taken off
# after the dot ((1024 + zero) * sum(x)); the tile unpacked whole by a reshape, one dot a
# tile (up to 2x slower).
#
# More tokens than BLOCK_M run as token tiles (a grid axis, the fastest: the token tiles of
# a weight tile run together and the L2 serves its re-reads). Gathering x's columns 8 apart
# wastes most of each 32-byte sector; with X_LAYOUT 1 the caller permutes x within each K
# tile (8r + j -> ROWS j + r) so that nibble j meets ROWS contiguous inputs: 0.83-0.91x the
# time from 32 to 128 tokens (BENCHMARKS.md, 2026-12-06, evening). Past ~128 tokens the
# unpacking, repeated for every token tile, costs more than dequantizing the weight once
# for cuBLAS (:func:`dequant_int4_matmul`).


@triton.jit
def _int4_pair(words, zf, J: tl.constexpr):
    """Nibbles J and J + 4 of ``words`` (BLOCK_N, ROWS) less the zeros ``zf`` (float16 1024 +
    zero, per row): two (BLOCK_N, ROWS) float16 tiles."""
    v = ((words >> (4 * J)) & 0x000F000F) | 0x64006400  # both nibbles by one mask
    lo = v.to(tl.int16).to(tl.float16, bitcast=True) - zf[:, None]
    hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True) - zf[:, None]
    return lo, hi


@triton.jit
def _small_m_int4_kernel(
    X, QW, QZ, S, Out, WS, CNT, M, N, K, stride_xm, stride_qw0, stride_qz0, stride_s0,
    stride_om, K_PER_SPLIT, NUM_SPLITS,
    ZERO_PLUS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    X_LAYOUT: tl.constexpr,
):  # fmt: skip
    """Out[m, n] = sum_k X[m, k] (q[k, n] - z[g(k), n]) s[g(k), n] for m < M; program (token
    tile, n tile, split) covers BLOCK_M tokens and K_PER_SPLIT of K (the token tiles of one
    weight tile run one after the other: it is read from HBM once while the L2 holds it). N
    is a multiple of BLOCK_N, K of BLOCK_K, BLOCK_K divides GROUP and is at least 128 (the
    caller checks). X_LAYOUT (how a K tile's inputs k0 + 8r + j meet nibble j of word row r):
    0, X as given, gathered 8 apart; 1, X permuted by the caller within each K tile to
    k0 + ROWS j + r (16 contiguous inputs a nibble); 3, the nibbles joined into the tile in
    registers, one dot. (2, one load of x split into nibbles in registers, lost at every M
    above 16 and was removed: BENCHMARKS.md, 2026-12-06, evening.)"""
    pid_m = tl.program_id(0)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_K // 8
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, ROWS)
    m_ok = rm < M
    col_shift = (rn % 8) * 4
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_rows = X + rm[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        words = tl.load(QW + (k0 // 8 + rr)[None, :] * stride_qw0 + rn[:, None])
        g = k0 // GROUP
        z = ((tl.load(QZ + g * stride_qz0 + rn // 8) >> col_shift) & 0xF) + ZERO_PLUS
        zf = (z | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + zero
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if X_LAYOUT == 3:
            # the 8 nibbles joined back into the tile's natural order (column 8 r + j of
            # word row r's nibble j: a join adds the minor axis, so j's bits are joined from
            # the major one, b2 = lo/hi, down), one dot of BLOCK_K inputs against x as given
            p0 = tl.join(*_int4_pair(words, zf, 0))
            p1 = tl.join(*_int4_pair(words, zf, 1))
            p2 = tl.join(*_int4_pair(words, zf, 2))
            p3 = tl.join(*_int4_pair(words, zf, 3))
            w = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BLOCK_N, BLOCK_K))
            rk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + rk[:, None], mask=m_ok[None, :], other=0.0)
            part = tl.dot(w, xt.to(tl.float16), part)
        else:
            for j in tl.static_range(4):  # nibbles j and j + 4 of every word
                if X_LAYOUT == 1:
                    k_lo = k0 + j * ROWS + rr
                    k_hi = k_lo + 4 * ROWS
                else:
                    k_lo = k0 + rr * 8 + j
                    k_hi = k_lo + 4
                lo, hi = _int4_pair(words, zf, j)
                x_lo = tl.load(x_rows + k_lo[:, None], mask=m_ok[None, :], other=0.0)
                x_hi = tl.load(x_rows + k_hi[:, None], mask=m_ok[None, :], other=0.0)
                part = tl.dot(lo, x_lo.to(tl.float16), part)
                part = tl.dot(hi, x_hi.to(tl.float16), part)
        s = tl.load(S + g * stride_s0 + rn).to(tl.float32)
        acc += part * s[:, None]
    tile = pid_m * tl.num_programs(1) + pid  # the output tile's split-K counter
    _store_transposed(acc, Out, WS, CNT, M, N, stride_om, rm, rn, tile, split, NUM_SPLITS,
                      SPLIT_K, BLOCK_N, BLOCK_M)  # fmt: skip


def small_m_int4_gemm(
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    spec: QuantSpec,
    out_features: int,
    config: SmallMConfig | None = None,
) -> torch.Tensor:
    """x (M, K) bf16/fp16/fp32 @ W.T for a gptq or awq (repacked) W without act-order: (M, N)
    in x's dtype, x multiplied in float16 as in :func:`small_m_gemm`; M above
    ``config.block_m`` in token tiles of that many.
    ``config``: :func:`small_m_config`'s when None. Raises ValueError for what
    :func:`small_m_supported` refuses or AWQ tensors in the checkpoint layout. The first call
    on a device must not be inside a CUDA graph capture (the split-K counters are made
    then)."""
    from sched_lab.backend.quant_kernels import _num_sms, _split_counters

    x = x.contiguous()
    m, k = x.shape
    n = out_features
    c = config or small_m_config(m, n, k, spec.method)
    if spec.act_order or not small_m_supported(spec.method, m, n, k, c, spec.group_size):
        raise ValueError(
            f"small_m_int4_gemm: {spec.method} M={m} N={n} K={k} group {spec.group_size}"
            f"{' act-order' if spec.act_order else ''}; takes gptq/awq without act-order, "
            f"N a multiple of {c.block_n}, K of {c.block_k}, the K tile (>= 128) dividing the "
            "group, token tiles (block_m) a power of 2 from 16 to 256"
        )
    if spec.method == "awq" and not awq_is_repacked(tensors):
        raise ValueError("small_m_int4_gemm: awq tensors in the checkpoint layout; "
                         "repack them with quant_formats.repack_awq first")  # fmt: skip
    qw, qz, s = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    if c.x_layout == 1:  # k0 + 8 r + j -> k0 + ROWS j + r within each K tile
        x = x.view(m, k // c.block_k, c.block_k // 8, 8).transpose(2, 3).reshape(m, k)
    block_m = min(max(16, triton.next_power_of_2(m)), c.block_m)
    m_tiles = triton.cdiv(m, block_m)
    splits, k_per_split = split_of(n, k, _num_sms(x.device), c, m_tiles)
    if splits > 1 and m_tiles * (n // c.block_n) > MAX_TILES:
        raise ValueError(f"small_m_int4_gemm: {m_tiles * (n // c.block_n)} tiles; split K "
                         f"allows {MAX_TILES}")  # fmt: skip
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if splits > 1:
        ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = out
    _small_m_int4_kernel[(m_tiles, n // c.block_n, splits)](
        x, qw, qz, s, out, ws, counters, m, n, k, x.stride(0), qw.stride(0), qz.stride(0),
        s.stride(0), out.stride(0), k_per_split, splits,
        ZERO_PLUS=1 if spec.method == "gptq" else 0, GROUP=spec.group_size,
        BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        SPLIT_K=splits > 1, X_LAYOUT=c.x_layout, num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out


# ------------------------------------------- weights dequantized for a cuBLAS GEMM
# Above some number of tokens a GEMM is bound by arithmetic, and cuBLAS on a dense weight
# beats kernels that unpack codes for every token tile: the weight is dequantized into a
# buffer in x's dtype made for the call (one write of it and one read by cuBLAS, 4 bytes a
# weight in bf16 beside the codes' read), then ``x @ w``. Each weight is rounded to x's dtype
# once (bf16: 8 bits, as a bf16 checkpoint is). What vLLM's AWQ layer does from 256 tokens
# (awq.py, ``FP16_MATMUL_HEURISTIC_CONDITION``).


@triton.jit
def _dequant_int4_kernel(
    QW, QZ, S, GIDX, Out, N, stride_qw0, stride_qz0, stride_s0, stride_o0,
    ZERO_PLUS: tl.constexpr, GROUP: tl.constexpr, ACT_ORDER: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Out[k, n] = (q[k, n] - z[g(k), n]) s[g(k), n] for word rows [ROWS pid_k, +ROWS) (8 k
    each) and columns [BLOCK_N pid_n, +BLOCK_N); g(k) = k // GROUP (the program's rows inside
    one group) or, ACT_ORDER, GIDX[k] (a group per row, zeros and scales gathered)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    rr = pid_k * ROWS + tl.arange(0, ROWS)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    words = tl.load(QW + rr[:, None] * stride_qw0 + rn[None, :], mask=n_ok[None, :], other=0)
    col_shift = (rn % 8) * 4
    if not ACT_ORDER:
        g = (pid_k * ROWS * 8) // GROUP
        z = (tl.load(QZ + g * stride_qz0 + rn // 8, mask=n_ok, other=0) >> col_shift) & 0xF
        z = (z + ZERO_PLUS).to(tl.float32)
        s = tl.load(S + g * stride_s0 + rn, mask=n_ok, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        q = ((words >> (4 * j)) & 0xF).to(tl.float32)
        if ACT_ORDER:  # (ROWS, BLOCK_N) zeros and scales of rows 8 rr + j's groups
            gj = tl.load(GIDX + rr * 8 + j)
            zp = tl.load(QZ + gj[:, None] * stride_qz0 + (rn // 8)[None, :], mask=n_ok[None, :],
                         other=0)  # fmt: skip
            zj = (((zp >> col_shift[None, :]) & 0xF) + ZERO_PLUS).to(tl.float32)
            sj = tl.load(S + gj[:, None] * stride_s0 + rn[None, :], mask=n_ok[None, :], other=0.0)
            w = (q - zj) * sj.to(tl.float32)
        else:
            w = (q - z[None, :]) * s[None, :]
        tl.store(Out + (rr * 8 + j)[:, None] * stride_o0 + rn[None, :],
                 w.to(Out.dtype.element_ty), mask=n_ok[None, :])  # fmt: skip


def dequantize_int4(
    tensors: dict[str, torch.Tensor], spec: QuantSpec, out_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """W.T (K, N) of ``dtype`` for a gptq or awq (repacked) W: a new tensor, each weight (q -
    zero) * scale computed in float32 and rounded once. Act-order GPTQ: row k's zeros and
    scales are those of its group ``g_idx[k]`` (any group size). Raises ValueError for an
    unrepacked AWQ, a K that is not a multiple of 128, or (without act-order) a group that
    is not."""
    if spec.method == "awq" and not awq_is_repacked(tensors):
        raise ValueError("dequantize_int4: awq tensors in the checkpoint layout; "
                         "repack them with quant_formats.repack_awq first")  # fmt: skip
    k = tensors["qweight"].shape[0] * 8
    act_order = spec.act_order
    if (spec.group_size % 128 and not act_order) or k % 128:
        raise ValueError(
            f"dequantize_int4: {spec.method} K={k} group {spec.group_size}"
            f"{' act-order' if act_order else ''}; takes gptq/awq with K a multiple of 128 "
            "and, without act-order, the group too"
        )
    qw, qz, s = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    g_idx = tensors["g_idx"] if act_order else qw  # qw: a placeholder, never read
    n = out_features
    w = torch.empty(k, n, dtype=dtype, device=qw.device)
    rows, block_n = 16, 128
    _dequant_int4_kernel[(k // (rows * 8), triton.cdiv(n, block_n))](
        qw, qz, s, g_idx, w, n, qw.stride(0), qz.stride(0), s.stride(0), w.stride(0),
        ZERO_PLUS=1 if spec.method == "gptq" else 0, GROUP=spec.group_size,
        ACT_ORDER=act_order, ROWS=rows, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return w


def dequant_int4_matmul(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: QuantSpec, out_features: int
) -> torch.Tensor:
    """x (M, K) @ W.T for a gptq (act-order too) or awq (repacked) W: W dequantized into x's
    dtype by :func:`dequantize_int4` (a copy made for this call; its refusals), then
    torch.matmul (cuBLAS on CUDA). (M, N) in x's dtype."""
    w = dequantize_int4(tensors, spec, out_features, x.dtype)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"dequant_int4_matmul: x {tuple(x.shape)} for K={w.shape[0]}; "
                         "expected x (M, K)")  # fmt: skip
    return x @ w


@triton.jit
def _dequant_int8_kernel(
    W, S, Out, N, K, stride_w0, stride_o0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Out[n, k] = W[n, k] S[n] for rows [BLOCK_N pid_n, +BLOCK_N) and inputs [BLOCK_K pid_k,
    +BLOCK_K): the product in float32, rounded once to Out's dtype."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    mask = n_ok[:, None] & (rk < K)[None, :]
    q = tl.load(W + rn[:, None] * stride_w0 + rk[None, :], mask=mask, other=0)
    s = tl.load(S + rn, mask=n_ok, other=0.0)
    w = q.to(tl.float32) * s[:, None]
    tl.store(Out + rn[:, None] * stride_o0 + rk[None, :], w.to(Out.dtype.element_ty), mask=mask)


def dequantize_int8(
    weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """weight (N, K) int8, contiguous along K, times weight_scale (N, 1) float32 per row: a new
    (N, K) tensor of ``dtype``, each product computed in float32 and rounded once."""
    n, k = weight.shape
    if weight.dtype != torch.int8 or weight.stride(1) != 1 or weight_scale.numel() != n:
        raise ValueError(
            f"dequantize_int8: weight {weight.dtype} {tuple(weight.shape)} (stride "
            f"{weight.stride()}), {weight_scale.numel()} scales; expected int8 (N, K) "
            "contiguous along K and N scales"
        )
    scale = weight_scale.reshape(-1).float().contiguous()
    w = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_k = 16, 512
    _dequant_int8_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scale, w, n, k, weight.stride(0), w.stride(0), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return w


def dequant_int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """x (M, K) @ (weight * weight_scale).T for an int8 weight (N, K) with one float32 scale
    per row: the weight dequantized into x's dtype by :func:`dequantize_int8` (a copy made for
    this call), then torch.matmul (cuBLAS on CUDA). (M, N) in x's dtype."""
    w = dequantize_int8(weight, weight_scale, x.dtype)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"dequant_int8_matmul: x {tuple(x.shape)} for a weight "
                         f"{tuple(w.shape)}; expected x (M, {w.shape[1]})")  # fmt: skip
    return x @ w.t()
