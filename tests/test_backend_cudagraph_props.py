"""Randomized staging of the CUDA-graph static buffers (backend/cuda_graphs.py): a seeded
workload through ``StepGraphs.run`` with the replay stubbed (no forward), decode-only and mixed
steps alternating over one block-table mirror; after each step the graph picked and the static
buffers against ``prepare_inputs``. Injected invalid steps raise what ``prepare_inputs`` raises.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import QWEN3_TINY  # first: sets TRITON_INTERPRET

from sched_lab.backend.attention.base import decode_work, prefill_tiles  # noqa: E402
from sched_lab.backend.attention.triton_backend import interpreting  # noqa: E402
from sched_lab.backend.attention.triton_kernels import decode_work_device  # noqa: E402
from sched_lab.backend.inputs import SeqInput, prepare_inputs  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402

STEPS = 300
CONFIGS = {  # max_model_len 256 (QWEN3_TINY's)
    "bs4": dict(block_size=4, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=128),
    "bs1_odd_token_sizes": dict(block_size=1, num_gpu_blocks=300, max_num_seqs=40,
                                max_num_batched_tokens=96, cuda_graph_token_sizes=(3, 17, 40)),
    "bs4_decode_sizes_1_2_4": dict(block_size=4, num_gpu_blocks=64, max_num_seqs=8,
                                   max_num_batched_tokens=48, cuda_graph_sizes=(1, 2, 4)),
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tiny")
    write_random_checkpoint(QWEN3_TINY, path, dtype="float32", std=0.2)
    return path


def workload(seed, g, max_seqs, max_tokens):
    """(step, seqs) of STEPS random steps (decode-only at even steps), committed after each."""
    rng, bs, live = random.Random(seed), g.block_size, []
    for step in range(STEPS):
        if live and rng.random() < 0.15:
            live.pop(rng.randrange(len(live)))
        while len(live) < max_seqs and (not live or rng.random() < 0.3):
            plen = rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, 128)])
            s = SimpleNamespace(prompt=plen, done=0, table=[])  # done: the next start_pos
            if live and rng.random() < 0.3:  # a cached prefix: a copy of another's blocks
                other = rng.choice(live)
                k = min(other.done // bs, (s.prompt - 1) // bs)
                s.table, s.done = other.table[:k], k * bs
            live.append(s)
        if rng.random() < 0.05:  # preempted: recomputed into a fresh list
            s = rng.choice(live)
            s.prompt, s.done, s.table = max(s.done, 1), 0, []
        if rng.random() < 0.1:
            rng.shuffle(live)
        budget, seqs, fed = rng.randint(1, max_tokens), [], []
        for s in live:
            left = s.prompt - s.done
            if budget == 0 or (left > 0 and step % 2 == 0) or rng.random() < 0.1:
                continue  # (no cap on seqs: at most max_seqs are live)
            q = min(budget, rng.choice([left, rng.randint(1, left)])) if left > 0 else 1
            need = -(-(s.done + q) // bs) - len(s.table) + rng.choice([0, 0, 0, 1, 2])
            s.table += [rng.randrange(g.kv_cache.num_gpu_blocks) for _ in range(need)]  # append
            ids = [rng.randrange(g.vocab_size) for _ in range(q)]
            seqs.append(SeqInput(ids, s.done, s.table, rng.random() < 0.8, rng.choice([0, 0.7])))
            fed.append((s, q))
            budget -= q
        if seqs:
            yield step, seqs
        for s, q in fed:
            s.done += q
        live = [s for s in live if s.done < g.max_model_len]


def expected(g, seqs):
    return prepare_inputs(seqs, g.block_size, g.kv_cache.num_gpu_blocks, g.max_model_len,
                          g.vocab_size, torch.device("cpu"))  # fmt: skip


def dispatch(g, seqs):
    """The graph the step should run in: ("decode", size), ("mixed", tokens, decode rows) or
    None (eager). The decode-row variant: the smallest that holds the step's decodes."""
    q = [len(s.token_ids) for s in seqs]
    sizes = [x for x in g.sizes if x >= len(seqs)]
    if all(x == 1 for x in q) and sizes:
        return ("decode", sizes[0])
    tokens = [t for t in g.token_sizes if t >= sum(q)]
    if not tokens or len(seqs) > g.max_seqs:
        return None
    return ("mixed", tokens[0], min(r for r in g.attn.decode_rows(tokens[0]) if r >= q.count(1)))


