"""The policy zoo, hand-computed: victim rules, priority (with preemption and its rollback),
SJF/SRPT (predictors, aging), EDF and VTC, with the toy executor of tests/helpers.py (every
step takes 10 ms)."""

from __future__ import annotations

import numpy as np
import pytest
import test_properties as tp
from helpers import FixedCost, by_id
from hypothesis import given, settings
from hypothesis import strategies as st

from sched_lab.core.kv import BlockManager
from sched_lab.core.plan import StepResult
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.sim.replay import replay


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


# ----------------------------------------------------------------------------- SJF / SRPT
def test_sjf_oracle_runs_shortest_output_first():
    # One sequence at a time, all at t = 0: outputs 5, 2, 3 run as b (2), c (3), a (5).
    trace = [req("a", 0, 4, 5), req("b", 0, 4, 2), req("c", 0, 4, 3)]
    res = replay_requests("sjf", trace, seqs=1)
    assert first_token_order(res) == ["b", "c", "a"]
    np.testing.assert_allclose(res.token_times(by_id(res)["a"]), [0.06, 0.07, 0.08, 0.09, 0.10])


def test_noisy_predictor_is_seeded_per_request():
    s = make("sjf", predictor="noisy", sigma=1.0, seed=3)
    r = req("7", 0, 4, 100)
    first = s.predict(r)
    assert first == make("sjf", predictor="noisy", sigma=1.0, seed=3).predict(req("7", 5, 9, 100))
    assert first != 100.0 and first != s.predict(req("8", 0, 4, 100))
    assert make("sjf", predictor="noisy", sigma=0.0).predict(r) == 100.0


def test_bucketed_ranker_is_fcfs_within_a_bucket():
    # Buckets (-inf, 10), [10, 100), [100, inf): b (50) and c (20) share bucket 1, a (500)
    # is in bucket 2, d (3) in bucket 0. Order: d, then b before c (arrival), then a.
    trace = [req("a", 0, 4, 500), req("b", 0.001, 4, 50), req("c", 0.002, 4, 20)]
    trace.append(req("d", 0.003, 4, 3))
    s = make("sjf", predictor="bucketed", buckets=[10, 100])
    for r in trace:
        s.add(r, r.arrival_s)
    assert [r.request_id for r in s.admission_order()] == ["d", "b", "c", "a"]


def starving_trace() -> list[Request]:
    """long (output 10) at t = 0 behind an endless line of 2-token requests: s0 at 0, s_k at
    0.02k - 0.005, so one is always waiting when the single sequence slot frees up."""
    trace = [req("long", 0.0, 4, 10), req("s0", 0.0, 4, 2)]
    trace += [req(f"s{k}", round(0.02 * k - 0.005, 3), 4, 2) for k in range(1, 11)]
    return trace


@pytest.mark.parametrize(
    "options, first_token_s",
    [
        ({}, 0.23),  # no aging: long waits for all eleven shorts (0.00-0.22)
        # wait >= 0.05 s first at the plan of t = 0.06 (plans come every 0.02 s)
        ({"max_wait_s": 0.05}, 0.07),
        # key 10 - 100 t beats a fresh short's 2 - 100 * 0.005 = 1.5 once t > 0.085: t = 0.10
        ({"aging_tokens_per_s": 100.0}, 0.11),
    ],
)
def test_aging_releases_a_starved_request_at_the_stated_time(options, first_token_s):
    res = replay_requests("sjf", starving_trace(), seqs=1, **options)
    r = by_id(res)
    assert res.token_times(r["long"])[0] == pytest.approx(first_token_s)
    assert r["long"].first_scheduled_s == pytest.approx(first_token_s - 0.01)


def test_srpt_ranks_by_remaining_and_preempts_longer_ones():
    # seqs 1. long (output 6) runs from t = 0; at t = 0.025 short (output 2) arrives. With
    # preempt_longer, the plan at 0.03 preempts long (6 - 3 = 3 left > 2): short tokens at
    # 0.04, 0.05; long is recomputed (4 + 3 tokens) from 0.05: tokens 4..6 at 0.06..0.08.
    trace = [req("long", 0.0, 4, 6), req("short", 0.025, 4, 2)]
    res = replay_requests("srpt", trace, seqs=1, preempt_longer=True)
    r = by_id(res)
    np.testing.assert_allclose(res.token_times(r["short"]), [0.04, 0.05])
    np.testing.assert_allclose(res.token_times(r["long"]), [0.01, 0.02, 0.03, 0.06, 0.07, 0.08])
    assert r["long"].num_preemptions_recompute == 1
    # Not preemptive: short waits for long (0.00-0.06).
    plain = by_id(
        replay_requests(
            "srpt", [req(x.request_id, x.arrival_s, 4, x.output_len) for x in trace], seqs=1
        )
    )
    np.testing.assert_allclose(plain["short"].first_scheduled_s, 0.06)
    # 2 left (short) vs 6 - 3 = 3 left: no preemption when long has 2 or fewer left.
    near = [req("long", 0.0, 4, 6), req("short", 0.045, 4, 3)]
    assert (
        by_id(replay_requests("srpt", near, seqs=1, preempt_longer=True))["long"].num_preemptions
        == 0
    )


