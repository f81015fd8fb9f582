"""The paged prefill attention kernel with two changes, an engine option
(``engine.triton_prefill_kernel: exp2``; the default ``base`` runs
:func:`sched_lab.backend.attention.triton_kernels.prefill_attention`):

* key tiles that every query row of the tile sees (below the tile's first row's position)
  run without the causal mask; only the tiles on the diagonal mask;
* the softmax in base 2: the scores scaled by ``scale * log2(e)`` once, then ``exp2``
  (FlashAttention-2's form; the same probabilities up to rounding).

Tiles, grid, paging, FP8 K/V and the output are the base kernel's; outputs agree with it to
float32 rounding before the cast (tests/test_prefill_exp2.py). On an H100 (Llama-3.1-8B
heads, 8k prefill tokens; benchmarks/prefill_attention.py, BENCHMARKS.md 2026-12-07) the
attention ran 1.3-1.5x faster than the base kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sched_lab.backend.attention.triton_kernels import (
    BLOCK_M,
    BLOCK_N,
    _head_dim_p,
    dequantize,
    is_fp8,
)

LOG2E = 1.4426950408889634


@triton.jit
def _tile(q, KCache, VCache, BlockTables, seq, stride_bt, stride_cb, stride_cs, stride_ch,
          kv_head, cols, dims, dim_mask, m_i, l_i, acc, qk_scale, k_scale, v_scale, q_pos,
          seq_len, MASK: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
          KV_FP8: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """One key tile folded into the running (m_i, l_i, acc), scores in base 2; ``MASK``: the
    causal and length masks (a diagonal tile), else every key is visible to every row."""
    if MASK:
        col_mask = cols < seq_len
        blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE, mask=col_mask, other=0)
        kv_mask = col_mask[:, None] & dim_mask[None, :]
    else:
        blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE)
        kv_mask = dim_mask[None, :]
    kv_off = blocks.to(tl.int64) * stride_cb + (cols % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    k = tl.load(KCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(VCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    k = dequantize(k, k_scale, KV_FP8, DTYPE)
    v = dequantize(v, v_scale, KV_FP8, DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
    if MASK:
        visible = (cols[None, :] <= q_pos[:, None]) & (cols < seq_len)[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width varies step to step
def _prefill_exp2_kernel(
    Q, KCache, VCache, Out, BlockTables, QueryStartLoc, SeqLens, Tiles, qk_scale, k_scale,
    v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Grid (tile rows, heads), Tiles as the base kernel's; ``qk_scale`` = scale * log2(e)."""
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

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    dims = tl.arange(0, HEAD_DIM_P)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # fmt: skip
    q_pos = prefix_len + rows  # absolute position of each query row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    kv_end = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    # Keys [0, full_end) are at or before the tile's first row: visible to every row.
    full_end = tl.minimum((prefix_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    for start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _tile(q, KCache, VCache, BlockTables, seq, stride_bt, stride_cb,
                              stride_cs, stride_ch, kv_head, start + tl.arange(0, BLOCK_N),
                              dims, dim_mask, m_i, l_i, acc, qk_scale, k_scale, v_scale, q_pos,
                              seq_len, False, BLOCK_SIZE, DOT_PRECISION, KV_FP8,
                              Q.dtype.element_ty)  # fmt: skip
    for start in range(full_end, kv_end, BLOCK_N):  # the diagonal: key 0 is always visible
        m_i, l_i, acc = _tile(q, KCache, VCache, BlockTables, seq, stride_bt, stride_cb,
                              stride_cs, stride_ch, kv_head, start + tl.arange(0, BLOCK_N),
                              dims, dim_mask, m_i, l_i, acc, qk_scale, k_scale, v_scale, q_pos,
                              seq_len, True, BLOCK_SIZE, DOT_PRECISION, KV_FP8,
                              Q.dtype.element_ty)  # fmt: skip
    out = acc / l_i[:, None]
    o_ptrs = Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


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
    """:func:`sched_lab.backend.attention.triton_kernels.prefill_attention`'s contract (same
    arguments, shapes and tiles), by this module's kernel."""
    if tiles.shape[0] == 0:
        return
    num_heads, head_dim = q.shape[1:]
    _prefill_exp2_kernel[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tiles,
        scale * LOG2E, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_DIM_P=_head_dim_p(head_dim), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=is_fp8(k_cache),
    )  # fmt: skip
