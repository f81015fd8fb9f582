"""Asynchronous scheduling in the core and the replay loop (docs/ARCHITECTURE.md, "Scheduler
rules"; lab/sim/replay.py): hand-computed timelines with block size 4 and a fixed-cost executor
(every step takes 1 s, host time 0), and the sync invariants of tests/test_properties.py
with async on, plus the exact wasted-slot rule. Ends by length (the default) are foreseen:
no step after them, their slot and blocks free for the next plan; ends by "stop" (EOS, a
stop string) cost one wasted slot and free their blocks a step late.

Timelines are written as the loop runs them: at time t the loop plans step N+1 while step N
(launched at its own planning) runs; N's results are applied at its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from helpers import bundled_policy_names
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import (
    BOUNDARY_CASES,
    PROFILE,
    RecordingExecutor,
    Scenario,
    check_preemptions,
    check_requests,
    check_steps,
    scenarios_for,
)

from sched_lab.core.kv import BlockManager, make_block_manager
from sched_lab.core.plan import SchedulerOutput, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.policies.chunked_prefill import ChunkedPrefill
from sched_lab.sim.records import ReplayResult
from sched_lab.sim.replay import replay

BS = 4  # block size of the timelines


@dataclass
class Handle:
    result: StepResult
    host_s: float  # the loop reads it: host seconds inside the step's 1 s


class LaunchWait:
    """A fake executor with ``launch``/``wait``: every step takes 1 s, host time ``host_s``.

    At launch it records what an engine would read from the plan: the token ids of each
    prefill chunk (all must be known), each decode's position and whether its input token
    is known yet (a placeholder if not). Each sampled token's id is 1000 * request id + its
    position, so a test can tell which step sampled which token.
    """

    wall_clock = False

    def __init__(self, host_s: float = 0.0) -> None:
        self.host_s = host_s
        self.launches: list[dict] = []

    def launch(self, plan: SchedulerOutput):
        prefills = {s.request.request_id: s.token_ids() for s in plan.prefill_seqs()}
        decodes = {}
        sampled = {}
        for s in plan.prefill_seqs():
            if s.sample:
                sampled[s.request] = (
                    1000 * int(s.request.request_id) + s.start_pos + s.num_new_tokens
                )
        for r, pos in zip(plan.decodes, plan.decode_positions()):
            known = len(r.output_token_ids) > pos - r.prompt_len
            decodes[r.request_id] = (pos, known)
            sampled[r] = 1000 * int(r.request_id) + pos + 1
        self.launches.append({"prefills": prefills, "decodes": decodes})
        return Handle(StepResult(1.0, sampled), self.host_s)

    def wait(self, handle: Handle) -> StepResult:
        return handle.result

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return self.wait(self.launch(plan))


def tokens(rid: int, prompt: int) -> list[int]:
    return [10 * rid + i for i in range(prompt)]


def go(
    policy,
    reqs: list[tuple],
    *,
    asynchronous: bool = True,
    gpu: int = 8,
    cpu: int = 8,
    budget: int = 64,
    max_num_seqs: int = 8,
    executor: LaunchWait | None = None,
    finish_reason: str = "length",
) -> tuple[ReplayResult, dict[str, Request], LaunchWait]:
    """Replay (id, arrival_s, prompt, output) rows, prompts with token ids; every request
    ends with ``finish_reason`` ("stop": an end the scheduler cannot foresee)."""
    cls = get_policy(policy) if isinstance(policy, str) else policy
    bm = make_block_manager(gpu, cpu, BS, 0.0, False)
    s = cls(SchedulerLimits(max_num_seqs, budget, 1000), bm, async_scheduling=asynchronous)
    ex = executor or LaunchWait()
    requests = [
        Request(str(i), a, p, o, prompt_token_ids=tokens(i, p), finish_reason=finish_reason)
        for i, a, p, o in reqs
    ]
    res = replay(requests, s, ex, check_invariants=True)
    assert res.failure is None, res.failure
    return res, {r.request_id: r for r in res.requests}, ex


def col(res: ReplayResult, name: str) -> list:
    return res.steps[name].tolist()


# ----------------------------------------------------------------------------- timelines
def test_stop_end_wastes_one_slot_and_frees_a_step_late():
    """A (prompt 3, output 2) at t=0, B (prompt 3, output 1) at t=0.5, 2 GPU blocks, both
    ending by "stop" (EOS: the scheduler cannot foresee it).

    async: t=0 plan P0 (prefill A, 1 block) and P1 (decode A on its placeholder, 2nd
    block; A's last token). t=1: P2 decodes A once more (wasted) and cannot admit B (A
    holds both blocks). t=2: A's results arrive (finished at 2, blocks freed), P3 admits B.
    t=3: P4 is B's wasted slot; B finishes at 4. sync: B is admitted at t=2 and ends at 3.
    """
    rows = [(0, 0.0, 3, 2), (1, 0.5, 3, 1)]
    res, by, ex = go("chunked_prefill", rows, gpu=2, finish_reason="stop")
    assert col(res, "time_s") == [0, 1, 2, 3, 4]
    assert col(res, "num_prefill_tokens") == [3, 0, 0, 3, 0]
    assert col(res, "num_decode_tokens") == [0, 1, 1, 0, 1]
    assert col(res, "num_wasted_tokens") == [0, 0, 1, 0, 1]
    assert col(res, "kv_used_blocks") == [1, 2, 2, 1, 1]  # A's blocks held through step 2
    assert col(res, "num_waiting") == [0, 0, 1, 0, 0]
    a, b = by["0"], by["1"]
    assert (a.finish_s, b.finish_s) == (2.0, 4.0)
    assert res.token_times(a).tolist() == [1.0, 2.0]  # the wasted slot is no token
    assert res.token_times(b).tolist() == [4.0]
    assert a.decode_segments == [(0, 1)] and a.num_output_tokens == 2
    # Token ids: A's last one (sampled in step 1 at position 4) kept, the wasted one dropped.
    assert a.output_token_ids == [3, 4] and b.output_token_ids == [1003]
    assert ex.launches[1]["decodes"] == {"0": (3, False)}  # P1 fed A's placeholder
    assert ex.launches[2]["decodes"] == {"0": (4, False)}  # the wasted slot
    summary_wasted = int(res.steps["num_wasted_tokens"].sum())
    assert summary_wasted == 2 == sum(r.status is RequestStatus.FINISHED for r in res.requests)

    sync, sby, _ = go("chunked_prefill", rows, gpu=2, asynchronous=False)
    assert col(sync, "time_s") == [0, 1, 2] and col(sync, "num_wasted_tokens") == [0, 0, 0]
    assert (sby["0"].finish_s, sby["1"].finish_s) == (2.0, 3.0)


def test_length_end_costs_no_step_and_frees_blocks_at_launch():
    """The same two requests ending by length (foreseen). t=0: P0 prefills A, P1 decodes A's
    last token (2nd block); launching P1 frees A's 2 blocks. t=1: P2 admits B (arrived at
    0.5) into them; launching it ends B too. A finishes at 2 (P1's end), B at 3: the steps
    and finish times of the sync run, no wasted slot."""
    rows = [(0, 0.0, 3, 2), (1, 0.5, 3, 1)]
    res, by, ex = go("chunked_prefill", rows, gpu=2)
    assert col(res, "time_s") == [0, 1, 2]
    assert col(res, "num_prefill_tokens") == [3, 0, 3]
    assert col(res, "num_decode_tokens") == [0, 1, 0]
    assert col(res, "num_wasted_tokens") == [0, 0, 0]
    assert col(res, "kv_used_blocks") == [1, 2, 1]  # P2 planned with A's blocks free
    a, b = by["0"], by["1"]
    assert (a.finish_s, b.finish_s) == (2.0, 3.0)
    assert res.token_times(a).tolist() == [1.0, 2.0] and res.token_times(b).tolist() == [3.0]
    assert a.decode_segments == [(0, 1)] and a.num_output_tokens == 2
    assert a.output_token_ids == [3, 4] and b.output_token_ids == [1003]
    assert ex.launches[1]["decodes"] == {"0": (3, False)}
    assert len(ex.launches) == 3
    sync, sby, _ = go("chunked_prefill", rows, gpu=2, asynchronous=False)
    assert col(sync, "time_s") == col(res, "time_s")
    assert (sby["0"].finish_s, sby["1"].finish_s) == (a.finish_s, b.finish_s)


def test_length_end_of_a_lone_request_costs_no_step():
    """A (prompt 3, output 3) alone, 1 s steps: P0 prefills, P1 and P2 decode, P2 its last
    token; no step follows (3 steps, as sync), A's E2E 3 s as sync. By "stop": P3 is its
    wasted slot (4 steps; E2E still 3 s, the end of the step that sampled the token)."""
    res, by, _ = go("chunked_prefill", [(0, 0.0, 3, 3)])
    sync, sby, _ = go("chunked_prefill", [(0, 0.0, 3, 3)], asynchronous=False)
    stop, tby, _ = go("chunked_prefill", [(0, 0.0, 3, 3)], finish_reason="stop")
    assert len(res.steps["time_s"]) == len(sync.steps["time_s"]) == 3
    assert len(stop.steps["time_s"]) == 4 and col(stop, "num_wasted_tokens") == [0, 0, 0, 1]
    assert by["0"].finish_s == sby["0"].finish_s == tby["0"].finish_s == 3.0


@pytest.mark.parametrize("policy", ["chunked_prefill", "fcfs"])
def test_length_end_frees_its_sequence_slot_for_the_next_plan(policy):
    """max_num_seqs 1: A (prompt 3, output 3) and B (prompt 3, output 1) at t=0, 1 s steps.
    async: P0 (t=0) prefills A, P1 (t=0) and P2 (t=1) decode it; P2 schedules A's last
    token, so launching it frees A's slot and P3 (t=2, the next plan) admits B. Four steps
    as in sync; A's E2E 3 s and B's 4 s as in sync. With "stop" ends P3 is A's wasted slot
    (A still holds the sequence slot): B waits for P4 and wastes P5, B's E2E 5 s."""
    rows = [(0, 0.0, 3, 3), (1, 0.0, 3, 1)]
    res, by, ex = go(policy, rows, max_num_seqs=1)
    assert col(res, "time_s") == [0, 1, 2, 3]
    assert col(res, "num_prefill_tokens") == [3, 0, 0, 3]
    assert col(res, "num_wasted_tokens") == [0, 0, 0, 0]
    assert [e["prefills"] for e in ex.launches][3] == {"1": [10, 11, 12]}
    a, b = by["0"], by["1"]
    assert (a.finish_s, b.finish_s) == (3.0, 4.0)
    assert res.token_times(a).tolist() == [1.0, 2.0, 3.0]
    sync, sby, _ = go(policy, rows, max_num_seqs=1, asynchronous=False)
    assert len(sync.steps["time_s"]) == 4
    assert (sby["0"].finish_s, sby["1"].finish_s) == (3.0, 4.0)
    stop, tby, _ = go(policy, rows, max_num_seqs=1, finish_reason="stop")
    assert col(stop, "num_prefill_tokens") == [3, 0, 0, 0, 3, 0]
    assert col(stop, "num_wasted_tokens") == [0, 0, 0, 1, 0, 1]
    assert (tby["0"].finish_s, tby["1"].finish_s) == (3.0, 5.0)


def test_recompute_preemption_keeps_the_token_in_flight():
    """A (3, 3) and B (3, 2) at t=0, 3 GPU blocks. P0 prefills both (1 block each). P1,
    planned while P0 runs, needs a block for each decode with 1 free: B (the newest) is
    recomputed with its first token still in flight. That token is kept (B's output stays
    1 token; its KV count 3 is what the recompute drops); B's re-prefill (P4, at t=3, once A
    has finished at 3 and freed its 2 blocks) feeds prompt + that token, all known."""
    rows = [(0, 0.0, 3, 3), (1, 0.0, 3, 2)]
    res, by, ex = go("chunked_prefill", rows, gpu=3, finish_reason="stop")
    assert col(res, "time_s") == [0, 1, 2, 3, 4, 5]
    assert col(res, "num_preempted") == [0, 1, 0, 0, 0, 0]
    assert col(res, "num_prefill_tokens") == [6, 0, 0, 0, 4, 0]
    assert col(res, "num_wasted_tokens") == [0, 0, 0, 1, 0, 1]
    a, b = by["0"], by["1"]
    assert res.token_times(a).tolist() == [1.0, 2.0, 3.0] and a.finish_s == 3.0
    assert res.token_times(b).tolist() == [1.0, 5.0] and b.finish_s == 5.0
    assert b.num_preemptions_recompute == 1 and b.num_recomputed_tokens == 3
    assert b.prefill_token_steps == [0, 4]
    assert ex.launches[4]["prefills"] == {"1": [10, 11, 12, 1003]}  # the kept token
    assert b.output_token_ids == [1003, 1004]
    # sync: B is re-admitted as soon as A's blocks free (t=3) and ends at 4.
    _, sby, _ = go("chunked_prefill", rows, gpu=3, asynchronous=False)
    assert sby["1"].finish_s == 4.0 and sby["1"].num_recomputed_tokens == 3
    # Ends by length: launching P2 (A's last token, t=1) frees A's blocks, so P3 (t=2)
    # re-admits B; B ends at 4 as in sync, A at 3.
    res, by, ex = go("chunked_prefill", rows, gpu=3)
    assert col(res, "num_prefill_tokens") == [6, 0, 0, 4]
    assert col(res, "num_wasted_tokens") == [0, 0, 0, 0]
    assert (by["0"].finish_s, by["1"].finish_s) == (3.0, 4.0)
    assert ex.launches[3]["prefills"] == {"1": [10, 11, 12, 1003]}
    assert by["1"].prefill_token_steps == [0, 3] and by["1"].output_token_ids == [1003, 1004]


def test_chunked_prefill_token_is_a_placeholder():
    """A (prompt 6, output 2), budget 4: P0 computes 4 prompt tokens, P1 (planned at t=0)
    the last 2 and samples A's first token; P2 (at t=1) decodes it at position 6 before it
    is known, its last token (an end by length: no step after it). A alone with host time
    0: the same steps and token times as sync."""
    res, by, ex = go("chunked_prefill", [(0, 0.0, 6, 2)], budget=4)
    assert col(res, "num_prefill_tokens") == [4, 2, 0]
    assert col(res, "num_decode_tokens") == [0, 0, 1]
    assert col(res, "num_wasted_tokens") == [0, 0, 0]
    assert ex.launches[1]["prefills"] == {"0": [4, 5]}
    assert ex.launches[2]["decodes"] == {"0": (6, False)}
    a = by["0"]
    assert res.token_times(a).tolist() == [2.0, 3.0] and a.finish_s == 3.0
    assert a.output_token_ids == [6, 7]
    sync, sby, _ = go("chunked_prefill", [(0, 0.0, 6, 2)], budget=4, asynchronous=False)
    assert sync.token_times(sby["0"]).tolist() == [2.0, 3.0] and len(sync.steps["time_s"]) == 3


def test_swap_keeps_the_token_and_feeds_it_after_swap_in():
    """swap policy (fcfs, prefill-first), A (3, 3) and B (3, 2) at t=0, 3 GPU blocks. P1
    (at t=0) swaps B out with its first token in flight; B cannot come back while A holds 2
    blocks (A's wasted slot P3 included); A's blocks free at t=3 and P4 swaps B in and
    decodes the kept token (known by then); B's wasted slot is P5."""
    rows = [(0, 0.0, 3, 3), (1, 0.0, 3, 2)]
    res, by, ex = go("swap", rows, gpu=3, finish_reason="stop")
    assert col(res, "num_prefill_tokens") == [6, 0, 0, 0, 0, 0]
    assert col(res, "num_decode_tokens") == [0, 1, 1, 1, 1, 1]
    assert col(res, "num_swap_out_blocks") == [0, 1, 0, 0, 0, 0]
    assert col(res, "num_swap_in_blocks") == [0, 0, 0, 0, 1, 0]
    assert col(res, "num_wasted_tokens") == [0, 0, 0, 1, 0, 1]
    a, b = by["0"], by["1"]
    assert a.finish_s == 3.0 and b.finish_s == 5.0
    assert res.token_times(b).tolist() == [1.0, 5.0] and b.num_preemptions_swap == 1
    assert ex.launches[4]["decodes"] == {"1": (3, True)}  # the kept token, known now
    assert b.output_token_ids == [1003, 1004]
    _, sby, _ = go("swap", rows, gpu=3, asynchronous=False)
    assert sby["1"].finish_s == 4.0
    # Ends by length: A's blocks free when P2 (its last token) is launched at t=1, so P3
    # (t=2) swaps B in; B ends at 4 as in sync.
    res, by, ex = go("swap", rows, gpu=3)
    assert col(res, "num_swap_in_blocks") == [0, 0, 0, 1]
    assert col(res, "num_wasted_tokens") == [0, 0, 0, 0]
    assert (by["0"].finish_s, by["1"].finish_s) == (3.0, 4.0)
    assert ex.launches[3]["decodes"] == {"1": (3, True)}


def test_arrivals_are_planned_one_step_later():
    """Host time 0, so each step takes as long as in sync, but B (arriving at 0.5, while
    step 0 runs) is first planned at t=1 for step 2 (step 1 was planned at t=0): its token
    comes at 3, not 2. A alone keeps its sync token times."""
    rows = [(0, 0.0, 3, 4), (1, 0.5, 3, 1)]
    res, by, _ = go("chunked_prefill", rows)
    sync, sby, _ = go("chunked_prefill", rows, asynchronous=False)
    assert col(res, "num_prefill_tokens") == [3, 0, 3, 0]
    assert col(sync, "num_prefill_tokens") == [3, 3, 0, 0]
    assert res.token_times(by["1"]).tolist() == [3.0]
    assert sync.token_times(sby["1"]).tolist() == [2.0]
    assert res.token_times(by["0"]).tolist() == sync.token_times(sby["0"]).tolist()
    assert np.all(res.steps["duration_s"] == 1.0)


def test_step_lasts_the_longer_of_device_and_next_host_time():
    """Host 0.4 s of each 1 s step: device 0.6 s, so a step followed by another lasts
    max(0.6, 0.4) = 0.6 s, and the last one (nothing planned after it) 0.6 s as well. With
    "stop" ends a third step (the wasted slot) follows."""
    res, by, _ = go("chunked_prefill", [(0, 0.0, 3, 2)], executor=LaunchWait(host_s=0.4))
    assert res.steps["duration_s"].tolist() == pytest.approx([0.6, 0.6])
    res, by, _ = go(
        "chunked_prefill", [(0, 0.0, 3, 2)], executor=LaunchWait(host_s=0.4), finish_reason="stop"
    )
    assert res.steps["duration_s"].tolist() == pytest.approx([0.6, 0.6, 0.6])
    res, by, _ = go("chunked_prefill", [(0, 0.0, 3, 2)], executor=LaunchWait(host_s=0.7))
    # device 0.3 s, host of the next step 0.7 s: host-bound; the last step only its device.
    assert res.steps["duration_s"].tolist() == pytest.approx([0.7, 0.3])


class PreemptThenAdmit(ChunkedPrefill):
    """Test policy: at its second plan it recomputes the newest running request, then tries
    admission in the same plan (no built-in policy admits after preempting)."""

    done = False

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        if self.num_steps == 1 and not self.done and self.running:
            self.done = True
            self.preempt(plan, self.running[-1], "test")
        self.reserve_decode_blocks(plan)
        self.admit_waiting(plan, self.limits.max_num_batched_tokens - len(self.decode_set))
        return self.add_decodes(plan)


def test_recompute_victim_waits_while_its_token_is_in_flight():
    """P1 (planned at t=0, P0 in flight) recomputes B and may not re-admit it: its first
    token is not known (wait reason token_in_flight). P2 (t=1) re-prefills prompt + token;
    A's last token and B's are sampled in P2 (ends by length: no step after it)."""
    res, by, ex = go(PreemptThenAdmit, [(0, 0.0, 3, 3), (1, 0.0, 3, 2)])
    waits = [(w[0], w[1].request_id, w[2]) for w in res.events.waits if w[1] is not None]
    assert ("token_in_flight", "1", 1) in waits
    assert col(res, "num_prefill_tokens") == [6, 0, 4]
    assert col(res, "num_wasted_tokens") == [0, 0, 0]
    assert ex.launches[2]["prefills"] == {"1": [10, 11, 12, 1003]}
    assert by["0"].finish_s == by["1"].finish_s == 3.0


class SkipSecondPlan(ChunkedPrefill):
    """Test policy: its second plan is empty, once."""

    skipped = False

    def schedule(self) -> SchedulerOutput:
        if self.num_steps == 1 and not self.skipped:
            self.skipped = True
            return SchedulerOutput()
        return super().schedule()


def test_an_empty_plan_waits_for_the_step_in_flight():
    """An empty plan made while P0 runs is not launched (nor an error): the loop applies
    P0 and plans again at t=1; that decode feeds a token already known."""
    res, by, ex = go(SkipSecondPlan, [(1, 0.0, 3, 2)])
    assert col(res, "time_s") == [0, 1]
    assert col(res, "num_decode_tokens") == [0, 1]
    assert col(res, "num_wasted_tokens") == [0, 0]
    assert ex.launches[1]["decodes"] == {"1": (3, True)}
    assert by["1"].finish_s == 2.0 and by["1"].output_token_ids == [1003, 1004]


# ----------------------------------------------------------------------------- properties
def replay_async(
    policy: str, sc: Scenario, finish_reason: str
) -> tuple[ReplayResult, object, RecordingExecutor]:
    cls = get_policy(policy)
    bm = BlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
    scheduler = cls(sc.limits, bm, async_scheduling=True)
    ex = RecordingExecutor(scheduler)
    reqs = [
        Request(str(i), a, p, o, finish_reason=finish_reason)
        for i, (a, p, o) in enumerate(sc.requests)
    ]
    return replay(reqs, scheduler, ex, check_invariants=True), scheduler, ex


def last_token_step(res: ReplayResult, r: Request) -> int:
    steps = list(r.prefill_token_steps) + [int(res.tick_steps[b - 1]) for _, b in r.decode_segments]
    return max(steps)


def check_async(policy: str, sc: Scenario, finish_reason: str) -> None:
    res, scheduler, ex = replay_async(policy, sc, finish_reason)
    if res.failure:
        pytest.fail(f"{policy} (async) failed on valid input {sc}: {res.failure}")
    check_requests(sc, res)  # statuses as in sync; token counts and times
    check_steps(sc, res, scheduler, ex)
    check_preemptions(res, scheduler)
    wasted = res.steps["num_wasted_tokens"]
    finished = [r for r in res.requests if r.status is RequestStatus.FINISHED]
    # The exact rule: an end by length wastes nothing; a stop end wastes one slot iff the
    # step after its last token runs decodes; decode-first policies always do, so there
    # wasted == finished.
    decodes = res.steps["num_decode_tokens"]
    n = len(decodes)
    after = [last_token_step(res, r) + 1 for r in finished]
    if finish_reason == "length":
        assert int(wasted.sum()) == 0
    else:
        assert int(wasted.sum()) == sum(s < n and decodes[s] > 0 for s in after)
    if finish_reason == "stop" and get_policy(policy).chunked_prefill:
        assert int(wasted.sum()) == len(finished)
    assert np.all(wasted <= res.steps["num_decode_tokens"])
    # Every sampled slot is a received token or a wasted one.
    received = sum(res.num_token_times(r) for r in res.requests)
    assert sum(rec.sampled for rec in ex.steps) == received + int(wasted.sum())


@pytest.mark.parametrize("finish_reason", ["length", "stop"])
@pytest.mark.parametrize("policy", bundled_policy_names())
@settings(PROFILE, max_examples=max(10, PROFILE.max_examples // 4))
@given(data=st.data())
def test_async_invariants_on_random_traces(policy, finish_reason, data):
    check_async(policy, data.draw(scenarios_for(policy), label="scenario"), finish_reason)


@pytest.mark.parametrize("finish_reason", ["length", "stop"])
@pytest.mark.parametrize("case", sorted(BOUNDARY_CASES))
@pytest.mark.parametrize("policy", bundled_policy_names())
def test_async_boundary_cases(policy, case, finish_reason):
    check_async(policy, BOUNDARY_CASES[case], finish_reason)


def test_sync_scheduler_wastes_nothing():
    res, _, _ = go("chunked_prefill", [(0, 0.0, 3, 2), (1, 0.0, 5, 3)], asynchronous=False)
    assert int(res.steps["num_wasted_tokens"].sum()) == 0 and res.async_scheduling is False
    res, _, _ = go("chunked_prefill", [(0, 0.0, 3, 2), (1, 0.0, 5, 3)])
    assert int(res.steps["num_wasted_tokens"].sum()) == 0 and res.async_scheduling is True
    res, _, _ = go("chunked_prefill", [(0, 0.0, 3, 2), (1, 0.0, 5, 3)], finish_reason="stop")
    assert int(res.steps["num_wasted_tokens"].sum()) == 2


# ----------------------------------------------------------------------------- config, run
SYNTHETIC = (
    "{format: synthetic, num_requests: 6, arrival: {process: poisson, rate: 2}, "
    "prompt_len: 8, output_len: 3}"
)


def test_config_key_and_per_policy_override():
    from sched_lab.config import validate

    cfg = validate(
        {
            "trace": {"format": "azure2023"},
            "scheduler": {"async_scheduling": True},
            "policies": ["fcfs", {"name": "swap", "async_scheduling": False}],
        },
        "x.yaml",
    )
    assert cfg.scheduler.async_scheduling is True
    assert dict(cfg.policies[1].options) == {"async_scheduling": False}
    assert (
        validate({"trace": {"format": "azure2023"}}, "x.yaml").scheduler.async_scheduling is False
    )


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"scheduler": {"async_scheduling": "yes"}}, r"^x.yaml: scheduler.async_scheduling: "),
        (
            {"policies": [{"name": "fcfs", "async_scheduling": 1}]},
            r"^x.yaml: policies\[0\].async_scheduling: ",
        ),
        (
            {
                "scheduler": {"async_scheduling": True},
                "cluster": {"replicas": 2, "router": "round_robin"},
            },
            r"^x.yaml: scheduler.async_scheduling: the cluster simulator runs synchronous",
        ),
        (  # set in a policy entry: that key is named
            {
                "policies": ["fcfs", {"name": "swap", "async_scheduling": True}],
                "cluster": {"replicas": 2, "router": "round_robin"},
            },
            r"^x.yaml: policies\[1\].async_scheduling: the cluster simulator runs synchronous "
            r"replicas only; remove cluster: or set async_scheduling: false$",
        ),
    ],
)
def test_bad_config_is_one_line(raw, message):
    from sched_lab.config import validate
    from sched_lab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as e:
        validate({"trace": {"format": "azure2023"}, **raw}, "x.yaml")
    assert "\n" not in str(e.value)