# ----------------------------------------------------------------------------- EDF
def test_edf_orders_by_ttft_deadline():
    # Class SLOs: a 0 + 1.0, b 0.001 + 0.2; c and d have none: the option's 0.5 gives
    # c 0.502 and d 0.5, so b (0.201), d, c, a.
    trace = [req("a", 0, 4, 2, ttft_slo_s=1.0), req("b", 0.001, 4, 2, ttft_slo_s=0.2)]
    trace += [req("c", 0.002, 4, 2), req("d", 0.0, 4, 2)]
    s = make("edf", ttft_s=0.5)
    for r in trace:
        s.add(r, 0.003)
    assert [r.request_id for r in s.admission_order()] == ["b", "d", "c", "a"]
    s = make("edf")  # no option: c and d have no deadline, FCFS after a and b
    for r in trace:
        s.add(r, 0.003)
    assert [r.request_id for r in s.admission_order()] == ["b", "a", "d", "c"]


# ----------------------------------------------------------------------------- VTC
class CounterLog(FixedCost):
    """The toy executor, also recording VTC's counters (A, B) as each step is executed."""

    def __init__(self, scheduler) -> None:
        super().__init__()
        self.s, self.log = scheduler, []

    def execute(self, plan):
        self.log.append((self.s.counters["A"], self.s.counters["B"]))
        return super().execute(plan)


def test_vtc_counters_step_by_step_with_the_lift():
    # One sequence at a time; weights: 1 per prompt token, 2 per output token. Tenant A:
    # a1..a3 at t = 0 (prompt 10, output 2); B: b1 at 0 (prompt 4, output 2), b2 and b3
    # at 0.045. Each request takes a prefill step (charged 10 or 4 at admission, 2 for its
    # first token) and a decode step (2).
    trace = [req(f"a{i}", 0.0, 10, 2, tenant="A") for i in (1, 2, 3)]
    trace += [req("b1", 0.0, 4, 2, tenant="B")]
    trace += [req(f"b{i}", 0.045, 4, 2, tenant="B") for i in (2, 3)]
    s = make("vtc", seqs=1)
    ex = CounterLog(s)
    res = replay(trace, s, ex, check_invariants=True)
    # t=0: tie 0/0 -> A (a1 waits before b1). a1: A = 10, 12, 14. b1 (B 0 < 14): B = 4, 6, 8. a2: A = 24.
    # b2 arrives at 0.045 with B's queue empty while A is backlogged (a3 waits, A = 24):
    # the lift raises B from 8 to 24. a2 ends at 26, 28; then B 24 < 28: b2 (28, 30, 32);
    # A 28 < 32: a3 (38, 40, 42); then b3 (36, 38, 40).
    assert ex.log == [
        (10, 0), (12, 0), (14, 4), (14, 6), (24, 8), (26, 24),
        (28, 28), (28, 30), (38, 32), (40, 32), (42, 36), (42, 38),
    ]  # fmt: skip
    assert (s.counters["A"], s.counters["B"]) == (42, 40)
    # Without the lift B (8) would take b2 and b3 before a3; fcfs takes all of A first.
    assert first_token_order(res) == ["a1", "b1", "a2", "b2", "a3", "b3"]
    fcfs = replay_requests(
        "fcfs", [req(r.request_id, r.arrival_s, r.prompt_len, 2) for r in trace], seqs=1
    )
    assert first_token_order(fcfs) == ["a1", "a2", "a3", "b1", "b2", "b3"]


def vtc_schedule(first: str, second: str):
    """One sequence at a time (10 ms steps): q1, p1, q2, p2 at t = 0 (prompt 10, output 2),
    q* of tenant ``first``, p* of ``second``; (id, first-token time, end time) in order."""
    trace = [req(f"{k}{i}", 0.0, 10, 2, tenant=first if k == "q" else second)
             for i in (1, 2) for k in ("q", "p")]  # fmt: skip
    res = replay_requests("vtc", trace, seqs=1)
    rows = [(r.request_id, round(res.token_times(r)[0], 6), round(r.finish_s, 6))
            for r in res.requests]  # fmt: skip
    return sorted(rows, key=lambda row: row[1])


