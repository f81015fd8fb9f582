"""The replay loop's order at equal times (lab/sim/replay.py): a plan made at time t sees
every request arriving at t, whatever other requests arrived before."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import by_id, run

# fcfs (vLLM V0's prefill-first step), 1 s steps; A: prompt 4, 3 output tokens at t = 0;
# B: prompt 4, 2 output tokens, arriving at t = 1.0 exactly when A's prefill step ends.
A, B = ("A", 0.0, 4, 3), ("B", 1.0, 4, 2)
REJECTED = ("R", 0.5, 5000, 2)  # longer than max_model_len: rejected at its arrival


def schedule(requests):
    res = run("fcfs", requests, gpu_blocks=8, step_s=1.0, max_model_len=200)
    got = by_id(res)
    times = {i: (got[i].first_scheduled_s, got[i].finish_s) for i in ("A", "B")}
    return times, res.steps["time_s"].tolist(), res.steps["num_prefill_tokens"].tolist()


def test_arrival_at_a_step_end_is_seen_by_the_next_plan():
    # step [0,1): prefill A; t=1: B has arrived -> [1,2): prefill B (prefill-first);
    # [2,3): decode A and B (B's 2nd token: B ends at 3); [3,4): decode A (A ends at 4).
    times, starts, prefill = schedule([A, B])
    assert times == {"A": (0.0, 4.0), "B": (1.0, 3.0)}
    assert starts == [0.0, 1.0, 2.0, 3.0]
    assert prefill == [4, 4, 0, 0]


def test_a_rejected_arrival_moves_no_other_request():
    """R arrives mid-step and is rejected; before the fix the arrival process's next timeout
    was created after the step's, so B (t = 1.0) was seen one step late and ended at 4.0."""
    with_r = schedule([A, REJECTED, B])
    assert with_r == schedule([A, B])
    assert with_r[0]["B"] == (1.0, 3.0)


def test_a_queued_arrival_between_is_planned_with_the_equal_time_one():
    # C (prompt 4, 1 token) arrives at 0.25, mid-step: the plan at 1.0 prefills B and C
    # together (8 tokens); C ends at 2.0 and B still at 3.0.
    times, starts, prefill = schedule([A, ("C", 0.25, 4, 1), B])
    assert prefill == [4, 8, 0, 0]
    assert times == {"A": (0.0, 4.0), "B": (1.0, 3.0)}


# ------------------------------------------------------------------ fast-forward
def test_repeated_decode_plans_skip_the_policy(monkeypatch):
    """Scheduler.repeat_decodes plans a step that repeats the decode-only step before it
    (no arrival, finish, preemption or swap in between) without the policy: a (40 + 10
    tokens) and b (20 + 2) with 4 blocks of 16, b blocked until a finishes at step 9 (as in
    tests/test_events.py). The policy plans steps 0 (prefill a), 1 (the first decode), 10
    (prefill b) and 11 (decode b); steps 2-9 repeat step 1, the 4th block of a included
    (step 8), and b's wait streak still counts every step, 0 to 9."""
    from sched_lab.policies.fcfs import FCFS

    planned = []
    schedule = FCFS.schedule

    def counted(self):
        planned.append(self.num_steps)
        return schedule(self)

    monkeypatch.setattr(FCFS, "schedule", counted)
    res = run("fcfs", [("a", 0.0, 40, 10), ("b", 0.0, 20, 2)], gpu_blocks=4)
    assert planned == [0, 1, 10, 11]
    assert res.steps["kv_used_blocks"].tolist() == [3] * 8 + [4, 4, 2, 2]
    assert res.events.waits == [["kv_blocks", by_id(res)["b"], 0, 9, 10, 2, 1]]


def test_fast_forward_is_declared_per_class():
    """A subclass inherits no fast_forward: edf (an fcfs with its own admission order) and
    the policies that reorder or count every step plan every step themselves."""
    from sched_lab.policies import get_policy

    names = ("fcfs", "swap", "chunked_prefill", "edf", "sjf", "priority", "vtc")
    assert {p for p in names if get_policy(p).fast_forward} == {"fcfs", "swap", "chunked_prefill"}