def test_run_summary_counts_wasted_tokens(tmp_path):
    from sched_lab.config import validate
    from sched_lab.run.experiment import run_experiment

    raw = {
        "trace": parse_flow(SYNTHETIC),
        "kv_cache": {"num_gpu_blocks": 64},
        "scheduler": {"max_num_seqs": 4},
        "policies": [
            {"name": "chunked_prefill", "label": "async", "async_scheduling": True},
            {"name": "chunked_prefill", "label": "sync"},
        ],
    }
    cfg = validate(raw, str(tmp_path / "x.yaml"))
    runs = run_experiment(cfg, progress=False)
    by = {r.summary["policy"]: r.summary for r in runs}
    assert by["async"]["async_scheduling"] is True and by["sync"]["async_scheduling"] is False
    # A trace's output lengths are ends by length: foreseen, no slot wasted.
    assert by["async"]["num_wasted_tokens"] == 0 and by["async"]["completed"] == 6
    assert by["sync"]["num_wasted_tokens"] == 0
    from sched_lab.report.markdown import report_markdown as _markdown

    text = _markdown(cfg, runs, [])
    assert "Wasted decode slots (async scheduling): async 0." in text


def parse_flow(text: str):
    from sched_lab.traces.readers import parse_yaml

    return parse_yaml(f"a: {text}")["a"]


