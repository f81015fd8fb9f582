"""GEMMs on quantized weights: y = x @ W.T with W kept packed (layouts in
:mod:`sched_lab.backend.quant_formats`).

Two Triton kernels, chosen by :func:`sched_lab.backend.quant_linear.gemm_path` from H200
measurements (docs/quantization.md):

* :func:`weight_only_gemm`, the tiled kernel (int4 in GPTQ's (K/8, N) layout, AWQ after
  :func:`~sched_lab.backend.quant_formats.repack_awq`, and int8; any M): tiles of
  (BLOCK_M, BLOCK_N) outputs over BLOCK_K inputs, K split over programs while the grid is
  small (float32 atomics into a zeroed buffer, cast at the end), codes converted to floats
  and multiplied in x's dtype by ``tl.dot``. Its tiles come from one function,
  :func:`tile_config` (benchmarks/quant_decode.py ``--sweep`` times the alternatives).
  Every call is CUDA-graph safe (buffers allocated per call, no host sync).
* :func:`weight_streaming_gemm` (M <= 64): one tile of M, narrow tiles of N, long tiles of
  K split over programs, codes turned into floats by bit moves (int4 as c + q, int8 as
  0x6400 | (q + 128) - 1152, e4m3 as float16 holding value / 2^8); split-K partials summed
  by the last program of a tile (per-device counters made on the first call, which must
  not be inside a CUDA graph capture). The engine no longer runs it: on the H200 it lost to
  the tiled kernel for int8 and GPTQ at every M, and for fp8 to W8A8 from two tokens once
  the activations were quantized in one kernel (H100, docs/quantization.md; fp8 steps of up
  to 32 tokens now run ``quant_gemv.small_m_gemm``); it stays for
  benchmarks/quant_decode.py's A/B and reads AWQ in the checkpoint layout (shifts through
  :func:`_nibble_shifts`).
* fp8 (W8A8) above ``quant_linear.FP8_SMALL_M_MAX_TOKENS`` (32) tokens: activations get one
  scale per token (amax / 448) at run time, in one kernel
  (:func:`quantize_activations_fp8_kernel`); on CUDA ``torch._scaled_mm`` with row-wise
  scales (Hopper); elsewhere :func:`fp8_reference`.

The ``*_reference`` functions dequantize the weight to float32 on every call: they are the
tests' references and the path on CPU without ``TRITON_INTERPRET=1`` (slow, a transient
copy; never used on CUDA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sched_lab.backend.attention.triton_backend import interpreting
from sched_lab.backend.quant_formats import FP8_MAX, QuantSpec, awq_is_repacked, dequantize

LAYOUT = {"awq": 0, "gptq": 1, "int8": 2, "fp8": 3}
STREAM_MAX_M = 64  # rows the streaming kernel holds in one tile
STREAM_PROGRAMS_PER_SM = 4  # split K until the grid has this many programs per SM
MAX_TILES = 1 << 16  # per-tile split-K counters per device


@triton.jit
def _nibble_shifts(LAYOUT: tl.constexpr):
    """Bit shift of the 8 codes of an int32 word, in the order they are unpacked: AWQ's
    columns j = 0..7 sit in nibbles (0, 4, 1, 5, 2, 6, 3, 7)[j] (AWQ_PACK_ORDER inverted);
    GPTQ's rows (qweight) and columns (qzeros) in nibble j."""
    j = tl.arange(0, 8)
    if LAYOUT == 0:
        shifts = ((j % 2) * 4 + j // 2) * 4
    else:
        shifts = j * 4
    return shifts


@triton.jit
def _unpack_along_n(words, LAYOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(ROWS, BLOCK_N / 8) int32 words packed along N (AWQ qweight, both qzeros) -> (ROWS,
    BLOCK_N) codes in column order."""
    q = (words[:, :, None] >> _nibble_shifts(LAYOUT)[None, None, :]) & 0xF
    return tl.reshape(q, (ROWS, BLOCK_N))


@triton.jit
def _load_raw(QW, k0, k_end, n0, N, stride_qw0,
              LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The stored words of the weight tile at rows k0.. (below ``k_end``), columns n0..: AWQ
    (BLOCK_K, BLOCK_N / 8) int32 and GPTQ (BLOCK_K / 8, BLOCK_N) int32, contiguous along N;
    int8 / e4m3 (BLOCK_K, BLOCK_N) bytes of the (N, K) weight, contiguous along K. Each word
    is loaded once."""
    rn = n0 + tl.arange(0, BLOCK_N)
    if LAYOUT == 0:
        rk = k0 + tl.arange(0, BLOCK_K)
        rw = n0 // 8 + tl.arange(0, BLOCK_N // 8)
        raw = tl.load(QW + rk[:, None] * stride_qw0 + rw[None, :],
                      mask=(rk < k_end)[:, None] & (rw < N // 8)[None, :], other=0)  # fmt: skip
    elif LAYOUT == 1:
        rr = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        raw = tl.load(QW + rr[:, None] * stride_qw0 + rn[None, :],
                      mask=(rr < k_end // 8)[:, None] & (rn < N)[None, :], other=0)  # fmt: skip
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        raw = tl.load(QW + rn[None, :] * stride_qw0 + rk[:, None],
                      mask=(rk < k_end)[:, None] & (rn < N)[None, :], other=0)  # fmt: skip
    return raw


@triton.jit
def _decode(raw, LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_load_raw`'s tile as (BLOCK_K, BLOCK_N): int4 codes 0..15 (int32, a fixed shift
    per nibble; GPTQ row k0 + 8 r + j from word row r, nibble j), int8 as float16, e4m3 as
    float16 holding the value / 2^8, both exact and by bit moves (no int-to-float
    conversion instruction)."""
    if LAYOUT == 0:
        w = _unpack_along_n(raw, LAYOUT, BLOCK_K, BLOCK_N)
    elif LAYOUT == 1:
        w = (raw[:, None, :] >> _nibble_shifts(LAYOUT)[None, :, None]) & 0xF
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))
    elif LAYOUT == 2:  # 0x6400 | (q + 128) is 1024 + q + 128; minus 1152: q, exactly
        b = raw.to(tl.uint8, bitcast=True).to(tl.uint16)
        w = ((b ^ 0x80) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
    else:
        b = raw.to(tl.uint16)
        w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return w


@triton.jit
def _offset_codes(q, DTYPE: tl.constexpr):
    """4-bit codes q (int32) as c + q in DTYPE, exactly, by setting the exponent bits: bfloat16
    0x4300 | q is 128 + q, float16 0x6400 | q is 1024 + q."""
    if DTYPE == tl.float16:
        w = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        w = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return w


@triton.jit
def _load_zeros(QZ, rows, rows_ok, n0, N, stride_qz0,
                LAYOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Zero points (ROWS, BLOCK_N) of qzeros rows ``rows`` (ROWS,), columns n0.. (GPTQ
    stores zero - 1)."""
    rw = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    words = tl.load(QZ + rows[:, None] * stride_qz0 + rw[None, :],
                    mask=rows_ok[:, None] & (rw < N // 8)[None, :], other=0)  # fmt: skip
    z = _unpack_along_n(words, LAYOUT, ROWS, BLOCK_N)
    if LAYOUT == 1:
        z = z + 1
    return z


@triton.jit
def _product(x, w, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """x (BLOCK_M, BLOCK_K) @ w (BLOCK_K, BLOCK_N) in float32: one row by multiply and sum,
    more through tl.dot (w in x's dtype, where the codes are exact; F32_DOT: float32)."""
    if BLOCK_M == 1:
        xr = tl.reshape(x.to(tl.float32), (BLOCK_K, 1))
        out = tl.sum(xr * w.to(tl.float32), axis=0)[None, :]
    elif F32_DOT:
        out = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(x, w.to(x.dtype))
    return out


@triton.jit
def _wq_gemm_kernel(
    X, QW, QZ, S, GIDX, Out, WS, CNT, M, N, K, stride_xm, stride_qw0, stride_qz0, stride_s0,
    stride_om, K_PER_SPLIT, NUM_SPLITS,
    LAYOUT: tl.constexpr, GROUP: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Out[m, n] = sum_k X[m, k] * W[n, k]; program (tile, split) covers K_PER_SPLIT of K.
    LAYOUT 0: AWQ qweight (K, N/8); 1: GPTQ qweight (K/8, N); 2: int8 weight (N, K); 3: e4m3
    weight (N, K) as uint8. 2 and 3: one scale per n. SPLIT_K: NUM_SPLITS > 1 programs per
    tile. F32_DOT: float32 operands (float32 activations, and the interpreter, whose
    bfloat16 dot is wrong). The next K tile's words are loaded before the current one is
    decoded (two tiles in flight per program)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = (pid % tiles_n) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_M == 1 and LAYOUT >= 2:  # one row, 8 bits: products summed over K once, at the end
        acc_k = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    raw = _load_raw(QW, k_start, k_end, n0, N, stride_qw0, LAYOUT, BLOCK_K, BLOCK_N)
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        raw_next = _load_raw(QW, k0 + BLOCK_K, k_end, n0, N, stride_qw0, LAYOUT, BLOCK_K,
                             BLOCK_N)  # fmt: skip
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = _decode(raw, LAYOUT, BLOCK_K, BLOCK_N)
        if LAYOUT >= 2 and BLOCK_M == 1:
            acc_k += tl.reshape(x.to(tl.float32), (BLOCK_K, 1)) * w.to(tl.float32)
        elif LAYOUT >= 2:
            acc += _product(x, w, BLOCK_M, BLOCK_K, F32_DOT)
        elif ACT_ORDER:  # each row k in group g_idx[k]: dequantize the tile, then multiply
            g = tl.load(GIDX + rk, mask=k_ok, other=0)
            z = _load_zeros(QZ, g, k_ok, n0, N, stride_qz0, LAYOUT, BLOCK_K, BLOCK_N)
            s = tl.load(S + g[:, None] * stride_s0 + rn[None, :],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
            acc += _product(x, (w - z).to(tl.float32) * s.to(tl.float32), BLOCK_M, BLOCK_K, True)
        else:  # the tile lies in group k0 // GROUP: s * (x @ (c + q) - (c + z) * sum(x))
            g = k0 // GROUP + tl.zeros((1,), dtype=tl.int32)
            z = tl.reshape(_load_zeros(QZ, g, g * GROUP < k_end, n0, N, stride_qz0, LAYOUT, 1,
                                       BLOCK_N), (BLOCK_N,))  # fmt: skip
            s = tl.load(S + g * stride_s0 + rn, mask=n_ok & (k0 < k_end), other=0.0)
            if X.dtype.element_ty == tl.float32:
                part = _product(x, w.to(tl.float32), BLOCK_M, BLOCK_K, F32_DOT)
                z = z.to(tl.float32)
            else:  # c + q by bit moves (no int-to-float conversion, a slow instruction)
                part = _product(x, _offset_codes(w, X.dtype.element_ty), BLOCK_M, BLOCK_K,
                                F32_DOT)  # fmt: skip
                z = z.to(tl.float32) + (1024.0 if X.dtype.element_ty == tl.float16 else 128.0)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            acc += (part - x_sum[:, None] * z[None, :]) * s.to(tl.float32)[None, :]
        raw = raw_next
    if BLOCK_M == 1 and LAYOUT >= 2:
        acc = tl.sum(acc_k, axis=0)[None, :]
    if LAYOUT >= 2:
        s = tl.load(S + rn, mask=n_ok, other=0.0).to(tl.float32)
        if LAYOUT == 3:
            s = s * 256.0  # the bytes were decoded as value / 2^8
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
            for j in range(NUM_SPLITS):
                total += tl.load(ws + j * M * N, mask=o_mask, other=0.0, cache_modifier=".cv")
            tl.store(out_ptr, total.to(Out.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(CNT + pid, 0)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the interpreter's split-K tests)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor:
    """The device's MAX_TILES zeroed int32 split-K counters (each kernel leaves them 0)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "quantized GEMM: first call on this device inside a CUDA graph capture; "
                "run one eager forward first (the split-K counters are made then)"
            )
        counters = _COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def _operands(tensors: dict[str, torch.Tensor], spec: QuantSpec):
    """(layout, packed weight, qzeros, scales, g_idx) as the kernel reads them (unused ones
    point at the weight)."""
    layout = LAYOUT[spec.method]
    if layout >= 2:
        w = tensors["weight"]
        w = w.view(torch.uint8) if layout == 3 else w
        return layout, w, w, tensors["weight_scale"], w
    qw = tensors["qweight"]
    return layout, qw, tensors["qzeros"], tensors["scales"], tensors.get("g_idx", qw)


@dataclass(frozen=True)
class GemmPlan:
    """One launch of the kernel: tiles, ``splits`` programs per output tile over
    ``k_per_split`` inputs each, ``num_warps``, ``num_stages`` (the tiled kernel's only)."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    k_per_split: int
    num_warps: int
    num_stages: int = 3


def _plan(m: int, n: int, k: int, spec: QuantSpec, block_m: int, block_n: int, block_k: int,
          split: int, num_warps: int) -> GemmPlan:  # fmt: skip
    """The plan for these tiles: int4 with the trivial g_idx keeps a K tile in one group (the
    largest power of 2 dividing it) and a split on whole groups; ``split`` is rounded so that
    each split is whole K tiles."""
    group = spec.group_size if LAYOUT[spec.method] <= 1 and not spec.act_order else None
    if group is not None:
        block_k = min(block_k, group & -group)
    k_blocks = triton.cdiv(k, block_k)
    steps = triton.cdiv(k_blocks, max(1, min(split, k_blocks)))
    if group is not None:
        per_group = group // block_k
        steps = triton.cdiv(steps, per_group) * per_group
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = triton.cdiv(k_blocks, steps)
    if splits > 1 and tiles > MAX_TILES:
        raise ValueError(f"quantized GEMM: {tiles} tiles; split K allows {MAX_TILES}")
    return GemmPlan(block_m, block_n, block_k, splits, steps * block_k, num_warps)


def _launch(x, tensors, spec, n, plan: GemmPlan) -> torch.Tensor:
    """Run the kernel on x (M, K) as ``plan`` says: (M, N) in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    layout, qw, qz, s, g_idx = _operands(tensors, spec)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if plan.splits > 1:
        ws = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device)
    else:
        ws = counters = out
    tiles = triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n)
    _wq_gemm_kernel[(tiles, plan.splits)](
        x, qw, qz, s, g_idx, out, ws, counters, m, n, k, x.stride(0), qw.stride(0),
        qz.stride(0), s.stride(0), out.stride(0), plan.k_per_split, plan.splits,
        **kernel_constants(spec, k, x.dtype, plan), num_warps=plan.num_warps,
    )  # fmt: skip
    return out


def kernel_constants(spec: QuantSpec, k: int, dtype: torch.dtype, plan: GemmPlan) -> dict:
    """The kernel's constexpr arguments for ``plan`` (benchmarks/quant_compile_check.py
    compiles with them)."""
    layout = LAYOUT[spec.method]
    return dict(
        LAYOUT=layout, GROUP=spec.group_size if layout <= 1 else k,
        ACT_ORDER=layout <= 1 and spec.act_order, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, SPLIT_K=plan.splits > 1,
        F32_DOT=dtype == torch.float32 or interpreting(),
    )  # fmt: skip


@dataclass(frozen=True)
class StreamTiles:
    """Tiles of the streaming kernel: ``block_n`` output columns and ``block_k`` inputs per
    program step, ``num_warps``; ``dot``: one-row inputs too go through tl.dot (padded to
    16 rows) rather than multiply-and-sum; ``split_k``: programs per N tile (None: until
    STREAM_PROGRAMS_PER_SM programs per SM, at least two K tiles each)."""

    block_n: int
    block_k: int
    num_warps: int
    dot: bool
    split_k: int | None = None


#: (int4?, one row?) -> tiles, from sm_90 compiles (ptxas registers, SASS loads): int4 goes
#: through tl.dot even for one row (multiply-and-sum needed ~230 registers a thread at 4
#: warps and loaded x element by element at 8); one 8-bit row multiplies and sums (94
#: registers at 8 warps, 128-bit loads). benchmarks/quant_decode.py times the alternatives.
STREAM_TILES = {
    (True, True): StreamTiles(64, 128, 8, dot=True),
    (True, False): StreamTiles(64, 128, 8, dot=True),
    (False, True): StreamTiles(32, 256, 8, dot=False),
    (False, False): StreamTiles(32, 256, 8, dot=True),
}


def stream_plan(m: int, n: int, k: int, spec: QuantSpec, sms: int,
                tiles: StreamTiles | None = None) -> GemmPlan:  # fmt: skip
    """The streaming kernel's plan for an (m, k) @ (k, n) product on ``sms`` SMs."""
    if m > STREAM_MAX_M:
        raise ValueError(f"weight_streaming_gemm: {m} rows; at most {STREAM_MAX_M}")
    t = tiles or STREAM_TILES[LAYOUT[spec.method] <= 1, m == 1]
    split_k = t.split_k
    if split_k is None:
        n_tiles, k_blocks = triton.cdiv(n, t.block_n), triton.cdiv(k, t.block_k)
        split_k = 1
        while n_tiles * split_k < STREAM_PROGRAMS_PER_SM * sms and split_k * 4 <= k_blocks:
            split_k *= 2
    block_m = 1 if m == 1 and not t.dot else max(16, triton.next_power_of_2(m))
    num_warps = max(t.num_warps, 8) if block_m >= 32 else t.num_warps
    return _plan(m, n, k, spec, block_m, t.block_n, t.block_k, split_k, num_warps)


def weight_streaming_gemm(
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    spec: QuantSpec,
    out_features: int,
    tiles: StreamTiles | None = None,
) -> torch.Tensor:
    """x (M <= 64, K) bf16/fp16/fp32 @ W.T for an awq, gptq, int8 or fp8 W (fp8: weight-only,
    x is not quantized): (M, N) in x's dtype. ``tiles``: STREAM_TILES's choice when None."""
    m, k = x.shape
    plan = stream_plan(m, out_features, k, spec, _num_sms(x.device), tiles)
    return _launch(x, tensors, spec, out_features, plan)


# ---------------------------------------------------------------- the tiled kernel
@triton.jit
def _tiled_gemm_kernel(
    X, QW, QZ, S, GIDX, Out, M, N, K, stride_xm, stride_qw0, stride_qz0, stride_s0, stride_om,
    K_PER_SPLIT,
    INT4: tl.constexpr, ZERO_PLUS: tl.constexpr, GROUP: tl.constexpr, ACT_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    F32_DOT: tl.constexpr, WORDS_ONCE: tl.constexpr,
):  # fmt: skip
    """Out[m, n] (+)= sum_k X[m, k] * W[n, k]; program (tile, split) covers K_PER_SPLIT of K.
    WORDS_ONCE (int4): load the tile's (BLOCK_K / 8, BLOCK_N) words once and unpack them by
    reshape, instead of one word load per code (8 loads of each word, from the cache).
    INT4: qweight (K/8, N) int32 (row k in nibble k % 8 of row k // 8), qzeros (K/g, N/8)
    (column n in nibble n % 8) holding zero - ZERO_PLUS, scales (K/g, N); a K tile lies in
    one group unless ACT_ORDER (row k's group is GIDX[k]). Else int8 weight (N, K) with one
    scale per n. SPLIT_K: float32 atomic adds into a zeroed Out. F32_DOT: float32 operands
    (float32 activations, and the interpreter, whose bfloat16 dot is wrong)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    col_shift = (rn % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if F32_DOT:
            x = x.to(tl.float32)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if not INT4:
            q = tl.load(QW + rn[None, :] * stride_qw0 + rk[:, None], mask=w_mask, other=0)
            w = q.to(tl.float32).to(x.dtype)  # (BLOCK_K, BLOCK_N), exact: |q| <= 127
            if F32_DOT:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        else:
            if WORDS_ONCE:
                raw = _load_raw(QW, k0, K, (pid % tiles_n) * BLOCK_N, N, stride_qw0, 1, BLOCK_K,
                                BLOCK_N)  # fmt: skip
                q = _decode(raw, 1, BLOCK_K, BLOCK_N)
            else:
                packed = tl.load(QW + (rk // 8)[:, None] * stride_qw0 + rn[None, :],
                                 mask=w_mask, other=0)  # fmt: skip
                q = (packed >> ((rk % 8) * 4)[:, None]) & 0xF
            if ACT_ORDER:  # per-row group: dequantize the tile, then multiply
                g = tl.load(GIDX + rk, mask=k_ok, other=0)
                zp = tl.load(QZ + g[:, None] * stride_qz0 + (rn // 8)[None, :], mask=w_mask,
                             other=0)  # fmt: skip
                z = ((zp >> col_shift[None, :]) & 0xF) + ZERO_PLUS
                s = tl.load(S + g[:, None] * stride_s0 + rn[None, :], mask=w_mask, other=0.0)
                w = (q - z).to(tl.float32) * s.to(tl.float32)
                if F32_DOT:
                    acc += tl.dot(x, w, input_precision="ieee")
                else:
                    acc += tl.dot(x, w.to(x.dtype))
            else:  # the tile lies in group k0 // GROUP: (x @ (q - z)) * s
                g = k0 // GROUP
                zp = tl.load(QZ + g * stride_qz0 + rn // 8, mask=n_ok & (k0 < K), other=0)
                z = ((zp >> col_shift) & 0xF) + ZERO_PLUS
                w = (q - z[None, :]).to(tl.float32).to(x.dtype)  # exact: -16..15
                if F32_DOT:
                    part = tl.dot(x, w, input_precision="ieee")
                else:
                    part = tl.dot(x, w)
                s = tl.load(S + g * stride_s0 + rn, mask=n_ok & (k0 < K), other=0.0)
                acc += part * s.to(tl.float32)[None, :]
    if not INT4:
        s = tl.load(S + rn, mask=n_ok, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    out_ptr = Out + rm[:, None] * stride_om + rn[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if not SPLIT_K:
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(out_ptr, acc, mask=o_mask)


@dataclass(frozen=True)
class TileConfig:
    """The tiled kernel's launch choices: ``block_m`` x ``block_n`` outputs per program,
    ``block_k`` inputs per step (int4: cut to the group's largest power-of-2 divisor), K
    split while the grid has fewer than ``split_sms`` programs per SM (0: never),
    ``num_warps``, ``num_stages`` (software pipelining depth); ``words_once`` (int4): each
    packed word loaded once per tile and unpacked by reshape rather than loaded per code."""

    block_m: int
    block_n: int
    block_k: int
    split_sms: int
    num_warps: int
    num_stages: int
    words_once: bool = False


def tile_config(m: int, n: int, k: int, spec: QuantSpec) -> TileConfig:
    """The tiles the engine uses for an (m, k) @ (k, n) product: the one place to set the
    winners of ``benchmarks/quant_decode.py --sweep``. Up to 16 rows: the sweep's winners on
    the H200 for the Llama-3.1-8B projections at M = 1 and 16 (BENCHMARKS.md, 2026-12-03):
    int4 words loaded once, 128 columns (256 for one row of a wide N); int8 K tiles of
    128-256. Above 16 rows (not swept): 32/64-row tiles, 64 columns up to 64 rows, 128
    above; K tiles of 64; split until 2 programs per SM; 8 warps from 64 x 64 outputs."""
    if m <= 16:
        if LAYOUT[spec.method] <= 1:  # int4 (awq repacked, gptq)
            wide = n >= 6144 and m == 1
            split = 4 if wide or n >= 16384 else 2
            return TileConfig(16, 256 if wide else 128, 64, split, 4, 3, words_once=True)
        if n >= 16384:  # int8, a wide N (gate_up): enough tiles without a split
            return TileConfig(16, 64, 256, 1, 4, 3)
        if k >= 8192:  # int8, a long K (down)
            return TileConfig(16, 128, 128, 1, 8, 4)
        if m == 1:
            return TileConfig(16, 128, 128, 2 if n > 4096 else 1, 8, 3)
        return TileConfig(16, 32, 256, 1 if n > 4096 else 2, 4, 3)
    block_m = 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    num_warps = 8 if block_m * block_n >= 64 * 64 else 4
    return TileConfig(block_m, block_n, 64, 2, num_warps, 3)


#: rows the small-M kernels of :mod:`sched_lab.backend.quant_gemv` take (the MMA's N side: M
#: rounded up to 16, 32 or 64) and their weights (fp8/int8: ``small_m_gemm``; int4 in GPTQ's
#: layout: ``small_m_int4_gemm``). Their tiles and the shapes they take are decided here (for
#: ``quant_linear.gemm_path`` too), as :func:`tile_config` decides the tiled kernel's
SMALL_M_MAX = 64
SMALL_M_METHODS = ("fp8", "int8", "gptq", "awq")


@dataclass(frozen=True)
class SmallMConfig:
    """Launch choices: ``block_n`` output rows and ``block_k`` inputs per program step, K split
    in powers of 2 while the grid has fewer than ``split_sms`` programs per SM (each split
    keeps >= ``min_k_tiles`` K tiles), ``num_warps``, ``num_stages``; int4 only:
    ``block_m`` tokens per program at most (more tokens: a program per ``block_m`` of them),
    ``x_layout`` how x meets the nibbles (``_small_m_int4_kernel``'s X_LAYOUT: 0 gathered,
    1 permuted by a copy first, 3 the weight tile joined, one dot; 2 was removed)."""

    block_n: int = 32
    block_k: int = 256
    split_sms: int = 2
    num_warps: int = 4
    num_stages: int = 3
    min_k_tiles: int = 2
    block_m: int = SMALL_M_MAX
    x_layout: int = 0


def small_m_config(m: int, n: int, k: int, method: str = "fp8") -> SmallMConfig:
    """The small-M kernels' tiles for an (m, k) x (k, n) product. fp8/int8: the winners of
    ``benchmarks/quant_small_m.py`` for the Llama-3.1-8B projections (BENCHMARKS.md,
    2026-12-06: 16 configs at M = 1 and 64 on the H200, runners-up within 1-4% at M = 1; an
    H100 sweep at M = 1 and 16 came within 0.5% with these): 32 rows, K split until 2
    programs per SM, 4 warps; K tiles of 128 in 4 stages for a wide N (gate_up), of 256 in 3
    stages otherwise. int4 (gptq, awq): the winners of 18 configs at M = 4 and 32 on an H100
    (BENCHMARKS.md, 2026-12-06): 128 rows, K tiles of 128 (one group), 4 warps, 3 stages;
    K split until 2 programs per SM up to 16 rows, until 1 above (the partials of 32 rows cost
    more than the split gains); above 16 rows x permuted by a copy first (x_layout 1: 0.91x
    the time of the gather at 32 tokens, 0.87x at 64, 0.83x at 128, H100), in token tiles
    of 64 (tiles of 128 and 256-row weight tiles were slower from 128 to 512 tokens)."""
    if method in ("gptq", "awq"):
        if m <= 16:
            return SmallMConfig(128, 128, 2, 4, 3)
        return SmallMConfig(128, 128, 1, 4, 3, x_layout=1)
    if n >= 16384:
        return SmallMConfig(32, 128, 2, 4, 4)
    return SmallMConfig(32, 256, 2, 4, 3)


def small_m_supported(
    method: str, m: int, n: int, k: int, c: SmallMConfig | None = None, group_size: int = 128
) -> bool:
    """Whether a small-M kernel of :mod:`~sched_lab.backend.quant_gemv` takes this GEMM: a
    method of SMALL_M_METHODS, at most SMALL_M_MAX rows, N and K multiples of the tiles of
    ``c`` (default: :func:`small_m_config`'s); int4 (gptq, awq, act-order excluded by the
    caller): any number of rows (tiled by ``c.block_m``, a power of 2 from 16 to 256), a K
    tile of >= 128 (dots of K tile / 8 inputs) that divides ``group_size``."""
    c = c or small_m_config(m, n, k, method)
    int4 = method in ("gptq", "awq")
    ok = method in SMALL_M_METHODS and (m <= SMALL_M_MAX or int4) and n % c.block_n == 0
    ok = ok and k % c.block_k == 0
    if int4:
        ok = ok and group_size % c.block_k == 0 and c.block_k >= 128
        ok = ok and c.block_m in (16, 32, 64, 128, 256) and c.x_layout in (0, 1, 3)
    return ok


def tiled_plan(m: int, n: int, k: int, spec: QuantSpec, sms: int,
               config: TileConfig | None = None) -> GemmPlan:  # fmt: skip
    """The tiled kernel's plan on ``sms`` SMs (``config``: :func:`tile_config`'s when None):
    K split in powers of 2 while tiles x splits < split_sms x sms and each split keeps at
    least 4 K tiles; int4 splits on whole groups (one scale per K tile)."""
    c = config or tile_config(m, n, k, spec)
    int4 = LAYOUT[spec.method] <= 1
    if spec.method == "fp8":
        raise ValueError("tiled quantized GEMM: int4 (awq, gptq) or int8 only, not fp8")
    group = spec.group_size if int4 else k
    block_k = min(c.block_k, group & -group) if int4 else c.block_k
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < c.split_sms * sms and split * 2 <= k_blocks // 4:
        split *= 2
    steps = triton.cdiv(k_blocks, split)
    if int4 and not spec.act_order:  # a split starts at a group boundary
        per_group = group // block_k
        steps = triton.cdiv(steps, per_group) * per_group
    splits = triton.cdiv(k_blocks, steps)
    return GemmPlan(c.block_m, c.block_n, block_k, splits, steps * block_k, c.num_warps,
                    c.num_stages)  # fmt: skip


def weight_only_gemm(
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    spec: QuantSpec,
    out_features: int,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """x (M, K) bf16/fp16/fp32 @ W.T by the tiled kernel: (M, N) in x's dtype. W: gptq,
    int8, or awq in :func:`~sched_lab.backend.quant_formats.repack_awq`'s layout (a
    checkpoint-layout AWQ qweight is a ValueError). ``config``: :func:`tile_config`'s when
    None."""
    x = x.contiguous()
    m, k = x.shape
    n = out_features
    config = config or tile_config(m, n, k, spec)
    plan = tiled_plan(m, n, k, spec, _num_sms(x.device), config)
    int4 = LAYOUT[spec.method] <= 1
    if int4:
        if spec.method == "awq" and not awq_is_repacked(tensors):
            raise ValueError("weight_only_gemm: awq tensors in the checkpoint layout; "
                             "repack them with quant_formats.repack_awq first")  # fmt: skip
        qw, qz, s = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        g_idx = tensors.get("g_idx", qw)
    else:
        qw = g_idx = tensors["weight"]
        qz, s = qw, tensors["weight_scale"]
    split = plan.splits > 1
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split else torch.empty(
        m, n, dtype=x.dtype, device=x.device)  # fmt: skip
    tiles = triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n)
    _tiled_gemm_kernel[(tiles, plan.splits)](
        x, qw, qz, s, g_idx, out, m, n, k, x.stride(0), qw.stride(0), qz.stride(0), s.stride(0),
        out.stride(0), plan.k_per_split,
        INT4=int4, ZERO_PLUS=1 if spec.method == "gptq" else 0,
        GROUP=spec.group_size if int4 else k, ACT_ORDER=int4 and spec.act_order,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT_K=split,
        F32_DOT=x.dtype == torch.float32 or interpreting(),
        WORDS_ONCE=int4 and config.words_once,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out.to(x.dtype) if split else out


def weight_only_reference(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: QuantSpec
) -> torch.Tensor:
    """The float32 reference: W dequantized on this call, x @ W.T in float32, cast to x's dtype."""
    return (x.float() @ dequantize(tensors, spec).t()).to(x.dtype)


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: (x / scale as float8_e4m3fn (M, K), scale (M, 1) float32),
    scale = max(amax of the row * float32(1 / FP8_MAX), 1e-12) (a product, as torch's CUDA
    division by a scalar is, so that CPU and GPU agree). The reference of
    :func:`quantize_activations_fp8_kernel` (nine torch kernels)."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, fp8_max,
                          inv_fp8_max, BLOCK: tl.constexpr):  # fmt: skip
    """One program per row: its amax over K (first pass), then x / scale cast to e4m3
    (second pass, the row read again, from the L2)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_fp8_max, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -fp8_max), fp8_max)  # IEEE, as torch
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_activations_fp8_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations_fp8` in one Triton kernel (x (M, K) with unit stride
    along K): the same scales bit for bit; the codes the same on the GPU (round to nearest;
    Triton's CPU interpreter truncates, so up to one e4m3 step apart there)."""
    if x.stride(1) != 1:
        raise ValueError("quantize_activations_fp8_kernel: x must have unit stride along K")
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = min(2048, triton.next_power_of_2(k))
    _per_token_fp8_kernel[(m,)](x, xq, scale, k, x.stride(0), xq.stride(0), FP8_MAX,
                                1.0 / FP8_MAX, BLOCK=block, num_warps=4)  # fmt: skip
    return xq, scale


#: benchmarks/quant_decode.py's A/B switch: False quantizes W8A8 activations with the nine
#: torch kernels of :func:`quantize_activations_fp8` (the path before the kernel)
ACT_QUANT_KERNEL = True


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """W8A8: x (M, K) @ (weight * weight_scale).T with x quantized per token; CUDA:
    :func:`quantize_activations_fp8_kernel` and ``torch._scaled_mm`` (row-wise scales, bf16
    out), else :func:`fp8_reference`."""
    if x.device.type != "cuda":
        return fp8_reference(x, weight, weight_scale)
    quantize = quantize_activations_fp8_kernel if ACT_QUANT_KERNEL else quantize_activations_fp8
    xq, x_scale = quantize(x.contiguous())
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def fp8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor):
    """W8A8 in float32: the same per-token activation rounding, both sides dequantized on
    this call (for tests and CPU runs only)."""
    xq, x_scale = quantize_activations_fp8(x)
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    return ((xq.float() * x_scale) @ w.t()).to(x.dtype)