def test_advance_to_moves_the_clock_only_when_nothing_is_due():
    from sched_lab.sim.replay import SimEnvironment

    env = SimEnvironment()
    env.timeout(2.0)
    assert env.advance_to(1.5) and env.now == 1.5
    assert not env.advance_to(2.0)  # an event at 2.0 comes first
    assert env.now == 1.5
    env.run()
    assert env.now == 2.0 and env.advance_to(7.25) and env.now == 7.25


# ------------------------------------------------------------------ multi-step fast-forward
def _context_cost(f) -> float:
    """1/4 s a step plus 1/4096 s per decode context token: durations grow with the
    decodes' contexts and stay binary fractions (exact sums)."""
    return 0.25 + f.decode_context_tokens / 4096


class ContextCost:
    """A toy executor priced by ``_context_cost``; ``many=False`` hides ``step_time``, so
    the loop repeats decode plans one step at a time."""

    def __init__(self, many: bool = True) -> None:
        self.step_time = _context_cost if many else None

    def execute(self, plan):
        from sched_lab.core.plan import StepResult

        return StepResult(_context_cost(plan.features()))


def replay_both(monkeypatch, requests, gpu_blocks=8, policy="fcfs", progress_every=None):
    """Replay ``requests`` with multi-step fast-forward, with repeats one step at a time,
    and with the policy planning every step; assert the three agree in every column, token
    time, request state, event and wait (and progress call). Returns the fast-forwarded
    result, its runs, (first step, steps) each, and its progress calls."""
    from sched_lab.core.kv import BlockManager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import Scheduler, SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.sim import replay as replay_mod

    if progress_every is not None:
        monkeypatch.setattr(replay_mod, "_PROGRESS_EVERY", progress_every)
    runs = []
    original = Scheduler.repeat_decodes_run

    def counted(self, prev, *args, **kwargs):
        first = self.num_steps
        run = original(self, prev, *args, **kwargs)
        if run is not None:
            runs.append((first, len(run.start_s)))
        return run

    monkeypatch.setattr(Scheduler, "repeat_decodes_run", counted)

    def one(many: bool, fast_forward: bool = True):
        bm = BlockManager(gpu_blocks, 8, 4, 0.0)
        scheduler = get_policy(policy)(SchedulerLimits(8, 64, 10**6), bm)
        scheduler.fast_forward = fast_forward
        reqs = [Request(*t) for t in requests]
        calls = []
        res = replay_mod.replay(
            reqs, scheduler, ContextCost(many), True, lambda n, t: calls.append((n, t))
        )
        assert res.failure is None, res.failure
        return res, calls

    a, calls_a = one(True)
    for b, calls_b in (one(False), one(False, fast_forward=False)):
        _assert_same(a, b)
        assert calls_a == calls_b
    return a, runs, calls_a


def _assert_same(a, b) -> None:
    for col in a.steps:
        assert a.steps[col].dtype == b.steps[col].dtype, col
        assert np.array_equal(a.steps[col], b.steps[col]), col
    assert np.array_equal(a.tick_steps, b.tick_steps)
    for ra, rb in zip(a.requests, b.requests, strict=True):
        state = ("status", "finish_s", "reason", "num_preemptions", "decode_segments")
        assert [getattr(ra, k) for k in state] == [getattr(rb, k) for k in state]
        assert np.array_equal(a.token_times(ra), b.token_times(rb))

    def events(res):
        rows = [(s, k, r.request_id, x, y) for s, k, r, x, y in res.events.rows(res.requests)]
        waits = [(w[0], getattr(w[1], "request_id", None), *w[2:]) for w in res.events.waits]
        return rows, waits

    assert events(a) == events(b)


