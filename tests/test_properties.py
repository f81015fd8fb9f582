"""Property-based tests of the simulator: random traces and limits through every policy.

Hypothesis draws KV limits (block size, GPU and CPU blocks, watermark), scheduler limits
(max_num_seqs, token budget, max_model_len) and a trace (arrival bursts, zero gaps, arrivals
landing exactly on step ends, 1-token outputs, prompts at block-size boundaries and at and
beyond the KV capacity), replays it with the toy executor of tests/helpers.py (every step
takes ``STEP_S``) and ``check_invariants=True`` (``Scheduler.check_plan`` after every
plan), then checks what must hold whatever the policy decides:

* every request ends finished, rejected or aborted, and *which* of the three is fixed by the
  request and the limits alone (derived in ``expected_status``);
* a finished request got exactly ``output_len`` tokens at strictly increasing times, one
  step apart at least, the first one step after its arrival at the earliest;
* at every step: KV blocks used <= total (GPU and CPU), tokens <= budget, running <=
  max_num_seqs, nothing scheduled and preempted at once; all blocks free at the end;
* the engine idles only while nothing is pending (work conservation);
* termination within a bound on the number of steps (derived in ``check_termination``);
* determinism: the same inputs give identical replays, and (``run_experiment.main``)
  byte-identical results files.

Profiles: ``sched-lab-ci`` (default; derandomized, so CI runs the same examples every time)
and ``sched-lab-explore`` (random, 40x the examples), chosen with the environment variable
``SCHED_LAB_HYPOTHESIS_PROFILE``. Set per test through ``settings(parent=...)`` so that no
global hypothesis profile of other test files is changed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import bundled_policy_names
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

import run_experiment
from sched_lab.core.kv import BlockManager, blocks_for
from sched_lab.core.plan import PreemptionMode, SchedulerOutput, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import Scheduler, SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.sim.records import ReplayResult
from sched_lab.sim.replay import replay

# Every step of the toy cost model takes 1/4 s and arrival gaps are multiples of 1/8 s: all
# times are then exact binary fractions, so arrivals that land exactly on a step's end (a
# tie SimPy resolves by event order) really happen, and time comparisons need no tolerance.
STEP_S = 0.25
GAPS_S = (0.0, 0.0, 0.0, 0.125, 0.25, 0.5, 3.0)  # zero gaps three times as likely: bursts
# Scenario size: small enough for ~10 ms per example, large enough for KV pressure.
MAX_GPU_BLOCKS, MAX_NUM_SEQS, MAX_REQUESTS = 24, 6, 14

EXAMPLES = 150  # per policy in the CI profile (1-1.5 s each on the 2-core dev box)
settings.register_profile(
    "sched-lab-ci", max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True
)
settings.register_profile(  # random, 6,000 examples a policy
    "sched-lab-explore", max_examples=40 * EXAMPLES, deadline=None, print_blob=True
)
PROFILE = settings.get_profile(os.environ.get("SCHED_LAB_HYPOTHESIS_PROFILE", "sched-lab-ci"))

POLICIES = bundled_policy_names()


# --------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """Limits and a trace: (arrival_s, prompt_len, output_len) per request, sorted."""

    block_size: int
    gpu_blocks: int
    cpu_blocks: int
    watermark: float
    limits: SchedulerLimits
    requests: tuple[tuple[float, int, int], ...]


@st.composite
def scenarios(draw, chunked: bool) -> Scenario:
    """Valid limits (as lab/run/experiment.py ``resolve_limits`` accepts them) and a trace."""
    bs = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    gpu = draw(st.integers(1, MAX_GPU_BLOCKS))
    cap = gpu * bs  # KV capacity in tokens
    max_len = draw(st.sampled_from([cap, cap + 1, 2 * cap, max(1, cap // 2), 10**6]))
    seqs = draw(st.integers(1, MAX_NUM_SEQS))
    # resolve_limits refuses a budget below max_num_seqs, and without chunked prefill one
    # below max_model_len (a long prompt could never be scheduled).
    low = seqs if chunked else max(seqs, max_len)
    budget = low + draw(st.sampled_from([0, 0, 1, 5, 64]))
    limits = SchedulerLimits(seqs, budget, max_len)

    def at_blocks(k: int, delta: int) -> int:
        return max(1, k * bs + delta)

    k = st.integers(1, gpu + 1)
    prompt = st.one_of(
        st.integers(1, max(1, cap // 3)),  # several fit at once: KV pressure, preemptions
        st.integers(1, max(1, cap // 3)),
        st.integers(1, cap + 2 * bs),
        k.map(lambda k: at_blocks(k, -1)),  # prompt + 1 == k * block_size
        k.map(lambda k: at_blocks(k, 0)),
        k.map(lambda k: at_blocks(k, 1)),
        st.sampled_from([max(1, cap - 1), cap, cap + 1]),  # the capacity boundary
    )
    # 1-token outputs, short ones, and long ones that grow into a full cache.
    long_output = st.integers(bs, cap + bs)
    output = st.one_of(st.just(1), st.integers(1, 3 * bs), long_output, long_output)
    rows = draw(
        st.lists(
            st.tuples(st.sampled_from(GAPS_S), prompt, output), min_size=1, max_size=MAX_REQUESTS
        )
    )
    t, reqs = 0.0, []
    for gap, p, o in rows:
        t += gap
        reqs.append((t, p, o))
    return Scenario(
        bs,
        gpu,
        draw(st.integers(0, 16)),
        draw(st.sampled_from([0.0, 0.01, 0.1, 0.25, 0.5])),
        limits,
        tuple(reqs),
    )


def scenarios_for(policy: str):
    return scenarios(get_policy(policy).chunked_prefill)


# --------------------------------------------------------------------------- replay
@dataclass
class StepRecord:
    """What the executor saw in one plan (taken before the step's results are applied)."""

    tokens: int
    sampled: int  # requests that sample a token in this step
    prefill_tokens_no_sample: int  # prompt tokens fed by chunks that sample nothing


class RecordingExecutor:
    """The toy executor (every step takes STEP_S) that also checks and records each plan.

    Checked at execute time, when the scheduler state is the one the plan was made in:
    limits, blocks used <= total, no request both scheduled and preempted, whole prompts
    for policies without chunked prefill, no empty prefill chunk.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self.steps: list[StepRecord] = []

    def execute(self, plan: SchedulerOutput) -> StepResult:
        s, bm, lim = self.s, self.s.block_manager, self.s.limits
        tokens = plan.features().num_tokens
        assert tokens <= lim.max_num_batched_tokens
        assert len(s.running) <= lim.max_num_seqs
        assert len(plan.prefills) + len(plan.decodes) <= lim.max_num_seqs
        assert 0 <= bm.num_used_gpu_blocks <= bm.num_gpu_blocks
        assert 0 <= bm.num_used_cpu_blocks <= bm.num_cpu_blocks
        scheduled = {r.request_id for r in plan.prefills} | {r.request_id for r in plan.decodes}
        preempted = {r.request_id for r, _ in plan.preempted}
        assert not scheduled & preempted, f"scheduled and preempted: {scheduled & preempted}"
        sampled, silent = len(plan.decodes), 0
        for r, n in plan.prefills.items():
            left = r.num_tokens - r.num_computed_tokens
            assert 1 <= n <= left, f"{r.request_id}: chunk {n} of {left} tokens left"
            assert s.chunked_prefill or n == left, f"{r.request_id}: partial prompt"
            if n == left:
                sampled += 1
            elif not plan.decodes:
                silent += n
        self.steps.append(StepRecord(tokens, sampled, silent))
        return StepResult(STEP_S)


def replay_scenario(
    policy: str, sc: Scenario, fast_forward: bool = True
) -> tuple[ReplayResult, Scheduler, RecordingExecutor]:
    cls = get_policy(policy)
    bm = BlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
    scheduler = cls(sc.limits, bm)
    if not fast_forward:
        scheduler.fast_forward = False  # every plan by the policy's schedule()
    executor = RecordingExecutor(scheduler)
    reqs = [Request(str(i), a, p, o) for i, (a, p, o) in enumerate(sc.requests)]
    result = replay(reqs, scheduler, executor, check_invariants=True)
    return result, scheduler, executor


def expected_status(sc: Scenario, prompt: int, output: int) -> RequestStatus:
    """The end state of a request, decided by the request and the limits alone.

    * Rejected at arrival: prompt + output > max_model_len, or the prompt plus the slot
      of its first sampled token needs more blocks than the GPU has
      (``Scheduler.rejection_reason``).
    * Otherwise it finishes iff its last state fits the GPU: a request holds
      ceil(num_tokens / block_size) blocks after every step (lab/core/scheduler.py), at most
      ceil((prompt + output) / block_size). If that fits, neither abort path can fire:
      "outgrew the KV cache" needs one block more than the whole cache while running
      alone, "needs N KV blocks to resume" needs more blocks than the whole (then empty)
      cache. If it does not fit, the request can never finish, so it must be aborted.
    """
    bs, gpu = sc.block_size, sc.gpu_blocks
    if prompt + output > sc.limits.max_model_len or blocks_for(prompt + 1, bs) > gpu:
        return RequestStatus.REJECTED
    if blocks_for(prompt + output, bs) > gpu:
        return RequestStatus.ABORTED
    return RequestStatus.FINISHED


# --------------------------------------------------------------------------- checks
def check_requests(sc: Scenario, res: ReplayResult) -> None:
    arrivals = {r.request_id: r.arrival_s for r in res.requests}
    for r in res.requests:
        want = expected_status(sc, r.prompt_len, r.output_len)
        assert r.status is want, (
            f"{r.request_id} (p={r.prompt_len}, o={r.output_len}): "
            f"{r.status.value}, expected {want.value} ({r.reason})"
        )
        assert r.block_table == []
        times = res.token_times(r)
        if r.status is RequestStatus.FINISHED:
            assert r.reason == ""
            assert len(times) == r.output_len
            # One token per step at most, and none before the step after arrival ends.
            assert np.all(np.diff(times) >= STEP_S)
            assert times[0] >= arrivals[r.request_id] + STEP_S
            assert times[-1] == r.finish_s
        elif r.status is RequestStatus.REJECTED:
            assert r.reason, f"{r.request_id}: rejected without a reason"
            key = (
                "exceeds max_model_len"
                if r.prompt_len + r.output_len > sc.limits.max_model_len
                else "KV blocks"
            )
            assert key in r.reason, r.reason
            assert len(times) == 0 and r.first_scheduled_s == -1.0 and r.num_preemptions == 0
            assert r.finish_s == r.arrival_s  # rejected on arrival
        else:
            assert r.reason, f"{r.request_id}: aborted without a reason"
            assert len(times) < r.output_len


def check_steps(
    sc: Scenario, res: ReplayResult, scheduler: Scheduler, ex: RecordingExecutor
) -> None:
    s, lim = res.steps, sc.limits
    # The per-step record (steps.csv) says what the plans said.
    assert [rec.tokens for rec in ex.steps] == (
        s["num_prefill_tokens"] + s["num_decode_tokens"]
    ).tolist()
    assert np.all(s["kv_used_blocks"] <= sc.gpu_blocks)
    assert np.all(s["cpu_used_blocks"] <= sc.cpu_blocks)
    assert np.all(s["num_prefill_tokens"] + s["num_decode_tokens"] <= lim.max_num_batched_tokens)
    assert np.all(s["num_running"] <= lim.max_num_seqs)
    assert np.all(s["num_seqs"] <= lim.max_num_seqs)
    assert np.all(s["duration_s"] == STEP_S)
    # Steps never overlap, and the engine idles only when nothing is pending: a step that
    # does not start when the previous one ends starts at an arrival (the engine's wakeup).
    end = res.step_end_s
    assert np.all(s["time_s"][1:] >= end[:-1])
    arrivals = {r.arrival_s for r in res.requests}
    idle_starts = s["time_s"][:1].tolist() + [
        t for t, e in zip(s["time_s"][1:], end[:-1], strict=True) if t > e
    ]
    assert all(t in arrivals for t in idle_starts), "engine idled while work was pending"
    # Nothing left anywhere: every block back in its pool, every queue empty.
    bm = scheduler.block_manager
    assert bm.num_free_gpu_blocks == sc.gpu_blocks and bm.num_free_cpu_blocks == sc.cpu_blocks
    assert not scheduler.has_unfinished() and not scheduler.prefilling
    assert len(scheduler.decode_set) == 0


def check_preemptions(res: ReplayResult, scheduler: Scheduler) -> None:
    s = res.steps
    per_request = [r.num_preemptions for r in res.requests]
    assert s["num_preempted"].sum() == sum(per_request)
    assert max(per_request) <= scheduler.limits.max_preemptions
    if scheduler.preemption_mode is PreemptionMode.RECOMPUTE:
        assert all(r.num_preemptions_swap == 0 for r in res.requests)
        assert s["num_swap_out_blocks"].sum() == 0 and s["num_swap_in_blocks"].sum() == 0
    else:
        # A swapped request is never aborted (only waiting and running ones are), so each
        # comes back with the blocks it left with: blocks out == blocks in over the run.
        assert s["num_swap_out_blocks"].sum() == s["num_swap_in_blocks"].sum()
        assert s["num_swap_out_blocks"].sum() >= sum(r.num_preemptions_swap for r in res.requests)


def check_termination(res: ReplayResult, scheduler: Scheduler, ex: RecordingExecutor) -> None:
    """Bound the number of steps.

    Every plan is non-empty (else SchedulerStuckError), and a swap only ever comes with
    decodes (fcfs/swap run swap-in and swap-out in decode steps), so every step either
    samples a token (a decode, or a prefill that reaches the end of its tokens) or feeds
    >= 1 prompt token of a chunk that samples nothing. Sampled tokens are never lost (a
    recomputed request keeps its output and re-prefills it), so the first kind is at most
    S = sum(tokens received) <= sum(output_len). Chunk tokens of request r are at most
    (prompt_r + output_r - 1) per admission, and r is admitted at most 1 + recompute_r
    times. Hence

        steps <= sum(output_r) + sum((prompt_r + output_r) * (1 + recompute_r)),

    and without chunked prefill (every step samples) steps <= S.
    """
    n = len(res.steps["time_s"])
    received = sum(len(res.token_times(r)) for r in res.requests)
    assert all(rec.sampled >= 1 or rec.prefill_tokens_no_sample >= 1 for rec in ex.steps)
    # What the plans say was sampled is what the requests say they received.
    assert sum(rec.sampled for rec in ex.steps) == received
    assert received <= sum(r.output_len for r in res.requests)
    silent_tokens = sum(rec.prefill_tokens_no_sample for rec in ex.steps)
    assert silent_tokens <= sum(
        (r.prompt_len + r.output_len - 1) * (1 + r.num_preemptions_recompute) for r in res.requests
    )
    bound = sum(
        r.output_len + (r.prompt_len + r.output_len) * (1 + r.num_preemptions_recompute)
        for r in res.requests
    )
    assert n <= bound, f"{n} steps > bound {bound}"
    if not scheduler.chunked_prefill:
        assert silent_tokens == 0 and n <= received


# --------------------------------------------------------------------------- properties
def check_all(policy: str, sc: Scenario) -> ReplayResult:
    res, scheduler, ex = replay_scenario(policy, sc)
    if res.failure:  # stuck, thrashing or a broken invariant: report the input
        pytest.fail(f"{policy} failed on valid input {sc}: {res.failure}")
    check_requests(sc, res)
    check_steps(sc, res, scheduler, ex)
    check_preemptions(res, scheduler)
    check_termination(res, scheduler, ex)
    return res


@pytest.mark.parametrize("policy", POLICIES)
@settings(PROFILE)
@given(data=st.data())
def test_every_policy_on_random_traces(policy, data):
    res = check_all(policy, data.draw(scenarios_for(policy), label="scenario"))
    # Coverage of the interesting cases (shown by pytest --hypothesis-show-statistics).
    for status in RequestStatus:
        if any(r.status is status for r in res.requests):
            event(f"some request {status.value}")
    preemptions = int(res.steps["num_preempted"].sum())
    event("preemptions: " + ("0" if preemptions == 0 else "1-9" if preemptions < 10 else "10+"))
    target(float(preemptions), label="preemptions")  # steer the search towards KV pressure
    if res.steps["num_swap_out_blocks"].sum():
        event("swapped out")


BOUNDARY_CASES = {
    # Block size 4, 4 GPU blocks = 16 tokens. prompt 15 + its sampled slot fill the cache
    # at admission (finishes); prompt 16 needs a 5th block for its sampled token
    # (rejected); 15 + 2 tokens outgrow it (aborted); a burst of three at t=0, then two
    # arriving exactly at the end of the first step.
    "capacity": Scenario(
        4,
        4,
        2,
        0.0,
        SchedulerLimits(2, 64, 64),
        ((0.0, 15, 1), (0.0, 16, 1), (0.0, 15, 2), (0.25, 3, 5), (0.25, 1, 1)),
    ),
    # Block size 1, 3 blocks, watermark floor(0.5 * 3) = 1 block, one sequence at a time,
    # budget 3 = max_model_len: 2 + 1 and 1 + 2 fill the cache exactly, 3 + 1 exceeds
    # max_model_len.
    "one_token_blocks": Scenario(
        1,
        3,
        0,
        0.5,
        SchedulerLimits(1, 3, 3),
        ((0.0, 2, 1), (0.0, 1, 2), (0.0, 3, 1), (0.125, 1, 1)),
    ),
    # Block size 8, 3 blocks: prompts 7, 15, 23 (prompt + 1 == k * 8) under pressure.
    "prompt_plus_one_on_block_boundary": Scenario(
        8,
        3,
        3,
        0.0,
        SchedulerLimits(3, 24, 24),
        ((0.0, 7, 9), (0.0, 15, 1), (0.0, 7, 17), (0.0, 23, 1), (0.5, 7, 8)),
    ),
}


@pytest.mark.parametrize("case", sorted(BOUNDARY_CASES))
@pytest.mark.parametrize("policy", POLICIES)
def test_boundary_cases(policy, case):
    check_all(policy, BOUNDARY_CASES[case])


@pytest.mark.parametrize("policy", POLICIES)
@settings(PROFILE, max_examples=max(10, PROFILE.max_examples // 4))
@given(data=st.data())
def test_replay_is_deterministic(policy, data):
    sc = data.draw(scenarios_for(policy), label="scenario")
    a, _, _ = replay_scenario(policy, sc)
    b, _, _ = replay_scenario(policy, sc)
    for col in a.steps:
        assert np.array_equal(a.steps[col], b.steps[col]), col
    assert np.array_equal(a.tick_steps, b.tick_steps)
    for ra, rb in zip(a.requests, b.requests, strict=True):
        assert (ra.status, ra.reason, ra.num_preemptions) == (
            rb.status,
            rb.reason,
            rb.num_preemptions,
        )
        assert np.array_equal(a.token_times(ra), b.token_times(rb))


FAST_FORWARD = [p for p in POLICIES if get_policy(p).fast_forward]


@pytest.mark.parametrize("policy", FAST_FORWARD)
@settings(PROFILE, max_examples=max(10, PROFILE.max_examples // 4))
@given(data=st.data())
def test_fast_forward_is_step_by_step(policy, data):
    """Plans repeated by Scheduler.repeat_decodes give the replay the policy's own plans give:
    the same steps, token times, statuses, events and wait streaks."""
    sc = data.draw(scenarios_for(policy), label="scenario")
    a, sa, _ = replay_scenario(policy, sc)
    b, sb, _ = replay_scenario(policy, sc, fast_forward=False)
    for col in a.steps:
        assert np.array_equal(a.steps[col], b.steps[col]), col
    assert np.array_equal(a.tick_steps, b.tick_steps)
    for ra, rb in zip(a.requests, b.requests, strict=True):
        assert (ra.status, ra.reason, ra.finish_s, ra.block_table) == (
            rb.status,
            rb.reason,
            rb.finish_s,
            rb.block_table,
        )
        assert np.array_equal(a.token_times(ra), b.token_times(rb))

    def events(res: ReplayResult):
        rows = [(st_, k, r.request_id, x, y) for st_, k, r, x, y in res.events.rows(res.requests)]
        waits = [(w[0], getattr(w[1], "request_id", None), *w[2:]) for w in res.events.waits]
        return rows, waits

    assert events(a) == events(b)


def _priced(f) -> float:
    """STEP_S plus 1/8 s per decode context token modulo 8: steps of a run differ in
    length, and every time stays a multiple of 1/8 s, as arrivals are (they land exactly on
    step ends, the edge of a run)."""
    return STEP_S + f.decode_context_tokens % 8 / 8


class PricedExecutor:
    """Steps priced by ``_priced``; ``many``: with ``step_time`` (the loop runs repeated
    decode steps many at once, ``Scheduler.repeat_decodes_run``), else one at a time."""

    def __init__(self, many: bool) -> None:
        self.step_time = _priced if many else None

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return StepResult(_priced(plan.features()))


@pytest.mark.parametrize("policy", FAST_FORWARD)
@settings(PROFILE, max_examples=max(10, PROFILE.max_examples // 4))
@given(data=st.data())
def test_many_steps_at_once_are_step_by_step(policy, data):
    """Runs of repeated decode steps made at once give the replay made one step at a time
    (and the one the policy plans every step of): the same columns, token times, states,
    block tables, events, wait streaks and progress calls (one every 3 steps)."""
    from unittest import mock

    from sched_lab.sim import replay as replay_mod

    sc = data.draw(scenarios_for(policy), label="scenario")

    def run(many: bool, fast_forward: bool = True):
        bm = BlockManager(sc.gpu_blocks, sc.cpu_blocks, sc.block_size, sc.watermark)
        scheduler = get_policy(policy)(sc.limits, bm)
        scheduler.fast_forward = fast_forward
        reqs = [Request(str(i), a, p, o) for i, (a, p, o) in enumerate(sc.requests)]
        calls: list[tuple[int, float]] = []
        with mock.patch.object(replay_mod, "_PROGRESS_EVERY", 3):
            res = replay(reqs, scheduler, PricedExecutor(many), True, lambda *c: calls.append(c))
        rows = [(s, k, r.request_id, x, y) for s, k, r, x, y in res.events.rows(res.requests)]
        waits = [(w[0], getattr(w[1], "request_id", None), *w[2:]) for w in res.events.waits]
        state = [
            (r.status, r.reason, r.finish_s, r.block_table, r.num_preemptions, r.decode_segments)
            for r in res.requests
        ]
        return res, (rows, waits, state, calls, res.failure)

    a, sa = run(True)
    for b, sb in (run(False), run(False, fast_forward=False)):
        for col in a.steps:
            assert np.array_equal(a.steps[col], b.steps[col]), col
        assert np.array_equal(a.tick_steps, b.tick_steps)
        for ra, rb in zip(a.requests, b.requests, strict=True):
            assert np.array_equal(a.token_times(ra), b.token_times(rb))
        assert sa == sb


# --------------------------------------------------------------------------- livelock guard
class Thrash(Scheduler):
    """A deliberately bad policy (not registered): whenever two requests run, it preempts
    the newer one, and re-admits it as soon as only one runs."""

    name = "test_thrash"

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        if len(self.running) >= 2:
            self.preempt(plan, self.running[-1])
        else:
            self.admit_waiting(plan, self.limits.max_num_batched_tokens)
            if plan.prefills:
                return plan
        self.reserve_decode_blocks(plan)
        return self.add_decodes(plan)


def test_livelock_guard_names_the_thrashing_request():
    # Step 1 (t=0) prefills a and b; from then on every even step (planned at t = 0.25,
    # 0.75, 1.25, 1.75) preempts b and decodes a, every odd one re-prefills b. The 4th
    # preemption exceeds max_preemptions = 3 while planning step 8, at t = 7 * 0.25 = 1.75.
    bm = BlockManager(64, 0, 4, 0.0)
    scheduler = Thrash(SchedulerLimits(4, 1024, 1024, max_preemptions=3), bm)
    reqs = [Request("a", 0.0, 8, 100), Request("b", 0.0, 8, 100)]
    res = replay(reqs, scheduler, RecordingExecutor(scheduler), check_invariants=True)
    msg = res.failure  # the run stops; every request is accounted for
    assert msg.startswith(
        "SchedulerStuckError: policy 'test_thrash' is thrashing: request b was preempted 4 times"
    )
    assert "scheduler.max_preemptions = 3" in msg and "t=1.750000s" in msg
    assert reqs[0].num_preemptions == 0
    assert all(r.status is RequestStatus.UNFINISHED and msg in r.reason for r in res.requests)


def test_livelock_guard_allows_max_preemptions():
    # The same policy with a = 7 output tokens: a gets its tokens from steps 1 (prefill)
    # and 2, 4, ..., 12 (a decode every other step); b is preempted in steps 2, 4, ..., 12
    # (6 times) and re-prefilled in between, then runs alone from step 13. The guard fires
    # only above max_preemptions, so with 6 the run completes.
    scheduler = Thrash(
        SchedulerLimits(4, 1024, 1024, max_preemptions=6), BlockManager(64, 0, 4, 0.0)
    )
    reqs = [Request("a", 0.0, 8, 7), Request("b", 0.0, 8, 20)]
    res = replay(reqs, scheduler, RecordingExecutor(scheduler), check_invariants=True)
    a, b = res.requests
    assert (a.num_preemptions, b.num_preemptions_recompute) == (0, 6)
    assert res.token_times(a).tolist() == [STEP_S * k for k in (1, 2, 4, 6, 8, 10, 12)]
    assert a.status is b.status is RequestStatus.FINISHED
    assert len(res.token_times(b)) == 20


# --------------------------------------------------------------------------- results files
SYNTHETIC_YAML = """\
name: determinism
seed: 7
trace:
  format: synthetic
  num_requests: 150
  arrival: {process: gamma, rate: 40.0, burstiness: 0.25}
  prompt_len: {lognormal: {mean: 600, sigma: 0.8}}
  output_len: {uniform: [1, 300]}
model: qwen3-0.6b
hardware: h100-sxm
kv_cache: {block_size: 16, num_gpu_blocks: 400, swap_space_gib: 0.05}
scheduler: {max_num_seqs: 32}
policies: [fcfs, swap, {name: chunked_prefill, max_num_batched_tokens: 512}]
"""


def test_results_files_are_byte_identical(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text(SYNTHETIC_YAML)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert run_experiment.main([str(exp), "--out", str(out), "--no-progress"]) == 0
    a, b = outs
    for name in ("requests.csv", "steps.csv", "config.yaml", "report.md", "summary.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    sa = json.loads((a / "summary.json").read_text())
    # Only timing.json holds wall-clock seconds.
    assert set(json.loads((a / "timing.json").read_text())) == set(sa)
    # The runs are not trivial: KV pressure makes every policy preempt.
    assert all(s["num_preemptions"] > 0 for s in sa.values())


def test_results_files_same_across_fresh_interpreters(tmp_path):
    """Same check across two processes: no hash-seed or import-order dependence."""
    import subprocess
    import sys

    exp = tmp_path / "exp.yaml"
    exp.write_text(SYNTHETIC_YAML.replace("num_requests: 150", "num_requests: 60"))
    root = Path(run_experiment.__file__).resolve().parent
    for i, seed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [
                sys.executable,
                str(root / "run_experiment.py"),
                str(exp),
                "--out",
                str(tmp_path / f"o{i}"),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
    for name in ("requests.csv", "steps.csv"):
        assert (tmp_path / "o0" / name).read_bytes() == (tmp_path / "o1" / name).read_bytes()
