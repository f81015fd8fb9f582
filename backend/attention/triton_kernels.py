"""Paged-attention Triton kernels: store K/V into slots, prefill with a cached prefix, decode.

All three read the cache through the block table: position p of sequence s lives in block
``block_tables[s, p // BLOCK_SIZE]`` at row ``p % BLOCK_SIZE``. Keys are gathered token by
token inside a tile (``BLOCK_N`` positions may span several cache blocks), so any block size
works. Softmax is the online (flash) form in float32.

Prefill: one program per (query tile, head), the tiles of all chunks listed in a tile table
so the grid depends only on its length (CUDA graphs pad it); GQA heads re-read their kv head
(from L2). Decode: one program per (sequence, kv head, context split): the query heads of a
kv head are packed into one tile so K/V is read once per group, and long contexts are split
across programs whose partial results a second kernel merges by log-sum-exp
(flash-decoding: Dao, Haziza, Massa and Sizov, "Flash-Decoding for long-context inference",
PyTorch blog, 2023), so batch 1 at 4k tokens still runs on every SM. Sequence index -1 in
either kernel's table is CUDA-graph padding: its programs return at once.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors through Triton's interpreter; the tests use that on small shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.attention.base import PREFILL_TILE_M

BLOCK_M = PREFILL_TILE_M  # query rows per prefill program
BLOCK_N = 64  # key positions per inner-loop tile
DECODE_BLOCK_N = 64  # key positions per decode tile
DECODE_NUM_WARPS = 4  # warps per decode program (benchmarks/decode_attention_sweep.py)
DECODE_NUM_STAGES = 2  # software-pipelining stages of the decode loop
MAX_SPLITS = 16  # most context splits of one decode
DECODE_TARGET_PROGRAMS = 4 * 132  # H100/H200 SXM: 132 SMs (NVIDIA H100 datasheet); 4 each


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


@triton.jit(do_not_specialize=["stride_bt"])  # the block-table width varies step to step
def _prefill_kernel(
    Q, KCache, VCache, Out, BlockTables, QueryStartLoc, SeqLens, Tiles, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (tile table rows, heads): causal attention of one BLOCK_M-row tile of a chunk
    over prefix + chunk. Tiles (n, 2) int32 holds (sequence, tile index in its chunk); a
    row whose sequence is negative (CUDA-graph padding) does nothing."""
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
    Q, KCache, VCache, Out, PartialOut, PartialLse, BlockTables, QueryStartLoc, SeqLens, SeqIdx,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (decode seqs, kv heads, splits): the GROUP query heads that share a kv head attend
    over one contiguous share of the context (split-K, "flash-decoding"), so each K/V tile
    is read once for the whole group and short batches still fill the GPU.

    With one split the result goes straight to Out; otherwise each split writes its
    normalised partial output and log-sum-exp, and :func:`_decode_reduce_kernel` merges them.
    """
    seq = tl.load(SeqIdx + tl.program_id(0))
    if seq < 0:  # a CUDA-graph padding row
        return
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(QueryStartLoc + seq).to(tl.int64)
    seq_len = tl.load(SeqLens + seq)
    # Each split covers a whole number of BLOCK_N tiles; trailing splits may be empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)

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
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (GROUP_P, N)
        scores = tl.where(col_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out_mask = g_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_ptrs = Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        # Partial buffers: (num_decodes, num_heads, NUM_SPLITS, HEAD_DIM_P) and (.., NUM_SPLITS).
        row = (tl.program_id(0) * (tl.num_programs(1) * GROUP) + heads).to(tl.int64)
        nonempty = lo < hi
        out = tl.where(nonempty, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        lse = tl.where(nonempty, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        p_ptrs = PartialOut + (row[:, None] * NUM_SPLITS + split) * HEAD_DIM_P + dims[None, :]
        tl.store(p_ptrs, out, mask=out_mask)
        tl.store(PartialLse + row * NUM_SPLITS + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    PartialOut, PartialLse, Out, QueryStartLoc, SeqIdx, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Grid (decode seqs, heads): out = sum_s exp(lse_s - lse) * out_s over the splits."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(SeqIdx + i)
    if seq < 0:  # a CUDA-graph padding row
        return
    token = tl.load(QueryStartLoc + seq).to(tl.int64)
    row = (i * tl.num_programs(1) + head).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    lse = tl.load(PartialLse + row * NUM_SPLITS + splits)  # split 0 is never empty
    weights = tl.exp(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    parts = tl.load(
        PartialOut + (row * NUM_SPLITS + splits[:, None]) * HEAD_DIM_P + dims[None, :],
        mask=dim_mask[None, :], other=0.0,
    )  # fmt: skip
    out = tl.sum(parts * weights[:, None], axis=0)
    tl.store(Out + token * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty),
             mask=dim_mask)  # fmt: skip


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
    tiles: torch.Tensor,
    scale: float,
) -> None:
    """Fill ``out`` rows of the prefill chunks (chunks over a cached prefix), one program per
    (row of ``tiles``, head).

    Args:
        q, out: (num_tokens, num_heads, head_dim), last dim contiguous.
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), already holding
            this step's k/v.
        block_tables: (num_seqs, max_blocks) int32.
        query_start_loc: (num_seqs + 1,) int32. seq_lens: (num_seqs,) int32.
        tiles: (num_tiles, 2) int32 from :func:`backend.attention.base.prefill_tiles`
            (``BLOCK_M`` rows a tile); rows with sequence -1 are skipped.
    """
    if tiles.shape[0] == 0:
        return
    num_heads, head_dim = q.shape[1:]
    _prefill_kernel[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tiles, scale,
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
    max_seq_len: int | None = None,
    splits: int | None = None,
) -> None:
    """Fill ``out`` rows of the one-token sequences in ``seq_idx`` (entries -1, CUDA-graph
    padding, are skipped); shapes as in prefill.

    ``max_seq_len`` (host int, optional) caps the number of splits (see :func:`num_splits`);
    ``splits`` (a power of two <= MAX_SPLITS) overrides the choice (warm-up, tests).
    """
    num_decodes = seq_idx.numel()
    if num_decodes == 0:
        return
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if splits is None:
        splits = num_splits(num_decodes, num_kv_heads, max_seq_len)
    head_dim_p = _head_dim_p(head_dim)
    if splits > 1:
        partial = torch.empty(num_decodes, num_heads, splits, head_dim_p, dtype=torch.float32,
                              device=q.device)  # fmt: skip
        lse = torch.empty(num_decodes, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        partial = lse = out  # unused
    _decode_kernel[(num_decodes, num_kv_heads, splits)](
        q, k_cache, v_cache, out, partial, lse, block_tables, query_start_loc, seq_lens, seq_idx,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES,
    )  # fmt: skip
    if splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            partial, lse, out, query_start_loc, seq_idx, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=splits,
        )  # fmt: skip


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Compile the prefill kernel and every decode split variant for these caches' strides
    and dtype, so no step of a measured run pays for a Triton compile (~1 s each). Reads
    block 0 of the caches, writes only scratch tensors."""
    dev, head_dim = k_cache.device, k_cache.shape[3]
    q = torch.zeros(2, num_heads, head_dim, dtype=k_cache.dtype, device=dev)
    out = torch.empty_like(q)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=dev)  # 2 positions: 2 blocks at most
    starts = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    seq = torch.zeros(1, dtype=torch.int32, device=dev)
    tiles = torch.zeros(1, 2, dtype=torch.int32, device=dev)  # sequence 0, tile 0
    prefill_attention(q, k_cache, v_cache, out, tables, starts, starts[1:].clone(), tiles, scale)
    ones = torch.ones(1, dtype=torch.int32, device=dev)
    for splits in (1 << i for i in range(MAX_SPLITS.bit_length())):
        decode_attention(q, k_cache, v_cache, out, tables, starts, ones, seq, scale,
                         splits=splits)  # fmt: skip


def num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int | None = None) -> int:
    """Splits of each decode's context: enough (seq, kv head, split) programs to give every
    SM several (``DECODE_TARGET_PROGRAMS``), at most ``MAX_SPLITS``, a power of two, and no
    more than the longest context has ``DECODE_BLOCK_N`` tiles."""
    want = -(-DECODE_TARGET_PROGRAMS // (num_decodes * num_kv_heads))
    splits = min(MAX_SPLITS, triton.next_power_of_2(max(1, want)))
    if max_seq_len is not None:
        tiles = -(-max_seq_len // DECODE_BLOCK_N)
        while splits > 1 and splits // 2 >= tiles:
            splits //= 2
    return splits


def _head_dim_p(head_dim: int) -> int:
    """head_dim padded to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))
