"""Paged-attention Triton kernels: store K/V into slots, prefill with a cached prefix, decode.

All three read the cache through the block table: position p of sequence s lives in block
``block_tables[s, p // BLOCK_SIZE]`` at row ``p % BLOCK_SIZE``. Keys are gathered token by
token inside a tile (``BLOCK_N`` positions may span several cache blocks), so any block size
works. Softmax is the online (flash) form in float32.

Kept simple on purpose: one program per (query tile, sequence, head) for prefill and per
(sequence, head) for decode; GQA heads re-read their kv head (from L2). Split-K over long
decode contexts and a GQA-packed decode are later optimisations.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors through Triton's interpreter; the tests use that on small shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # query rows per prefill program
BLOCK_N = 64  # key positions per inner-loop tile


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, SlotMapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):  # fmt: skip
    """One program per fed token: copy its (num_kv_heads, head_dim) k and v into its slot.

    A negative slot (a CUDA-graph padding row) writes nothing."""
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    dst = slot * NUM_KV_HEADS * HEAD_DIM + heads * HEAD_DIM + dims  # the caches are contiguous
    k = tl.load(K + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(V + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


@triton.jit
def _prefill_kernel(
    Q, KCache, VCache, Out, BlockTables, QueryStartLoc, SeqLens, SeqIdx, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, prefill seqs, heads): causal attention of a chunk over prefix + chunk."""
    tile = tl.program_id(0)
    seq = tl.load(SeqIdx + tl.program_id(1))
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(QueryStartLoc + seq)
    query_len = tl.load(QueryStartLoc + seq + 1) - q_start
    if tile * BLOCK_M >= query_len:
        return
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


@triton.jit
def _decode_kernel(
    Q, KCache, VCache, Out, BlockTables, QueryStartLoc, SeqLens, SeqIdx, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (decode seqs, heads): one query token over its whole cached context."""
    seq = tl.load(SeqIdx + tl.program_id(0))
    head = tl.program_id(1)
    kv_head = head // GROUP
    token = tl.load(QueryStartLoc + seq)
    seq_len = tl.load(SeqLens + seq)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    q = tl.load(Q + token * stride_qt + head * stride_qh + dims, mask=dim_mask, other=0.0).to(
        tl.float32
    )

    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)  # scalar running max
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)  # scalar denominator
    acc = tl.zeros([HEAD_DIM_P], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < seq_len
        blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE, mask=col_mask, other=0)
        kv_off = (
            blocks.to(tl.int64) * stride_cb + (cols % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        )
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(KCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        v = tl.load(VCache + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        scores = tl.sum(k * q[None, :], axis=1) * scale  # (BLOCK_N,)
        scores = tl.where(col_mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(
        Out + token * stride_ot + head * stride_oh + dims,
        out.to(Out.dtype.element_ty),
        mask=dim_mask,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v (num_tokens, num_kv_heads, head_dim), strided rows allowed, into their slots.

    Tokens whose slot is negative are skipped (CUDA-graph padding rows)."""
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
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=_head_dim_p(head_dim),
    )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_idx: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> None:
    """Fill ``out`` rows of the sequences in ``seq_idx`` (chunks over a cached prefix).

    Args:
        q, out: (num_tokens, num_heads, head_dim), last dim contiguous.
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), already holding
            this step's k/v.
        block_tables: (num_seqs, max_blocks) int32.
        query_start_loc: (num_seqs + 1,) int32. seq_lens: (num_seqs,) int32.
        seq_idx: (n,) int32, the sequences to compute. max_query_len: largest chunk among them.
    """
    if seq_idx.numel() == 0:
        return
    num_heads, head_dim = q.shape[1:]
    grid = (triton.cdiv(max_query_len, BLOCK_M), seq_idx.numel(), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, seq_idx, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_DIM_P=_head_dim_p(head_dim), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_idx: torch.Tensor,
    scale: float,
) -> None:
    """Fill ``out`` rows of the one-token sequences in ``seq_idx``; shapes as in prefill."""
    if seq_idx.numel() == 0:
        return
    num_heads, head_dim = q.shape[1:]
    _decode_kernel[(seq_idx.numel(), num_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, seq_idx, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        HEAD_DIM_P=_head_dim_p(head_dim), BLOCK_N=BLOCK_N,
    )  # fmt: skip


def _head_dim_p(head_dim: int) -> int:
    """head_dim padded to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))
