"""The serving loop: one scheduler and its executor stepped on the wall clock, in a thread.

The HTTP side (lab/serve/app.py) hands requests in with :meth:`ServingLoop.submit` and takes
them back with :meth:`ServingLoop.cancel` (a client gone, a stop string seen); both are
thread-safe queues the loop drains between steps. The loop owns the scheduler: it alone
calls ``add``, ``schedule``, ``launched``, ``update`` and aborts, in the order of the replay
loop (lab/sim/replay.py), with the same contract (docs/ARCHITECTURE.md, "The contract"):

* sync: plan; execute; wait the step's duration; ``update`` at its end time;
* async scheduling: plan N+1 while N is in flight; launch it; wait for N; ``update`` N.

Time is the server's clock, ``(wall seconds since start) x speed``. The engine's steps take
their own wall time (``speed`` is 1). The simulator's executor only predicts a duration: the
loop sleeps until the step's predicted end, so the digital twin answers at simulated times,
``speed`` times faster than real.

After each step the loop hands every served request's new token ids to ``dispatch`` (one
call per step, from this thread). An end the scheduler cannot foresee (an EOS token;
a stop string, through ``cancel``) and a cancel are applied by aborting the request between
steps, with no step in flight: under async scheduling the loop lets the pipeline drain
first. Its blocks return to the pool at once (visible in the metrics).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sched_lab.core.events import EventLog
from sched_lab.core.plan import Executor, SchedulerOutput, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import Scheduler
from sched_lab.serve.metrics import ServeMetrics

log = logging.getLogger("sched_lab.serve.loop")

IDLE_WAIT_S = 0.5  # an idle loop rechecks its stop flag this often (wall seconds)
MAX_EVENTS = 100_000  # a busy scheduler's event log (events + wait streaks) is renewed past this
STOP = "stop"  # finish reasons, OpenAI's
LENGTH = "length"
ABORT = "abort"


@dataclass(eq=False)
class Stream:
    """One served request, shared by its HTTP handler and the loop.

    Attributes:
        request: the scheduler's request (``output_len`` = max_tokens).
        stop_ids: token ids that end it (EOS); empty with ``ignore_eos``.
        sent: output tokens handed to ``dispatch`` so far (loop thread only).
        done: its end was dispatched; later tokens are dropped (loop thread only).
        context: the handler's own state (its asyncio queue).
        ended: the handler saw its end (HTTP side only); else it cancels it when it leaves.
        received: output tokens the handler took (HTTP side only; usage counts these).
    """

    request: Request
    stop_ids: frozenset[int] = frozenset()
    context: Any = None
    sent: int = 0
    done: bool = False
    first_s: float = -1.0
    last_s: float = -1.0
    ended: bool = False
    received: int = 0


#: What ``dispatch`` receives per step: (stream, new token ids, finish reason or None,
#: error message or "").
StreamEvent = tuple[Stream, list[int], str | None, str]


@dataclass
class _Flight:
    """An async step launched, its results not applied."""

    plan: SchedulerOutput
    handle: Any
    host_s: float


@dataclass
class _Inbox:
    """What the HTTP side handed in since the loop last looked (guarded by ``lock``)."""

    lock: threading.Condition = field(default_factory=threading.Condition)
    arrivals: list[Stream] = field(default_factory=list)
    cancels: list[tuple[Stream, str]] = field(default_factory=list)


class ServingLoop:
    """Steps ``scheduler`` with ``executor`` in its own thread (module docstring).

    Args:
        dispatch: called from the loop thread with each step's events (:data:`StreamEvent`).
        speed: the clock's factor over the wall clock (simulator only; 1 for the engine).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        metrics: ServeMetrics,
        dispatch: Callable[[list[StreamEvent]], None],
        speed: float = 1.0,
    ) -> None:
        self.scheduler, self.executor, self.metrics = scheduler, executor, metrics
        self.dispatch, self.speed = dispatch, speed
        self.wall_clock = bool(getattr(executor, "wall_clock", False))
        self._launch = getattr(executor, "launch", None)
        self._wait = getattr(executor, "wait", None)
        self._inbox = _Inbox()
        self._streams: dict[Request, Stream] = {}
        self._stopping = False
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._main, name="serving-loop", daemon=True)
        self._events: list[StreamEvent] = []  # of the step being applied
        self.failure = ""  # why the loop stopped, if a step raised

    # ------------------------------------------------------------------ any thread
    def now(self) -> float:
        """The server's clock (seconds since start, times ``speed``)."""
        return (time.perf_counter() - self._t0) * self.speed

    def submit(self, stream: Stream) -> None:
        """Queue a new request (its ``arrival_s`` is set when the loop takes it)."""
        with self._inbox.lock:
            self._inbox.arrivals.append(stream)
            self._inbox.lock.notify()

    def cancel(self, stream: Stream, reason: str) -> None:
        """Abort a request (a client gone: ``reason`` "abort"; a stop string: "stop")."""
        with self._inbox.lock:
            self._inbox.cancels.append((stream, reason))
            self._inbox.lock.notify()

    def num_waiting(self) -> int:
        """Requests not admitted yet: handed in, or in the scheduler's waiting queue."""
        return len(self._inbox.arrivals) + len(self.scheduler.waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; requests still served end with finish "abort"."""
        with self._inbox.lock:
            self._stopping = True
            self._inbox.lock.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the loop thread
    def _main(self) -> None:
        try:
            if self.scheduler.async_scheduling:
                self._run_async()
            else:
                self._run_sync()
        except Exception as e:  # a failed step: every request still served ends, with why
            self.failure = f"{type(e).__name__}: {e}".splitlines()[0]
            log.error("the serving loop stopped: %s", self.failure)
        self._end_all(self.failure or "the server is stopping")

    def _run_sync(self) -> None:
        scheduler = self.scheduler
        while not self._stopping:
            self._intake(cancels=True)
            if not scheduler.has_unfinished():
                self._idle()
                continue
            start = self.now()
            plan, runs = self._plan()
            if not runs:
                continue
            result = self.executor.execute(plan)
            end = self._step_end(start, result.duration_s)
            scheduler.update(plan, result, end)
            self._applied(plan, result, end)

    def _run_async(self) -> None:
        """At most one step in flight while the next is planned (lab/sim/replay.py). With
        cancels waiting, no new step is launched: the one in flight finishes, then they
        are applied."""
        scheduler, launch, wait = self.scheduler, self._launch, self._wait
        flight: _Flight | None = None
        start = self.now()  # when the step in flight started (the previous one's end)
        while not self._stopping:
            self._intake(cancels=flight is None)
            nxt = None
            if scheduler.has_unfinished() and not (flight and self._inbox.cancels):
                if flight is None:
                    start = self.now()
                plan, runs = self._plan(in_flight=flight is not None)
                if runs:
                    handle = launch(plan) if launch is not None else self.executor.execute(plan)
                    scheduler.launched(plan)
                    nxt = _Flight(plan, handle, float(getattr(handle, "host_s", 0.0)))
            if flight is None:
                if nxt is None:
                    if not scheduler.has_unfinished():
                        self._idle()
                else:
                    flight = nxt
                continue
            result: StepResult = wait(flight.handle) if launch is not None else flight.handle
            if self.wall_clock:
                end = self.now()
            else:  # as the replay loop: max(device time of N, host time of N+1)
                device_s = result.duration_s - flight.host_s
                duration = max(device_s, nxt.host_s if nxt is not None else 0.0)
                end = self._step_end(start, duration)
            scheduler.update(flight.plan, result, end)
            self._applied(flight.plan, result, end)
            flight, start = nxt, end

    def _plan(self, in_flight: bool = False) -> tuple[SchedulerOutput, bool]:
        """The next plan and whether it goes to the executor (as the replay loop's). A plan
        that advances nothing with no step in flight ends every request (stuck); requests it
        aborted are handed on now when no step runs (else with the step's results)."""
        scheduler = self.scheduler
        plan = scheduler.schedule()
        self._dispatch_aborted(plan)
        moves = bool(plan.aborted or plan.preempted) and not plan.is_empty
        runs = plan.feeds_tokens or moves
        if not runs and plan.aborted:  # no step to apply, whose end would hand these on
            self._update_gauges()
            self._flush()
        if not runs and not plan.aborted and not in_flight:
            bm = scheduler.block_manager
            why = (
                f"policy {scheduler.name!r} made no progress with {scheduler.num_unfinished} "
                f"requests and {bm.num_free_gpu_blocks}/{bm.num_gpu_blocks} free GPU blocks"
            )
            log.error("%s; ending them", why)
            self._end_all(why)
        return plan, runs

    def _step_end(self, start: float, duration_s: float) -> float:
        """The end of a step that started at ``start`` (server clock): measured now for the
        engine; for the simulator, ``start + duration_s`` after sleeping until then."""
        if self.wall_clock:
            return self.now()
        end = start + duration_s
        late = end - self.now()
        if late > 0:
            time.sleep(late / self.speed)
        return max(end, self.now()) if late < 0 else end

    def _idle(self) -> None:
        """Wait for a request or a stop; a fresh event log (its history is not served; a
        loop that is never idle renews it past MAX_EVENTS, in :meth:`_applied`)."""
        self.scheduler.events = EventLog()
        self._update_gauges()
        with self._inbox.lock:
            if not (self._inbox.arrivals or self._inbox.cancels or self._stopping):
                self._inbox.lock.wait(IDLE_WAIT_S)

    def _intake(self, cancels: bool) -> None:
        """Add the requests handed in; apply the cancels when ``cancels`` (no step in
        flight)."""
        inbox = self._inbox
        with inbox.lock:
            arrivals, inbox.arrivals = inbox.arrivals, []
            taken: list[tuple[Stream, str]] = []
            if cancels:
                taken, inbox.cancels = inbox.cancels, []
        now = self.now()
        for s in arrivals:
            r = s.request
            r.arrival_s = now
            if self.scheduler.add(r, now):
                self._streams[r] = s
            else:  # the server checks lengths first; a rejection here is a backstop
                self._events.append((s, [], ABORT, r.reason))
        for s, reason in taken:
            self._abort(s, reason)
        if arrivals or taken:
            self._update_gauges()  # before the events: a client that saw them sees these
            self._flush()

    def _abort(self, s: Stream, reason: str) -> None:
        """End ``s`` now (no step in flight): out of its queue, blocks freed."""
        r, scheduler = s.request, self.scheduler
        if r.status is RequestStatus.SWAPPED:
            scheduler.swapped.remove(r)
            scheduler.block_manager.free(r)
            r.status, r.finish_s = RequestStatus.ABORTED, self.now()
        elif r.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            if r.status is RequestStatus.WAITING:
                scheduler.waiting.remove(r)
            scheduler.abort(SchedulerOutput(), r, f"{reason}: ended by the server")
        if self._streams.pop(r, None) is not None and not s.done:
            self._finish(s, [], reason)

    def _applied(self, plan: SchedulerOutput, result: StepResult, now: float) -> None:
        """After ``update``: new tokens to their streams, ends, metrics."""
        m = self.metrics
        if plan.preempted:
            m.preemptions.inc(len(plan.preempted))
        if m.speculative and plan.spec_decodes:
            m.spec_drafts.inc(len(plan.spec_decodes))
            m.spec_draft_tokens.inc(sum(plan.spec_decodes.values()))
            m.spec_accepted.inc(sum(result.num_accepted.values()))
        streams = self._streams
        ended: list[Stream] = []
        for r in (*plan.prefills, *plan.decodes):
            s = streams.get(r)
            if s is None or s.done:
                continue
            new = r.output_token_ids[s.sent :]
            if new:
                self._tokens(s, new, now)
            if s.done:
                ended.append(s)
            elif r.status is RequestStatus.FINISHED:
                self._finish(s, [], LENGTH)
                del streams[r]
        for s in ended:  # an EOS: the request may still hold a slot and blocks
            if s.request.status is not RequestStatus.FINISHED:
                self.cancel(s, STOP)  # applied with no step in flight
            streams.pop(s.request, None)
        self._update_gauges()
        self._flush()
        log_ = self.scheduler.events
        if len(log_) + len(log_.waits) > MAX_EVENTS:  # never idle for long: renewed here
            self.scheduler.events = EventLog()

    def _tokens(self, s: Stream, new: list[int], now: float) -> None:
        """Hand ``new`` ids of ``s`` on; an EOS among them ends it there (kept: it counts)."""
        m, r = self.metrics, s.request
        finish = None
        if s.stop_ids:
            for i, t in enumerate(new):
                if t in s.stop_ids:
                    new, finish = new[: i + 1], STOP
                    break
        if s.sent == 0:
            s.first_s = now
            m.ttft.observe(now - r.arrival_s)
            m.prompt_tokens.inc(r.prompt_len)
            m.prefix_queries.inc(r.prompt_len)
            m.prefix_hits.inc(r.num_cached_tokens)
        else:
            m.itl.observe(now - s.last_s)
        s.last_s = now
        s.sent += len(new)
        m.generation_tokens.inc(len(new))
        if finish is None and s.sent >= r.output_len:
            finish = LENGTH
        if finish is None:
            self._events.append((s, list(new), None, ""))
        else:
            self._finish(s, list(new), finish)

    def _finish(self, s: Stream, new: list[int], reason: str, message: str = "") -> None:
        s.done = True
        if s.first_s >= 0:
            self.metrics.e2e.observe(max(s.last_s, s.first_s) - s.request.arrival_s)
        self.metrics.success(reason)
        self._events.append((s, new, reason, message))

    def _dispatch_aborted(self, plan: SchedulerOutput) -> None:
        """Requests the scheduler aborted while planning (e.g. one that can never fit)."""
        for r in plan.aborted:
            s = self._streams.pop(r, None)
            if s is not None and not s.done:
                self._finish(s, [], ABORT, r.reason)

    def _end_all(self, why: str) -> None:
        """End every request still served (a failed step, a stuck policy, the stop)."""
        self.scheduler.end_unfinished(why, self.now())
        with self._inbox.lock:
            arrivals, self._inbox.arrivals = self._inbox.arrivals, []
        for s in [*self._streams.values(), *arrivals]:
            if not s.done:
                self._finish(s, [], ABORT, why)
        self._streams.clear()
        self._update_gauges()
        self._flush()

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.dispatch(events)

    def _update_gauges(self) -> None:
        s, m = self.scheduler, self.metrics
        bm = s.block_manager
        m.running.set(len(s.running))
        m.waiting.set(self.num_waiting())
        m.swapped.set(len(s.swapped))
        m.kv_usage.set(bm.num_used_gpu_blocks / bm.num_gpu_blocks if bm.num_gpu_blocks else 0.0)


class PlaceholderTokens:
    """The simulator's executor with token ids: every sampled token is id 0, so the loop
    reads output tokens from ``Request.output_token_ids`` for both backends.

    Which requests sample in a step: those whose prefill chunk reaches the end of their
    tokens, and every decode (as the engine).
    """

    wall_clock = False

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        if hasattr(inner, "launch"):
            self.launch, self.wait = self._launch, self._wait_launched

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return self._with_tokens(plan, self.inner.execute(plan))

    def _launch(self, plan: SchedulerOutput) -> tuple[SchedulerOutput, Any]:
        samplers = self._samplers(plan)
        handle = self.inner.launch(plan)
        return _Handle(samplers, handle, float(getattr(handle, "host_s", 0.0)))

    def _wait_launched(self, handle: _Handle) -> StepResult:
        result = self.inner.wait(handle.inner)
        result.sampled_token_ids.update(dict.fromkeys(handle.samplers, 0))
        return result

    @staticmethod
    def _samplers(plan: SchedulerOutput) -> list[Request]:
        """Read before the plan is launched (``launched`` advances the counts)."""
        return [s.request for s in plan.prefill_seqs() if s.sample] + list(plan.decodes)

    def _with_tokens(self, plan: SchedulerOutput, result: StepResult) -> StepResult:
        result.sampled_token_ids.update(dict.fromkeys(self._samplers(plan), 0))
        return result


@dataclass
class _Handle:
    samplers: list[Request]
    inner: Any
    host_s: float