def check_staged(g, seqs, kind, size, rows=None, last_rows=None, work=True):
    """The static buffers after staging ``seqs``; with ``work``, also the decode work items
    the graph would cut from them (the interpreter makes that the slow part)."""
    ref = expected(g, seqs)
    a, n, total = ref.attn, len(seqs), ref.input_ids.numel()
    pad = size - total  # token rows beyond the step's
    assert g.input_ids[:size].tolist() == ref.input_ids.tolist() + [0] * pad
    assert g.positions[:size].tolist() == ref.positions.tolist() + [0] * pad
    assert g.attn.slot_mapping[:size].tolist() == a.slot_mapping.tolist() + [-1] * pad
    for i, s in enumerate(seqs):
        used = -(-(s.start_pos + len(s.token_ids)) // g.block_size)
        assert g.attn.block_tables[i, :used].tolist() == s.block_table[:used], f"row {i}"
    rows_read = size if kind == "decode" else n  # decode padding rows: length 0 (no work)
    lens = a.seq_lens.tolist() + [0] * (rows_read - n)
    assert g.attn.seq_lens[:rows_read].tolist() == lens
    assert g.attn.seq_start_loc[: rows_read + 1].tolist() == [0, *np.cumsum(lens).tolist()]
    if kind == "decode":
        assert g.attn.block_tables[n:size, 0].tolist() == [0] * pad
        meta = g.attn.decode_metadata(size)  # the constants: one query row per sequence row
        assert meta.query_start_loc.tolist() == list(range(size + 1))
        assert meta.decode_seq_idx.tolist() == list(range(size))
        if work:
            check_work(g, meta, a.seq_lens.tolist(), list(range(n)) + [-1] * (size - n),
                       g.attn.decode_items(size))  # fmt: skip
        return
    qsl = g.attn.mixed_query_start_loc.tolist()
    assert qsl == a.query_start_loc.tolist() + [total] * (g.max_seqs - n)
    meta = g.attn.mixed_metadata(size, rows)
    decodes = a.decode_seq_idx.tolist()
    assert meta.decode_seq_idx.tolist() == decodes + [-1] * (rows - len(decodes))
    if work:
        check_work(g, meta, a.seq_lens.tolist(), decodes + [-1] * (rows - len(decodes)),
                   g.attn.decode_items(rows, mixed=True))  # fmt: skip
    tiles = prefill_tiles([len(s.token_ids) for s in seqs]).tolist()
    assert meta.prefill_tiles.tolist() == tiles + [[-1, -1]] * (g.attn.tile_rows(size) - len(tiles))
    assert last_rows.tolist() == ref.logits_indices.tolist()


def check_work(g, meta, seq_lens, decode_rows, items):
    """The decode work items the graph cuts from the staged buffers at replay (run here,
    since the replay is stubbed): ``decode_work`` of the decode rows (-1: padding)."""
    meta.decode_work.fill_(7)
    decode_work_device(meta.seq_lens, meta.decode_seq_idx, meta.decode_work, meta.decode_work_loc)
    lens = [seq_lens[i] if i >= 0 else 0 for i in decode_rows]
    work, loc = decode_work(lens, decode_rows, items)
    assert meta.decode_work.tolist() == work.tolist()
    assert meta.decode_work_loc.tolist() == loc.tolist()


def make_invalid(rng, g, seqs):
    """The step with one sequence broken, and the message prepare_inputs raises for it."""
    i = rng.randrange(len(seqs))
    s, table, bs = seqs[i], list(seqs[i].block_table), g.block_size
    table[rng.randrange(-(-(s.start_pos + len(s.token_ids)) // bs))] = g.kv_cache.num_gpu_blocks
    bad = rng.choice([
        SeqInput(s.token_ids, s.start_pos, table, s.sample),  # a block id out of range
        SeqInput(s.token_ids, g.max_model_len - len(s.token_ids) + 1, s.block_table, s.sample),
        SeqInput([], s.start_pos, s.block_table, s.sample),
    ])  # fmt: skip
    bad_seqs = seqs[:i] + [bad] + seqs[i + 1 :]
    with pytest.raises(ValueError) as eager:
        expected(g, bad_seqs)
    return bad_seqs, str(eager.value)


@pytest.mark.skipif(
    not interpreting(),
    reason="stages on a CPU runner with the triton backend: runs under TRITON_INTERPRET=1 "
    "(machines without CUDA); the GPU cases of test_backend_cudagraph.py stage compiled",
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_steps_stage_like_prepare_inputs(qwen3_dir, monkeypatch, name):
    kw = CONFIGS[name]
    g = ModelRunner(qwen3_dir, device="cpu", attention_backend="triton", swap_space_bytes=0,
                    cuda_graphs=True, **kw).graphs  # fmt: skip
    calls, vocab = [], g.vocab_size

    def record(kind, fn):  # stage(seqs, size), stage_mixed(seqs, tokens, rows): logged
        return lambda seqs, *size: calls.append((kind, *size, fn(seqs, *size))) or calls[-1][-1]

    for attr, kind in (("stage", "decode"), ("stage_mixed", "mixed")):
        monkeypatch.setattr(g, attr, record(kind, getattr(g, attr)))
    monkeypatch.setattr(g, "_replay", lambda key: torch.zeros(key[1], vocab))  # no forward
    monkeypatch.setattr(g.model, "compute_logits", lambda h: torch.zeros(len(h), vocab))
    rng, seen = random.Random(name), {"decode": 0, "mixed": 0, None: 0, "invalid": 0}
    steps = workload(rng.randrange(1 << 30), g, kw["max_num_seqs"], kw["max_num_batched_tokens"])
    for step, seqs in steps:
        want = dispatch(g, seqs)
        if want is not None and rng.random() < 0.1:
            bad_seqs, message = make_invalid(rng, g, seqs)
            with pytest.raises(ValueError) as err:
                g.run(bad_seqs)
            assert str(err.value) == message, f"step {step}"
            seen["invalid"] += 1
        calls.clear()
        out = g.run(seqs)
        seen[want[0] if want else None] += 1
        assert [c[:-1] for c in calls] == ([want] if want else []), f"step {step}"
        assert (out is None) == (want is None), f"step {step}"
        if want is not None:
            check_staged(g, seqs, *want, last_rows=calls[0][-1], work=step % 16 < 2)
            sampled = [i for i, s in enumerate(seqs) if s.sample]
            assert out[0] == sampled and out[2].shape == (len(sampled), vocab)
    assert seen["decode"] and seen["mixed"] and seen["invalid"]
