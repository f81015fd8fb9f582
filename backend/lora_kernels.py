"""Batched LoRA for a step that mixes adapters: segmented shrink and expand in Triton.

A step's tokens each run with the adapter in one GPU slot, or with none. The host sorts the
token rows by slot (:func:`sched_lab.backend.lora.lora_segments`) and hands the kernels
``order`` (the rows, grouped by slot) with each slot's segment in it, cut into tiles of
:data:`BLOCK_M` rows (``tile_slot``, ``tile_first`` into ``order``, ``tile_len``). A program
works on one tile, so a batch of many adapters is one launch per op, and rows with no
adapter are in no tile (skipped). Two grids:

* tiles (:func:`shrink_tiles`, :func:`expand_tiles`): one program row per possible tile of
  the step, at most :func:`sched_lab.backend.lora.max_tiles` (T, slots); tiles past the
  step's own have length 0 and their programs return at once;
* slots (:func:`shrink`, :func:`expand`): ``cdiv(T, BLOCK_M)`` program rows for every
  slot, most of them empty in a decode step (kept to compare against).

Both grids depend only on the padded token count and the slot count, so a CUDA graph holds
them with the segments as static inputs.

Shapes: x (T, K); A (slots, N, K) with N = slices * max_rank (the projection's slices, e.g.
q, k, v, share x, so their A matrices stack along N and one shrink serves them all); shrink
-> xr (splits, T, N) float32, split-K partials that the expand sums in a fixed order
(deterministic, no atomics). B (slots, out, max_rank) with the slices' outputs concatenated;
expand adds ``scale[slot] * xr[:, slice's ranks] @ B[slot, slice's rows]^T`` into y (T, out)
in place. Ranks below max_rank are zero-padded, so they add nothing.

:func:`shrink_ref` / :func:`expand_ref` are the torch references (one adapter at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sched_lab.backend.lora_tiles import TILE_ROWS, Tiling

BLOCK_M = TILE_ROWS  # token rows per program: tl.dot's smallest tile
K_PER_SPLIT = 512  # input features per shrink program of the slots grid (split-K)


# -- the work of one tile, shared by both grids ---------------------------------------------


@triton.jit
def _tile_rows(Order, first, count, BLOCK_M: tl.constexpr):
    """The tile's token rows (int64, 0 where masked) and their mask: order[first : + count]."""
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(Order + first + offs_m, mask=mask_m, other=0).to(tl.int64)
    return rows, mask_m


