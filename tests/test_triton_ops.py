"""The fused Triton kernels (backend/triton_ops.py) and the split-K decode against torch.

Without CUDA they run in Triton's CPU interpreter, which rounds float32 -> bfloat16 toward
zero instead of to nearest even; bf16 cases are therefore exact on a GPU only and checked to
one bf16 ulp-ish tolerance in the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_setup import DEVICE, HAS_CUDA, needs_triton, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

from backend import triton_ops  # noqa: E402
from backend.attention import triton_kernels  # noqa: E402
from backend.attention.base import store_kv  # noqa: E402
from backend.model import RMSNorm  # noqa: E402
from backend.rope import apply_rope  # noqa: E402

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def close(got, ref, dtype):
    """Exact in float32 up to summation order; bf16 to interpreter rounding (see module doc)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    elif HAS_CUDA:
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    x, r = rand(7, hidden, dtype=dtype, seed=1), rand(7, hidden, dtype=dtype, seed=2)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.weight.data = rand(hidden, dtype=dtype, seed=3)
    out, summed = triton_ops.rms_norm(x, norm.weight, 1e-6)
    assert summed is None
    close(out, norm(x), dtype)
    out, summed = triton_ops.rms_norm(x, norm.weight, 1e-6, r)
    close(summed, x + r, dtype)
    close(out, norm(x + r), dtype)
    if dtype == torch.float32:  # a hand-checked row: x = [3, 4], rms = sqrt(12.5)
        two = torch.tensor([[3.0, 4.0]], device=DEVICE)
        got, _ = triton_ops.rms_norm(two, torch.tensor([1.0, 2.0], device=DEVICE), 0.0)
        torch.testing.assert_close(got, torch.tensor([[3.0, 8.0]], device=DEVICE) / 12.5**0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = rand(5, 2 * 40, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    close(triton_ops.silu_and_mul(x), F.silu(gate) * up, dtype)


def reference_qkv(qkv, cos, sin, caches, slots, heads, kv_heads, head_dim, norms):
    """The torch path of backend.model.Attention: split, [q/k norm], RoPE, store k/v."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim)
    v = v.reshape(n, kv_heads, head_dim)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keep = slots >= 0
    store_kv(k[keep], v[keep], caches[0], caches[1], slots[keep])
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "qk_norm"),
                         [(4, 2, 32, True), (6, 2, 24, False), (2, 1, 16, True)])  # fmt: skip
def test_qkv_prepare_matches_the_torch_path(dtype, heads, kv_heads, head_dim, qk_norm):
    n, num_blocks, block_size = 6, 8, 4
    qkv = rand(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, head_dim // 2)
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 31, 8], device=DEVICE)  # -1: a padding row
    norms = None
    if qk_norm:
        norms = [RMSNorm(head_dim, 1e-6).to(DEVICE, dtype) for _ in range(2)]
        for i, m in enumerate(norms):
            m.weight.data = rand(head_dim, dtype=dtype, seed=10 + i)
    caches = rand(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=5)
    ref_caches = caches.clone()
    ref_q = reference_qkv(qkv, cos, sin, ref_caches, slots, heads, kv_heads, head_dim, norms)
    q = triton_ops.qkv_prepare(
        qkv, cos, sin, caches[0], caches[1], slots, heads, kv_heads, head_dim,
        norms[0].weight if norms else None, norms[1].weight if norms else None, 1e-6,
    )  # fmt: skip
    assert q.shape == (n, heads, head_dim) and q.is_contiguous()
    close(q, ref_q, dtype)
    close(caches, ref_caches, dtype)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[[3, 17, 0, 31, 8]] = False  # slot -1 wrote nothing: every other slot is as before
    flat = caches.view(2, -1, kv_heads, head_dim)
    before = rand(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=5)
    assert torch.equal(flat[:, untouched], before.view(2, -1, kv_heads, head_dim)[:, untouched])


def test_num_splits():
    # 4 programs per SM on 132 SMs = 528: batch 1 x 8 kv heads wants 66 -> capped at 16;
    # batch 32 x 8 = 256 programs wants 3 -> next power of two, 4; batch 256 needs none.
    assert triton_kernels.num_splits(1, 8) == 16
    assert triton_kernels.num_splits(32, 8) == 4
    assert triton_kernels.num_splits(256, 8) == 1
    assert triton_kernels.num_splits(66, 8) == 1
    # ...and no more splits than the longest context has 64-token tiles, rounded up to 2^k.
    assert triton_kernels.num_splits(1, 8, max_seq_len=100) == 2
    assert triton_kernels.num_splits(1, 8, max_seq_len=64) == 1
    assert triton_kernels.num_splits(1, 8, max_seq_len=200) == 4


def test_split_decode_matches_reference_over_long_contexts():
    # 4 decodes x 1 kv head: 16 splits of 64 tokens for the 701-token context; the short
    # sequences leave trailing splits empty (their log-sum-exp is -inf, weight 0).
    from test_backend_triton import assert_backends_agree, batch, run_both

    seqs = batch([(700, 1), (5, 1), (64, 1), (300, 1)], block_size=16, num_blocks=128)
    results = run_both(seqs, 4, 1, 32, block_size=16, num_blocks=128, dtype=torch.float32)
    assert_backends_agree(results, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_warm_up_only_reads_the_caches(block_size):
    caches = rand(2, 3, block_size, 2, 32)
    before = caches.clone()
    triton_kernels.warm_up(caches[0], caches[1], num_heads=4, scale=0.1)
    assert torch.equal(caches, before)
