"""Batched LoRA for a step that mixes adapters: segmented shrink and expand in Triton.

A step's tokens each run with the adapter in one GPU slot, or with none. The host sorts the
token rows by slot (:func:`sched_lab.backend.lora.lora_segments`) and hands the kernels
``order`` (the rows, grouped by slot) with each slot's ``seg_start`` / ``seg_len`` in it; a
program works on one tile of one slot's rows, so a batch of many adapters is one launch per
op, and rows with no adapter are in no segment (skipped). The grids depend only on the
padded token count and the slot count, so a CUDA graph holds them with the segments as
static inputs.

Shapes: x (T, K); A (slots, N, K) with N = slices * max_rank (the projection's slices, e.g.
q, k, v, share x, so their A matrices stack along N); shrink -> xr (T, N) float32, kept as
split-K partials that the expand sums in a fixed order (deterministic, no atomics).
B (slots, out, max_rank) with the slices' outputs concatenated; expand adds
``scale[slot] * xr[:, slice's ranks] @ B[slot, slice's rows]^T`` into y (T, out) in place.
Ranks below max_rank are zero-padded, so they add nothing.

:func:`shrink_ref` / :func:`expand_ref` are the torch references (one adapter at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # token rows per program: tl.dot's smallest tile
K_PER_SPLIT = 512  # input features per shrink program (split-K)


@triton.jit
def _shrink_kernel(
    X, A, Out, Order, SegStart, SegLen, stride_x, stride_as, stride_an, stride_os, stride_o,
    N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (m, n-tile * splits + split, slot): Out[split, rows, n-tile] = X[rows, split's
    K range] @ A[slot, n-tile, split's K range]^T, float32."""
    pid_m, pid_nk, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(SegLen + slot)
    if pid_m * BLOCK_M >= count:
        return
    pid_n, split = pid_nk % N_BLOCKS, pid_nk // N_BLOCKS
    first = tl.load(SegStart + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(Order + first + offs_m, mask=mask_m, other=0).to(tl.int64)
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
def _expand_kernel(
    XR, B, Y, Order, SegStart, SegLen, Scale, Bounds, stride_xs, stride_xr, stride_bs,
    stride_bn, stride_y, OUT: tl.constexpr, RANK: tl.constexpr, SLICES: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (m, n, slot): Y[rows, n-tile] += Scale[slot] * xr[rows, slice] @ B[slot, n-tile]^T
    with xr the sum of the shrink's SPLITS partials XR, each output column taking the ranks
    of the slice it falls in (Bounds: SLICES + 1 column offsets)."""
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(SegLen + slot)
    if pid_m * BLOCK_M >= count:
        return
    first = tl.load(SegStart + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(Order + first + offs_m, mask=mask_m, other=0).to(tl.int64)
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


def shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor,
           seg_len: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x[t] @ a[slot(t)]^T for every row in a segment, as (splits, T, N) float32 partial sums
    over K ranges (split-K: a decode step has few rows per adapter, so K is what spreads the
    work); rows in no segment hold garbage. :func:`expand` sums the partials.

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
    """y[t, cols of slice i] += scale[slot(t)] * xr[t, ranks of slice i] @ b[slot(t), cols]^T
    for every row in a segment, in place; returns y.

    Args:
        y: (T, out), a contiguous-row view (it may be the fused projection's output).
        xr: (splits, T, slices * rank) float32 partials from :func:`shrink`.
        b: (slots, out, rank), rank a power of two >= 16. scale: (slots,) float32.
        bounds: (slices + 1,) int32 column offsets of the slices in ``out``.
    """
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
