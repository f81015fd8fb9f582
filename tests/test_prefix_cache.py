"""The prefix cache of the block manager and the scheduler's use of it (hand-computed).

Most scenarios use KV blocks of 4 tokens and one hash id per block (hash_block_size 4), so
block j of a request is keyed by its first j + 1 hash ids. Plans are driven step by step
(``Driver``) with every invariant checked after each plan.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import bundled_policy_names
from hypothesis import given, settings
from hypothesis import strategies as st

from sched_lab.core.kv import (
    BlockManager,
    PrefixCachingBlockManager,
    blocks_for,
    make_block_manager,
)
from sched_lab.core.plan import StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy


class Driver:
    """A scheduler with a prefix-caching block manager, stepped by hand."""

    def __init__(self, policy="fcfs", gpu=8, cpu=8, bs=4, budget=10_000, seqs=8):
        self.bm = PrefixCachingBlockManager(gpu, cpu, bs, 0.0)
        self.s = get_policy(policy)(SchedulerLimits(seqs, budget, 10**6), self.bm)
        self.now = 0.0

    def add(self, rid, prompt, output, hash_ids=None, tokens=None, hbs=4, **extra) -> Request:
        r = Request(rid, self.now, prompt, output, tokens, hash_ids, hash_block_size=hbs, **extra)
        assert self.s.add(r, self.now)
        return r

    def step(self):
        plan = self.s.schedule()
        self.s.check_plan(plan)
        plan.features()
        self.now += 0.01
        self.s.update(plan, StepResult(0.01), self.now)
        self.bm.check_integrity(list(self.s.running) + list(self.s.swapped))
        return plan

    def run_until_idle(self, limit=1000):
        for _ in range(limit):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def test_two_requests_share_a_prefix_by_hash_ids():
    # KV blocks of 16 tokens, hash blocks of 32 (2 KV blocks per hash id). a: prompt 80,
    # ids [1, 2, 3]; b: prompt 80, ids [1, 2, 4]. After a's prefill its 5 full blocks are
    # keyed; b's first 4 blocks (ids 1, 2) match, its 5th (id 4) does not.
    d = Driver(gpu=20, bs=16)
    a = d.add("a", 80, 10, [1, 2, 3], hbs=32)
    d.step()
    assert a.block_table == [0, 1, 2, 3, 4, 5] and d.bm.num_cached_blocks == 5
    b = d.add("b", 80, 10, [1, 2, 4], hbs=32)
    plan = d.step()
    assert plan.prefills == {b: 16}  # 80 - 64 cached
    assert plan.num_cached_tokens == 64 and plan.num_cached_blocks == 4
    f = plan.features()
    assert (f.num_prefill_tokens, f.prefill_context_tokens) == (16, 64)
    # b: the 4 shared blocks, then blocks_for(81) - 4 = 2 new ones.
    assert b.block_table == [0, 1, 2, 3, 6, 7]
    assert b.num_cached_tokens == 64 and a.num_cached_tokens == 0
    assert d.bm._ref[:8] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert d.bm.num_used_gpu_blocks == 8  # a shared block counts once
    d.run_until_idle()
    assert d.bm.num_used_gpu_blocks == 0
    assert d.bm.num_free_gpu_blocks == 20


def test_three_requests_and_the_exact_multiple_rule():
    # bs 4, one id per block. a: prompt 12 ids [1,2,3] (3 full blocks, all keyed after its
    # prefill). b: prompt 13 ids [1,2,3,9]: lookup limit (13-1)//4 = 3 -> 3 blocks, 12
    # tokens, prefill 1. c: prompt 12 ids [1,2,3] = a's prompt, an exact multiple: limit
    # (12-1)//4 = 2 -> 2 blocks (8 tokens); its last block is allocated anew and recomputed
    # whole (4 tokens); its key is cached already (a's block 2), so c's copy stays unkeyed.
    d = Driver(gpu=16)
    a = d.add("a", 12, 5, [1, 2, 3])
    d.step()
    assert a.block_table == [0, 1, 2, 3]
    b = d.add("b", 13, 5, [1, 2, 3, 9])
    c = d.add("c", 12, 5, [1, 2, 3])
    plan = d.step()
    assert plan.prefills == {b: 1, c: 4}
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 8)
    assert plan.num_cached_tokens == 20 and plan.num_cached_blocks == 5
    assert b.block_table == [0, 1, 2, 4]  # blocks_for(14) = 4: 3 cached + 1 new
    assert c.block_table == [0, 1, 5, 6]  # blocks_for(13) = 4: 2 cached + 2 new
    assert d.bm._ref[:7] == [3, 3, 2, 1, 1, 1, 1]
    assert d.bm._key_of[5] is None  # c's recomputed last block: a duplicate, unkeyed
    assert d.bm._key_of[2] == c.block_hashes[2]
    d.run_until_idle()
    # Everything ends cached free (keyed) or free: used + cached free + free = total.
    assert d.bm.num_used_gpu_blocks == 0
    assert d.bm.num_cached_free_gpu_blocks + len(d.bm._free_gpu) == 16


def test_token_ids_share_blocks_without_hash_ids():
    d = Driver(gpu=16)
    a = d.add("a", 10, 2, tokens=list(range(10)))
    d.step()
    b = d.add("b", 10, 2, tokens=[0, 1, 2, 3, 4, 5, 6, 7, 99, 99])
    plan = d.step()
    assert plan.prefills == {b: 2} and b.block_table[:2] == a.block_table[:2]
    c = d.add("c", 10, 2, tokens=[7] + list(range(1, 10)))  # differs in block 0: no hit
    assert d.step().prefills == {c: 10}
    n = d.add("n", 10, 2)  # no prefix identity: nothing is looked up or keyed
    assert d.step().prefills == {n: 10}
    d.run_until_idle()
    assert n.block_hashes == [] and n.num_cached_tokens == 0


def test_cache_salt_and_lora_name_separate_what_must_not_be_shared():
    # bs 4, one id per block. a: prompt 12, ids [1,2,3], salt t1: its 3 full blocks keyed.
    # Then four requests with prompt 13, ids [1,2,3,9] (lookup limit (13-1)//4 = 3 blocks):
    # salt t2 -> 0 cached; salt t1 -> all 3 (12 tokens); no salt -> 0; adapter x with salt
    # t1 -> 0 (the adapter is in every key).
    d = Driver(gpu=32)
    a = d.add("a", 12, 5, [1, 2, 3], cache_salt="t1")
    d.step()
    assert d.bm.num_cached_blocks == 3
    ids = [1, 2, 3, 9]
    b = d.add("b", 13, 5, ids, cache_salt="t2")
    c = d.add("c", 13, 5, ids, cache_salt="t1")
    e = d.add("e", 13, 5, ids)
    f = d.add("f", 13, 5, ids, cache_salt="t1", lora_name="x")
    plan = d.step()
    assert plan.prefills == {b: 13, c: 1, e: 13, f: 13}
    assert [r.num_cached_tokens for r in (b, c, e, f)] == [0, 12, 0, 0]
    assert c.block_table[:3] == a.block_table[:3]
    # The keys, by hand: vLLM's extra keys (adapter, then salt on the first block only).
    assert e.block_hashes[:2] == [hash((0, 1, ())), hash((hash((0, 1, ())), 2, ()))]
    assert c.block_hashes[0] == hash((0, 1, ("t1",)))
    assert c.block_hashes[1] == hash((c.block_hashes[0], 2, ()))
    assert f.block_hashes[0] == hash((0, 1, ("x", "t1")))
    assert f.block_hashes[1] == hash((f.block_hashes[0], 2, ("x",)))
    d.run_until_idle()
    # Token ids: the same tokens under another salt share nothing, under the same all.
    g = d.add("g", 10, 2, tokens=list(range(10)), cache_salt="u")
    d.step()
    h = d.add("h", 10, 2, tokens=list(range(10)), cache_salt="v")
    k = d.add("k", 10, 2, tokens=list(range(10)), cache_salt="u")
    assert d.step().prefills == {h: 10, k: 2}
    assert k.block_table[:2] == g.block_table[:2]


def test_eviction_order_lru_then_tail_first():
    # 8 blocks of 4. a (prompt 8, ids [1,2], out 1) finishes in step 1: blocks [0,1,2];
    # 0 and 1 keyed, 2 has no id -> pool. Released tail first: queue [1, 0].
    # b (prompt 8, ids [3,4], out 1): blocks [2 (freed), 3, 4]; queue [1, 0, 3, 2].
    # c (prompt 16, ids [5..8], out 1): blocks_for(17) = 5: the 4 free (4 freed, 5..7
    # never used), then 1 evicted: the LRU head, a's tail block 1 (id 2).
    d = Driver(gpu=8)
    a = d.add("a", 8, 1, [1, 2])
    assert a.num_cached_tokens == 0
    d.step()
    assert list(d.bm._evictable) == [1, 0] and d.bm.num_evicted_blocks == 0
    b = d.add("b", 8, 1, [3, 4])
    d.step()
    assert b.status is RequestStatus.FINISHED
    assert list(d.bm._evictable) == [1, 0, 3, 2]
    c = d.add("c", 16, 1, [5, 6, 7, 8])
    d.step()
    assert d.bm.num_evicted_blocks == 1 and c.num_cached_tokens == 0
    # a's head block (id 1) is still cached, its tail (id 2) is gone; b's prefix is whole.
    e = d.add("e", 9, 2, [1, 2, 9])
    f = d.add("f", 9, 2, [3, 4, 9])
    assert d.bm.lookup(e) == [0] and d.bm.lookup(f) == [2, 3]
    # c finished too: its keyed blocks 4..7 queue after b's, tail first; its unkeyed block 1
    # is free. Admitting e references block 0 and takes blocks_for(10) - 1 = 2 new: block 1,
    # then the LRU head: b's tail block 3 (id 4). f, looked up after that, finds block 2 only.
    assert list(d.bm._evictable) == [0, 3, 2, 7, 6, 5, 4]
    plan = d.step()
    assert plan.prefills == {e: 5, f: 5}
    assert (e.num_cached_tokens, f.num_cached_tokens) == (4, 4)
    assert e.block_table == [0, 1, 3]
    assert d.bm.num_evicted_blocks == 4  # c: 1, e: 1, f: 2 (blocks 7, 6)


def test_taking_more_blocks_than_are_free_fails_and_takes_nothing():
    # 4 blocks of 4: a request's 2 keyed blocks, released, are the whole queue; the pool
    # still has the 2 never used. 5 blocks asked: 4 free (2 in the pool + 2 cached).
    bm = PrefixCachingBlockManager(4, 0, 4, 0.0)
    r = Request("a", 0.0, 8, 4, prompt_token_ids=[1] * 8)
    bm.allocate_cached(r, [], 2)
    r.num_computed_tokens = 8
    bm.register(r)
    bm.free(r)
    assert (bm._free_gpu.num_free, list(bm._evictable)) == (2, [1, 0])
    with pytest.raises(RuntimeError, match="5 blocks asked, 4 free"):
        bm._take(5)
    assert (bm._free_gpu.num_free, list(bm._evictable), bm.num_evicted_blocks) == (2, [1, 0], 0)
    assert bm._take(4) == [2, 3, 1, 0] and bm.num_evicted_blocks == 2


def test_recompute_victim_readmitted_after_the_cache_changed():
    # 8 blocks of 4, fcfs. a: prompt 8, ids [1,2,3,4], out 14; b: prompt 8, ids [5,6,7,8],
    # out 20. Step 1 prefills both (a [0,1,2], b [3,4,5]). Decode tick t runs with
    # L = 8 + t tokens; a block is needed at L = 12 (t 4: a 6, b 7) and L = 16 (t 8): none
    # free, b (newest) is preempted by recompute with 16 tokens (15 computed: blocks 0..2
    # full, all keyed). b's blocks leave tail first: 7 (unkeyed) -> pool, queue [5, 4, 3].
    # a takes block 7 at t 8, and at t 12 (L 20) evicts the LRU head: b's block 5 (id 7).
    # While a runs, b's admission (blocks_for(17) = 5) never fits. a finishes at t 13; then
    # b's lookup finds blocks 3, 4 (8 tokens), not 3 as at its preemption: it prefills
    # 16 - 8 = 8 tokens into 2 cached + 3 new blocks.
    d = Driver(gpu=8)
    a = d.add("a", 8, 14, [1, 2, 3, 4])
    b = d.add("b", 8, 20, [5, 6, 7, 8])
    d.step()
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    for _ in range(8):
        plan = d.step()
    assert [m.value for _, m in plan.preempted] == ["recompute"] and b.num_tokens == 16
    assert list(d.bm._evictable) == [5, 4, 3] and a.block_table[-1] == 7
    while a.status is not RequestStatus.FINISHED:
        plan = d.step()
        assert b not in plan.prefills
    assert d.bm.num_evicted_blocks == 1
    plan = d.step()
    assert plan.prefills == {b: 8}
    assert b.block_table[:2] == [3, 4] and len(b.block_table) == blocks_for(17, 4)
    assert (b.num_cached_tokens, b.num_resumed_cached_tokens) == (0, 8)
    assert plan.num_cached_tokens == 8
    d.run_until_idle()
    assert b.status is RequestStatus.FINISHED and b.num_output_tokens == 20


def test_swap_of_a_request_holding_shared_blocks():
    # 8 GPU blocks of 4, swap policy. a: prompt 8, ids [1,2,3,4], out 12 -> [0,1,2].
    # b: prompt 9, ids [1,2,5], out 20: hits a's blocks 0, 1 (8 tokens), prefills 1 into
    # [0, 1, 3]. Decode blocks: b at t 3, 7 (blocks 4, 6), a at t 4, 8 (5, 7). At t 11 b
    # (L 20) needs a block, none is free: b is swapped out. All 5 of its blocks are copied
    # to CPU, shared ones included; on the GPU blocks 0, 1 stay used (a holds them), b's
    # own blocks 3, 4, 6 are free: unkeyed, since b's 3 ids = ceil(9 / 4) describe its
    # 9-token prompt only (2 full blocks), while a's 4 ids > ceil(8 / 4) cover its outputs.
    d = Driver("swap", gpu=8, cpu=8)
    a = d.add("a", 8, 12, [1, 2, 3, 4])
    d.step()
    b = d.add("b", 9, 20, [1, 2, 5])
    plan = d.step()
    assert plan.prefills == {b: 1} and b.block_table == [0, 1, 3]
    for _ in range(10):
        plan = d.step()
    assert plan.preempted == [] and b.block_table == [0, 1, 3, 4, 6]
    plan = d.step()  # t 11
    assert [m.value for _, m in plan.preempted] == ["swap"]
    assert plan.swap_out == [(0, 0), (1, 1), (3, 2), (4, 3), (6, 4)]
    assert b.status is RequestStatus.SWAPPED and b.block_table == [0, 1, 2, 3, 4]
    # a finished in that step: its keyed blocks (ids 1..4: 0, 1, 2, 5) join the queue,
    # tail first; its unkeyed block 7 is free (pool, LIFO: 7, 3, 4, 6 handed out next).
    assert a.status is RequestStatus.FINISHED
    assert list(d.bm._evictable) == [5, 2, 1, 0]
    assert d.bm.num_used_gpu_blocks == 0 and d.bm.num_used_cpu_blocks == 5
    # Swap in: blocks 0, 1 still hold b's keys: re-referenced, not copied. b's blocks 2..4
    # (CPU 2, 3, 4) are copied into free blocks 7, 3, 4; b (20 tokens) takes one more (6).
    assert d.bm.blocks_to_swap_in(b) == 5  # 3 copies + 2 cached free re-referenced
    plan = d.step()
    assert plan.swap_in == [(2, 7), (3, 3), (4, 4)]
    assert b.block_table == [0, 1, 7, 3, 4, 6]
    assert d.bm.num_used_cpu_blocks == 0 and list(d.bm._evictable) == [5, 2]
    d.run_until_idle()
    assert b.num_output_tokens == 20 and b.num_preemptions_swap == 1


def test_hash_block_size_must_be_a_multiple_of_the_block_size():
    d = Driver(bs=16)
    d.add("a", 40, 2, [1, 2], hbs=24)
    with pytest.raises(ValueError, match="hash_block_size 24 is not a multiple of the KV block"):
        d.step()


def test_make_block_manager_keeps_the_plain_one_when_off():
    assert type(make_block_manager(4, 0, 16)) is BlockManager
    assert type(make_block_manager(4, 0, 16, 0.0, True)) is PrefixCachingBlockManager


# --------------------------------------------------------------------------- properties
def _common_blocks(r: Request, q: Request, bs: int) -> int:
    """KV blocks of ``r``'s prompt equal to ``q``'s content (by hash ids), full blocks."""
    per = r.hash_block_size // bs
    n = 0
    for i, (x, y) in enumerate(zip(r.hash_ids, q.hash_ids)):
        if x != y:
            break
        n = (i + 1) * per
    return n


@st.composite
def shared_traces(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    per = draw(st.sampled_from([1, 2]))
    gpu = draw(st.integers(4, 24))
    prefixes = [[draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 4)))]]
    rows, t = [], 0.0
    for i in range(draw(st.integers(1, 10))):
        t += draw(st.sampled_from([0.0, 0.0, 0.005, 0.02]))
        base = draw(st.sampled_from(prefixes))
        tail = [100 + i * 10 + k for k in range(draw(st.integers(0, 3)))]
        ids = base + tail
        prompt = max(1, len(ids) * per * bs - draw(st.integers(0, per * bs)))
        if draw(st.booleans()):
            prefixes.append(ids)
        rows.append((str(i), t, prompt, draw(st.integers(1, 3 * bs)), ids))
    return bs, per, gpu, draw(st.integers(0, 12)), rows


@pytest.mark.parametrize("policy", bundled_policy_names())
@settings(max_examples=80, deadline=None, derandomize=True)
@given(shared_traces())
def test_random_shared_traces_keep_every_invariant(policy, trace):
    from sched_lab.sim.replay import replay
    from tests.helpers import FixedCost

    bs, per, gpu, cpu, rows = trace
    cls = get_policy(policy)
    limits = SchedulerLimits(4, 64 if cls.chunked_prefill else 10**6, 10**6)
    bm = PrefixCachingBlockManager(gpu, cpu, bs, 0.0)
    reqs = [
        Request(rid, t, p, o, None, ids, hash_block_size=per * bs) for rid, t, p, o, ids in rows
    ]
    res = replay(reqs, cls(limits, bm), FixedCost(), check_invariants=True)
    ended = (RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED)
    assert all(r.status in ended for r in res.requests)
    assert res.failure is None or "thrashing" in res.failure
    assert bm.num_used_gpu_blocks == 0 and bm.num_used_cpu_blocks == 0
    for r in res.requests:
        if r.status is RequestStatus.FINISHED:
            assert r.num_output_tokens == r.output_len
        assert r.num_cached_tokens % bs == 0 and r.num_cached_tokens <= r.prompt_len - 1
        # Hits come only from requests admitted before (their content, in full blocks).
        earlier = [q for q in res.requests if q is not r and 0 <= q.first_scheduled_s]
        earlier = [q for q in earlier if q.first_scheduled_s < r.first_scheduled_s]
        best = max((_common_blocks(r, q, bs) for q in earlier), default=0)
        assert r.num_cached_tokens <= best * bs
    cached = res.steps["num_cached_tokens"].sum()
    assert cached == sum(r.num_cached_tokens + r.num_resumed_cached_tokens for r in res.requests)


@pytest.mark.parametrize(
    "policy", [p for p in bundled_policy_names() if get_policy(p).fast_forward]
)
@settings(max_examples=80, deadline=None, derandomize=True)
@given(shared_traces())
def test_fast_forward_with_the_cache_is_step_by_step(policy, trace):
    """Plans repeated by Scheduler.repeat_decodes under prefix caching (requests waiting while
    decodes take blocks that may be cached ones) give the step-by-step replay: the same steps,
    hits, evictions, block tables and wait streaks; so do runs of repeats made at once
    (Scheduler.repeat_decodes_run, with an executor that has ``step_time``)."""
    from sched_lab.sim.replay import replay
    from tests.helpers import FixedCost

    bs, per, gpu, cpu, rows = trace

    def run(fast_forward: bool, many: bool = False):
        cls = get_policy(policy)
        limits = SchedulerLimits(4, 64 if cls.chunked_prefill else 10**6, 10**6)
        bm = PrefixCachingBlockManager(gpu, cpu, bs, 0.0)
        reqs = [
            Request(rid, t, p, o, None, ids, hash_block_size=per * bs) for rid, t, p, o, ids in rows
        ]
        scheduler = cls(limits, bm)
        scheduler.fast_forward = fast_forward
        executor = FixedCost()
        if many:
            executor.step_time = lambda features: executor.step_s
        res = replay(reqs, scheduler, executor, check_invariants=True)
        waits = [(w[0], getattr(w[1], "request_id", None), *w[2:]) for w in res.events.waits]
        got = [(r.status, r.num_cached_tokens, r.finish_s, r.block_table) for r in res.requests]
        return res, waits, got, bm.num_evicted_blocks

    b = run(False)
    for a in (run(True), run(True, many=True)):
        for col in a[0].steps:
            assert np.array_equal(a[0].steps[col], b[0].steps[col]), col
        assert a[1:] == b[1:]


# --------------------------------------------------------------------------- config
def _config(**over):
    from sched_lab.config import validate

    raw = {
        "name": "pc",
        "trace": {
            "format": "synthetic",
            "num_requests": 5,
            "prompt_len": 40,
            "output_len": 2,
            "arrival": {"process": "poisson", "rate": 1.0},
        },  # fmt: skip
        "kv_cache": {"num_gpu_blocks": 64, "enable_prefix_caching": True},
        "policies": ["fcfs"],
    }
    raw.update(over)
    return validate(raw)


def test_caching_with_no_prefix_identity_is_one_line():
    from sched_lab.core.errors import ConfigError
    from sched_lab.run.experiment import run_experiment

    with pytest.raises(ConfigError) as e:
        run_experiment(_config(), progress=False)
    assert str(e.value) == (
        "pc: kv_cache.enable_prefix_caching: trace format 'synthetic' gives its requests no "
        "prefix identity (no hash_ids, no prompt token ids): nothing could ever be cached"
    )


def test_caching_flag_must_be_a_bool():
    from sched_lab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kv_cache.enable_prefix_caching: expected true or"):
        _config(kv_cache={"enable_prefix_caching": "yes"})
    with pytest.raises(ConfigError, match=r"policies\[0\].enable_prefix_caching: expected true"):
        _config(policies=[{"name": "fcfs", "enable_prefix_caching": 1}])


def test_hash_block_size_not_a_multiple_is_one_line():
    from sched_lab.core.errors import ConfigError
    from sched_lab.run.experiment import run_experiment

    reqs = [Request("0", 0.0, 40, 2, None, [1, 2], hash_block_size=24)]
    with pytest.raises(ConfigError) as e:
        run_experiment(_config(), progress=False, requests=reqs)
    assert str(e.value) == (
        "pc: kv_cache.enable_prefix_caching: request 0: hash_block_size 24 is not a "
        "multiple of kv_cache.block_size 16"
    )


def test_per_policy_flag_compares_caching_off_and_on():
    from sched_lab.run.experiment import run_experiment

    cfg = _config(
        policies=[{"name": "fcfs", "label": "off", "enable_prefix_caching": False}, "fcfs"]
    )
    reqs = lambda: [  # noqa: E731
        Request(str(i), 0.05 * i, 40, 2, None, [7, 8, 9 + i], hash_block_size=16) for i in range(3)
    ]
    off, on = (run_experiment(dataclasses_replace(cfg, p), False, reqs())[0] for p in (0, 1))
    assert off.summary["prefix_caching"] is False and off.summary["prefix_cache_hit_rate"] == 0
    # Requests 1 and 2 find blocks 0, 1 (ids 7, 8: 32 tokens) cached: 64 of 120 prompt tokens.
    assert on.summary["prefix_caching"] is True
    assert on.summary["prefix_cache_hit_rate"] == 64 / 120
    assert list(on.requests["num_cached_tokens"]) == [0, 32, 32]
    assert on.result.steps["num_cached_tokens"].sum() == 64


def test_a_run_keeps_tenants_apart_by_cache_salt():
    from sched_lab.run.experiment import run_experiment

    # The requests of the test above under salts a, b, a: request 2 finds request 0's
    # blocks 0, 1 (32 tokens), request 1 (salt b) finds nothing.
    reqs = [
        Request(str(i), 0.05 * i, 40, 2, None, [7, 8, 9 + i], hash_block_size=16, cache_salt=s)
        for i, s in enumerate("aba")
    ]
    on = run_experiment(_config(), False, reqs)[0]
    assert list(on.requests["num_cached_tokens"]) == [0, 0, 32]
    assert list(on.requests["cache_salt"]) == ["a", "b", "a"]
    assert "lora_name" not in on.requests


def dataclasses_replace(cfg, i):
    import dataclasses

    return dataclasses.replace(cfg, policies=(cfg.policies[i],))


# --------------------------------------------------------------------------- preemption
def _recording(policy: str, made_room: list):
    """``policy``'s class whose make_room also records (plan, waiting request) when it preempts."""
    cls = get_policy(policy)

    class Recording(cls):
        def make_room(self, plan, r, need):
            regained = super().make_room(plan, r, need)
            if regained is not None and plan.preempted:
                made_room.append((plan, r))
            return regained

    return Recording