class WallClock(LaunchWait):
    """A wall-clock executor: ``wait`` sleeps 20 ms."""

    wall_clock = True

    def wait(self, handle: Handle) -> StepResult:
        import time

        time.sleep(0.02)
        return handle.result


def test_wall_clock_steps_last_from_wait_to_wait():
    res, by, _ = go("chunked_prefill", [(0, 0.0, 3, 2)], executor=WallClock())
    d = res.steps["duration_s"]
    assert len(d) == 2 and np.all(d >= 0.02) and np.all(d < 1.0)  # not the handle's 1 s


def test_wall_clock_executor_without_launch_is_refused():
    class Sync:
        wall_clock = True

        def execute(self, plan):
            return StepResult(0.01)

    bm = make_block_manager(8, 0, BS, 0.0, False)
    s = get_policy("fcfs")(SchedulerLimits(8, 64, 1000), bm, async_scheduling=True)
    res = replay([Request("0", 0.0, 3, 2)], s, Sync())
    assert res.failure.startswith("ConfigError: scheduler.async_scheduling: Sync has no launch")
    assert res.requests[0].status is RequestStatus.UNFINISHED


@pytest.mark.parametrize("finish_reason", ["length", "stop"])
@pytest.mark.parametrize("policy", bundled_policy_names())
def test_prefix_caching_with_token_ids(policy, finish_reason):
    """Shared prompts with token ids (the engine's keys) under KV pressure: invariants
    hold (check_plan, check_integrity), every request ends as in sync, and (stop ends) each
    finished request wastes one slot unless the step after its last token runs no decode;
    ends by length waste none."""
    import random

    for seed in range(8):
        rnd = random.Random(seed)
        rows = []
        t = 0.0
        for i in range(8):
            t += rnd.choice([0.0, 0.0, 0.5, 1.0])
            p = rnd.randint(1, 14)
            rows.append((i, t, p, rnd.randint(1, 9)))
        gpu, out = rnd.randint(5, 12), {}
        for asynchronous in (True, False):
            bm = make_block_manager(gpu, 8, BS, 0.0, True)
            s = get_policy(policy)(SchedulerLimits(4, 64, 1000), bm, async_scheduling=asynchronous)
            reqs = [
                Request(str(i), a, p, o, prompt_token_ids=[7] * p, finish_reason=finish_reason)
                for i, a, p, o in rows
            ]
            res = replay(reqs, s, LaunchWait(), check_invariants=True)
            assert res.failure is None, res.failure
            out[asynchronous] = res
        statuses = [[r.status for r in out[k].requests] for k in (True, False)]
        assert statuses[0] == statuses[1]
        res = out[True]
        decodes, n = res.steps["num_decode_tokens"], len(res.steps["time_s"])
        fin = [r for r in res.requests if r.status is RequestStatus.FINISHED]
        after = [last_token_step(res, r) + 1 for r in fin]
        expected = sum(s < n and decodes[s] > 0 for s in after) if finish_reason == "stop" else 0
        assert res.steps["num_wasted_tokens"].sum() == expected
        assert res.steps["num_cached_tokens"].sum() > 0 or len(fin) < 2