@triton.jit
def _shrink_tile(
    X, A, Out, rows, mask_m, slot, pid_nk, stride_x, stride_as, stride_an, stride_os, stride_o,
    N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Out[split, rows, n-tile] = X[rows, split's K range] @ A[slot, n-tile, K range]^T, with
    pid_nk = n-tile + N_BLOCKS * split."""
    pid_n, split = pid_nk % N_BLOCKS, pid_nk // N_BLOCKS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = A + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * K_SPLIT, split * K_SPLIT + K_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + rows[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        a = tl.load(
            a_base + offs_n[None, :] * stride_an + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # (BLOCK_K, BLOCK_N)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    out = Out + split.to(tl.int64) * stride_os + rows[:, None] * stride_o + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_tile(
    XR, B, Y, Scale, Bounds, rows, mask_m, slot, pid_n, stride_xs, stride_xr, stride_bs,
    stride_bn, stride_y, OUT: tl.constexpr, RANK: tl.constexpr, SLICES: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Y[rows, n-tile] += Scale[slot] * xr[rows, slice] @ B[slot, n-tile]^T with xr the sum
    of the shrink's SPLITS partials XR, each output column taking the ranks of the slice it
    falls in (Bounds: SLICES + 1 column offsets)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < OUT
    offs_r = tl.arange(0, RANK)
    b_base = B + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SLICES):
        lo = tl.load(Bounds + s)
        hi = tl.load(Bounds + s + 1)
        in_slice = mask_n & (offs_n >= lo) & (offs_n < hi)
        if tl.sum(in_slice.to(tl.int32), axis=0) > 0:
            xr_ptrs = XR + rows[:, None] * stride_xr + s * RANK + offs_r[None, :]
            xr = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
            for k in tl.static_range(SPLITS):  # in order: the same sum every run
                xr += tl.load(xr_ptrs + k * stride_xs, mask=mask_m[:, None], other=0.0)
            b = tl.load(
                b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=in_slice[None, :],
                other=0.0,
            )  # (RANK, BLOCK_N)
            if IEEE:
                acc += tl.dot(xr.to(b.dtype), b, input_precision="ieee")
            else:
                acc += tl.dot(xr.to(b.dtype), b)
    scale = tl.load(Scale + slot)
    y_ptrs = Y + rows[:, None] * stride_y + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + scale * acc).to(Y.dtype.element_ty), mask=mask)


# -- tiles grid: programs (tile, column block) ----------------------------------------------


@triton.jit
def _tile_of_program(Order, TileSlot, TileFirst, TileLen, BLOCK_M: tl.constexpr):
    """Program row tl.program_id(0)'s tile: (rows, mask, slot, count); count 0 (every row
    masked) for a tile past the step's own."""
    tile = tl.program_id(0)
    count = tl.load(TileLen + tile)
    rows, mask_m = _tile_rows(Order, tl.load(TileFirst + tile), count, BLOCK_M)
    return rows, mask_m, tl.load(TileSlot + tile), count


@triton.jit
def _shrink_tiles_kernel(
    X, A, Out, Order, TileSlot, TileFirst, TileLen, stride_x, stride_as, stride_an,
    stride_os, stride_o, N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    N_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (tile, n-tile + N_BLOCKS * split); a tile of length 0 does nothing."""
    rows, mask_m, slot, count = _tile_of_program(Order, TileSlot, TileFirst, TileLen, BLOCK_M)
    if count > 0:
        _shrink_tile(X, A, Out, rows, mask_m, slot, tl.program_id(1), stride_x, stride_as,
                     stride_an, stride_os, stride_o, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                     N_BLOCKS, IEEE)  # fmt: skip


@triton.jit
def _expand_tiles_kernel(
    XR, B, Y, Order, TileSlot, TileFirst, TileLen, Scale, Bounds, stride_xs, stride_xr,
    stride_bs, stride_bn, stride_y, OUT: tl.constexpr, RANK: tl.constexpr,
    SLICES: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """Program (tile, n-tile); a tile of length 0 does nothing."""
    rows, mask_m, slot, count = _tile_of_program(Order, TileSlot, TileFirst, TileLen, BLOCK_M)
    if count > 0:
        _expand_tile(XR, B, Y, Scale, Bounds, rows, mask_m, slot, tl.program_id(1), stride_xs,
                     stride_xr, stride_bs, stride_bn, stride_y, OUT, RANK, SLICES, SPLITS,
                     BLOCK_M, BLOCK_N, IEEE)  # fmt: skip


def shrink_tiles(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, tile_slot: torch.Tensor,
                 tile_first: torch.Tensor, tile_len: torch.Tensor,
                 tiling: Tiling | None = None) -> torch.Tensor:  # fmt: skip
    """x[t] @ a[slot(t)]^T for every row in a tile, as (splits, T, N) float32 partial sums
    over K ranges; rows in no tile hold garbage. :func:`expand_tiles` sums the partials.

    Args:
        x: (T, K). a: (slots, N, K), contiguous in K. order: (T,) int32 rows grouped by slot.
        tile_slot, tile_first, tile_len: (M,) int32; tile i is rows
            order[tile_first[i] : + tile_len[i]] (at most BLOCK_M) of slot tile_slot[i];
            M (the grid) is fixed by the caller, unused tiles have length 0.
        tiling: tile sizes (None: :class:`Tiling`'s defaults).
    """
    tiling = tiling or Tiling()
    num_tokens, k = x.shape
    _, n, _ = a.shape
    block_n = max(16, min(128, triton.next_power_of_2(n)))
    block_k = max(16, min(128, 8192 // block_n, triton.next_power_of_2(k)))
    k_split = triton.cdiv(tiling.k_per_split, block_k) * block_k
    splits = triton.cdiv(k, k_split)
    out = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=x.device)
    n_blocks = triton.cdiv(n, block_n)
    grid = (tile_len.numel(), n_blocks * splits)
    if grid[0] == 0:
        return out
    _shrink_tiles_kernel[grid](
        x, a, out, order, tile_slot, tile_first, tile_len, x.stride(0), a.stride(0),
        a.stride(1), out.stride(0), out.stride(1), N=n, K=k, K_SPLIT=k_split, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, N_BLOCKS=n_blocks, IEEE=x.dtype == torch.float32,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    return out


def expand_tiles(y: torch.Tensor, xr: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 bounds: torch.Tensor, order: torch.Tensor, tile_slot: torch.Tensor,
                 tile_first: torch.Tensor, tile_len: torch.Tensor,
                 tiling: Tiling | None = None) -> torch.Tensor:  # fmt: skip
    """y[t, cols of slice i] += scale[slot(t)] * xr[t, ranks of slice i] @ b[slot(t), cols]^T
    for every row in a tile, in place; returns y.

    Args:
        y: (T, out), a contiguous-row view (it may be the fused projection's output).
        xr: (splits, T, slices * rank) float32 partials from :func:`shrink_tiles`.
        b: (slots, out, rank), rank a power of two >= 16. scale: (slots,) float32.
        bounds: (slices + 1,) int32 column offsets of the slices in ``out``.
        order, tile_slot, tile_first, tile_len, tiling: as for :func:`shrink_tiles`.
    """
    tiling = tiling or Tiling()
    num_tokens, out_cols = y.shape
    _, _, rank = b.shape
    block_n = tiling.expand_n(rank)
    grid = (tile_len.numel(), triton.cdiv(out_cols, block_n))
    if grid[0] == 0:
        return y
    _expand_tiles_kernel[grid](
        xr, b, y, order, tile_slot, tile_first, tile_len, scale, bounds, xr.stride(0),
        xr.stride(1), b.stride(0), b.stride(1), y.stride(0), OUT=out_cols, RANK=rank,
        SLICES=bounds.numel() - 1, SPLITS=xr.shape[0], BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        IEEE=y.dtype == torch.float32, num_warps=tiling.num_warps,
    )  # fmt: skip
    return y


# -- slots grid: programs (m-tile, column block, slot) --------------------------------------


@triton.jit
def _segment_tile_of_program(Order, SegStart, SegLen, BLOCK_M: tl.constexpr):
    """Program (m, _, slot)'s tile: the m-th BLOCK_M rows of the slot's segment, as (rows,
    mask, slot, count); count <= 0 (every row masked) past the segment's end."""
    pid_m, slot = tl.program_id(0), tl.program_id(2)
    count = tl.load(SegLen + slot) - pid_m * BLOCK_M
    first = tl.load(SegStart + slot) + pid_m * BLOCK_M
    rows, mask_m = _tile_rows(Order, first, count, BLOCK_M)
    return rows, mask_m, slot, count


@triton.jit
def _shrink_kernel(
    X, A, Out, Order, SegStart, SegLen, stride_x, stride_as, stride_an, stride_os, stride_o,
    N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (m, n-tile + N_BLOCKS * split, slot); past the slot's rows it does nothing."""
    rows, mask_m, slot, count = _segment_tile_of_program(Order, SegStart, SegLen, BLOCK_M)
    if count > 0:
        _shrink_tile(X, A, Out, rows, mask_m, slot, tl.program_id(1), stride_x, stride_as,
                     stride_an, stride_os, stride_o, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                     N_BLOCKS, IEEE)  # fmt: skip


@triton.jit
def _expand_kernel(
    XR, B, Y, Order, SegStart, SegLen, Scale, Bounds, stride_xs, stride_xr, stride_bs,
    stride_bn, stride_y, OUT: tl.constexpr, RANK: tl.constexpr, SLICES: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (m, n-tile, slot); past the slot's rows it does nothing."""
    rows, mask_m, slot, count = _segment_tile_of_program(Order, SegStart, SegLen, BLOCK_M)
    if count > 0:
        _expand_tile(XR, B, Y, Scale, Bounds, rows, mask_m, slot, tl.program_id(1), stride_xs,
                     stride_xr, stride_bs, stride_bn, stride_y, OUT, RANK, SLICES, SPLITS,
                     BLOCK_M, BLOCK_N, IEEE)  # fmt: skip


def shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor,
           seg_len: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """:func:`shrink_tiles` on the slots grid: (splits, T, N) float32 partials.

    Args:
        x: (T, K). a: (slots, N, K), contiguous in K. order: (T,) int32 rows grouped by slot.
        seg_start, seg_len: (slots,) int32; slot s owns order[seg_start[s] : + seg_len[s]].
    """
    num_tokens, k = x.shape
    slots, n, _ = a.shape
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    k_split = max(block_k, triton.cdiv(K_PER_SPLIT, block_k) * block_k)
    splits = triton.cdiv(k, k_split)
    out = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=x.device)
    n_blocks = triton.cdiv(n, block_n)
    grid = (triton.cdiv(num_tokens, BLOCK_M), n_blocks * splits, slots)
    _shrink_kernel[grid](
        x, a, out, order, seg_start, seg_len, x.stride(0), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), N=n, K=k, K_SPLIT=k_split, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, N_BLOCKS=n_blocks, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def expand(y: torch.Tensor, xr: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
           bounds: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor,
           seg_len: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """:func:`expand_tiles` on the slots grid, in place; returns y. ``xr`` from
    :func:`shrink`; the other arguments as there and in :func:`expand_tiles`."""
    num_tokens, out_cols = y.shape
    slots, _, rank = b.shape
    slices = bounds.numel() - 1
    block_n = 64
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(out_cols, block_n), slots)
    _expand_kernel[grid](
        xr, b, y, order, seg_start, seg_len, scale, bounds, xr.stride(0), xr.stride(1),
        b.stride(0), b.stride(1), y.stride(0), OUT=out_cols, RANK=rank, SLICES=slices,
        SPLITS=xr.shape[0], BLOCK_M=BLOCK_M, BLOCK_N=block_n, IEEE=y.dtype == torch.float32,
    )  # fmt: skip
    return y


# -- torch references ----------------------------------------------------------------------


def token_slots(order: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                num_tokens: int) -> torch.Tensor:  # fmt: skip
    """(num_tokens,) int64 slot of each row, -1 for rows in no segment (host-side loop)."""
    slot_of = torch.full((num_tokens,), -1, dtype=torch.long)
    for s, (start, n) in enumerate(zip(seg_start.tolist(), seg_len.tolist(), strict=True)):
        slot_of[order[start : start + n].long().cpu()] = s
    return slot_of.to(order.device)


def shrink_ref(x: torch.Tensor, a: torch.Tensor, slot_of: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """:func:`shrink` with a per-row slot (-1: none), one adapter at a time."""
    for s in slot_of.unique().tolist():
        if s >= 0:
            rows = (slot_of == s).nonzero().squeeze(1)
            out[rows] = x[rows].float() @ a[s].float().t()
    return out


def expand_ref(y: torch.Tensor, xr: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
               bounds: list[int], slot_of: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """:func:`expand` with a per-row slot (-1: none), one adapter and slice at a time."""
    rank = b.shape[2]
    for s in slot_of.unique().tolist():
        if s < 0:
            continue
        rows = (slot_of == s).nonzero().squeeze(1)
        delta = torch.empty(len(rows), y.shape[1], dtype=torch.float32, device=y.device)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            ranks = xr[rows, i * rank : (i + 1) * rank]
            delta[:, lo:hi] = ranks @ b[s, lo:hi].float().t()
        y[rows] = (y[rows].float() + float(scale[s]) * delta).to(y.dtype)
    return y
