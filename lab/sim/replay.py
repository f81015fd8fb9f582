"""The replay loop: SimPy processes that own time (docs/ARCHITECTURE.md, "The contract").

:class:`ReplayLoop` holds one serving instance (a scheduler and its executor) in a SimPy
environment, with two processes as methods:

* ``arrivals`` hands each trace request to the scheduler at its arrival time (``add``:
  queued, or rejected at once with a reason if it can never run).
* ``run`` loops: ask the policy for a plan (``Scheduler.schedule``), hand it to the
  executor, wait the step's duration, then let the scheduler apply the step's results at
  the new time (``Scheduler.update``). The loop owns time and the per-step records
  (:class:`sched_lab.sim.records.StepRecorder`); all request state belongs to the scheduler.
* Asynchronous scheduling (``Scheduler.async_scheduling``; rules in docs/ARCHITECTURE.md,
  "Scheduler rules"): plan P0; launch P0; then loop { plan P(N+1) while N is in flight;
  launch it; wait for N; apply N's results }. Step N lasts, start to the next step's start,
  max(device time of N, host time of N+1) in the simulator (the launch handle's ``host_s``,
  0 if absent; device time = duration - host time), and the wall time between consecutive
  waits on a wall-clock executor (the engine).

Idle gaps cost nothing: with no work, the loop waits for the next ``add``; the run ends when
no event is left. Equal times: a plan made at time t sees every request that arrives at t
(arrivals are SimPy's urgent events, :func:`arrival_timeout`, processed before a step that
ends at t), so the order never depends on when unrelated events were created. Work left when
no event is left, or a plan that cannot advance anything, ends the run as a deadlock: every
request not ended yet gets status ``unfinished`` with a reason starting ``deadlock:``.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import simpy

from sched_lab.core.errors import ConfigError, DeadlockError
from sched_lab.core.plan import Executor, SchedulerOutput, StepFeatures, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import Scheduler
from sched_lab.sim.records import (
    ENDED,
    LORA_COLUMNS,
    STEP_COLUMNS,
    ReplayResult,
    StepRecorder,
)

_WASTED = STEP_COLUMNS.index("num_wasted_tokens")
DEADLOCK = "deadlock"  # the reason prefix of requests a run could not advance
_PROGRESS_EVERY = 4096  # steps between progress calls


class SimEnvironment(simpy.Environment):
    """A SimPy environment whose clock a process may move forward without an event.

    A step that ends before every scheduled event would be the next event processed: its
    process would resume at once, with nothing else run in between. :meth:`advance_to` skips
    that event (its creation, heap push and pop, and the generator switch) and gives the same
    clock, to the last bit (``now + duration``, as ``timeout`` computes it). Relies on SimPy 4's
    ``_now`` (pinned ``simpy>=4.1,<5``).
    """

    def advance_to(self, t: float) -> bool:
        """Set the clock to ``t`` and return True if no event is scheduled at or before
        ``t`` (then nothing could happen in between); else change nothing and return False."""
        if self._queue and self._queue[0][0] <= t:
            return False
        self._now = t
        return True


def arrival_timeout(env: simpy.Environment, delay_s: float) -> simpy.Event:
    """A timeout of ``delay_s`` that SimPy processes before the ordinary events of the same
    time (URGENT priority): a step ending then is applied after the arrival, and its next
    plan sees the arriving request."""
    event = simpy.Event(env)
    event._ok, event._value = True, None  # triggered, as simpy.Timeout does it
    env.schedule(event, simpy.events.URGENT, delay_s)
    return event


@dataclass
class _Launched:
    """A step handed to the executor whose results have not been applied (async)."""

    plan: SchedulerOutput
    handle: Any  # the executor's launch handle, or the StepResult of an executor without one
    row: list
    host_s: float  # host seconds inside the step's duration (the handle's ``host_s``)


class ReplayLoop:
    """One serving instance stepped in ``env``: its scheduler, executor and step records.

    Args:
        check_invariants: check every plan's blocks and limits (slow; for tests).
        progress: optional callable(num_ended_requests, sim_time_s), called now and then.
        on_step: optional callable(plan, now_s), called after each step's ``update`` (the
            cluster hands a prefill replica's finished prefills on there).
    """

    def __init__(
        self,
        env: simpy.Environment,
        scheduler: Scheduler,
        executor: Executor,
        check_invariants: bool = False,
        progress: Callable[[int, float], None] | None = None,
        on_step: Callable[[SchedulerOutput, float], None] | None = None,
    ) -> None:
        self.env, self.scheduler, self.executor = env, scheduler, executor
        self.check_invariants, self.progress, self.on_step = check_invariants, progress, on_step
        self._lora = scheduler.lora is not None
        self.recorder = StepRecorder(LORA_COLUMNS if self._lora else ())
        self.num_added = 0  # requests handed to add() so far
        self._wakeup = env.event()  # the idle loop waits on it; add() triggers it
        # Moves the clock past a step with no event when nothing else is due (SimEnvironment).
        self._advance_to = getattr(env, "advance_to", lambda t: False)
        # Prices a fast-forward run's steps by their context alone (Scheduler.repeat_decodes_run).
        self._decode_time = getattr(executor, "decode_step_time", None)
        # see _fast_forward: a pending step's duration and its record (made at its end)
        self._pending_step: tuple[float, Callable[[], None]] | None = None

    def add(self, r: Request) -> None:
        """Hand ``r`` to the scheduler now; wake the loop if ``r`` was queued."""
        self.num_added += 1
        if self.scheduler.add(r, self.env.now):
            self.wake()

    def arrivals(self, requests: list[Request]) -> Iterator[simpy.Event]:
        """Process: ``add`` each of ``requests`` (sorted by arrival) at its arrival time."""
        env = self.env
        for r in requests:
            if r.arrival_s > env.now:
                yield arrival_timeout(env, r.arrival_s - env.now)
            self.add(r)

    def run(self) -> Iterator[simpy.Event]:
        """Process: run steps while a request is unfinished, wait for ``add`` when idle.
        Never returns (the run ends when no event is left); raises what a step raises."""
        if self.scheduler.async_scheduling:
            return self._run_async()
        return self._run_sync()

    def _run_sync(self) -> Iterator[simpy.Event]:
        scheduler, executor = self.scheduler, self.executor
        wall_clock = getattr(executor, "wall_clock", False)
        plan_step, row_of, step = self._plan, self._row, self._step
        bm = scheduler.block_manager
        # Fast-forward (Scheduler.repeat_decodes): simulator, synchronous, no drafts, no hooks.
        fast = (
            scheduler.fast_forward
            and not wall_clock
            and scheduler.speculative is None
            and self.on_step is None
            and scheduler.on_finish is None
        )
        # Many steps at once (Scheduler.repeat_decodes_run): also a step time that depends on
        # the features alone, and a clock that moves without events.
        step_time = getattr(executor, "step_time", None) if fast else None
        many = step_time is not None and isinstance(self.env, SimEnvironment)
        repeat = row = None  # the latest plan and its record, when the next may repeat it
        ran = False  # ``repeat`` ended a run: the next step cannot start another
        while True:
            if not scheduler.has_unfinished():
                repeat = None
                yield self._idle()
                continue
            t_plan = time.perf_counter() if wall_clock else 0.0
            repeated = None  # a repeated plan's columns that differ from ``row``
            plan = None
            if repeat is not None:
                if many and not ran and self._fast_forward(repeat, row, step_time):
                    if self._pending_step is not None:  # its last step waits for another event
                        added = self.num_added
                        yield from self._pending(repeat)
                        if self.num_added != added or not _repeatable(repeat):
                            repeat = None
                        continue
                    if repeat.finished:
                        repeat = None
                        continue  # the run's last step finished a request: the policy plans
                    ran = True
                    continue
                ran = False
                plan = scheduler.repeat_decodes(repeat)
            if plan is not None:  # the record differs from ``row`` in its blocks and context
                repeated = (
                    bm.num_used_gpu_blocks,
                    plan.decode_context_tokens,
                    bm.num_cached_blocks,
                )
                if self.check_invariants:
                    scheduler.check_plan(plan)
            else:
                repeat = None
                plan, runs = plan_step(False)
                if not runs:
                    if not plan.aborted:  # blocks held for another replica: wait for a release
                        yield self._idle()
                    continue  # only aborts: plan again
                row = row_of(plan)
                if many and _repeatable(plan) and self._fast_forward(plan, row, step_time, True):
                    if self._pending_step is not None:  # its last step waits for another event
                        added = self.num_added
                        yield from self._pending(plan)
                        if self.num_added == added and _repeatable(plan):
                            repeat = plan
                    elif not plan.finished:  # the run began with this plan
                        repeat, ran = plan, True
                    continue
            if wall_clock:
                plan_s = time.perf_counter() - t_plan
                result = executor.execute(plan)
                # Rounded to the 9 significant digits that steps.csv keeps: a simulator fed
                # these durations (cost_model.durations_from) then runs the very same clock,
                # so arrivals fall between the same steps to the last bit.
                result.duration_s = float(f"{result.duration_s + plan_s:.9g}")
            else:
                result = executor.execute(plan)
            added = self.num_added
            yield from step(plan, result, row, repeated)
            repeat = plan if fast and self.num_added == added and _repeatable(plan) else None

    def _fast_forward(
        self,
        plan: SchedulerOutput,
        row: list,
        step_time: Callable[[StepFeatures], float],
        planned: bool = False,
    ) -> bool:
        """Run at once the repeats of ``plan`` (recorded as ``row``) that end before any
        other event (:meth:`Scheduler.repeat_decodes_run`): records, clock and progress
        calls as step by step. ``planned``: ``plan`` is a decode-only plan just made, not
        run, its ``row`` not recorded: the run starts with its step. Returns whether any
        step ran or was planned; the step that ends at or after the next event, if planned
        as the run's last (``RepeatRun.pending``), has its duration and record left in
        ``_pending_step``: the caller runs :meth:`_pending` next, which
        records it at its end, as :meth:`_step` does (a run another process stops meanwhile
        keeps no record of it)."""
        env, scheduler, recorder = self.env, self.scheduler, self.recorder
        first = recorder.num_steps
        queue = env._queue  # (a SimEnvironment: peek() and advance_to() inlined)
        run = scheduler.repeat_decodes_run(
            plan, step_time, env._now, queue[0][0] if queue else math.inf,
            self.check_invariants, self._decode_time, planned, True,
        )  # fmt: skip
        if run is None:
            return False
        start, duration, used, context, cached, pending = run
        if start:
            if not planned:
                recorder.append_repeats(row, start, duration, used, context, cached)
            else:
                row[0], row[1] = start[0], duration[0]
                recorder.append(row, plan.decodes)
                if len(start) > 1:
                    recorder.append_repeats(
                        row, start[1:], duration[1:], used[1:], context[1:], cached[1:]
                    )
        if pending is not None:
            if planned and not start:  # the policy's plan itself

                def record() -> None:
                    row[0], row[1] = pending[0], pending[1]
                    recorder.append(row, plan.decodes)

            else:
                record = partial(recorder.append_repeat, row, *pending)
            self._pending_step = pending[1], record
            if not start:
                return True
        end_s = scheduler.now_s
        if queue and queue[0][0] <= end_s:
            raise RuntimeError(f"fast-forward: a step ends at t={end_s!r}s, after another event")
        env._now = end_s
        if self.progress is not None:  # after each 4096th step, at its end
            k = len(start)
            ended = self.num_added - scheduler.num_unfinished  # after the last step
            for i in range((-first - 1) % _PROGRESS_EVERY, k, _PROGRESS_EVERY):
                if i + 1 < k:  # before the last step's finishes
                    self.progress(ended - len(plan.finished), run.start_s[i + 1])
                else:
                    self.progress(ended, end_s)
        return True

    def _pending(self, plan: SchedulerOutput) -> Iterator[simpy.Event]:
        """Wait for the step a fast-forward run left pending (``plan``, lasting
        ``_pending_step``'s duration: it ends at or after another event), then record it and
        apply it as :meth:`_step` does."""
        (duration_s, record), self._pending_step = self._pending_step, None
        yield self.env.timeout(duration_s)
        record()
        now = self.env.now
        self.scheduler.update(plan, StepResult(duration_s), now)
        if self.progress is not None and self.recorder.num_steps % _PROGRESS_EVERY == 0:
            self.progress(self.num_added - self.scheduler.num_unfinished, now)

    def _run_async(self) -> Iterator[simpy.Event]:
        """At most one step is in flight while the next is planned. A plan that feeds no
        token is not launched (unless it has swaps to run): the loop waits for the step in
        flight and plans again (with none in flight, or if the plan preempted and no request
        waits on the step in flight: stuck, as sync)."""
        scheduler, executor = self.scheduler, self.executor
        launch, wait = getattr(executor, "launch", None), getattr(executor, "wait", None)
        wall_clock = getattr(executor, "wall_clock", False)
        if wall_clock and launch is None:  # it would read placeholder token ids at execute
            raise ConfigError(
                f"scheduler.async_scheduling: {type(executor).__name__} has no launch/wait "
                "(device-fed tokens); run it with async_scheduling: false"
            )
        flight: _Launched | None = None
        t_last = 0.0  # wall clock: when the last wait returned, or the pipeline started
        while True:
            nxt = None
            if scheduler.has_unfinished():
                if flight is None and wall_clock:
                    t_last = time.perf_counter()
                plan, runs = self._plan(flight is not None)
                if runs:
                    row = self._row(plan)
                    handle = launch(plan) if launch is not None else executor.execute(plan)
                    scheduler.launched(plan)
                    row[_WASTED] = plan.num_wasted_tokens
                    nxt = _Launched(plan, handle, row, float(getattr(handle, "host_s", 0.0)))
                elif plan.aborted:
                    continue  # only aborts: plan again
            if flight is None:
                if nxt is None:
                    yield self._idle()
                else:
                    flight = nxt  # the pipeline starts: plan the next step while this one runs
                continue
            result = wait(flight.handle) if launch is not None else flight.handle
            if wall_clock:  # rounded as in the sync loop (cost_model.durations_from)
                t = time.perf_counter()
                result.duration_s, t_last = float(f"{t - t_last:.9g}"), t
            else:
                device_s = result.duration_s - flight.host_s
                result.duration_s = max(device_s, nxt.host_s if nxt is not None else 0.0)
            yield from self._step(flight.plan, result, flight.row)
            flight = nxt

    def wake(self) -> None:
        """Wake the idle loop (a request was queued, or held blocks were released)."""
        if not self._wakeup.triggered:
            self._wakeup.succeed()

    def _idle(self) -> simpy.Event:
        """The event the idle loop waits on: the next :meth:`wake`."""
        if self._wakeup.triggered:
            self._wakeup = self.env.event()
        return self._wakeup

    def _plan(self, in_flight: bool) -> tuple[SchedulerOutput, bool]:
        """The next plan (checked if ``check_invariants``) and whether it goes to the
        executor: it feeds a token, or it aborts or preempts and still has swaps to run.
        Raises DeadlockError if no request advances, none is aborted, and nothing can free
        blocks: no step in flight (or the plan preempted while no request waits on the
        step in flight: a last token or drafts, ``Scheduler.in_flight.pinned``) and none
        held for another replica."""
        scheduler = self.scheduler
        plan = scheduler.schedule()
        feeds = plan.feeds_tokens
        stuck = not in_flight or (plan.preempted and not scheduler.in_flight.pinned)
        if not feeds and not plan.aborted and stuck:
            if not scheduler.held or plan.preempted:
                raise DeadlockError(_stuck_message(scheduler, self.env.now))
        if self.check_invariants:
            scheduler.check_plan(plan)
        moves = bool(plan.aborted or plan.preempted) and not plan.is_empty
        return plan, feeds or moves

    def _row(self, plan: SchedulerOutput) -> list:
        """The step's record (``STEP_COLUMNS``) as planned, its time and duration still 0."""
        scheduler = self.scheduler
        bm, f = scheduler.block_manager, plan.features()
        row = [
            0.0, 0.0, f.num_prefill_tokens, f.num_decodes, f.num_seqs, bm.num_used_gpu_blocks,
            bm.num_used_cpu_blocks, len(scheduler.waiting), len(scheduler.running),
            len(scheduler.swapped), len(plan.preempted), len(plan.swap_out), len(plan.swap_in),
            f.num_prefills, f.prefill_context_tokens, f.prefill_attention_pairs,
            f.decode_context_tokens, plan.num_cached_tokens, plan.num_cached_blocks,
            bm.num_cached_blocks, plan.num_wasted_tokens, f.num_spec_tokens,
        ]  # fmt: skip
        if self._lora:
            row += [f.num_loras, f.num_lora_loads]
        return row

    def _step(
        self,
        plan: SchedulerOutput,
        result: StepResult,
        row: list,
        repeated: tuple[int, int, int] | None = None,
    ) -> Iterator[simpy.Event]:
        """Run a step from now for ``result.duration_s``, then record it, apply its results
        and call the hooks. The record: ``row``, its time and duration set here; or, given
        ``repeated`` (its kv_used_blocks, decode_context_tokens, kv_cached_blocks), ``row``
        with those (``StepRecorder.append_repeats``). Raises ValueError if the step would
        not end at a finite time."""
        env, duration_s = self.env, result.duration_s
        now = env.now
        if not 0.0 <= duration_s < math.inf or math.isinf(now + duration_s):
            raise ValueError(
                f"step {self.recorder.num_steps}: duration {duration_s!r} s leaves the clock "
                f"at t={now:.6g}s without a finite end"
            )
        if not self._advance_to(now + duration_s):  # something else is due first: wait for it
            yield env.timeout(duration_s)
        recorder = self.recorder
        if repeated is None:
            row[0], row[1] = now, duration_s
            recorder.append(row, plan.decodes)
        else:
            recorder.append_repeat(row, now, duration_s, *repeated)
        now = env.now
        self.scheduler.update(plan, result, now)
        if self.on_step is not None:
            self.on_step(plan, now)
        if self.progress is not None and recorder.num_steps % _PROGRESS_EVERY == 0:
            self.progress(self.num_added - self.scheduler.num_unfinished, now)


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
            replayed (status DROPPED) are a reporting matter
            (:func:`sched_lab.results.metrics.in_trace_order`) and are refused here.
        check_invariants: check blocks and limits after every plan (slow; for tests).
        progress: optional callable(num_ended_requests, sim_time_s), called now and then.

    Returns:
        The result, its requests sorted by arrival. If a step fails (the executor raises,
        e.g. device out of memory, or the policy thrashes: SchedulerStuckError) or the run
        deadlocks (work nothing can advance: ``deadlock: ...``), the replay stops there,
        every request not ended yet is aborted with a reason naming the failure, and
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
            "(not replayed; see sched_lab.results.metrics.in_trace_order)"
        )
    requests = sorted(requests, key=lambda r: r.arrival_s)
    env = SimEnvironment()
    loop = ReplayLoop(env, scheduler, executor, check_invariants, progress)
    processes = [loop.arrivals(requests), loop.run()]
    for process in processes:
        env.process(process)
    failure = run_to_end(env, requests, [scheduler], lambda: loop.num_added, check_invariants)
    for process in processes:  # the loop waits for work forever: its frame holds the loop,
        process.close()  # its event the frame, in a cycle that only the collector would free
    steps, ticks = loop.recorder.columns()
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


