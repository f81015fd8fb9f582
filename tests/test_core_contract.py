"""The core's contract used directly, without the replay loop: add, schedule, update; the
plan's per-sequence inputs; the policy hooks; the lazy block pools."""

from __future__ import annotations

import pytest

from sched_lab.core.kv import BlockManager, BlockPool
from sched_lab.core.plan import ScheduledSeq, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import POLICIES, Scheduler, SchedulerLimits, register_policy
from sched_lab.policies import get_policy
from sched_lab.policies.fcfs import FCFS


def make(policy: str = "fcfs", gpu_blocks: int = 8, block_size: int = 4, **limits) -> Scheduler:
    lim = SchedulerLimits(
        limits.get("max_num_seqs", 8), limits.get("budget", 64), limits.get("max_model_len", 64)
    )
    return get_policy(policy)(lim, BlockManager(gpu_blocks, 4, block_size, 0.0))


def test_add_schedule_update_by_hand():
    s = make()
    r = Request("a", 0.0, 3, 2, prompt_token_ids=[11, 12, 13])
    assert s.add(r, 0.0) and list(s.waiting) == [r]
    plan = s.schedule()
    assert plan.prefills == {r: 3} and plan.decodes == []
    # Prompt 3 + the sampled slot = 4 tokens: one block of 4.
    assert plan.seqs() == [ScheduledSeq(r, 0, 3, [0], True)]
    assert plan.seqs()[0].token_ids() == [11, 12, 13]
    s.update(plan, StepResult(0.01, {r: 7}), 0.01)
    assert r.output_token_ids == [7] and r.num_output_tokens == 1 and s.num_steps == 1
    assert r.prefill_token_steps == [0] and r in s.decode_set
    plan = s.schedule()
    # The decode feeds token 7 at position 3 and samples into position 4: a second block.
    assert plan.decodes == [r] and plan.decode_tick == 0
    assert plan.seqs() == [ScheduledSeq(r, 3, 1, [0, 1], True)]
    assert plan.seqs()[0].token_ids() == [7]
    s.update(plan, StepResult(0.01, {r: 9}), 0.02)
    assert r.status is RequestStatus.FINISHED and r.finish_s == 0.02
    assert r.output_token_ids == [7, 9] and r.num_output_tokens == 2
    assert r.block_table == [] and s.block_manager.num_free_gpu_blocks == 8
    assert not s.has_unfinished()


def test_add_rejects_what_can_never_run():
    s = make(max_model_len=16)
    r = Request("long", 1.5, 10, 8)
    assert not s.add(r, 1.5)
    assert r.status is RequestStatus.REJECTED and r.finish_s == 1.5
    assert "18 tokens (5 blocks) exceeds max_model_len 16" in r.reason
    assert not s.waiting


def test_recompute_victim_feeds_prompt_and_generated_tokens():
    # After a recompute preemption the re-prefill feeds prompt + generated ids.
    s = make(gpu_blocks=2)
    a = Request("a", 0.0, 3, 4, prompt_token_ids=[1, 2, 3])
    b = Request("b", 0.0, 3, 4, prompt_token_ids=[4, 5, 6])
    s.add(a, 0.0), s.add(b, 0.0)
    plan = s.schedule()  # both prompts: 1 block each
    assert list(plan.prefills) == [a, b]
    s.update(plan, StepResult(0.01, {a: 20, b: 30}), 0.01)
    plan = s.schedule()  # each needs a 2nd block for position 4: b (newest) is preempted
    assert plan.preempted[0][0] is b and plan.decodes == [a]
    s.update(plan, StepResult(0.01, {a: 21}), 0.02)
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [30]
    # a decodes twice more (7 tokens, 2 blocks) and finishes at 0.04; b waits for 2 blocks.
    for t in (0.03, 0.04):
        plan = s.schedule()
        assert plan.decodes == [a] and not plan.prefills
        s.update(plan, StepResult(0.01, {a: 22}), t)
    assert a.status is RequestStatus.FINISHED and a.output_token_ids == [20, 21, 22, 22]
    # b re-prefills its 3 prompt tokens and its 1 generated token.
    plan = s.schedule()
    (seq,) = [q for q in plan.seqs() if q.request is b]
    assert (seq.start_pos, seq.num_new_tokens, seq.token_ids()) == (0, 4, [4, 5, 6, 30])


class ShortestFirst(FCFS):
    """Test policy: admits the shortest prompt first, preempts the oldest running."""

    def admission_order(self):
        return sorted(self.waiting, key=lambda r: (r.prompt_len, r.arrival_s))

    def pick_victim(self):
        return self.running[0]


@pytest.fixture
def shortest_first():
    """ShortestFirst registered for one test (registered at import, it would change what
    other test files collect: they parametrize over the registered policies)."""
    register_policy("test_shortest_first_oldest_victim")(ShortestFirst)
    yield
    POLICIES.pop("test_shortest_first_oldest_victim", None)


def test_admission_order_hook(shortest_first):
    s = make("test_shortest_first_oldest_victim", budget=8, max_model_len=64)
    long, short = Request("long", 0.0, 6, 2), Request("short", 0.0, 2, 2)
    s.add(long, 0.0), s.add(short, 0.0)
    plan = s.schedule()  # budget 8: short (2) then long (6) both fit, shortest first
    assert list(plan.prefills) == [short, long]
    s2 = make("test_shortest_first_oldest_victim", budget=7, max_model_len=7)
    s2.add(Request("long", 0.0, 6, 1), 0.0), s2.add(Request("short", 0.0, 2, 1), 0.0)
    plan = s2.schedule()  # budget 7: short (2) fits, long (6) does not: stop there
    assert [r.request_id for r in plan.prefills] == ["short"]
    assert [r.request_id for r in s2.waiting] == ["long"]


