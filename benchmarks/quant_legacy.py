"""The quantized GEMMs as they were before the weight-streaming kernels (commit 21378d6 of
backend/quant_kernels.py), kept only so that benchmarks/quant_decode.py can time old against
new in one run: one tiled Triton kernel for int4/int8 at every batch (AWQ unpacked column by
column, split K through float32 atomics into a zeroed buffer), and fp8 always W8A8. Its GPTQ
and int8 arithmetic is again the engine's (quant_kernels.weight_only_gemm); what only this
file has is the kernel on AWQ's (K, N/8) layout, which the engine now repacks at load.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sched_lab.backend.attention.triton_backend import interpreting
from sched_lab.backend.quant_formats import QuantSpec
from sched_lab.backend.quant_kernels import fp8_gemm

LAYOUT = {"awq": 0, "gptq": 1, "int8": 2}


@triton.jit
def _wq_gemm_kernel(
    X, QW, QZ, S, Out, M, N, K, stride_xm, stride_qw0, stride_qw1, stride_qz0, stride_s0,
    stride_om, K_PER_SPLIT,
    LAYOUT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Out[m, n] (+)= sum_k X[m, k] * W[n, k]; program (tile, split) covers K_PER_SPLIT of K.
    LAYOUT 0: AWQ qweight (K, N/8); 1: GPTQ qweight (K/8, N); 2: int8 weight (N, K) with
    one scale per n (GROUP = K). F32_DOT: float32 operands (float32 activations, and the
    interpreter, whose bfloat16 dot is wrong)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    nib = rn % 8
    if LAYOUT == 0:
        col_shift = ((nib % 2) * 4 + nib // 2) * 4  # AWQ: column j sits in nibble (0,4,1,5,..)[j]
    else:
        col_shift = nib * 4
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
        if LAYOUT == 2:
            q = tl.load(QW + rn[None, :] * stride_qw0 + rk[:, None], mask=w_mask, other=0)
            w = q.to(tl.float32).to(x.dtype)  # (BLOCK_K, BLOCK_N), exact: |q| <= 127
        else:
            if LAYOUT == 0:
                packed = tl.load(QW + rk[:, None] * stride_qw0 + (rn // 8)[None, :],
                                 mask=w_mask, other=0)  # fmt: skip
                q = (packed >> col_shift[None, :]) & 0xF
            else:
                packed = tl.load(QW + (rk // 8)[:, None] * stride_qw0 + rn[None, :] * stride_qw1,
                                 mask=w_mask, other=0)  # fmt: skip
                q = (packed >> ((rk % 8) * 4)[:, None]) & 0xF
            g = k0 // GROUP
            zp = tl.load(QZ + g * stride_qz0 + rn // 8, mask=n_ok & (k0 < K), other=0)
            z = (zp >> col_shift) & 0xF
            if LAYOUT == 1:
                z = z + 1  # GPTQ stores zero - 1
            w = (q - z[None, :]).to(tl.float32).to(x.dtype)  # exact: -15..15
        if F32_DOT:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if LAYOUT == 2:
            acc += part
        else:
            s = tl.load(S + (k0 // GROUP) * stride_s0 + rn, mask=n_ok & (k0 < K), other=0.0)
            acc += part * s.to(tl.float32)[None, :]
    if LAYOUT == 2:
        s = tl.load(S + rn, mask=n_ok, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    out_ptr = Out + rm[:, None] * stride_om + rn[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(out_ptr, acc, mask=o_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the interpreter's split-K tests)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def legacy_weight_only_gemm(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: QuantSpec, out_features: int
) -> torch.Tensor:
    """x (M, K) bf16/fp16/fp32 @ W.T for an int4 (awq, gptq) or int8 W: (M, N) in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = out_features
    layout = LAYOUT[spec.method]
    group = k if layout == 2 else spec.group_size
    qw = tensors["weight"] if layout == 2 else tensors["qweight"]
    qz = tensors.get("qzeros", qw)
    s = tensors["weight_scale"] if layout == 2 else tensors["scales"]
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 64 else 128
    block_k = min(64, group)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * _num_sms(x.device) and split * 2 <= k_blocks // 4:
        split *= 2  # small M: spread K so every SM streams its part of the weight
    steps = triton.cdiv(k_blocks, split)
    if layout != 2:  # a split must start at a group boundary (one scale per K tile)
        per_group = group // block_k
        steps = triton.cdiv(steps, per_group) * per_group
        split = triton.cdiv(k_blocks, steps)
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    _wq_gemm_kernel[(tiles, split)](
        x, qw, qz, s, out, m, n, k, x.stride(0), qw.stride(0), qw.stride(1), qz.stride(0),
        s.stride(0), out.stride(0), steps * block_k,
        LAYOUT=layout, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, F32_DOT=x.dtype == torch.float32 or interpreting(),
    )  # fmt: skip
    return out if split == 1 else out.to(x.dtype)


def legacy_gemm(x: torch.Tensor, tensors: dict[str, torch.Tensor], spec: QuantSpec, n: int):
    """The old dispatch: fp8 always W8A8 ``_scaled_mm``, int4/int8 always the tiled kernel."""
    if spec.method == "fp8":
        return fp8_gemm(x, tensors["weight"], tensors["weight_scale"])
    return legacy_weight_only_gemm(x, tensors, spec, n)