def run_to_end(
    env: simpy.Environment,
    requests: list[Request],
    schedulers: list[Scheduler],
    num_arrived: Callable[[], int],
    check_invariants: bool,
) -> str | None:
    """Run ``env`` until no event is left. Returns None, or why the run stopped (the first
    line of the error; ``deadlock: ...`` when work remained that nothing could advance);
    then every request not ended yet ends UNFINISHED with a reason: one that never arrived
    (``requests`` sorted by arrival, the first ``num_arrived()`` arrived) has no finish time,
    one in a queue or caught by the failed step finishes now (a deadlock's reason starts
    ``deadlock:``).

    Raises nothing: a failed step, a deadlock, or a broken block-manager invariant
    (``check_invariants``) all end the run this way."""
    try:
        env.run()
        lost = [r.request_id for r in requests if r.status not in ENDED]
        if lost:  # no event left, yet work remains: nothing will ever advance it
            raise DeadlockError(
                f"no event left at t={env.now:.6f}s with {len(lost)} requests unfinished: "
                f"{', '.join(lost[:10])}"
            )
        if check_invariants:
            for s in schedulers:
                s.block_manager.check_integrity([])
        return None
    except DeadlockError as e:
        failure = f"{DEADLOCK}: {e}".splitlines()[0]
        unfinished = f"{failure} (the run stopped at t={env.now:.3f}s)"
    except Exception as e:  # a failed step ends the run, accounted for request by request
        failure = f"{type(e).__name__}: {e}".splitlines()[0]
        unfinished = f"not finished: the run stopped at t={env.now:.3f}s ({failure})"
    for s in schedulers:
        s.end_unfinished(unfinished, env.now)
    arrived = num_arrived()
    for i, r in enumerate(requests):
        if r.status in ENDED:
            continue
        r.status = RequestStatus.UNFINISHED
        if i >= arrived:  # never arrived: no finish time
            r.reason = (
                f"not replayed: the run stopped at t={env.now:.3f}s, before its arrival ({failure})"
            )
        else:  # in a queue, in transfer, or caught by the step that failed
            r.finish_s, r.reason = env.now, unfinished
    return failure


def _repeatable(plan: SchedulerOutput) -> bool:
    """Whether ``plan`` (applied) decoded only and finished no request: the step after it may
    repeat it (:meth:`Scheduler.repeat_decodes` says whether it does)."""
    return bool(plan.decodes) and not (
        plan.prefills
        or plan.finished
        or plan.preempted
        or plan.swap_in
        or plan.swap_out
        or plan.aborted
        or plan.spec_decodes
    )


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
