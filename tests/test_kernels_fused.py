"""The split-K merge fused into the decode kernel, and FlashAttention varlen for prefill
chunks from position 0 (backend/attention/flash_varlen.py), against the torch reference.

Without CUDA the Triton kernels run in Triton's CPU interpreter (tests/triton_setup.py);
varlen_attn has no CPU kernel, so the CPU tests check its selection rule and feed the model
path a reference implementation of the same signature in its place.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import DEVICE, HAS_CUDA, QWEN3_TINY, needs_triton, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

from sched_lab.backend import triton_ops  # noqa: E402
from sched_lab.backend.attention import flash_varlen, get_attention_backend, triton_kernels  # noqa: E402
from sched_lab.backend.attention.base import decode_work  # noqa: E402
from sched_lab.backend.attention.torch_ref import attend, gather_sequence  # noqa: E402
from sched_lab.backend.errors import DeviceError  # noqa: E402
from sched_lab.backend.inputs import SeqInput, prepare_inputs  # noqa: E402
from sched_lab.backend.rope import apply_rope  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402

pytestmark = needs_triton


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def decode_case(lens, items, heads=4, kv_heads=2, head_dim=32, block_size=16):
    """Decodes over ``lens`` positions (each its own blocks), their work items, q, caches."""
    need = [-(-n // block_size) for n in lens]
    first = np.cumsum([0] + need)
    seqs = [
        SeqInput([1], n - 1, list(range(first[i], first[i + 1])), True) for i, n in enumerate(lens)
    ]
    meta = prepare_inputs(seqs, block_size, int(first[-1]), 1 << 20, 1 << 30, DEVICE).attn
    work, loc = decode_work(lens, np.arange(len(lens)), items)
    q = rand(len(lens), heads, head_dim)
    caches = rand(2, int(first[-1]), block_size, kv_heads, head_dim, seed=1)
    return seqs, meta, work, loc, q, caches


def run_decode(meta, work, loc, q, caches, fused):
    out = torch.full_like(q, float("nan"))
    triton_kernels.decode_attention(
        q, caches[0], caches[1], out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        torch.from_numpy(work).to(DEVICE), torch.from_numpy(loc).to(DEVICE), q.shape[2] ** -0.5,
        fused_merge=fused,
    )  # fmt: skip
    return out


def reference(seqs, lens, q, caches):
    scale = q.shape[2] ** -0.5
    rows = []
    for i, (s, n) in enumerate(zip(seqs, lens, strict=True)):
        keys = gather_sequence(caches[0], s.block_table, n)
        values = gather_sequence(caches[1], s.block_table, n)
        rows.append(attend(q[i : i + 1], keys, values, scale))
    return torch.cat(rows)


def test_fused_merge_matches_the_reference_and_the_separate_merge():
    # Lengths 300 and 40 over 4 items of 64-key tiles: 2 tiles an item, so the first decode
    # has items [0, 128), [128, 256), [256, 300) (its last one finds the chunk size from the
    # item before it) and the second one item, written directly; 2 kv heads, so 2 merges.
    lens = [300, 40]
    seqs, meta, work, loc, q, caches = decode_case(lens, 4)
    assert work.tolist() == [[0, 0, 128], [0, 128, 256], [0, 256, 300], [1, 0, 40]]
    fused = run_decode(meta, work, loc, q, caches, fused=True)
    separate = run_decode(meta, work, loc, q, caches, fused=False)
    ref = reference(seqs, lens, q, caches)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-6)
    counters = triton_kernels.merge_counters(len(lens), 2, DEVICE)
    assert int(counters.abs().sum()) == 0  # every count back to zero for the next launch


def test_fused_merge_over_many_items_and_padding():
    # 5 decodes of uneven length, 40 items (1 tile an item: 17 + 1 + 8 + 2 + 1 = 29 used,
    # 11 padding), then the same contexts squeezed into 6 items (k = 9 tiles: 2 + 1 + 1 +
    # 1 + 1); the item counts per decode come from the table, not from the host.
    lens = [1083, 5, 512, 100, 64]
    for items, per_decode in ((40, [17, 1, 8, 2, 1]), (6, [2, 1, 1, 1, 1])):
        seqs, meta, work, loc, q, caches = decode_case(lens, items, heads=6, kv_heads=3)
        assert np.diff(loc).tolist() == per_decode
        got = run_decode(meta, work, loc, q, caches, fused=True)
        torch.testing.assert_close(got, reference(seqs, lens, q, caches), atol=1e-5, rtol=1e-5)
    assert int(triton_kernels.merge_counters(5, 3, DEVICE).abs().sum()) == 0


def test_the_merge_is_fused_by_default_when_rows_have_few_items(monkeypatch):
    assert triton_kernels.FUSED_MERGE is True
    assert triton_kernels.FUSED_MERGE_MAX_ITEMS_PER_ROW == 8
    calls = []
    monkeypatch.setattr(triton_kernels, "_decode_reduce_kernel", _Recorder(calls))
    _, meta, work, loc, q, caches = decode_case([300, 40], 4)  # 2 items a row: one launch
    run_decode(meta, work, loc, q, caches, fused=None)
    assert calls == []
    with pytest.raises(_Launched):  # the separate merge is the second launch
        run_decode(meta, work, loc, q, caches, fused=False)
    calls.clear()
    # 15 items for 2 rows (7.5 a row) still fused; 16 (8 a row) merged separately
    _, meta, work, loc, q, caches = decode_case([960, 40], 15)
    run_decode(meta, work, loc, q, caches, fused=None)
    assert calls == []
    _, meta, work, loc, q, caches = decode_case([960, 40], 16)
    with pytest.raises(_Launched):
        run_decode(meta, work, loc, q, caches, fused=None)
    assert calls == [(2, 4)]  # (decode rows, heads)


class _Launched(Exception):
    pass


class _Recorder:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(grid)
            raise _Launched

        return launch


# -- FlashAttention varlen: the rule ---------------------------------------------------------


def test_varlen_prefix_and_the_auto_rule():
    assert flash_varlen.VARLEN_MIN_MEAN_CHUNK == 1024
    # the shapes: 1 x 8192, 4 x 4096, 8 x 1024 win; 16 x 512 and 32 x 256 do not
    for lens, auto in (([8192], 1), ([4096] * 4, 4), ([1024] * 8, 8), ([512] * 16, 0),
                       ([256] * 32, 0)):  # fmt: skip
        assert flash_varlen.choose("auto", lens, lens) == auto
        assert flash_varlen.choose("flash_varlen", lens, lens) == len(lens)
        assert flash_varlen.choose("triton", lens, lens) == 0
    # mean exactly 1024 qualifies: (1500 + 548) / 2 = 1024; 2047 / 2 does not
    assert flash_varlen.choose("auto", [1500, 548], [1500, 548]) == 2
    assert flash_varlen.choose("auto", [1500, 547], [1500, 547]) == 0
    # decodes after the chunks are fine (they keep the Triton decode kernel)
    assert flash_varlen.varlen_prefix([700, 300, 1, 1], [700, 300, 41, 9]) == 2
    # a chunk over a cached prefix, anywhere, or a chunk after a decode: no varlen
    assert flash_varlen.varlen_prefix([700, 5, 1], [700, 45, 41]) == 0
    assert flash_varlen.varlen_prefix([5, 700], [45, 700]) == 0
    assert flash_varlen.varlen_prefix([700, 1, 600], [700, 9, 600]) == 0
    assert flash_varlen.varlen_prefix([1, 1], [9, 12]) == 0  # decodes only


def test_prefill_attention_option_errors():
    backend = get_attention_backend("triton", DEVICE, torch.float32, 16)
    assert backend.prefill_attention == "auto"
    with pytest.raises(ConfigError, match="prefill_attention must be one of auto, triton, "
                       "flash_varlen; got 'fast'"):  # fmt: skip
        backend.set_prefill_attention("fast")
    if not HAS_CUDA:  # no flash kernel on the CPU: auto falls back, forcing it is refused
        assert not flash_varlen.available(DEVICE, torch.bfloat16)
        assert not backend.varlen
        with pytest.raises(DeviceError, match="needs torch.nn.attention.varlen on CUDA"):
            backend.set_prefill_attention("flash_varlen")
    reference_backend = get_attention_backend("torch", DEVICE, torch.float32, 16)
    reference_backend.set_prefill_attention("triton")  # accepted: its own kernels
    with pytest.raises(ConfigError, match="needs the 'triton' attention backend; got 'torch'"):
        reference_backend.set_prefill_attention("flash_varlen")


# -- FlashAttention varlen: the model path, with a reference in varlen_attn's place -----------


def reference_varlen(calls):
    """varlen_attn's contract in plain torch (causal chunks over their own k/v, GQA)."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, **kwargs):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
        bounds = cu_q.tolist()
        assert max(b - a for a, b in zip(bounds, bounds[1:])) == max_q
        calls.append((bounds, tuple(q.shape)))
        return torch.cat([attend(q[a:b], k[a:b], v[a:b], scale)
                          for a, b in zip(bounds, bounds[1:])])  # fmt: skip

    return varlen_attn


