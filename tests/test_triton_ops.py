"""The fused Triton kernels (backend/triton_ops.py) and the split-K decode against torch.

Without CUDA they run in Triton's CPU interpreter, which rounds float32 -> bfloat16 toward
zero instead of to nearest even; bf16 cases are therefore exact on a GPU only and checked to
one bf16 ulp-ish tolerance in the interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

import torch.nn.functional as F
from triton_setup import DEVICE, HAS_CUDA, needs_triton, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

from sched_lab.backend import triton_ops  # noqa: E402
from sched_lab.backend.attention import triton_kernels  # noqa: E402
from sched_lab.backend.attention.base import decode_items, decode_work, store_kv  # noqa: E402
from sched_lab.backend.inputs import prepare_inputs  # noqa: E402
from sched_lab.backend.model import RMSNorm  # noqa: E402
from sched_lab.backend.rope import apply_rope  # noqa: E402

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
    """The torch path of sched_lab.backend.model.Attention: split, [q/k norm], RoPE, store k/v."""
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


def test_decode_items():
    # 4 programs per SM on 132 SMs = 528: batch 1 x 8 kv heads wants 66 -> capped at 16 items;
    # batch 32 x 8 = 256 programs wants 3 -> next power of two, 4 a row, + 32 // 4 = 136;
    # batch 256 needs 1 a row, + 64 of headroom.
    assert decode_items(1, 8) == 16
    assert decode_items(32, 8) == 32 * 4 + 8
    assert decode_items(256, 8) == 256 + 64
    assert decode_items(66, 8) == 66 + 16  # 66 x 8 = 528 programs: 1 a row
    assert decode_items(32, 8, splits=16) == 32 * 16 + 8  # mixed graphs fix the splits
    assert decode_items(0, 8) == 0


def test_decode_work_hand_computed():
    # 5 + 1 tiles of 64 do not fit 4 items; 2 tiles (128 positions) an item: 3 + 1.
    work, loc = decode_work([300, 40], [0, 1], 4)
    assert work.tolist() == [[0, 0, 128], [0, 128, 256], [0, 256, 300], [1, 0, 40]]
    assert loc.tolist() == [0, 3, 4]
    # Padding rows (sequence -1) get no items; unused items are (-1, 0, 0).
    work, loc = decode_work([9, 100, 9], [-1, 3, -1], 4)
    assert work.tolist() == [[3, 0, 64], [3, 64, 100], [-1, 0, 0], [-1, 0, 0]]
    assert loc.tolist() == [0, 0, 2, 2]
    # Uniform batch 32 at 1025 positions (17 tiles), 136 items: 5 tiles an item, 4 a row
    # (4 tiles would need 5 a row, 160 items): the split of the earlier fixed-split kernel.
    work, loc = decode_work([1025] * 32, range(32), 136)
    assert loc.tolist() == list(range(0, 129, 4))
    assert work[:4].tolist() == [[0, 0, 320], [0, 320, 640], [0, 640, 960], [0, 960, 1025]]
    assert (work[128:] == [-1, 0, 0]).all()
    # One 16k context among 63 of 1k, 144 items (batch 64): 1,328 tiles in all; 14 tiles an
    # item needs 19 + 63 x 2 = 145 items, 15 needs 18 + 126 = 144. The long context takes 18
    # items of 960 positions instead of 2 of 8k.
    work, loc = decode_work([16385] + [1025] * 63, range(64), 144)
    assert loc[:3].tolist() == [0, 18, 20] and loc[-1] == 144
    assert work[17].tolist() == [0, 16320, 16385] and work[18].tolist() == [1, 0, 960]
    with pytest.raises(ValueError, match="3 decode rows need at least as many items, got 2"):
        decode_work([5, 5, 5], [0, 1, 2], 2)


def test_decode_work_covers_each_context_with_the_fewest_tiles():
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = int(rng.integers(1, 40))
        lens = rng.integers(1, 5000, rows)
        idx = np.where(rng.random(rows) < 0.2, -1, rng.permutation(100)[:rows])
        real = int((idx >= 0).sum())
        items = real + int(rng.integers(0, 200))
        work, loc = decode_work(lens, idx, items)
        assert work.shape == (items, 3) and loc[0] == 0 and loc[-1] <= items
        k = max(int(work[i, 2] - work[i, 1]) for i in range(loc[-1])) if loc[-1] else 0
        k = -(-k // 64)  # tiles an item
        for r in range(rows):
            mine = work[loc[r] : loc[r + 1]]
            if idx[r] < 0:
                assert len(mine) == 0
                continue
            assert (mine[:, 0] == idx[r]).all() and mine[0, 1] == 0 and mine[-1, 2] == lens[r]
            assert (mine[1:, 1] == mine[:-1, 2]).all() and (mine[:, 1] % (64 * k) == 0).all()
        assert (work[loc[-1] :] == [-1, 0, 0]).all()
        tiles = -(-lens[idx >= 0] // 64)
        if k > 1:  # the smallest item size that fits
            assert (-(-tiles // (k - 1))).sum() > items


def test_device_work_items_match_the_host_function():
    # The CUDA graphs cut the work items on the device: same items, same offsets, padding
    # (-1, 0, 0) written over whatever the buffer held; rows of sequence -1 or length 0
    # get none. 40 random steps, 1-40 decode rows over 1-5,000 positions.
    rng = np.random.default_rng(1)
    for case in range(40):
        rows = int(rng.integers(1, 40))
        lens = rng.integers(0, 5000, rows + 5).astype(np.int32)  # indexed by sequence
        idx = np.where(rng.random(rows) < 0.2, -1, rng.permutation(rows + 5)[:rows])
        idx = idx.astype(np.int32)
        row_lens = np.where(idx >= 0, lens[np.maximum(idx, 0)], 0)
        items = rows + int(rng.integers(0, 200)) * (case % 4 > 0)  # at least one a row
        work, loc = decode_work(row_lens, np.where(row_lens > 0, idx, -1), items)
        got_work = torch.full((items, 3), 7, dtype=torch.int32, device=DEVICE)
        got_loc = torch.full((rows + 1,), 7, dtype=torch.int32, device=DEVICE)
        triton_kernels.decode_work_device(
            torch.from_numpy(lens).to(DEVICE), torch.from_numpy(idx).to(DEVICE), got_work, got_loc
        )
        assert got_work.cpu().numpy().tolist() == work.tolist(), f"case {case}"
        assert got_loc.cpu().numpy().tolist() == loc.tolist(), f"case {case}"
    # Fewer items than rows: refused before launch (the kernel cannot count real rows).
    lens = torch.ones(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="3 decode rows need at least as many items, got 2"):
        triton_kernels.decode_work_device(
            lens,
            torch.arange(3, dtype=torch.int32, device=DEVICE),
            torch.empty(2, 3, dtype=torch.int32, device=DEVICE),
            torch.empty(4, dtype=torch.int32, device=DEVICE),
        )


# bf16 tl.dot is wrong under the interpreter (before and after the work items: values of
# ~1e8), so bf16 decode runs on the GPU only.
@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * HAS_CUDA)
def test_decode_merges_many_items_per_row(dtype):
    # One decode over 1,500 positions in 24 items of 64 (two merge blocks of 16), one over
    # 40 in one item (written directly), a padding row between them, and unused items.
    from test_backend_triton import batch

    from sched_lab.backend.attention.torch_ref import attend, gather_sequence

    seqs = batch([(1499, 1), (39, 1)], block_size=16, num_blocks=128)
    meta = prepare_inputs(seqs, 16, 128, 1 << 20, 1 << 30, DEVICE).attn
    work, loc = decode_work([1500, 9, 40], [0, -1, 1], 30)
    assert loc.tolist() == [0, 24, 24, 25]
    heads, kv_heads, head_dim = 4, 2, 32
    q = rand(2, heads, head_dim, dtype=dtype)
    caches = rand(2, 128, 16, kv_heads, head_dim, dtype=dtype, seed=1)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    triton_kernels.decode_attention(
        q, caches[0], caches[1], out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        torch.from_numpy(work).to(DEVICE), torch.from_numpy(loc).to(DEVICE), scale,
    )  # fmt: skip
    for i, (s, n) in enumerate(zip(seqs, (1500, 40))):
        keys = gather_sequence(caches[0], s.block_table, n)
        values = gather_sequence(caches[1], s.block_table, n)
        close(out[i : i + 1], attend(q[i : i + 1], keys, values, scale).to(dtype), dtype)


def test_split_decode_matches_reference_over_long_contexts():
    # 4 decodes x 1 kv head: 528 programs wanted, 16 items a row at most (+1 of headroom):
    # 65 items, 1,083 positions in 17 + 1 + 2 + 5 tiles -> 1 tile an item.
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