def test_pick_victim_hook(shortest_first):
    # Same as test_recompute_victim_feeds...: 2 blocks, both need a 2nd. The default
    # preempts b (newest); this policy preempts a (oldest).
    s = make("test_shortest_first_oldest_victim", gpu_blocks=2)
    a, b = Request("a", 0.0, 3, 4), Request("b", 0.0, 3, 4)
    s.add(a, 0.0), s.add(b, 0.0)
    s.update(s.schedule(), StepResult(0.01), 0.01)
    plan = s.schedule()
    assert [v.request_id for v, _ in plan.preempted] == ["a"] and plan.decodes == [b]


def test_block_pool_is_lazy_and_lifo():
    pool = BlockPool(10**15)  # no list of 10**15 ids is ever built
    assert len(pool) == 10**15
    assert pool.take(3) == [0, 1, 2]
    pool.put([0, 2])  # freed: 0 first, so 0 comes back first
    assert pool.take(4) == [0, 2, 3, 4]
    assert len(pool) == 10**15 - 5  # 1 and 0, 2, 3, 4 are out
    small = BlockPool(3)
    small.put([])
    assert small.take(3) == [0, 1, 2] and len(small) == 0
    small.put([2, 0])
    assert sorted(small.free_ids()) == [0, 2] and small.take(2) == [2, 0]


def test_end_unfinished_frees_everything():
    s = make(gpu_blocks=4)
    reqs = [Request(str(i), 0.0, 3, 8) for i in range(3)]
    for r in reqs:
        s.add(r, 0.0)
    s.update(s.schedule(), StepResult(0.01), 0.01)
    ended = s.end_unfinished("stopped", 0.5)
    assert sorted(r.request_id for r in ended) == ["0", "1", "2"]
    assert all(
        r.status is RequestStatus.UNFINISHED and r.reason == "stopped" and r.finish_s == 0.5
        for r in reqs
    )
    assert s.block_manager.num_free_gpu_blocks == 4 and not s.has_unfinished()
    s.block_manager.check_integrity([])


@pytest.mark.parametrize("name", ["fcfs", "swap", "chunked_prefill"])
def test_builtin_policies_registered(name):
    assert get_policy(name).name == name


def test_copied_or_pickled_requests_keep_the_one_empty_and_replay():
    """copy.copy, copy.deepcopy and pickle give EMPTY itself back (not another read-only
    list the writers' ``is EMPTY`` would miss, failing the run at its first step)."""
    import copy
    import pickle

    from sched_lab.core.request import EMPTY

    assert copy.copy(EMPTY) is EMPTY and copy.deepcopy(EMPTY) is EMPTY
    assert all(pickle.loads(pickle.dumps(EMPTY, p)) is EMPTY for p in range(6))
    for clone in (copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        a, b = clone([Request("a", 0.0, 3, 2), Request("b", 0.0, 3, 2)])
        assert a.block_table is EMPTY and b.output_token_ids is EMPTY
        s = make()
        assert s.add(a, 0.0) and s.add(b, 0.0)
        s.update(s.schedule(), StepResult(0.01, {a: 7, b: 8}), 0.01)
        assert a.output_token_ids == [7] and a.prefill_token_steps == [0] and EMPTY == []


def test_request_lists_start_shared_and_go_back_when_emptied():
    """A request's list fields are the one read-only EMPTY until written: the writers give
    it lists of its own (blocks, its prefill's step, its decode span, tokens), and freeing
    its blocks puts EMPTY back."""
    from sched_lab.core.request import EMPTY

    a, b = Request("a", 0.0, 3, 2), Request("b", 0.0, 3, 2)
    names = ("block_table", "prefill_token_steps", "decode_segments", "output_token_ids",
             "block_hashes", "spec_token_ids", "spec_steps")  # fmt: skip
    assert all(getattr(a, n) is EMPTY is getattr(b, n) for n in names)
    assert EMPTY == [] and not EMPTY and [1] + EMPTY == [1]
    for mutate in (lambda x: x.append(1), lambda x: x.extend([1]), lambda x: x.__setitem__(0, 1)):
        with pytest.raises(TypeError, match="EMPTY"):
            mutate(a.block_table)
    assert EMPTY == []  # nothing was written into it
    b.output_token_ids += [4, 5]  # a new list of b's own
    assert b.output_token_ids == [4, 5] and EMPTY == [] and a.output_token_ids is EMPTY
    s = make()
    assert s.add(a, 0.0)
    plan = s.schedule()  # prompt 3 + the sampled slot: one block of 4
    assert a.block_table == [0] and a.block_table is not EMPTY
    s.update(plan, StepResult(0.01, {a: 7}), 0.01)
    assert a.prefill_token_steps == [0] and a.output_token_ids == [7]
    s.update(s.schedule(), StepResult(0.01, {a: 9}), 0.02)  # its last token: it finishes
    assert a.status is RequestStatus.FINISHED and a.decode_segments == [(0, 1)]
    assert a.block_table is EMPTY and b.block_table is EMPTY