def test_decode_set_keeps_a_done_member_once():
    """A member that left and rejoined at the same tick has two live heap entries for the
    same last tick; ``advance(keep_done=True)`` reports it once and keeps it; ``remove``
    with the end tick writes back its state as of its last token."""
    from sched_lab.core.decode_set import DecodeSet

    ds = DecodeSet(BS)
    r = Request("0", 0.0, 3, 4)
    r.num_output_tokens = 1
    ds.add(r)
    ds.remove(r)  # e.g. swapped out in the plan it joined, then swapped back in
    ds.add(r)
    got = [ds.advance(keep_done=True) for _ in range(4)]
    assert got == [[], [], [r], []] and r in ds
    ds.remove(r, r.join_tick + r.output_len - r.join_num_output)
    assert r.num_output_tokens == 4 and r.decode_segments == [(0, 3)]
    assert r.num_computed_tokens == 6 and ds.context_tokens == 0


def test_cluster_with_async_overridden_off_by_every_policy_runs_sync():
    """scheduler.async_scheduling: true that every policy entry turns off runs nothing
    asynchronously, so the cluster takes it."""
    from sched_lab.config import validate

    cfg = validate(
        {
            "trace": {"format": "azure2023"},
            "scheduler": {"async_scheduling": True},
            "policies": [{"name": "fcfs", "async_scheduling": False}],
            "cluster": {"replicas": 2, "router": "round_robin"},
        },
        "x.yaml",
    )
    assert cfg.cluster is not None and dict(cfg.policies[0].options) == {"async_scheduling": False}


def test_bad_finish_reason_is_one_line():
    with pytest.raises(
        ValueError, match=r"^request x: finish_reason: expected one of length, stop, got 'eos'$"
    ):
        Request("x", 0.0, 3, 2, finish_reason="eos")
