"""The replay loop: SimPy processes that own time (docs/ARCHITECTURE.md, "The contract").

* ``arrival_process`` hands each trace request to the scheduler at its arrival time
  (``Scheduler.add``: queued, or rejected at once with a reason if it can never run).
* ``engine_process`` loops: ask the policy for a plan (``Scheduler.schedule``), hand it to
  the executor, wait the step's duration, then let the scheduler apply the step's results
  at the new time (``Scheduler.update``). The loop owns time and the per-step records; all
  request state belongs to the scheduler.
* Asynchronous scheduling (``Scheduler.async_scheduling``; semantics in
  lab/core/scheduler.py): plan P0; launch P0; then loop { plan P(N+1) while N is in flight;
  launch it; wait for N; apply N's results }. Step N lasts, start to the next step's start,
  max(device time of N, host time of N+1) in the simulator (the launch handle's ``host_s``,
  0 if absent; device time = duration - host time), and the wall time between consecutive
  waits on a wall-clock executor (the engine).

Idle gaps cost nothing: with no work, the engine waits for the next arrival. Simultaneous
events resolve in SimPy's order (scheduled time, then creation order), so a replay is
deterministic. Per-step records are kept in typed arrays (``array.array``, 8 bytes a value)
and viewed as numpy arrays once.
"""

from __future__ import annotations

import functools
import gc
import math
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from lab.core.errors import ConfigError, SchedulerStuckError
from lab.core.events import EventLog
from lab.core.plan import Executor, SchedulerOutput
from lab.core.request import Request, RequestStatus
from lab.core.scheduler import Scheduler

STEP_COLUMNS = (
    "time_s", "duration_s", "num_prefill_tokens", "num_decode_tokens", "num_seqs",
    "kv_used_blocks", "cpu_used_blocks", "num_waiting", "num_running", "num_swapped",
    "num_preempted", "num_swap_out_blocks", "num_swap_in_blocks", "num_prefills",
    "prefill_context_tokens", "prefill_attention_pairs", "decode_context_tokens",
    "num_cached_tokens", "num_cached_blocks", "kv_cached_blocks", "num_wasted_tokens",
    "num_spec_tokens",
)  # fmt: skip


@dataclass
class ReplayResult:
    """What one replay produced.

    Attributes:
        requests: every trace request in its final state (finished, rejected, aborted).
        steps: per-step columns (``STEP_COLUMNS``), one array each; ``time_s`` is the
            step's start and ``kv_used_blocks`` the GPU blocks held while it runs (a
            block shared by several requests once). Prefix cache: ``num_cached_tokens``
            and ``num_cached_blocks`` found cached by the step's admissions,
            ``kv_cached_blocks`` the GPU blocks holding a key (used or cached free).
            ``num_wasted_tokens``: decode slots of requests already finished (async).
            ``num_spec_tokens``: draft tokens verified by decodes (speculative decoding;
            step tokens = prefill + decode + spec tokens).
        tick_steps: for each decode tick, the index of the step that ran it.
        wall_s: wall-clock seconds the replay took.
        num_gpu_blocks: size of the GPU KV cache, for usage fractions.
        failure: None, or why the run stopped early (see ``replay``).
        prefix_caching: whether the block manager cached prefixes.
        num_evicted_blocks: blocks evicted from the prefix cache.
        events: what the scheduler's shared moves did to each request, and why requests
            waited (:class:`lab.core.events.EventLog`; step indices are rows of ``steps``).
        async_scheduling: whether the scheduler planned asynchronously.
    """

    requests: list[Request]
    steps: dict[str, np.ndarray]
    tick_steps: np.ndarray
    wall_s: float
    num_gpu_blocks: int = 0
    failure: str | None = None
    prefix_caching: bool = False
    num_evicted_blocks: int = 0
    events: EventLog | None = None
    async_scheduling: bool = False

    @functools.cached_property
    def step_end_s(self) -> np.ndarray:
        """End time (seconds) of each step: when its sampled tokens exist."""
        return self.steps["time_s"] + self.steps["duration_s"]

    def token_times(self, r: Request) -> np.ndarray:
        """Times (seconds) at which ``r`` received each of its output tokens."""
        end = self.step_end_s
        parts = [end[np.asarray(r.prefill_token_steps, dtype=np.int64)]]
        parts += [end[self.tick_steps[a:b]] for a, b in r.decode_segments]
        if r.spec_steps:  # accepted drafts: their tokens exist at their step's end too
            parts.append(
                end[np.repeat([s for s, _, _ in r.spec_steps], [a for *_, a in r.spec_steps])]
            )
        return np.sort(np.concatenate(parts))

    def num_token_times(self, r: Request) -> int:
        """``len(self.token_times(r))``, without computing them."""
        n = len(r.prefill_token_steps) + sum(b - a for a, b in r.decode_segments)
        return n + r.num_accepted_tokens if r.spec_steps else n