def test_a_run_of_repeats_ends_with_the_finishing_step(monkeypatch):
    """A (prompt 4, 10 tokens; blocks of 4): step 0 prefills, the policy plans step 1 (the
    first decode), which starts a run: steps 1-9 (ticks 0-8) at once, the last sampling A's
    10th token.
    At tick t A holds 5 + t tokens and reserves the next one's slot: a 3rd block at tick 3
    (step 4), a 4th at tick 7 (step 8)."""
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 10)])
    assert runs == [(1, 9)]
    durations = [0.25] + [0.25 + (5 + t) / 4096 for t in range(9)]
    assert res.steps["duration_s"].tolist() == durations
    starts = [0.0]
    for d in durations[:-1]:
        starts.append(starts[-1] + d)
    assert res.steps["time_s"].tolist() == starts
    assert res.steps["kv_used_blocks"].tolist() == [2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert res.steps["decode_context_tokens"].tolist() == [0] + [5 + t for t in range(9)]
    assert res.tick_steps.tolist() == list(range(1, 10))
    assert by_id(res)["A"].finish_s == starts[-1] + durations[-1]


def test_a_finish_inside_a_batch_ends_the_run(monkeypatch):
    """A (prompt 4, 10 tokens) and B (prompt 4, 4 tokens), blocks of 4: step 0 prefills
    both, the policy plans step 1 (two decodes) and steps 1-3 run at once, the last
    sampling B's 4th token; the policy plans step 4 (A alone; a 3rd block for A at tick 3)
    and steps 4-9 run at once, A's 10th token in step 9. At tick t each holds 5 + t tokens."""
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 10), ("B", 0.0, 4, 4)])
    assert runs == [(1, 3), (4, 6)]
    context = [0, 10, 12, 14] + [5 + t for t in range(3, 9)]
    assert res.steps["decode_context_tokens"].tolist() == context
    assert res.steps["duration_s"].tolist() == [0.25 + c / 4096 for c in context]
    assert res.steps["num_decode_tokens"].tolist() == [0, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    assert res.steps["num_running"].tolist() == [2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    assert res.steps["kv_used_blocks"].tolist() == [4, 4, 4, 4, 3, 3, 3, 3, 4, 4]
    assert res.steps.repeats.tolist() == [False, False] + [True] * 2 + [False] + [True] * 5
    ends = (res.steps["time_s"] + res.steps["duration_s"]).tolist()
    got = by_id(res)
    assert (got["B"].finish_s, got["A"].finish_s) == (ends[3], ends[9])


def test_a_finish_that_admits_a_waiting_request(monkeypatch):
    """As above with C (prompt 4, 2 tokens) waiting from t = 0 in 5 blocks (A and B hold 4,
    C needs 2): B's finish in step 3 frees 2 and the policy prefills C in step 4. C's wait
    for blocks covers steps 0-3."""
    reqs = [("A", 0.0, 4, 10), ("B", 0.0, 4, 4), ("C", 0.0, 4, 2)]
    res, runs, _ = replay_both(monkeypatch, reqs, gpu_blocks=5)
    assert runs[0] == (1, 3)
    assert res.steps["num_prefill_tokens"].tolist()[:6] == [8, 0, 0, 0, 4, 0]
    assert [(w[0], w[1].request_id, *w[2:5]) for w in res.events.waits] == [
        ("kv_blocks", "C", 0, 3, 4)
    ]


def test_a_finish_that_leaves_the_queue_waiting(monkeypatch):
    """C (prompt 12, 2 tokens: 4 blocks) waits in 5 blocks: after B's finish 3 are free,
    so the policy decodes A alone in step 4 and C's wait goes on through A's finish in step
    9; the policy admits C in step 10."""
    reqs = [("A", 0.0, 4, 10), ("B", 0.0, 4, 4), ("C", 0.0, 12, 2)]
    res, runs, _ = replay_both(monkeypatch, reqs, gpu_blocks=5)
    assert runs[:2] == [(1, 3), (4, 6)]
    assert res.steps["num_prefill_tokens"].tolist()[:12] == [8] + [0] * 9 + [12, 0]
    assert res.steps["num_waiting"].tolist()[:11] == [1] * 10 + [0]
    assert [(w[0], w[1].request_id, *w[2:5]) for w in res.events.waits] == [
        ("kv_blocks", "C", 0, 9, 10)
    ]


def test_an_arrival_inside_a_run_ends_it_before_the_step_it_falls_in(monkeypatch):
    """B arrives 0.1 s into step 4: steps 1-3 run at once, step 4 waits for the arrival
    as a SimPy timeout, and the policy prefills B in step 5."""
    t4 = 0.25 + sum(0.25 + (5 + t) / 4096 for t in range(3))  # step 4's start
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 10), ("B", t4 + 0.1, 4, 2)])
    assert runs[0] == (1, 3)
    assert res.steps["num_prefill_tokens"].tolist()[:6] == [4, 0, 0, 0, 0, 4]