@pytest.mark.parametrize(
    "policy, options",
    [("priority", {"priority_preemption": True}), ("srpt", {"preempt_longer": True})],
)
@settings(max_examples=80, deadline=None, derandomize=True)
@given(shared_traces(), st.data())
def test_a_preemption_for_a_waiting_request_admits_it(policy, options, trace, data):
    # Preempting to admit a waiting request counts only blocks whose reference count drops
    # to 0 (a block a victim shares with a request that stays frees nothing), so the waiting
    # request is admitted in the same plan, or nothing is preempted.
    from sched_lab.sim.replay import replay
    from tests.helpers import FixedCost

    bs, per, gpu, cpu, rows = trace
    made_room: list = []
    cls = _recording(policy, made_room)
    limits = SchedulerLimits(4, 64 if cls.chunked_prefill else 10**6, 10**6)
    bm = PrefixCachingBlockManager(gpu, cpu, bs, 0.0)
    reqs = [
        Request(rid, t, p, o, None, ids, data.draw(st.integers(0, 2)), hash_block_size=per * bs)
        for rid, t, p, o, ids in rows
    ]
    plans_admitted: list = []

    class Checking(FixedCost):
        def execute(self, plan):
            plans_admitted.extend((plan, r, r in plan.prefills) for p, r in made_room if p is plan)
            return super().execute(plan)

    res = replay(reqs, cls(limits, bm, **options), Checking(), check_invariants=True)
    assert res.failure is None or "thrashing" in res.failure
    assert len(plans_admitted) == len(made_room)
    assert all(admitted for _, _, admitted in plans_admitted), [
        r.request_id for _, r, ok in plans_admitted if not ok
    ]


