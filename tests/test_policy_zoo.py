"""The policy zoo, hand-computed: victim rules, priority (with preemption and its rollback),
SJF/SRPT (predictors, aging), EDF and VTC, with the toy executor of tests/helpers.py (every
step takes 10 ms)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FixedCost, by_id

from lab.core.kv import BlockManager
from lab.core.plan import StepResult
from lab.core.request import Request
from lab.core.scheduler import SchedulerLimits
from lab.sim.replay import replay
from policies import get_policy


def make(policy: str, *, gpu=8, bs=16, seqs=256, budget=64, **options):
    cls = get_policy(policy)
    return cls(SchedulerLimits(seqs, budget, 10_000), BlockManager(gpu, 0, bs, 0.0), **options)


def replay_requests(policy: str, requests: list[Request], **kw):
    res = replay(requests, make(policy, **kw), FixedCost(), check_invariants=True)
    assert res.failure is None, res.failure
    return res


def req(rid, arrival, prompt, output, priority=0, **fields) -> Request:
    return Request(rid, arrival, prompt, output, priority=priority, **fields)


def first_token_order(res) -> list[str]:
    return [r.request_id for r in sorted(res.requests, key=lambda r: res.token_times(r)[0])]


# ----------------------------------------------------------------------------- victim rules
def running_state(rule: str):
    """fcfs, block size 4: a, b, c, d admitted together in one prefill step.

    After it: a holds 10 + 1 tokens (3 blocks), b 3 + 1 (1), c 6 + 1 (2), d 5 + 1 (2);
    computed tokens 10, 3, 6, 5; c has the lowest priority (largest value)."""
    s = make("fcfs", gpu=20, bs=4, preemption_victim=rule)
    for r in (req("a", 0, 10, 5), req("b", 0, 3, 5), req("c", 0, 6, 5, 5), req("d", 0, 5, 5)):
        s.add(r, 0.0)
    plan = s.schedule()
    s.update(plan, StepResult(0.01), 0.01)
    return s


@pytest.mark.parametrize(
    "rule, victim",
    [("newest", "d"), ("fewest_computed", "b"), ("most_blocks", "a"), ("lowest_priority", "c")],
)
def test_victim_rules(rule, victim):
    s = running_state(rule)
    assert [r.request_id for r in s.running] == ["a", "b", "c", "d"]
    assert s.pick_victim().request_id == victim


def test_victim_rule_ties_go_to_the_newest():
    s = running_state("most_blocks")
    s.running[2].block_table.append(s.running[2].block_table[-1])  # c: 3 blocks, as a
    assert s.pick_victim().request_id == "c"
    s.running[2].block_table.pop()


def test_unknown_victim_rule_is_one_line():
    with pytest.raises(Exception, match="preemption_victim: expected one of newest, "):
        make("fcfs", preemption_victim="oldest")


# ----------------------------------------------------------------------------- priority
def test_priority_admits_by_priority_then_arrival():
    # One sequence at a time; all arrive at 0 except d (t = 0.001, priority 0).
    # Order: b (0, t=0), d (0, t=0.001), c (1), a (2); each takes a prefill and a decode.
    trace = [req("a", 0, 4, 2, 2), req("b", 0, 4, 2, 0), req("c", 0, 4, 2, 1)]
    trace.append(req("d", 0.001, 4, 2, 0))
    res = replay_requests("priority", trace, seqs=1)
    assert first_token_order(res) == ["b", "d", "c", "a"]
    r = by_id(res)
    np.testing.assert_allclose(res.token_times(r["b"]), [0.01, 0.02])
    np.testing.assert_allclose(res.token_times(r["d"]), [0.03, 0.04])
    np.testing.assert_allclose(res.token_times(r["a"]), [0.07, 0.08])
    # fcfs on the same trace: arrival order.
    fcfs = replay_requests(
        "fcfs", [req(x.request_id, x.arrival_s, 4, 2, x.priority) for x in trace], seqs=1
    )
    assert first_token_order(fcfs) == ["a", "b", "c", "d"]


def rollback_trace() -> list[Request]:
    return [req("low", 0.0, 7, 8, priority=1), req("high", 0.045, 7, 3, priority=0)]


def test_priority_preemption_rolls_back_a_victim_given_its_block_in_the_same_step():
    # Block size 4, 4 GPU blocks. low (prompt 7): prefill step 0.00-0.01 (token 1, 2
    # blocks), decodes at 0.01-0.05 give tokens 2..5 (its 8th token took a 3rd block). The
    # step planned at 0.05 first gives low its 4th block (12 tokens, 12 % 4 == 0), leaving
    # 0 free; high (arrived 0.045, priority 0, needs 2 blocks) does not fit, so low is
    # preempted: its new block goes back with the others and it samples nothing at 0.06.
    # high: tokens 0.06, 0.07, 0.08. low needs 4 blocks to resume (13 tokens), free from
    # 0.08: its re-prefill of 12 tokens samples token 6 at 0.09, then 0.10, 0.11.
    res = replay_requests("priority", rollback_trace(), gpu=4, bs=4, priority_preemption=True)
    r = by_id(res)
    np.testing.assert_allclose(
        res.token_times(r["low"]), [0.01, 0.02, 0.03, 0.04, 0.05, 0.09, 0.10, 0.11]
    )
    np.testing.assert_allclose(res.token_times(r["high"]), [0.06, 0.07, 0.08])
    assert r["low"].num_preemptions_recompute == 1 and r["high"].num_preemptions == 0
    s = res.steps
    step = int(np.flatnonzero(s["num_preempted"])[0])
    assert s["time_s"][step] == pytest.approx(0.05)
    # That step runs high's prompt alone: no decode (low's slot was rolled back).
    assert (s["num_prefill_tokens"][step], s["num_decode_tokens"][step]) == (7, 0)
    # Without the option, high waits for low to finish (0.08) instead.
    plain = by_id(replay_requests("priority", rollback_trace(), gpu=4, bs=4))
    assert plain["low"].num_preemptions == 0
    assert plain["high"].first_scheduled_s == pytest.approx(0.08)


def test_priority_preemption_does_not_depend_on_running_order():
    # Two low-priority decodes (priorities 1 and 2) and a waiting priority-0 request that
    # needs the blocks of one: the priority-2 one is the victim whatever the list order.
    outcomes = set()
    for flip in (False, True):
        s = make("priority", gpu=4, bs=4, priority_preemption=True)
        for r in (req("p1", 0, 3, 9, 1), req("p2", 0, 3, 9, 2)):
            s.add(r, 0.0)
        plan = s.schedule()
        s.update(plan, StepResult(0.01), 0.01)
        s.add(req("hi", 0.01, 7, 2, 0), 0.01)
        if flip:
            s.running.reverse()
        plan = s.schedule()
        s.check_plan(plan)
        outcomes.add(
            (
                tuple(sorted(r.request_id for r in plan.prefills)),
                tuple(sorted(r.request_id for r in plan.decodes)),
                tuple(r.request_id for r, _ in plan.preempted),
            )
        )
    assert outcomes == {(("hi",), ("p1",), ("p2",))}