def _pending_runs(monkeypatch) -> list:
    """Wrap Scheduler.repeat_decodes_run: the list it returns gets (first step, steps
    applied, pending) of each run, ``pending`` the run's ``RepeatRun.pending``."""
    from sched_lab.core.scheduler import Scheduler

    original, got = Scheduler.repeat_decodes_run, []

    def wrapped(self, prev, *args, **kwargs):
        first = self.num_steps
        run = original(self, prev, *args, **kwargs)
        if run is not None:
            got.append((first, len(run.start_s), run.pending))
        return run

    monkeypatch.setattr(Scheduler, "repeat_decodes_run", wrapped)
    return got


def test_the_step_an_arrival_falls_in_ends_the_run_as_its_pending_step(monkeypatch):
    """B arrives 0.1 s into step 4: the run applies steps 1-3 and plans step 4 (A's 9th
    token: 8 tokens of context, a 3rd block), which the loop waits for as a SimPy timeout
    and applies after B's arrival, as step by step; the policy prefills B in step 5."""
    got = _pending_runs(monkeypatch)
    t4 = 0.25 + sum(0.25 + (5 + t) / 4096 for t in range(3))  # step 4's start
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 10), ("B", t4 + 0.1, 4, 2)])
    d4 = 0.25 + 8 / 4096
    assert got[0] == (1, 3, (t4, d4, 3, 8, 0))
    assert res.steps["time_s"].tolist()[4:6] == [t4, t4 + d4]
    assert res.steps["kv_used_blocks"].tolist()[:6] == [2, 2, 2, 2, 3, 5]
    assert res.steps.repeats.tolist()[:6] == [False, False, True, True, True, False]


def test_a_decode_plan_whose_step_an_arrival_falls_in_is_the_pending_step(monkeypatch):
    """B arrives 0.1 s into step 1, the policy's first decode plan: the run applies no
    step and leaves that plan pending (its row recorded whole); after B's arrival the
    policy prefills B in step 2, as step by step."""
    got = _pending_runs(monkeypatch)
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 10), ("B", 0.35, 4, 2)])
    d1 = 0.25 + 5 / 4096
    assert got[0] == (1, 0, (0.25, d1, 2, 5, 0))
    assert runs[0] == (1, 0)
    assert res.steps["num_prefill_tokens"].tolist()[:3] == [4, 0, 4]
    assert res.steps["time_s"].tolist()[:3] == [0.0, 0.25, 0.25 + d1]
    assert res.steps.repeats.tolist()[:3] == [False, False, False]


def test_an_arrival_at_a_step_end_ends_the_run_before_that_step(monkeypatch):
    """B arrives exactly when step 3 ends: the run holds steps 1-2 only (a step must end before
    every other event), and the plan at step 3's end sees B."""
    t4 = 0.25 + sum(0.25 + (5 + t) / 4096 for t in range(3))
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 10), ("B", t4, 4, 2)])
    assert runs[0] == (1, 2)
    assert res.steps["num_prefill_tokens"].tolist()[:5] == [4, 0, 0, 0, 4]


