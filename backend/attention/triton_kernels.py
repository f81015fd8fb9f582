"""Paged-attention Triton kernels: store K/V into slots, prefill with a cached prefix, decode.

Position p of sequence s lives in block ``block_tables[s, p // BLOCK_SIZE]`` at row
``p % BLOCK_SIZE``; softmax is the online (flash) form in float32. Decode splits contexts
into work items merged by log-sum-exp (Flash-Decoding: Dao, Haziza, Massa and Sizov,
PyTorch blog, 2023). Sequence index -1 in any table is CUDA-graph padding. Under
``TRITON_INTERPRET=1`` (set before import) the kernels run on CPU tensors.

An FP8 cache (``torch.float8_e4m3fn``, ``KV_FP8``): the store writes x / scale saturated to
+-448 and rounded to nearest; the attention kernels load the FP8 tile and multiply by the
scale in float32, then compute as for a cache in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sched_lab.backend.attention.base import DECODE_TILE, PREFILL_TILE_M
from sched_lab.core.kv_dtypes import FP8_E4M3_MAX

BLOCK_M = PREFILL_TILE_M  # query rows per prefill program
BLOCK_N = 64  # key positions per inner-loop tile
DECODE_BLOCK_N = DECODE_TILE  # key positions per decode tile (work items cover whole tiles)
DECODE_NUM_WARPS = 4  # warps per decode program (benchmarks/decode_attention_sweep.py)
DECODE_NUM_STAGES = 2  # software-pipelining stages of the decode loop
MERGE_BLOCK = 16  # work items the merge kernel reads at a time
WORK_BLOCK = 32  # work items one program of the device work-table kernel writes
# Merge the split-K items inside the decode kernel (one launch a layer) rather than in a
# second kernel; a switch for A/B runs (benchmarks/kernels_step.py), read at each launch.
FUSED_MERGE = True
# ... when the decode rows average fewer work items than this: the merging program reads
# a row's items one after another, which outlasts the separate merge kernel when rows
# have many items (small batches: 16 a row) and saves its launch when they have few
# (batch >= 32 with 8 kv heads: 4 or fewer; H200 figures in BENCHMARKS.md).
FUSED_MERGE_MAX_ITEMS_PER_ROW = 8

FP8_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)  # E4M3's largest finite value
_counters: dict[torch.device, torch.Tensor] = {}  # the fused merge's counts, per device
_old_counters: list[torch.Tensor] = []  # replaced ones: captured graphs may still read them


def merge_counters(num_seqs: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``num_seqs * num_kv_heads`` counts shared by every
    decode launch on ``device``; each launch leaves it zero, so launches must be in stream
    order. Grown outside a CUDA-graph capture only."""
    need = max(1, num_seqs * num_kv_heads)
    buf = _counters.get(device)
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode merge counters must be allocated before graph capture")
        if buf is not None:
            _old_counters.append(buf)
        buf = torch.zeros(max(need, 4096), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, SlotMapping, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One program per fed token; a negative slot (padding) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    dst = slot * NUM_KV_HEADS * HEAD_DIM + heads * HEAD_DIM + dims  # the caches are contiguous
    k = tl.load(K + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(V + t * stride_vt + heads * stride_vh + dims, mask=mask)
    if KV_FP8:
        k = quantize_fp8(k, k_scale, KCache.dtype.element_ty)
        v = quantize_fp8(v, v_scale, VCache.dtype.element_ty)
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


@triton.jit
def quantize_fp8(x, scale, FP8: tl.constexpr):
    """x / scale in float32, saturated to +-448, rounded to nearest (ties to even) onto the
    E4M3 grid, then cast to ``FP8`` (then exact). The rounding is done here, not left to
    the cast, because Triton's CPU interpreter rounds wrongly when the mantissa carries into
    the exponent (1.95 -> 1.0); on the GPU the result is the hardware's cvt.rn.satfinite."""
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # E4M3 subnormals share the spacing of 2**-6's
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3): 3 bits
    t = a / ulp  # exact: a power-of-two scale, t < 16
    r = (t + 8388608.0) - 8388608.0  # round half to even at 2**23 (float32 has 23 bits)
    sign = y.to(tl.int32, bitcast=True) & -0x80000000  # kept for -0.0 too, as torch does
    q = ((r * ulp).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return q.to(FP8)


@triton.jit
def dequantize(x, scale, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """A loaded cache tile in DTYPE: FP8 times ``scale`` (float32), else as it is."""
    if KV_FP8:  # a compile-time branch: the tile's type changes
        x = (x.to(tl.float32) * scale).to(DTYPE)
    return x


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width varies step to step
def _prefill_kernel(
    Q, KCache, VCache, Out, BlockTables, QueryStartLoc, SeqLens, Tiles, scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Grid (tile rows, heads): causal attention of one BLOCK_M-row tile over prefix + chunk.
    Tiles (n, 2) int32 (sequence, tile); a negative sequence does nothing."""
    seq = tl.load(Tiles + 2 * tl.program_id(0))
    if seq < 0:
        return
    tile = tl.load(Tiles + 2 * tl.program_id(0) + 1)
    head = tl.program_id(1)
    kv_head = head // GROUP
    q_start = tl.load(QueryStartLoc + seq)
    query_len = tl.load(QueryStartLoc + seq + 1) - q_start
    seq_len = tl.load(SeqLens + seq)
    prefix_len = seq_len - query_len  # positions cached before this step

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the chunk
    dims = tl.arange(0, HEAD_DIM_P)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    q_ptrs = Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # (BLOCK_M, D)
    q_pos = prefix_len + rows  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    # Keys beyond the tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        col_mask = cols < seq_len
        blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE, mask=col_mask, other=0)
        kv_off = (
            blocks.to(tl.int64) * stride_cb + (cols % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        )
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            KCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0
        )  # (BLOCK_N, D)
        v = tl.load(VCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = dequantize(k, k_scale, KV_FP8, Q.dtype.element_ty)
        v = dequantize(v, v_scale, KV_FP8, Q.dtype.element_ty)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        visible = (cols[None, :] <= q_pos[:, None]) & col_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    Q, KCache, VCache, Out, PartialOut, PartialLse, BlockTables, QueryStartLoc, SeqLens, Work,
    Counters, scale, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FUSED_MERGE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Grid (work items, kv heads): the GROUP query heads of a kv head attend over one
    item's share [lo, hi) of a context. Work (n, 3) int32 (sequence, lo, hi); -1 is padding.
    A whole-context item writes Out; otherwise partial output and log-sum-exp, merged by
    the last program to finish (FUSED_MERGE; Counters (num_seqs, kv heads) int32 zero before
    and after) or by :func:`_decode_reduce_kernel`.
    """
    item = tl.program_id(0)
    seq = tl.load(Work + 3 * item)
    if seq < 0:  # a padding item
        return
    lo = tl.load(Work + 3 * item + 1)
    hi = tl.load(Work + 3 * item + 2)
    kv_head = tl.program_id(1)
    token = tl.load(QueryStartLoc + seq).to(tl.int64)
    seq_len = tl.load(SeqLens + seq)

    g = tl.arange(0, GROUP_P)  # query heads of this kv head (padded to a tl.dot size)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        Q + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=g_mask[:, None] & dim_mask[None, :], other=0.0,
    )  # (GROUP_P, D)  # fmt: skip

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < hi
        blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE, mask=col_mask, other=0)
        kv_off = (
            blocks.to(tl.int64) * stride_cb + (cols % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        )
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(KCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = dequantize(k, k_scale, KV_FP8, Q.dtype.element_ty)
        v = dequantize(v, v_scale, KV_FP8, Q.dtype.element_ty)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (GROUP_P, N)
        scores = tl.where(col_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out_mask = g_mask[:, None] & dim_mask[None, :]
    out = acc / l_i[:, None]  # items are never empty
    if (lo == 0) & (hi == seq_len):  # the only item of this decode
        o_ptrs = Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        # Partial buffers: (num_items, num_heads, HEAD_DIM_P) and (num_items, num_heads).
        num_heads = tl.num_programs(1) * GROUP
        row = item.to(tl.int64) * num_heads + heads
        tl.store(PartialOut + row[:, None] * HEAD_DIM_P + dims[None, :], out, mask=out_mask)
        tl.store(PartialLse + row, m_i + tl.log(l_i), mask=g_mask)
        if FUSED_MERGE:
            _merge_if_last(PartialOut, PartialLse, Out, Work, Counters, item, seq, lo, hi,
                           seq_len, kv_head, token, heads, g_mask, dims, out_mask, num_heads,
                           stride_ot, stride_oh, GROUP_P, HEAD_DIM_P)  # fmt: skip


@triton.jit
def _merge_if_last(
    PartialOut, PartialLse, Out, Work, Counters, item, seq, lo, hi, seq_len, kv_head, token,
    heads, g_mask, dims, out_mask, num_heads, stride_ot, stride_oh,
    GROUP_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):  # fmt: skip
    """Fused split-K merge: the last-finishing program of (decode, kv head) merges the
    partials into Out. Every item but a decode's last covers the same ``chunk``. Ordering:
    partial stores, barrier, then the acq_rel atomic; the merger reads partials with ``.cg``
    and resets the count to zero."""
    prev = tl.maximum(item - 1, 0)
    prev_size = tl.load(Work + 3 * prev + 2) - tl.load(Work + 3 * prev + 1)
    chunk = tl.where(hi == seq_len, prev_size, hi - lo)
    n = (seq_len + chunk - 1) // chunk
    first = item - lo // chunk
    counter = Counters + seq * tl.num_programs(1) + kv_head
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == n - 1:
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        for j in range(0, n):
            rows = (first + j).to(tl.int64) * num_heads + heads
            lse = tl.load(PartialLse + rows, mask=g_mask, other=0.0, cache_modifier=".cg")
            part = tl.load(PartialOut + rows[:, None] * HEAD_DIM_P + dims[None, :],
                           mask=out_mask, other=0.0, cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m, lse)
            w = tl.exp(lse - m_new)
            alpha = tl.exp(m - m_new)
            acc = acc * alpha[:, None] + part * w[:, None]
            denom = denom * alpha + w
            m = m_new
        o_ptrs = Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, (acc / denom[:, None]).to(Out.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _decode_reduce_kernel(
    PartialOut, PartialLse, Out, QueryStartLoc, Work, WorkLoc, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, MERGE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (decode rows, heads): out = sum_i exp(lse_i - lse) * out_i over the row's items;
    rows of fewer than two items do nothing."""
    r = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(WorkLoc + r)
    n = tl.load(WorkLoc + r + 1) - first
    if n < 2:
        return
    seq = tl.load(Work + 3 * first)
    token = tl.load(QueryStartLoc + seq).to(tl.int64)
    num_heads = tl.num_programs(1)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    m = tl.max(tl.full([MERGE_BLOCK], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([MERGE_BLOCK], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM_P], tl.float32)
    for c in range(0, n, MERGE_BLOCK):
        s = c + tl.arange(0, MERGE_BLOCK)
        mask = s < n
        rows = (first + s).to(tl.int64) * num_heads + head
        lse = tl.load(PartialLse + rows, mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))  # finite: the first block has 2+ items
        w = tl.exp(lse - m_new)
        alpha = tl.exp(m - m_new)
        parts = tl.load(PartialOut + rows[:, None] * HEAD_DIM_P + dims[None, :],
                        mask=mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        denom = denom * alpha + tl.sum(w, axis=0)
        m = m_new
    out = (acc / denom).to(Out.dtype.element_ty)
    tl.store(Out + token * stride_ot + head * stride_oh + dims, out, mask=dim_mask)


@triton.jit
def _decode_work_kernel(
    SeqLens, DecodeIdx, Work, WorkLoc, num_rows, num_items,
    TILE: tl.constexpr, ROWS_P: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Device twin of :func:`sched_lab.backend.attention.base.decode_work` (for CUDA graphs); program
    0 writes WorkLoc. Rows with sequence -1 or length 0 get no items."""
    rows = tl.arange(0, ROWS_P)
    seq = tl.load(DecodeIdx + rows, mask=rows < num_rows, other=-1)
    lens = tl.load(SeqLens + tl.maximum(seq, 0), mask=seq >= 0, other=0)
    tiles = (lens + (TILE - 1)) // TILE
    total = tl.sum(tiles, axis=0)
    real = tl.sum((tiles > 0).to(tl.int32), axis=0)
    lo = tl.maximum((total + num_items - 1) // num_items, 1)
    hi = tl.maximum(tl.max(tiles, axis=0), lo)
    if num_items > real:  # ceil(t / k) <= t / k + 1: this k always fits
        spare = tl.maximum(num_items - real, 1)
        hi = tl.maximum(lo, tl.minimum(hi, (total + spare - 1) // spare))
    while lo < hi:  # the smallest k with sum(ceil(tiles / k)) <= num_items
        mid = (lo + hi) // 2
        if tl.sum((tiles + mid - 1) // mid, axis=0) <= num_items:
            hi = mid
        else:
            lo = mid + 1
    counts = (tiles + lo - 1) // lo
    ends = tl.cumsum(counts, axis=0)  # inclusive: row r owns items [ends - counts, ends)
    if tl.program_id(0) == 0:
        tl.store(WorkLoc + 1 + rows, ends, mask=rows < num_rows)
        tl.store(WorkLoc, 0)
    items = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.sum((ends[None, :] <= items[:, None]).to(tl.int32), axis=1)  # (BLOCK,)
    row = tl.minimum(row, ROWS_P - 1)  # items beyond the last are padding anyway
    first = (items - tl.gather(ends - counts, row, 0)) * (lo * TILE)
    end = tl.minimum(first + lo * TILE, tl.gather(lens, row, 0))
    used = items < tl.sum(counts, axis=0)
    keep = items < num_items
    base = Work + 3 * items
    tl.store(base, tl.where(used, tl.gather(seq, row, 0), -1), mask=keep)
    tl.store(base + 1, tl.where(used, first, 0), mask=keep)
    tl.store(base + 2, tl.where(used, end, 0), mask=keep)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v (num_tokens, num_kv_heads, head_dim), strided rows allowed, into their
    slots; negative slots are skipped; an FP8 cache gets x / scale (module doc)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert (
        k.stride(2) == 1
        and v.stride(2) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=_head_dim_p(head_dim),
        KV_FP8=is_fp8(k_cache),
    )  # fmt: skip


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an FP8 (E4M3) KV cache."""
    return cache.dtype == torch.float8_e4m3fn


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Fill ``out`` rows of the prefill chunks (k_scale, v_scale: an FP8 cache's).

    Args:
        q, out: (num_tokens, num_heads, head_dim), last dim contiguous.
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), already holding
            this step's k/v.
        block_tables: (num_seqs, max_blocks) int32.
        query_start_loc: (num_seqs + 1,) int32. seq_lens: (num_seqs,) int32.
        tiles: (num_tiles, 2) int32 from :func:`sched_lab.backend.attention.base.prefill_tiles`.
    """
    if tiles.shape[0] == 0:
        return
    num_heads, head_dim = q.shape[1:]
    _prefill_kernel[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tiles, scale,
        k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_DIM_P=_head_dim_p(head_dim), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=is_fp8(k_cache),
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    work: torch.Tensor,
    work_loc: torch.Tensor,
    scale: float,
    merge: bool = True,
    fused_merge: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Fill ``out`` rows of the one-token sequences; shapes as in prefill.

    Args:
        work: (num_items, 3) int32 (sequence, lo, hi); sequence -1 is padding.
        work_loc: (num_decode_rows + 1,) int32; the items of each decode row.
        merge: run the merge kernel (False only when no row has more than one item).
        fused_merge: merge inside the decode kernel; None: ``FUSED_MERGE`` when rows average
            fewer than ``FUSED_MERGE_MAX_ITEMS_PER_ROW`` items.
        k_scale, v_scale: an FP8 cache's scales.
    """
    num_items = work.shape[0]
    if num_items == 0:
        return
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    head_dim_p = _head_dim_p(head_dim)
    partial = torch.empty(num_items, num_heads, head_dim_p, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_items, num_heads, dtype=torch.float32, device=q.device)
    rows = work_loc.numel() - 1
    few = num_items < FUSED_MERGE_MAX_ITEMS_PER_ROW * rows
    fused = FUSED_MERGE and few if fused_merge is None else fused_merge
    counters = merge_counters(seq_lens.numel(), num_kv_heads, q.device) if fused else work
    _decode_kernel[(num_items, num_kv_heads)](
        q, k_cache, v_cache, out, partial, lse, block_tables, query_start_loc, seq_lens, work,
        counters, scale, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        GROUP_P=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_N=DECODE_BLOCK_N, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED_MERGE=fused, KV_FP8=is_fp8(k_cache), num_warps=DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
    )  # fmt: skip
    if not fused and merge and work_loc.numel() > 1:
        _decode_reduce_kernel[(work_loc.numel() - 1, num_heads)](
            partial, lse, out, query_start_loc, work, work_loc, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, MERGE_BLOCK=MERGE_BLOCK,
        )  # fmt: skip


def decode_work_device(
    seq_lens: torch.Tensor, decode_idx: torch.Tensor, work: torch.Tensor, work_loc: torch.Tensor
) -> None:
    """Fill ``work`` (num_items, 3) int32 and ``work_loc`` (rows + 1,) int32 on the device
    from ``seq_lens`` (int32) and ``decode_idx`` (rows,) int32 (-1: padding).

    Raises:
        ValueError: fewer items than rows, padding included.
    """
    rows, num_items = decode_idx.numel(), work.shape[0]
    if num_items < rows:
        raise ValueError(f"decode_work_device: {rows} decode rows need at least as many "
                         f"items, got {num_items}")  # fmt: skip
    if num_items == 0:
        return
    _decode_work_kernel[(triton.cdiv(num_items, WORK_BLOCK),)](
        seq_lens, decode_idx, work, work_loc, rows, num_items,
        TILE=DECODE_BLOCK_N, ROWS_P=max(16, triton.next_power_of_2(rows)), BLOCK=WORK_BLOCK,
    )  # fmt: skip


def warm_up(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    dtype: torch.dtype | None = None,
) -> None:
    """Compile the prefill, decode and merge kernels for these caches' strides and dtype and
    queries of ``dtype`` (default: the cache's). Reads block 0 of the caches, writes only
    scratch tensors."""
    dev, head_dim = k_cache.device, k_cache.shape[3]
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype or k_cache.dtype, device=dev)
    out = torch.empty_like(q)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=dev)  # 2 positions: 2 blocks at most
    starts = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    tiles = torch.zeros(1, 2, dtype=torch.int32, device=dev)  # sequence 0, tile 0
    prefill_attention(q, k_cache, v_cache, out, tables, starts, starts[1:].clone(), tiles, scale)
    ones = torch.ones(1, dtype=torch.int32, device=dev)
    work = torch.tensor([[0, 0, 1]], dtype=torch.int32, device=dev)  # one item: no merging
    loc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    decode_attention(q, k_cache, v_cache, out, tables, starts, ones, work, loc, scale)


def _head_dim_p(head_dim: int) -> int:
    """head_dim padded to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))