def test_preempting_for_a_waiting_request_counts_only_unshared_blocks():
    # Blocks of 4 tokens, 6 GPU blocks, SRPT with preempt_longer. a: prompt 8, ids [1, 2],
    # 100 tokens out, takes blocks 0-2 (8 + 1 tokens). b: prompt 9, ids [1, 2, 3], 50 out,
    # hits a's blocks 0 and 1 and takes one new block: refs 0:2 1:2 2:1 3:1, 2 blocks free.
    # c: prompt 12, 1 token out (ranked first), needs ceil(13 / 4) = 4 blocks. Preempting
    # a alone frees only block 2 (0 and 1 stay with b): 3 free < 4, so b goes too
    # (blocks 0, 1, 3): 6 free, and c is admitted in the same plan.
    d = Driver("srpt", gpu=6, bs=4)
    d.s.preempt_longer = True
    a = d.add("a", 8, 100, [1, 2])
    d.step()
    b = d.add("b", 9, 50, [1, 2, 3])
    d.step()
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8 and d.bm.num_free_gpu_blocks == 2
    c = d.add("c", 12, 1, [7, 8, 9])
    plan = d.step()
    assert [v.request_id for v, _ in plan.preempted] == ["a", "b"]
    assert plan.prefills == {c: 12}
    assert c.status is RequestStatus.FINISHED and d.bm.num_free_gpu_blocks == 6
    assert a.status is RequestStatus.WAITING and b.status is RequestStatus.WAITING