def test_a_block_boundary_with_no_free_block_preempts_at_the_same_step(monkeypatch):
    """A and B (prompt 4, 20 tokens each) in 5 blocks: both reach 8 tokens at tick 3 and
    need a 3rd block with 1 free. Steps 1-3 run at once; step 4 goes back to the policy,
    which preempts B (the newest) as step by step."""
    res, runs, _ = replay_both(monkeypatch, [("A", 0.0, 4, 20), ("B", 0.0, 4, 20)], gpu_blocks=5)
    assert runs[0] == (1, 3)
    assert res.steps["num_preempted"].tolist()[:5] == [0, 0, 0, 0, 1]
    assert by_id(res)["B"].num_preemptions == 1


def test_progress_calls_inside_a_run_are_those_of_step_by_step(monkeypatch):
    """With a progress call every 5 steps, the calls after steps 4 (inside the run of steps
    1-9) and 9 (its last, finishing A) carry the same ended counts and times."""
    res, runs, calls = replay_both(monkeypatch, [("A", 0.0, 4, 10)], progress_every=5)
    assert runs == [(1, 9)]
    ends = (res.steps["time_s"] + res.steps["duration_s"]).tolist()
    assert calls == [(0, ends[4]), (1, ends[9])]


def test_the_step_recorder_expands_runs_of_repeats():
    """Whole rows and repeats of a row come back as one table in step order; only
    REPEAT_COLUMNS differ from the template, and every repeat is a decode tick."""
    from sched_lab.sim.records import STEP_COLUMNS, StepRecorder

    rec = StepRecorder()
    prefill = [float(i) for i in range(len(STEP_COLUMNS))]
    decode = [10.0 * i for i in range(len(STEP_COLUMNS))]
    rec.append(prefill, [])  # step 0: no decode tick
    rec.append(decode, ["r"])  # step 1
    rec.append_repeats(decode, [1.0, 2.0], [0.5, 0.5], [7, 8], [30, 31], [0, 0])  # 2, 3
    rec.append_repeat(decode, 3.0, 0.75, 9, 32, 1)  # 4: the same run
    rec.append(prefill, ["r"])  # 5
    steps, ticks = rec.columns()
    assert rec.num_steps == steps.num_steps == 6 and ticks.tolist() == [1, 2, 3, 4, 5]
    assert steps.repeats.tolist() == [False, False, True, True, True, False]
    assert steps["time_s"].tolist() == [0.0, 0.0, 1.0, 2.0, 3.0, 0.0]
    assert steps["duration_s"].tolist() == [1.0, 10.0, 0.5, 0.5, 0.75, 1.0]
    assert steps["kv_used_blocks"].tolist() == [5, 50, 7, 8, 9, 5]
    assert steps["decode_context_tokens"].tolist() == [16, 160, 30, 31, 32, 16]
    assert steps["kv_cached_blocks"].tolist() == [19, 190, 0, 0, 1, 19]
    assert steps["num_waiting"].tolist() == [7, 70, 70, 70, 70, 7]
    assert steps["num_waiting"].dtype == np.int64 and steps["time_s"].dtype == np.float64
    assert list(steps) == list(STEP_COLUMNS) and len(steps) == len(STEP_COLUMNS)
    with pytest.raises(ValueError, match="the last whole row"):
        rec.append_repeat(decode, 4.0, 0.75, 9, 33, 1)  # step 5 was a prefill