def test_qkv_prepare_writes_the_rotated_k_in_place():
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim)
    raw = qkv.clone()
    angles = rand(tokens, head_dim // 2, seed=2)
    cos, sin = angles.cos(), angles.sin()
    caches = torch.zeros(2, 4, 2, kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([0, 3, 4, 6, 7], device=DEVICE)
    q = triton_ops.qkv_prepare(qkv, cos, sin, caches[0], caches[1], slots, heads, kv_heads,
                               head_dim, None, None, 1e-6, k_in_place=True)  # fmt: skip
    q_ref, k_raw, v_raw = raw.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
    )
    k_ref = apply_rope(k_raw.reshape(tokens, kv_heads, head_dim), cos, sin)
    torch.testing.assert_close(q, apply_rope(q_ref.reshape(tokens, heads, head_dim), cos, sin))
    k_now = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, -1)
    torch.testing.assert_close(k_now, k_ref)
    assert torch.equal(k_now, caches[0].view(-1, kv_heads, head_dim)[slots])  # same as cached
    assert torch.equal(qkv[:, : heads * head_dim], raw[:, : heads * head_dim])  # q part untouched
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_raw)  # v untouched


def test_runner_with_varlen_prefill_matches_torch_backend(tmp_path, monkeypatch):
    # Step 1: two prompts from position 0 (varlen: 2 chunks); step 2: both decode while a
    # third prompt starts (varlen for the chunk, Triton decode for the decodes, the chunk's
    # rows copied in front); step 3: a chunk over a cached prefix (Triton only).
    from sched_lab.backend.runner import ModelRunner
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(QWEN3_TINY, tmp_path, dtype="float32", std=0.2)
    a, b, c = [5, 60, 7, 33, 2, 41, 19, 50], [8, 1, 63], [9, 10, 11, 52, 53]
    steps = [
        [SeqInput(list(range(30)), 0, a, True), SeqInput(list(range(9, 20)), 0, b, True)],
        [SeqInput(list(range(3, 10)), 0, c, False), SeqInput([5], 30, a, True),
         SeqInput([7], 11, b, True)],
        [SeqInput(list(range(40, 50)), 7, c, True), SeqInput([6], 31, a, True)],
    ]  # fmt: skip
    calls: list = []
    monkeypatch.setattr(flash_varlen, "varlen_attn", reference_varlen(calls))
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tmp_path, device=str(DEVICE), attention_backend=backend,
                             block_size=4, num_gpu_blocks=64, swap_space_bytes=0)  # fmt: skip
        if backend == "triton":
            runner.attn_backend.prefill_attention = "flash_varlen"  # forced: no CPU kernel
        logits[backend] = [x for s in steps for x in runner.execute_logits(s) if x is not None]
    for got, ref in zip(logits["triton"], logits["torch"], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    layers = QWEN3_TINY["num_hidden_layers"]
    assert calls == [([0, 30, 41], (41, 4, 32))] * layers + [([0, 7], (7, 4, 32))] * layers
