"""Fused Triton kernels for the non-attention work of a decoder layer (10 kernels a layer).

The kernels round where transformers' eager bf16 code rounds, so they match
:mod:`sched_lab.backend.model`'s torch path up to float32 summation order. Under
``TRITON_INTERPRET=1`` they run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sched_lab.backend.attention.triton_kernels import quantize_fp8


@triton.jit
def _rms_norm_kernel(
    X, Residual, ResidualOut, W, Out, stride_x, stride_r, stride_ro, stride_o, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One program per token: [s = x + residual, residual_out = s], out = w * norm(s)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + t * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded, as eager
        tl.store(ResidualOut + t * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = (x32 * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (num_tokens, hidden), optionally after adding ``residual``.

    Returns (weight * norm(s), s) with s = x + residual in x's dtype, or (weight * norm(x),
    None). Float32 normalisation (Zhang & Sennrich 2019, eq. 4), as transformers' Llama/Qwen.
    """
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return out, res_out
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _rms_norm_kernel[(num_tokens,)](
        x, r, ro, weight, out, x.stride(0), r.stride(0), ro.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
    )  # fmt: skip
    return out, res_out


@triton.jit
def _rope_half(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """Rotate-half RoPE on the two halves, each product rounded to DTYPE as in eager torch."""
    a = (x1 * cos).to(DTYPE).to(tl.float32)
    b = (x2 * sin).to(DTYPE).to(tl.float32)
    c = (x2 * cos).to(DTYPE).to(tl.float32)
    d = (x1 * sin).to(DTYPE).to(tl.float32)
    return (a - b).to(DTYPE), (c + d).to(DTYPE)


@triton.jit
def _head_rms_norm(x1, x2, W, halves, half_mask, eps, HEAD_DIM: tl.constexpr,
                   DTYPE: tl.constexpr):  # fmt: skip
    """Per-head RMSNorm of (heads, HEAD_DIM) given as its two halves (float32 in and out)."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    inv = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
    w1 = tl.load(W + halves, mask=half_mask, other=0.0).to(tl.float32)
    w2 = tl.load(W + HEAD_DIM // 2 + halves, mask=half_mask, other=0.0).to(tl.float32)
    n1 = (x1 * inv[:, None]).to(DTYPE).to(tl.float32)
    n2 = (x2 * inv[:, None]).to(DTYPE).to(tl.float32)
    return (w1[None, :] * n1).to(DTYPE).to(tl.float32), (w2[None, :] * n2).to(DTYPE).to(tl.float32)


@triton.jit
def _qkv_prepare_kernel(
    QKV, QOut, KCache, VCache, SlotMapping, Cos, Sin, QNormW, KNormW,
    stride_qkv, stride_cos, eps, k_scale, v_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr, HALF_P: tl.constexpr,
    QK_NORM: tl.constexpr, K_IN_PLACE: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """One program per token: [q/k RMSNorm], RoPE, q -> QOut, k/v -> cache slot (none for a
    negative slot; an FP8 cache gets x / scale, saturated); with K_IN_PLACE the prepared k
    also over the raw k (unquantized)."""
    t = tl.program_id(0).to(tl.int64)
    DTYPE: tl.constexpr = QKV.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    halves = tl.arange(0, HALF_P)
    half_mask = halves < HALF
    cos = tl.load(Cos + t * stride_cos + halves, mask=half_mask, other=0.0)
    sin = tl.load(Sin + t * stride_cos + halves, mask=half_mask, other=0.0)
    cos = cos.to(DTYPE).to(tl.float32)[None, :]  # the table is float32; eager casts it
    sin = sin.to(DTYPE).to(tl.float32)[None, :]
    row = QKV + t * stride_qkv

    heads = tl.arange(0, HEADS_P)[:, None]
    mask = (heads < NUM_HEADS) & half_mask[None, :]
    off = heads * HEAD_DIM + halves[None, :]
    q1 = tl.load(row + off, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(row + off + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _head_rms_norm(q1, q2, QNormW, halves, half_mask, eps, HEAD_DIM, DTYPE)
    q1, q2 = _rope_half(q1, q2, cos, sin, DTYPE)
    q_out = QOut + t * NUM_HEADS * HEAD_DIM
    tl.store(q_out + off, q1, mask=mask)
    tl.store(q_out + off + HALF, q2, mask=mask)

    slot = tl.load(SlotMapping + t).to(tl.int64)
    kv_heads = tl.arange(0, KV_HEADS_P)[:, None]
    kv_mask = (kv_heads < NUM_KV_HEADS) & half_mask[None, :] & (slot >= 0)
    kv_off = kv_heads * HEAD_DIM + halves[None, :]
    k_row = row + NUM_HEADS * HEAD_DIM
    v_row = k_row + NUM_KV_HEADS * HEAD_DIM
    k1 = tl.load(k_row + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_row + kv_off + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _head_rms_norm(k1, k2, KNormW, halves, half_mask, eps, HEAD_DIM, DTYPE)
    k1, k2 = _rope_half(k1, k2, cos, sin, DTYPE)
    dst = slot * NUM_KV_HEADS * HEAD_DIM + kv_off  # the caches are contiguous
    if K_IN_PLACE:  # this program alone reads the row, and has read it
        tl.store(k_row + kv_off, k1, mask=kv_mask)
        tl.store(k_row + kv_off + HALF, k2, mask=kv_mask)
    v1 = tl.load(v_row + kv_off, mask=kv_mask)
    v2 = tl.load(v_row + kv_off + HALF, mask=kv_mask)
    if KV_FP8:
        k1 = quantize_fp8(k1, k_scale, KCache.dtype.element_ty)
        k2 = quantize_fp8(k2, k_scale, KCache.dtype.element_ty)
        v1 = quantize_fp8(v1, v_scale, VCache.dtype.element_ty)
        v2 = quantize_fp8(v2, v_scale, VCache.dtype.element_ty)
    tl.store(KCache + dst, k1, mask=kv_mask)
    tl.store(KCache + dst + HALF, k2, mask=kv_mask)
    tl.store(VCache + dst, v1, mask=kv_mask)
    tl.store(VCache + dst + HALF, v2, mask=kv_mask)


def qkv_prepare(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_in_place: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """From the fused projection's output to attention inputs, in one kernel.

    Args:
        qkv: (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), rows contiguous.
        cos, sin: (num_tokens, head_dim // 2) float32, gathered by position.
        k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), contiguous;
            written at ``slot_mapping`` (skipped if < 0).
        q_norm_weight, k_norm_weight: (head_dim,) per-head RMSNorm weights (Qwen3), or None.
        k_in_place: also write the prepared k over the raw k in ``qkv`` (mutates it).
        k_scale, v_scale: an FP8 cache's scales (x / scale is stored, saturated to +-448).
    Returns:
        q: (num_tokens, num_heads, head_dim), contiguous, normalised and rotated.
    """
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert head_dim % 2 == 0 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    qk_norm = q_norm_weight is not None and k_norm_weight is not None
    _qkv_prepare_kernel[(num_tokens,)](
        qkv, q, k_cache, v_cache, slot_mapping, cos, sin,
        q_norm_weight if qk_norm else qkv, k_norm_weight if qk_norm else qkv,
        qkv.stride(0), cos.stride(0), eps, k_scale, v_scale,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_heads), KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HALF_P=triton.next_power_of_2(head_dim // 2), QK_NORM=qk_norm, K_IN_PLACE=k_in_place,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
    )  # fmt: skip
    return q


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (tokens, column tiles): out = silu(x[:, :INTER]) * x[:, INTER:]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, 2 * inter) = [gate | up] -> silu(gate) * up, (num_tokens, inter)."""
    num_tokens, width = x.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block
    )
    return out
