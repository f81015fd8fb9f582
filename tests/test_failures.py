"""Faults during a run: the run stops with a clear message and nothing is lost."""

from __future__ import annotations

import json

import pandas as pd
from helpers import FixedCost

import run_experiment
from sched_lab.core.kv import BlockManager
from sched_lab.core.plan import StepResult
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.sim.replay import replay


class FailingExecutor(FixedCost):
    """Fails like a device out of memory on its ``fail_at``-th step."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def execute(self, plan) -> StepResult:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return super().execute(plan)


def test_failed_step_stops_run_and_accounts_for_every_request():
    reqs = [Request("a", 0.0, 4, 3), Request("b", 0.0, 4, 10), Request("c", 5.0, 4, 2)]
    scheduler = get_policy("fcfs")(SchedulerLimits(8, 64, 64), BlockManager(16, 0, 4, 0.0))
    res = replay(reqs, scheduler, FailingExecutor(fail_at=4))
    # Steps 1-3 ran (prefill of a and b at 0.01, decodes at 0.02, 0.03): a finished.
    assert len(res.steps["time_s"]) == 3
    assert res.failure == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    status = {r.request_id: (r.status.value, r.reason) for r in res.requests}
    assert status["a"] == ("finished", "")
    assert status["b"][0] == "unfinished"  # b was running
    assert status["b"][1].startswith(
        "not finished: the run stopped at t=0.030s (RuntimeError: CUDA out of memory"
    )
    assert status["c"][0] == "unfinished"  # c had not arrived (t=5): no finish time
    assert status["c"][1].startswith(
        "not replayed: the run stopped at t=0.030s, before its "
        "arrival (RuntimeError: CUDA out of memory"
    )
    finish = {r.request_id: r.finish_s for r in res.requests}
    assert finish["b"] == 0.03 and finish["c"] == -1.0


def test_cli_writes_partial_results_and_exits_1(tmp_path, monkeypatch, capsys):
    import sched_lab.setup.sim

    real = sched_lab.setup.sim.CostModelExecutor

    class Flaky(real):
        def execute(self, plan):
            if plan.decodes and len(plan.decodes) >= 3:
                raise RuntimeError("device lost")
            return super().execute(plan)

    monkeypatch.setattr(sched_lab.setup.sim, "CostModelExecutor", Flaky)
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(
        "trace: {format: synthetic, num_requests: 20, arrival: {process: poisson, "
        "rate: 100}, prompt_len: 50, output_len: 20}\npolicies: [fcfs, swap]\n"
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(cfg), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "error: 2 of 2 runs stopped early: fcfs (RuntimeError: device lost), swap " in err
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 40 and list(req.policy.value_counts()) == [20, 20]  # every run ran
    assert (req.status == "unfinished").sum() > 0
    assert req.loc[req.status == "unfinished", "reason"].str.contains("device lost").all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fcfs"]["failure"] == "RuntimeError: device lost"
    assert summary["swap"]["failure"] == "RuntimeError: device lost"
    assert "stopped early" in (out / "report.md").read_text()


def test_replay_freezes_the_collector_and_restores_it_even_after_a_failure():
    import gc

    class Spy(FailingExecutor):
        def execute(self, plan):
            self.frozen_during = gc.get_freeze_count()
            return super().execute(plan)

    def run():
        reqs = [Request("a", 0.0, 4, 3), Request("b", 0.0, 4, 10)]
        scheduler = get_policy("fcfs")(SchedulerLimits(8, 64, 64), BlockManager(16, 0, 4, 0.0))
        spy = Spy(fail_at=3)
        assert replay(reqs, scheduler, spy).failure is not None
        return spy.frozen_during

    assert gc.get_freeze_count() == 0
    assert run() > 0  # objects that existed before the replay are frozen while it runs
    assert gc.get_freeze_count() == 0  # ...and unfrozen after it, though a step failed
    gc.freeze()  # a caller's own freeze is left as it was
    try:
        before = gc.get_freeze_count()
        run()
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()


def test_plans_that_feed_no_token_stop_the_run():
    """A plan that is not empty but advances no request (a 0-token chunk, a swap of nothing)
    is no progress either: the run stops instead of looping forever."""
    import pytest

    from sched_lab.core.plan import SchedulerOutput
    from sched_lab.core.scheduler import POLICIES, register_policy
    from sched_lab.policies.fcfs import FCFS

    class ZeroChunk(FCFS):
        def schedule(self):
            if self.num_steps >= 2 and self.running:
                plan = SchedulerOutput()
                plan.prefills[self.running[0]] = 0
                return plan
            return super().schedule()

    class SwapNothing(FCFS):
        def schedule(self):
            if self.num_steps >= 2:
                plan = SchedulerOutput()
                plan.swap_in.append((0, 0))
                return plan
            return super().schedule()

    for name, cls in (("test_zero_chunk", ZeroChunk), ("test_swap_nothing", SwapNothing)):
        register_policy(name)(cls)
        try:
            reqs = [Request("a", 0.0, 4, 8)]
            scheduler = cls(SchedulerLimits(8, 64, 64), BlockManager(16, 4, 4, 0.0))
            res = replay(reqs, scheduler, FixedCost())
            assert res.failure.startswith(
                f"deadlock: policy '{name}' made no progress at t=0.020000s"
            ), res.failure
            assert len(res.steps["time_s"]) == 2
            assert reqs[0].status.value == "unfinished"
            assert reqs[0].reason == f"{res.failure} (the run stopped at t=0.020s)"
        finally:
            POLICIES.pop(name, None)
    with pytest.raises(AssertionError, match="prefill chunks of no token"):
        s = ZeroChunk(SchedulerLimits(8, 64, 64), BlockManager(16, 4, 4, 0.0))
        s.add(Request("b", 0.0, 4, 8), 0.0)
        plan = s.schedule()
        plan.prefills[next(iter(plan.prefills))] = 0
        s.check_plan(plan)


def test_work_no_event_can_advance_ends_as_a_deadlock():
    """A policy that parks a request (add() says it did not queue it, yet leaves it waiting):
    the loop is never woken, no event is left, and the run ends as a deadlock, not as a
    normal end; the request arriving later is unfinished, before its arrival."""
    from sched_lab.core.scheduler import POLICIES, register_policy
    from sched_lab.policies.fcfs import FCFS

    @register_policy("test_park")
    class Park(FCFS):
        def add(self, request, now_s):
            return False  # neither queued nor rejected: nothing will ever run it

    try:
        reqs = [Request("a", 0.0, 4, 2), Request("b", 0.5, 4, 2)]
        scheduler = Park(SchedulerLimits(8, 64, 64), BlockManager(16, 4, 4, 0.0))
        res = replay(reqs, scheduler, FixedCost())
    finally:
        POLICIES.pop("test_park", None)
    assert res.failure == "deadlock: no event left at t=0.500000s with 2 requests unfinished: a, b"
    a, b = reqs
    assert (a.status.value, b.status.value) == ("unfinished", "unfinished")
    assert a.reason == f"{res.failure} (the run stopped at t=0.500s)"
    assert a.finish_s == 0.5 and b.finish_s == 0.5  # both arrived before the run stopped
    assert len(res.steps["time_s"]) == 0