def test_step_columns_rows_are_slices_of_the_columns():
    """StepColumns.rows(start, stop) equals every column made whole and sliced, value and
    dtype, for every range (runs of repeats cut anywhere); a column set on it is kept as
    given and comes last; ``dtype`` names a column's dtype without making it."""
    from sched_lab.sim.records import STEP_COLUMNS, StepRecorder

    rec = StepRecorder()
    width = len(STEP_COLUMNS)
    rows = [[float(100 * k + i) for i in range(width)] for k in range(4)]
    rows[2][STEP_COLUMNS.index("num_prefill_tokens")] = 2.0**40  # kept as int64
    rows[3][STEP_COLUMNS.index("num_seqs")] = -70_000.0  # int32
    rec.append(rows[0], ["r"])  # 0
    rec.append_repeats(rows[0], [1.0, 2.0, 3.0], [0.25] * 3, [7, 8, 9], [30, 31, 32], [1, 2, 3])
    rec.append(rows[1], [])  # 4
    rec.append(rows[2], ["r"])  # 5
    rec.append_repeat(rows[2], 6.0, 0.5, 11, 40, 4)  # 6
    rec.append(rows[3], ["r"])  # 7
    rec.append_repeats(rows[3], [8.0, 9.0], [0.75, 0.75], [12, 13], [41, 42], [5, 6])  # 8, 9
    steps, ticks = rec.columns()
    assert ticks.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    whole = {c: steps[c] for c in steps}
    assert whole["time_s"].tolist() == [0.0, 1.0, 2.0, 3.0, 100.0, 200.0, 6.0, 300.0, 8.0, 9.0]
    assert whole["num_running"].tolist() == [8, 8, 8, 8, 108, 208, 208, 308, 308, 308]
    assert whole["kv_cached_blocks"].tolist() == [19, 1, 2, 3, 119, 219, 4, 319, 5, 6]
    assert whole["num_prefill_tokens"].tolist() == [2, 2, 2, 2, 102, 2**40, 2**40, 302, 302, 302]
    assert whole["num_seqs"].tolist()[-3:] == [-70_000] * 3
    for start in range(11):
        for stop in range(start, 11):
            part = steps.rows(start, stop)
            assert list(part) == list(STEP_COLUMNS)
            for c in STEP_COLUMNS:
                assert part[c].dtype == whole[c].dtype == steps.dtype(c), c
                assert part[c].tolist() == whole[c][start:stop].tolist(), (c, start, stop)
    steps.update({"num_accepted_tokens": np.arange(10)})
    assert list(steps)[-1] == "num_accepted_tokens" and "num_accepted_tokens" in steps
    assert steps.rows(3, 5)["num_accepted_tokens"].tolist() == [3, 4]
    assert steps.dtype("num_accepted_tokens") == np.arange(1).dtype
    with pytest.raises(KeyError):
        steps["no_such_column"]


def test_a_recorded_column_is_kept_in_the_narrowest_type_that_holds_it():
    """Integer columns: int8, int16, int32 or int64 by their range, read back as
    ``astype(np.int64)`` of the float64 values; float columns stay float64."""
    from sched_lab.sim.records import _narrow

    def kept(values: list[float], name: str = "num_seqs") -> tuple[str, list]:
        v = np.array(values, dtype=np.float64)
        out = _narrow(name, v)
        assert out.astype(np.int64).tolist() == v.astype(np.int64).tolist() or name == "time_s"
        return out.dtype.name, out.tolist()

    assert kept([0.0, 127.0, -128.0]) == ("int8", [0, 127, -128])
    assert kept([0.0, 128.0]) == ("int16", [0, 128])
    assert kept([-32769.0, 5.0]) == ("int32", [-32769, 5])
    assert kept([0.0, 2.0**31]) == ("int64", [0, 2**31])
    assert kept([]) == ("int64", [])
    assert kept([0.5, 2.0**40], "time_s") == ("float64", [0.5, 2.0**40])


def test_a_seeded_replica_is_priced_step_by_step():
    """A cost model that draws per step (seeded noise) gives its executor no step_time; a
    deterministic one does, equal to execute's duration."""
    from sched_lab.core.plan import SchedulerOutput
    from sched_lab.sim.cost_model import AnalyticCostModel, CostModelExecutor
    from sched_lab.sim.hardware import HARDWARE
    from sched_lab.sim.models import MODELS
    from sched_lab.sim.noise import NoisyCostModel, StepNoise

    model = AnalyticCostModel(MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"])
    plain = CostModelExecutor(model, 16)
    plan = SchedulerOutput(decode_context_tokens=5000)
    assert plain.step_time(plan.features()) == plain.execute(plan).duration_s
    noise = StepNoise({}, {}, {}, 0.0, 0.0)
    assert CostModelExecutor(NoisyCostModel(model, noise, (0,)), 16).step_time is None