class _Wakeup:
    """An event the idle engine waits on; arrivals trigger it."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.event = env, env.event()

    def fire(self) -> None:
        if not self.event.triggered:
            self.event.succeed()

    def wait(self) -> simpy.Event:
        if self.event.triggered:
            self.event = self.env.event()
        return self.event


def arrival_process(
    env: simpy.Environment,
    requests: list[Request],
    scheduler: Scheduler,
    wakeup: _Wakeup,
    arrived: list[int],
) -> Iterator[simpy.Event]:
    """Inject ``requests`` (sorted by arrival) into the scheduler at their arrival times."""
    for r in requests:
        if r.arrival_s > env.now:
            yield env.timeout(r.arrival_s - env.now)
        arrived[0] += 1
        if scheduler.add(r, env.now):
            wakeup.fire()


def engine_process(
    env: simpy.Environment,
    scheduler: Scheduler,
    executor: Executor,
    num_requests: int,
    wakeup: _Wakeup,
    arrived: list[int],
    rec: dict[str, array],
    tick_steps: array,
    check_invariants: bool = False,
    progress=None,
    on_step=None,
) -> Iterator[simpy.Event]:
    """Run steps until every request has arrived and none is unfinished.

    ``on_step``: optional callable(plan, now_s) called after each step's ``update`` (the
    cluster simulator hands finished prefills to their decode replica there).
    """
    if scheduler.async_scheduling:
        yield from _async_engine_process(
            env, scheduler, executor, num_requests, wakeup, arrived, rec, tick_steps,
            check_invariants, progress, on_step,
        )  # fmt: skip
        return
    bm = scheduler.block_manager
    columns = [rec[c] for c in STEP_COLUMNS]
    wall_clock = getattr(executor, "wall_clock", False)
    step = 0
    while True:
        if not scheduler.has_unfinished():
            if arrived[0] == num_requests:
                return
            yield wakeup.wait()
            continue
        t_plan = time.perf_counter() if wall_clock else 0.0
        plan = scheduler.schedule()
        if not plan.feeds_tokens:  # no request advances: only an abort is progress
            if not plan.aborted:
                raise SchedulerStuckError(_stuck_message(scheduler, env.now))
            if plan.is_empty:
                continue  # nothing to execute (swaps planned with the abort still run)
        if check_invariants:
            scheduler.check_plan(plan)
        if wall_clock:
            plan_s = time.perf_counter() - t_plan
            result = executor.execute(plan)
            # Rounded to the 9 significant digits that steps.csv keeps: a simulator fed
            # these durations (cost_model.durations_from) then runs the very same clock,
            # so arrivals fall between the same steps to the last bit.
            result.duration_s = float(f"{result.duration_s + plan_s:.9g}")
        else:
            result = executor.execute(plan)
        f = plan.features()
        row = (
            env.now,
            result.duration_s,
            f.num_prefill_tokens,
            f.num_decodes,
            f.num_seqs,
            bm.num_used_gpu_blocks,
            bm.num_used_cpu_blocks,
            len(scheduler.waiting),
            len(scheduler.running),
            len(scheduler.swapped),
            len(plan.preempted),
            len(plan.swap_out),
            len(plan.swap_in),
            f.num_prefills,
            f.prefill_context_tokens,
            f.prefill_attention_pairs,
            f.decode_context_tokens,
            plan.num_cached_tokens,
            plan.num_cached_blocks,
            bm.num_cached_blocks,
            0,
            f.num_spec_tokens,
        )
        if not 0.0 <= result.duration_s < math.inf or math.isinf(env.now + result.duration_s):
            raise ValueError(
                f"step {step}: duration {result.duration_s!r} s leaves the clock "
                f"at t={env.now:.6g}s without a finite end"
            )
        yield env.timeout(result.duration_s)
        for col, value in zip(columns, row):
            col.append(value)
        if plan.decodes:
            tick_steps.append(step)
        scheduler.update(plan, result, env.now)
        if on_step is not None:
            on_step(plan, env.now)
        step += 1
        if progress is not None and step % 4096 == 0:
            progress(arrived[0] - scheduler.num_unfinished, env.now)


_WASTED = STEP_COLUMNS.index("num_wasted_tokens")


def _state_row(scheduler: Scheduler, plan: SchedulerOutput) -> list:
    """A step's record as planned (``STEP_COLUMNS``), its time and duration still 0 and its
    wasted slots counted once it is launched."""
    bm, f = scheduler.block_manager, plan.features()
    return [
        0.0, 0.0, f.num_prefill_tokens, f.num_decodes, f.num_seqs, bm.num_used_gpu_blocks,
        bm.num_used_cpu_blocks, len(scheduler.waiting), len(scheduler.running),
        len(scheduler.swapped), len(plan.preempted), len(plan.swap_out), len(plan.swap_in),
        f.num_prefills, f.prefill_context_tokens, f.prefill_attention_pairs,
        f.decode_context_tokens, plan.num_cached_tokens, plan.num_cached_blocks,
        bm.num_cached_blocks, 0, f.num_spec_tokens,
    ]  # fmt: skip


@dataclass
class _Launched:
    """A step handed to the executor whose results have not been applied."""

    plan: SchedulerOutput
    handle: Any  # the executor's launch handle, or the StepResult of an executor without one
    row: list
    host_s: float  # host seconds inside the step's duration (the handle's ``host_s``)


def _async_engine_process(
    env: simpy.Environment,
    scheduler: Scheduler,
    executor: Executor,
    num_requests: int,
    wakeup: _Wakeup,
    arrived: list[int],
    rec: dict[str, array],
    tick_steps: array,
    check_invariants: bool,
    progress,
    on_step,
) -> Iterator[simpy.Event]:
    """``engine_process`` under asynchronous scheduling (module doc): at most one step is in
    flight while the next is planned. A plan that feeds no token is not launched: the loop
    waits for the step in flight and plans again (with none in flight, or if the plan
    preempted: stuck, as sync)."""
    columns = [rec[c] for c in STEP_COLUMNS]
    launch, wait = getattr(executor, "launch", None), getattr(executor, "wait", None)
    wall_clock = getattr(executor, "wall_clock", False)
    if wall_clock and launch is None:  # it would read placeholder token ids at execute
        raise ConfigError(
            f"scheduler.async_scheduling: {type(executor).__name__} has no launch/wait "
            "(device-fed tokens); run it with async_scheduling: false"
        )
    flight: _Launched | None = None
    t_last = 0.0  # wall clock: when the last wait returned, or the pipeline started
    step = 0
    while True:
        nxt = None
        if scheduler.has_unfinished():
            if flight is None and wall_clock:
                t_last = time.perf_counter()
            plan = scheduler.schedule()
            if not plan.feeds_tokens and not plan.aborted and (flight is None or plan.preempted):
                raise SchedulerStuckError(_stuck_message(scheduler, env.now))
            if check_invariants:
                scheduler.check_plan(plan)
            if plan.feeds_tokens or (plan.aborted and not plan.is_empty):
                row = _state_row(scheduler, plan)
                handle = launch(plan) if launch is not None else executor.execute(plan)
                scheduler.launched(plan)
                row[_WASTED] = plan.num_wasted_tokens
                nxt = _Launched(plan, handle, row, float(getattr(handle, "host_s", 0.0)))
            elif plan.aborted:
                continue  # only aborts: plan again
        if flight is None:
            if nxt is not None:
                flight = nxt  # the pipeline starts: plan the next step while this one runs
                continue
            if arrived[0] == num_requests:
                return
            yield wakeup.wait()
            continue
        result = wait(flight.handle) if launch is not None else flight.handle
        if wall_clock:  # rounded as in the sync loop (cost_model.durations_from)
            t = time.perf_counter()
            result.duration_s, t_last = float(f"{t - t_last:.9g}"), t
        else:
            device_s = result.duration_s - flight.host_s
            result.duration_s = max(device_s, nxt.host_s if nxt is not None else 0.0)
        if not 0.0 <= result.duration_s < math.inf or math.isinf(env.now + result.duration_s):
            raise ValueError(
                f"step {step}: duration {result.duration_s!r} s leaves the clock "
                f"at t={env.now:.6g}s without a finite end"
            )
        flight.row[0], flight.row[1] = env.now, result.duration_s
        yield env.timeout(result.duration_s)
        for col, value in zip(columns, flight.row):
            col.append(value)
        if flight.plan.decodes:
            tick_steps.append(step)
        scheduler.update(flight.plan, result, env.now)
        if on_step is not None:
            on_step(flight.plan, env.now)
        step += 1
        if progress is not None and step % 4096 == 0:
            progress(arrived[0] - scheduler.num_unfinished, env.now)
        flight = nxt


def replay(
    requests: list[Request],
    scheduler: Scheduler,
    executor: Executor,
    check_invariants: bool = False,
    progress=None,
) -> ReplayResult:
    """Replay ``requests`` (mutated in place) through ``scheduler`` and ``executor``.

    Args:
        requests: fresh requests (status WAITING), any order. Trace rows that are not
            replayed (status DROPPED) are a reporting matter (:func:`lab.results.metrics.in_trace_order`)
            and are refused here.
        check_invariants: check blocks and limits after every plan (slow; for tests).
        progress: optional callable(num_ended_requests, sim_time_s), called now and then.

    Returns:
        The result, its requests sorted by arrival. If a step fails (the executor raises, e.g. device out of memory, or the
        policy gets stuck or thrashes: SchedulerStuckError), the replay stops there, every
        request not ended yet is aborted with a reason naming the failure, and
        ``failure`` holds the one-line message; nothing is lost and nothing hangs.
    """
    # Python's cyclic garbage collector would otherwise rescan every object that exists before
    # the replay (the engine's model and libraries, the trace, earlier runs' results) in its
    # full collections, which slows engine steps unevenly (benchmarks/eager_step_drift.py
    # measures it). Frozen, they are skipped. No gc.collect() first: with torch loaded it
    # costs more than it saves on short replays; garbage frozen here is collected after the
    # unfreeze.
    frozen_by_caller = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        return _replay(requests, scheduler, executor, check_invariants, progress)
    finally:
        if not frozen_by_caller:  # a caller's own freeze stays (unfreeze is all or nothing)
            gc.unfreeze()


def _replay(
    requests: list[Request],
    scheduler: Scheduler,
    executor: Executor,
    check_invariants: bool,
    progress,
) -> ReplayResult:
    t0 = time.perf_counter()
    dropped = [r.request_id for r in requests if r.status is RequestStatus.DROPPED]
    if dropped:
        raise ValueError(
            f"replay: requests {', '.join(dropped[:5])} are dropped trace rows "
            "(not replayed; see lab.results.metrics.in_trace_order)"
        )
    requests = sorted(requests, key=lambda r: r.arrival_s)
    env = simpy.Environment()
    wakeup, arrived = _Wakeup(env), [0]
    rec, tick_steps = step_records()
    env.process(arrival_process(env, requests, scheduler, wakeup, arrived))
    env.process(
        engine_process(
            env,
            scheduler,
            executor,
            len(requests),
            wakeup,
            arrived,
            rec,
            tick_steps,
            check_invariants,
            progress,
        )
    )
    failure = run_to_end(env, requests, [scheduler], lambda: arrived[0], check_invariants)
    steps, ticks = step_arrays(rec, tick_steps)
    return ReplayResult(
        requests,
        steps,
        ticks,
        time.perf_counter() - t0,
        scheduler.block_manager.num_gpu_blocks,
        failure,
        scheduler.block_manager.enable_prefix_caching,
        scheduler.block_manager.num_evicted_blocks,
        scheduler.events,
        scheduler.async_scheduling,
    )


_FLOAT_COLUMNS = ("time_s", "duration_s", "prefill_attention_pairs")


def run_to_end(
    env: simpy.Environment,
    requests: list[Request],
    schedulers: list[Scheduler],
    num_arrived: Callable[[], int],
    check_invariants: bool,
) -> str | None:
    """Run ``env`` until no event is left. Returns None, or why the run stopped (the first
    line of the error); then every request not ended yet is ABORTED with a reason: one that
    never arrived (``requests`` sorted by arrival, the first ``num_arrived()`` arrived) has no
    finish time, one in a queue or caught by the failed step finishes now.

    Raises nothing: a failed step, a request left unfinished, or a broken block-manager
    invariant (``check_invariants``) all end the run this way."""
    try:
        env.run()
        lost = [r.request_id for r in requests if r.status not in _ENDED]
        if lost:
            raise SchedulerStuckError(
                f"replay ended with {len(lost)} requests unfinished: {', '.join(lost[:10])}"
            )
        if check_invariants:
            for s in schedulers:
                s.block_manager.check_integrity([])
        return None
    except Exception as e:  # a failed step ends the run, accounted for request by request
        failure = f"{type(e).__name__}: {e}".splitlines()[0]
    unfinished = f"not finished: the run stopped at t={env.now:.3f}s ({failure})"
    for s in schedulers:
        s.abort_unfinished(unfinished, env.now)
    arrived = num_arrived()
    for i, r in enumerate(requests):
        if r.status in _ENDED:
            continue
        r.status = RequestStatus.ABORTED
        if i >= arrived:  # never arrived: no finish time
            r.reason = (
                f"not replayed: the run stopped at t={env.now:.3f}s, before its arrival ({failure})"
            )
        else:  # in a queue, in transfer, or caught by the step that failed
            r.finish_s, r.reason = env.now, unfinished
    return failure


def step_records() -> tuple[dict[str, array], array]:
    """Empty per-step records (one typed array per ``STEP_COLUMNS`` entry, 8 bytes a value
    while the replay runs: a list would hold a Python object each) and decode-tick steps."""
    return {c: array("d" if c in _FLOAT_COLUMNS else "q") for c in STEP_COLUMNS}, array("q")


def step_arrays(
    rec: dict[str, array], tick_steps: array
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The records as numpy views; a step that failed midway (a shorter column) is cut."""
    n = min(len(v) for v in rec.values())
    if any(len(v) != n for v in rec.values()):
        rec = {c: v[:n] for c, v in rec.items()}
        tick_steps = array("q", [t for t in tick_steps if t < n])
    steps = {
        c: np.frombuffer(v, dtype=np.float64 if c in _FLOAT_COLUMNS else np.int64)
        for c, v in rec.items()
    }
    return steps, np.frombuffer(tick_steps, dtype=np.int64)


_ENDED = (RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED)


def _stuck_message(s: Scheduler, now: float) -> str:
    def ids(q) -> str:
        return ", ".join(r.request_id for r in list(q)[:5]) or "-"

    bm = s.block_manager
    return (
        f"policy {s.name!r} made no progress at t={now:.6f}s: waiting [{ids(s.waiting)}], "
        f"running [{ids(s.running)}], swapped [{ids(s.swapped)}]; free GPU blocks "
        f"{bm.num_free_gpu_blocks}/{bm.num_gpu_blocks}, free CPU blocks "
        f"{bm.num_free_cpu_blocks}/{bm.num_cpu_blocks}"
    )