def test_vtc_ties_go_to_the_earliest_waiting_request_never_to_a_name():
    # t=0: both counters 0: q1 waits first -> its tenant (10 at admission, 2 per token:
    # 14 when q1 ends at 20 ms); p1 (0 < 14) runs [20, 40) ms -> 14 too; tie again at
    # 40 ms: q2 waits before p2 -> q2 [40, 60), p2 [60, 80). Renamed tenants (the
    # later name first, the names swapped) give the very same schedule.
    expected = [("q1", 0.01, 0.02), ("p1", 0.03, 0.04), ("q2", 0.05, 0.06), ("p2", 0.07, 0.08)]
    assert vtc_schedule("b", "a") == expected
    assert vtc_schedule("a", "b") == expected
    assert vtc_schedule("tenant-z", "tenant-0") == expected


def test_vtc_a_rejected_request_lifts_nothing():
    # A: a1, a2 at 0 (prompt 10, output 2) run one at a time; B's only request (prompt
    # 10_001 > max_model_len - output) is rejected at 5 ms, while A is backlogged at 10:
    # B's counter stays 0.
    s = make("vtc", seqs=1)
    trace = [req("a1", 0.0, 10, 2, tenant="A"), req("a2", 0.0, 10, 2, tenant="A")]
    trace.append(req("b1", 0.005, 10_001, 2, tenant="B"))
    res = replay(trace, s, FixedCost(), check_invariants=True)
    assert by_id(res)["b1"].status.value == "rejected"
    assert s.counters["B"] == 0 and s.counters["A"] == 28


def test_vtc_tenant_weights_divide_the_charge():
    s = make("vtc", seqs=1, tenant_weights={"A": 2.0})
    assert s.cost(req("x", 0, 10, 1, tenant="A"), 10, 1.0) == 5.0
    assert s.cost(req("y", 0, 10, 1, tenant="B"), 10, 1.0) == 10.0


# ----------------------------------------------------------------------------- properties
# tests/test_properties.py runs every registered policy with its default options; these
# are the options that change decisions, on the same random scenarios, with priorities and
# tenants drawn per request.
VARIANTS = [
    ("priority", {"priority_preemption": True}),
    ("srpt", {"preempt_longer": True, "predictor": "noisy", "sigma": 1.0}),
    ("sjf", {"predictor": "bucketed", "buckets": [4, 16], "max_wait_s": 0.5}),
    ("sjf", {"predictor": "noisy", "sigma": 0.25, "aging_tokens_per_s": 4.0}),
    ("edf", {"ttft_s": 1.0}),
    ("vtc", {"tenant_weights": {"b": 3.0}}),
    ("fcfs", {"preemption_victim": "fewest_computed"}),
    ("swap", {"preemption_victim": "most_blocks"}),
    ("chunked_prefill", {"preemption_victim": "lowest_priority"}),
]


@pytest.mark.parametrize("policy, options", VARIANTS, ids=lambda v: str(v))
@settings(tp.PROFILE, max_examples=max(10, tp.PROFILE.max_examples // 3))
@given(data=st.data())
def test_policy_options_on_random_traces(policy, options, data):
    sc = data.draw(tp.scenarios_for(policy), label="scenario")
    bm = BlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
    scheduler = get_policy(policy)(sc.limits, bm, **options)
    ex = tp.RecordingExecutor(scheduler)
    reqs = [
        Request(str(i), a, p, o, priority=i % 3, tenant="ab"[i % 2], ttft_slo_s=0.5 * (i % 2))
        for i, (a, p, o) in enumerate(sc.requests)
    ]
    res = replay(reqs, scheduler, ex, check_invariants=True)
    if res.failure:
        pytest.fail(f"{policy} {options} failed on valid input {sc}: {res.failure}")
    tp.check_requests(sc, res)
    tp.check_steps(sc, res, scheduler, ex)
    tp.check_preemptions(res, scheduler)
    tp.check_termination(res, scheduler, ex)


def test_recompute_counts_the_dropped_kv_tokens():
    # The rollback case: low had 12 tokens, 11 with KV (the 12th is fed by the next step).
    res = replay_requests("priority", rollback_trace(), gpu=4, bs=4, priority_preemption=True)
    assert by_id(res)["low"].num_recomputed_tokens == 11
