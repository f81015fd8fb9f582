"""Scheduler state and the moves every policy shares; the policy registry.

Rules: docs/ARCHITECTURE.md, "Scheduler rules". Moves by phase live in mixins:
lab/core/admission.py, preemption.py, spec_drafts.py; async state in in_flight.py.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from sched_lab.core.admission import Admission
from sched_lab.core.decode_set import DecodeSet
from sched_lab.core.errors import ConfigError
from sched_lab.core.events import ABORTED, PREFILL, EventLog
from sched_lab.core.in_flight import InFlight
from sched_lab.core.kv import BlockManager, blocks_for
from sched_lab.core.lora import LoRASlots
from sched_lab.core.plan import PreemptionMode, SchedulerOutput, StepFeatures, StepResult
from sched_lab.core.preemption import Preemption
from sched_lab.core.registry import Registry
from sched_lab.core.request import EMPTY, Request, RequestStatus
from sched_lab.core.spec import SpeculativeConfig
from sched_lab.core.spec_drafts import SpecDrafts

#: ``preemption_victim`` rules: the running request preempted when KV blocks are short is
#: the one with the largest key (ties: the newest, i.e. the last admitted). ``newest`` is
#: vLLM V0's rule; ``fewest_computed`` loses the least work to recompute;
#: ``most_blocks`` frees the most blocks; ``lowest_priority`` is vLLM's priority rule:
#: the largest (priority, arrival).
VICTIM_RULES: dict[str, Callable[[Scheduler, Request], Any]] = {
    "newest": lambda s, r: 0,
    "fewest_computed": lambda s, r: -s.num_computed_tokens(r),
    "most_blocks": lambda s, r: len(r.block_table),
    "lowest_priority": lambda s, r: (r.priority, r.arrival_s),
}
#: How each rule of :data:`VICTIM_RULES` chose its victim, for the request timeline.
VICTIM_WHY = {
    "newest": "the newest running request",
    "fewest_computed": "the running request with the fewest computed tokens",
    "most_blocks": "the running request holding the most KV blocks",
    "lowest_priority": "the running request of the lowest priority",
}


class RepeatRun(NamedTuple):
    """Steps made by :meth:`Scheduler.repeat_decodes_run`, one entry each: start and
    duration (seconds), GPU blocks used and holding a key as the step runs, and the
    decodes' context tokens. ``pending``: None, or the same five values of one more step,
    planned but not applied (it ends at or after the next event: the caller waits for it,
    then applies it with :meth:`Scheduler.update`)."""

    start_s: list[float]
    duration_s: list[float]
    kv_used_blocks: list[int]
    decode_context_tokens: list[int]
    kv_cached_blocks: list[int]
    pending: tuple[float, float, int, int, int] | None = None


@dataclass(frozen=True)
class SchedulerLimits:
    """Limits every plan respects (vLLM's names).

    Attributes:
        max_num_seqs: requests in the running batch at once.
        max_num_batched_tokens: token budget of one step (prefill + decode tokens).
        max_model_len: prompt + output tokens of one request; longer ones are rejected.
        max_preemptions: preemptions of one request after which the run fails as
            thrashing (a livelock guard).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_preemptions: int = 1000


class Scheduler(Admission, Preemption, SpecDrafts):
    """Queues, block manager and limits, plus the shared moves of every policy; the sole
    owner of request state.

    The replay loop calls :meth:`add`, :meth:`schedule`, :meth:`update`, and with async
    scheduling :meth:`launched` between the last two. Queues: ``waiting`` (FIFO; recompute
    victims at the front), ``running`` (admission order, newest last; each in
    ``decode_set`` or ``prefilling``), ``swapped`` (FIFO). Moves are recorded in ``events``.

    A policy registers a subclass (:func:`register_policy`), writes :meth:`schedule` from
    the shared moves, and may override :meth:`admission_order`, :meth:`make_room` and
    :meth:`pick_victim`; a hook's victim must be one of :meth:`preemptable`, else
    SchedulerStuckError.
    """

    name: ClassVar[str] = ""
    #: True if prompts may be split into chunks across steps.
    chunked_prefill: ClassVar[bool] = False
    #: How victims are preempted; the swap policy overrides it.
    preemption_mode: ClassVar[PreemptionMode] = PreemptionMode.RECOMPUTE
    #: Options a policy accepts in its YAML block, with defaults.
    options: ClassVar[dict[str, Any]] = {}
    #: Fast-forward (docs/ARCHITECTURE.md, "The contract"): True if, after a decode-only
    #: plan, this policy plans the same decodes again and records the same waits whenever
    #: only that plan's decode tick happened in between (no arrival, finish, preemption,
    #: swap or abort; free blocks only fewer), so the loop may plan with
    #: :meth:`repeat_decodes`. Not inherited: a subclass that changes what a plan depends on
    #: (the admission order, the time, its own counters) opts in itself or stays False.
    fast_forward: ClassVar[bool] = False
    #: The policy's victim rule when its ``preemption_victim`` option is not given.
    preemption_victim: str = "newest"
    #: How :meth:`pick_victim` chooses, for the explanation of a preemption (set from
    #: ``preemption_victim`` unless a policy overrides it).
    victim_rule: ClassVar[str] = ""

    def __init__(
        self,
        limits: SchedulerLimits,
        block_manager: BlockManager,
        preemption_victim: str | None = None,
        speculative: SpeculativeConfig | None = None,
        async_scheduling: bool = False,
        lora: LoRASlots | None = None,
        **options: Any,
    ):
        if preemption_victim is not None:
            if preemption_victim not in VICTIM_RULES:
                raise ConfigError(
                    f"preemption_victim: expected one of {', '.join(VICTIM_RULES)}, got "
                    f"{preemption_victim!r}"
                )
            self.preemption_victim = preemption_victim
        self.limits = limits
        self.speculative = speculative
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decode_set = DecodeSet(block_manager.block_size)
        self.now_s = 0.0  # time of the latest add() or update(): when the next plan is made
        self.num_steps = 0  # steps applied by update(); the index of the step being planned
        self.events = EventLog()
        self._admit_step = -1  # the step whose plan last tried admission
        for key, value in {**self.options, **options}.items():
            setattr(self, key, value)
        self._slots_planned_for: SchedulerOutput | None = None  # see reserve_decode_blocks
        self._admitted: set[Request] = set()  # admitted by the latest admit_waiting
        self.async_scheduling = async_scheduling
        self.lora = lora  # LoRA adapter slots (lab/core/lora.py); None: no adapters
        self.in_flight = InFlight()  # asynchronous scheduling: the step in flight
        # Called as a request finishes (with the time); True keeps its GPU blocks: it joins
        # ``held`` until release_held. A disaggregated prefill replica sets it: a finished
        # prefill's KV stays there until the decode side has room (lab/sim/cluster.py).
        self.on_finish: Callable[[Request, float], bool] | None = None
        self.held: list[Request] = []  # finished, blocks kept (see on_finish)
        cls = type(self)
        if not cls.victim_rule:
            if cls.pick_victim is not Scheduler.pick_victim:
                self.victim_rule = f"the victim {cls.__name__}.pick_victim chose"
            else:
                self.victim_rule = VICTIM_WHY[self.preemption_victim]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "fast_forward" not in cls.__dict__:
            cls.fast_forward = False

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        """Why the policy's YAML options cannot work (``key: expected ..., got ...``), or
        None. ``tenants``: those the trace's classes name (empty for a single trace)."""
        return None

    # ------------------------------------------------------------------ the contract
    def add(self, request: Request, now_s: float) -> bool:
        """Take a request arriving at ``now_s`` (mutates it and the queues). True if it joined
        ``waiting``; False if rejected (REJECTED, ``reason`` set, ``finish_s = now_s``)."""
        self.now_s = now_s
        reason = self.rejection_reason(request)
        if reason:
            request.status, request.reason, request.finish_s = (
                RequestStatus.REJECTED,
                reason,
                now_s,
            )
            return False
        self.waiting.append(request)
        return True

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Mutates queues and blocks; the plan records every preemption,
        swap and abort."""
        raise NotImplementedError

    def update(self, plan: SchedulerOutput, result: StepResult, now_s: float) -> None:
        """Apply the executed ``plan`` at its end time ``now_s``: token ids, advanced counts
        (sync only; async advanced them at :meth:`launched`), finishes and freed blocks.
        Mutates requests and queues."""
        self.now_s = now_s
        spec, flight = plan.spec_decodes, self.in_flight
        for r, token in result.sampled_token_ids.items():
            if r.status is not RequestStatus.FINISHED:  # async: a wasted slot's token is dropped
                ids = r.output_token_ids
                if ids is EMPTY:
                    ids = r.output_token_ids = []
                if r in spec:  # the accepted drafts come before the sampled token
                    ids.extend(r.spec_token_ids[: result.num_accepted.get(r, 0)])
                ids.append(token)
        if not self.async_scheduling:
            step_index = self.num_steps
            self._advance(plan, now_s)
            if self.speculative is not None:
                self._apply_drafts(plan, result, step_index, now_s)
            return
        for r in plan.finished:  # state as of the tick that sampled the last token
            if r in flight.finishing:  # an unforeseen end: it leaves running only now
                del flight.finishing[r]
                self.decode_set.remove(r, r.join_tick + r.output_len - r.join_num_output)
            else:  # a foreseen end: it left running when the plan was launched
                del flight.ended[r]
            self._finish(r, now_s)
        after = flight.arrived(plan)
        if self.speculative is not None:
            self._apply_drafts_async(plan, result, after)

    def launched(self, plan: SchedulerOutput) -> None:
        """Async: ``plan`` was handed to the executor. Advances counts with placeholder tokens
        and sets ``num_wasted_tokens``, ``sampled_prefills`` and ``finished``. A request whose
        last token ``plan`` samples leaves ``running`` now if its end is foreseen (its slot
        and blocks are free for the next plan), else at :meth:`update`; either way it
        finishes at :meth:`update`. Mutates requests, queues, blocks and the decode set."""
        self._advance(plan, None)
        self.in_flight.launch(plan)

    def _advance(self, plan: SchedulerOutput, now_s: float | None) -> None:
        """Advance ``plan``'s decodes and chunks. ``now_s``: sync end time (finishes happen);
        None (async): foreseen ends leave ``running`` (:meth:`_end_foreseen`), unforeseen
        ones stay for one wasted slot."""
        step_index = self.num_steps
        self.num_steps += 1
        finishing = self.in_flight.finishing
        if plan.decodes:
            plan.num_wasted_tokens = len(finishing)  # all of them decode in this step
            plan.finished = done = self.decode_set.advance(keep_done=now_s is None)
            for r in done:
                if now_s is not None:
                    self._finish(r, now_s)
                elif r.end_foreseen:
                    self.decode_set.remove(r)  # now: the tick after its last token
                    self._end_foreseen(r)
                else:
                    finishing[r] = None
        caching = self.block_manager.enable_prefix_caching
        if plan.prefills:  # lists of their own (the plan's defaults are shared empty tuples)
            plan.sampled_prefills, plan.finished = [], list(plan.finished)
        for r, num_new in plan.prefills.items():
            if r.num_computed_tokens and not (  # a later chunk (admit_waiting records the first)
                r in self._admitted and self._admit_step == step_index
            ):
                self.events.record((step_index, PREFILL, id(r), num_new, r.num_computed_tokens))
            r.num_computed_tokens += num_new
            if caching:  # key the prompt blocks this chunk filled
                self.block_manager.register(r)
            if r.num_computed_tokens < r.num_tokens:
                continue  # a partial chunk: no token yet
            if r in self.prefilling:
                self.prefilling.remove(r)
            r.num_output_tokens += 1
            if r.prefill_token_steps is EMPTY:
                r.prefill_token_steps = [step_index]
            else:
                r.prefill_token_steps.append(step_index)
            plan.sampled_prefills.append(r)
            if r.num_output_tokens < r.output_len:
                self.decode_set.add(r)
            elif now_s is None and not r.end_foreseen:  # async: it decodes once more, wasted
                self.decode_set.add(r)
                finishing[r] = None
                plan.finished.append(r)
            else:
                plan.finished.append(r)
                r.num_computed_tokens = r.num_tokens - 1
                if now_s is None:
                    self._end_foreseen(r)
                else:
                    self._finish(r, now_s)

    def repeat_decodes(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Fast-forward: the plan :meth:`schedule` of a ``fast_forward`` policy makes next,
        made without the policy, or None where the policy must plan. The caller vouches that
        ``prev``, the latest plan (synchronous, applied), decoded only (no prefill,
        preemption, swap, abort or drafts), finished no request, and that no request arrived
        since. Then that plan is ``prev``'s decodes again with their next tokens' blocks, and
        the waits ``prev`` recorded count this step too. Returns ``prev`` itself, moved to
        this step (no object per step; an applied plan is not read again). None if a decode
        needs a block and none is free (a preemption), or if requests wait and the blocks
        would evict a cached one (prefix caching: a prefix they would hit may go). Mutates
        blocks, waits and ``prev``."""
        need = self.decode_set.needing_block()
        if len(need) > self._repeat_budget():
            return None
        step = self.num_steps
        if self._admit_step == step - 1:  # prev tried admission (and admitted nobody)
            self._admit_step = step
        self.events.repeat(step)
        allocate = self.block_manager.allocate
        for r in need:
            allocate(r, 1)
        plan, decodes = prev, self.decode_set
        plan.decode_context_tokens = plan.features().decode_context_tokens = decodes.context_tokens
        plan.decode_tick = decodes.tick
        self._slots_planned_for = plan
        return plan

    def repeat_decodes_run(
        self,
        prev: SchedulerOutput,
        step_time: Callable[[StepFeatures], float],
        now_s: float,
        until_s: float,
        check: bool = False,
        decode_time: Callable[[StepFeatures], Callable[[int], float]] | None = None,
        planned: bool = False,
        pending: bool = False,
    ) -> RepeatRun | None:
        """Multi-step fast-forward: plan and apply at once the steps that
        :meth:`repeat_decodes` and :meth:`update` would make one by one, while nothing can
        change the plan: each gets its blocks by ``repeat_decodes``'s rule, lasts
        ``step_time(features)`` seconds from the end of the one before (the first starts at
        ``now_s``) and ends before ``until_s`` (the next event anything else has); the run
        stops after a step that finishes a request (then in ``prev.finished``, as
        ``update`` leaves it). The caller vouches for ``prev`` as for ``repeat_decodes``,
        for a synchronous loop with no per-step hook, and that ``step_time`` is what its
        executor reports for a plan with those features (no state, no draws). ``check``:
        :meth:`check_plan` each step. ``decode_time``: optional, ``decode_time(features)``
        gives ``step_time`` of those features as a function of their
        ``decode_context_tokens`` (equal to the last bit), made once for the run.
        ``planned``: ``prev`` is instead the plan :meth:`schedule` has just made, decodes
        only (no prefill, preemption, swap, abort or drafts), not run yet: it is the run's
        first step (its blocks and waits are the policy's), applied as :meth:`update`
        would. ``pending``: the step that would end at or after ``until_s`` (with a finite
        end, its blocks granted) is planned too, as :meth:`repeat_decodes` plans it (or,
        ``planned`` and the run's first, as the policy did), and returned as
        ``RepeatRun.pending``, not applied: the caller waits until it ends, then applies
        it with :meth:`update` (the steps before it are applied). Returns the steps'
        columns, or None if not one step qualifies (nothing changed). Mutates blocks,
        waits, requests, queues, the step count and ``prev`` (left as the last step's plan,
        or the pending one's)."""
        ds = self.decode_set
        horizon = ds.ticks_before_finish()  # step ``horizon`` of the run finishes someone
        f = prev.features()
        if f.num_lora_loads:
            return None
        stop = -1 if horizon is None else horizon + 1
        num_decodes, ctx, bs, tick0 = len(ds), ds.context_tokens, self.block_size, ds.tick
        needs = ds.needing_blocks()  # step j's: needs[j % bs]
        left = self._repeat_budget()
        allocate, bm = self.block_manager.allocate, self.block_manager
        if decode_time is not None:
            price = decode_time(f)
        else:

            def price(ctx: int) -> float:
                f.decode_context_tokens = ctx
                return step_time(f)

        start, duration, used, context, cached = [], [], [], [], []
        used_now, cached_now = bm.num_used_gpu_blocks, bm.num_cached_blocks  # change by allocating
        t, j, last = now_s, 0, None
        if planned:  # step 0: its blocks are allocated
            d = price(ctx)
            if not (d >= 0.0 and t + d < until_s):
                if pending and d >= 0.0 and t + d < math.inf:  # it waits for the event
                    last = (t, d, used_now, ctx, cached_now)
                    return tuple.__new__(RepeatRun, ([], [], [], [], [], last))
                f.decode_context_tokens = prev.decode_context_tokens
                return None
            start.append(t)
            duration.append(d)
            used.append(used_now)
            context.append(ctx)
            cached.append(cached_now)
            t += d
            ctx += num_decodes
            j = 1
        while j != stop:
            need = needs[j % bs]
            if need:
                left -= len(need)
                if left < 0:
                    break
            d = price(ctx)
            end = t + d
            if not (d >= 0.0 and end < until_s):  # the step loop raises for a bad duration
                if pending and d >= 0.0 and end < math.inf:  # step j waits for the event
                    if need:
                        for r in need:
                            allocate(r, 1)
                        used_now, cached_now = bm.num_used_gpu_blocks, bm.num_cached_blocks
                    last = (t, d, used_now, ctx, cached_now)
                break
            if need:
                for r in need:
                    allocate(r, 1)
                used_now, cached_now = bm.num_used_gpu_blocks, bm.num_cached_blocks
            if check:
                ds.skip(tick0 + j - ds.tick)  # the tick step j is planned at
                prev.decode_context_tokens, prev.decode_tick = ctx, ds.tick
                self.check_plan(prev)
            start.append(t)
            duration.append(d)
            used.append(used_now)
            context.append(ctx)
            cached.append(cached_now)
            t = end
            ctx += num_decodes
            j += 1
        if last is not None:  # step j is planned, not applied (tick0 + j is its tick)
            first = self.num_steps
            if self._admit_step == first - (not planned):  # as repeat_decodes, step after step
                self._admit_step = first + j
            self.events.repeat_run(first + planned, j + 1 - planned)
            if j:
                self.num_steps += j
                self.now_s = t
            prev.decode_context_tokens = f.decode_context_tokens = ctx
            ds.skip(tick0 + j - ds.tick)
            prev.decode_tick = ds.tick
            self._slots_planned_for = prev
            if check:
                self.check_plan(prev)
            return tuple.__new__(RepeatRun, (start, duration, used, context, cached, last))
        if not j:
            f.decode_context_tokens = prev.decode_context_tokens
            return None
        first = self.num_steps  # the run's first step
        if self._admit_step == first - (not planned):  # as repeat_decodes, step after step
            self._admit_step = first + j - 1
        if j > planned:  # the repeats of prev's step
            self.events.repeat_run(first + planned, j - planned)
        self.num_steps += j
        self.now_s = t
        prev.decode_context_tokens = f.decode_context_tokens = context[-1]
        ds.skip(tick0 + j - 1 - ds.tick)  # to the last step's tick
        prev.decode_tick = ds.tick
        self._slots_planned_for = prev
        if j == stop:  # the last step samples some request's last token
            prev.finished = done = ds.advance()
            for r in done:
                self._finish(r, t)
        else:
            ds.skip(1)
        return tuple.__new__(RepeatRun, (start, duration, used, context, cached, None))

    def _repeat_budget(self) -> int:
        """Blocks repeated decode plans may take, one after another, before the policy must
        plan: the free ones, or with requests waiting the free ones allocation takes before
        it evicts a cached block (an eviction could cut a prefix a waiting request would
        hit). Allocations take those first, so a run of repeats may take this many in all."""
        bm = self.block_manager
        return bm.num_unkeyed_free_gpu_blocks if self.waiting else bm.num_free_gpu_blocks

    def end_unfinished(self, reason: str, now_s: float) -> list[Request]:
        """End every queued request as UNFINISHED with ``reason`` (the run stopped before
        they ended), freeing blocks; returns them."""
        out = [*self.waiting, *self.running, *self.swapped, *self.in_flight.ended]
        for r in out:
            self.block_manager.free(r)
            r.status, r.reason, r.finish_s = RequestStatus.UNFINISHED, reason, now_s
        for r in self.held:  # finished here; their blocks go
            self.block_manager.free(r)
        self.held.clear()
        for queue in (self.waiting, self.running, self.swapped, self.prefilling):
            queue.clear()
        self.decode_set = DecodeSet(self.block_size)
        self.in_flight.clear()
        return out

    # ------------------------------------------------------------------ hooks
    def admission_order(self) -> Iterable[Request]:
        """Waiting requests in the order :meth:`admit_waiting` tries them (default:
        ``self.waiting``). Must not mutate; anything but ``self.waiting`` must not iterate
        ``waiting`` lazily (admission removes from it while reading)."""
        return self.waiting

    def pick_victim(self) -> Request:
        """The running request to preempt when blocks are short (>= 2 running), one of
        :meth:`preemptable`. Default: largest ``preemption_victim`` key, ties to the newest."""
        done = self.in_flight.pinned
        if self.preemption_victim == "newest":
            if not done:
                return self.running[-1]
            return next(r for r in reversed(self.running) if r not in done)
        key = VICTIM_RULES[self.preemption_victim]
        return max(enumerate(self.preemptable()), key=lambda ir: (key(self, ir[1]), ir[0]))[1]

    def make_room(self, plan: SchedulerOutput, r: Request, need: int) -> int | None:
        """Called when waiting ``r`` does not fit (``need`` blocks, or no sequence slot); may
        preempt for it. Returns the budget the victims held in ``plan``, or None to stop
        admitting (the default)."""
        return None

    # ------------------------------------------------------------------ queries
    def preemptable(self) -> list[Request]:
        """A new list of the running requests a policy may preempt (async: not those whose
        last token is in flight, nor parked ones), in ``running`` order."""
        done = self.in_flight.pinned
        return [r for r in self.running if r not in done] if done else list(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_computed_tokens(self, r: Request) -> int:
        """Tokens of ``r`` with KV cached now; use it, not ``r.num_computed_tokens``, for
        decodes (the decode set writes counts back only when they leave it)."""
        if r in self.decode_set:
            return self.decode_set.num_tokens(r) - 1
        return r.num_computed_tokens

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def rejection_reason(self, r: Request) -> str | None:
        """Why a request can never run under these limits, or None if it can."""
        total = r.prompt_len + r.output_len
        gpu = self.block_manager.num_gpu_blocks
        if total > self.limits.max_model_len:
            return (
                f"prompt {r.prompt_len} + output {r.output_len} = {total} tokens "
                f"({blocks_for(total, self.block_size)} blocks) exceeds max_model_len "
                f"{self.limits.max_model_len} tokens (KV cache: {gpu} GPU blocks of "
                f"{self.block_size} tokens)"
            )
        need = blocks_for(r.prompt_len + 1, self.block_size)
        if need > gpu:
            return f"prompt {r.prompt_len} tokens needs {need} KV blocks, the GPU cache has {gpu}"
        if self.lora is not None:
            return self.lora.unknown_reason(r.lora_name)
        return None

    def blocks_to_admit(self, r: Request) -> int:
        """GPU blocks a waiting request needs: all its tokens plus the slot it samples into."""
        return blocks_for(r.num_tokens + 1, self.block_size) - len(r.block_table)

    # ------------------------------------------------------------------ shared moves
    def reserve_decode_blocks(self, plan: SchedulerOutput) -> None:
        """Give each decode the block its next token (and drafts) need, preempting
        :meth:`pick_victim` while short; a request alone that still does not fit is aborted."""
        self._slots_planned_for = plan
        plan.lora = self.lora is not None
        if self.speculative is not None:
            return self._reserve_draft_blocks(plan)
        return self._reserve_decode_blocks(plan)

    def abort(self, plan: SchedulerOutput, r: Request, reason: str) -> None:
        """Drop ``r`` (running, or taken from ``waiting``) with ``reason``; frees its blocks."""
        if r.status is RequestStatus.RUNNING:
            self._leave_running(r)
            plan.spec_decodes.pop(r, None)
        self.block_manager.free(r)
        r.status, r.reason, r.finish_s = RequestStatus.ABORTED, reason, self.now_s
        plan.aborted.append(r)
        self.events.record((self.num_steps, ABORTED, id(r), 0, 0))

    def add_decodes(self, plan: SchedulerOutput) -> SchedulerOutput:
        """Put the decode batch in the plan; the last move of a plan. Records the waiting
        queue as held if the plan did not try admission."""
        if self._admit_step != self.num_steps and self.waiting:
            if self.swapped or plan.swap_in:
                why = "swapped_first"
            else:
                why = "preempted_step" if plan.preempted else "not_tried"
            self.events.wait_all(self.num_steps, why)
        plan.lora = self.lora is not None
        if self.decode_set:
            plan.decodes = self.decode_set.requests()
            plan.decode_context_tokens = self.decode_set.context_tokens
            plan.decode_tick = self.decode_set.tick
        return plan

    # ------------------------------------------------------------------ invariants
    def check_plan(self, plan: SchedulerOutput) -> None:
        """Assert a plan's invariants (slow: tests and ``check_invariants``): limits, no
        request twice or scheduled and preempted, decodes holding exactly their blocks."""
        lim = self.limits
        tokens = plan.features().num_tokens
        assert tokens <= lim.max_num_batched_tokens, f"{tokens} tokens > budget"
        assert len(self.running) <= lim.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        bad = [r.request_id for r, n in plan.prefills.items() if n < 1]
        assert not bad, f"prefill chunks of no token: {bad[:5]}"
        scheduled = set(plan.prefills) | set(plan.decodes)
        assert len(scheduled) == len(plan.prefills) + len(plan.decodes), "request scheduled twice"
        assert not scheduled & {r for r, _ in plan.preempted}, "request scheduled and preempted"
        assert all(r.status is RequestStatus.RUNNING for r in scheduled)
        assert set(plan.spec_decodes) <= set(plan.decodes), "drafts of a request not decoding"
        for r in plan.decodes:  # a wasted slot (async) reserves no slot for its token
            drafts = plan.spec_decodes.get(r, 0)
            left = r.output_len - (self.decode_set.num_tokens(r) - r.prompt_len) - 1
            assert drafts <= max(left, 0), f"{r.request_id}: {drafts} drafts, {left} tokens left"
            need = (
                self._draft_blocks(r, drafts)
                if self.speculative is not None
                else blocks_for(
                    self.decode_set.num_tokens(r) + (r not in self.in_flight.finishing),
                    self.block_size,
                )
            )
            assert len(r.block_table) == need, f"{r.request_id}: {len(r.block_table)} != {need}"
        if self.lora is not None:
            used = {r.lora_name for r in (*self.running, *self.swapped) if r.lora_name}
            assert len(used) <= self.lora.max_loras, f"{len(used)} adapters > max_loras"
            assert used <= set(self.lora.gpu), f"adapters in use off the GPU: {used}"
        self.block_manager.check_integrity(
            [*self.running, *self.swapped, *self.held, *self.in_flight.ended]
        )

    # ------------------------------------------------------------------ internals
    def _take_waiting(self, r: Request, head: bool) -> None:
        if head:
            self.waiting.popleft()
        else:
            self.waiting.remove(r)

    def _finish(self, r: Request, now_s: float) -> None:
        try:  # (one scan of ``running``, not two)
            self.running.remove(r)
        except ValueError:  # not running (a foreseen async end left it at launch)
            pass
        if self.on_finish is not None and self.on_finish(r, now_s):
            self.held.append(r)
        elif r.block_table:  # (a foreseen async end freed its blocks at launch)
            self.block_manager.free(r)
        r.status, r.finish_s = RequestStatus.FINISHED, now_s

    def _end_foreseen(self, r: Request) -> None:
        """Async: the step being launched samples the last token of ``r``, an end by length.
        Its sequence slot frees now, and its blocks too unless ``on_finish`` may keep them
        (then at :meth:`update`): the next plan may use both (a step reads and writes KV
        after the step before it). It stays RUNNING, in ``in_flight.ended``, until the
        step's results arrive. The caller has taken it out of the decode set."""
        self.running.remove(r)
        if self.on_finish is None:
            self.block_manager.free(r)
        self.in_flight.ended[r] = None

    def release_held(self, r: Request) -> None:
        """Free the blocks of ``r``, a finished request in ``held``. Mutates blocks."""
        self.held.remove(r)
        self.block_manager.free(r)

    def _leave_running(self, r: Request) -> None:
        self.running.remove(r)
        self.in_flight.parked.pop(r, None)
        if r in self.decode_set:
            self.decode_set.remove(r)
        elif r in self.prefilling:
            self.prefilling.remove(r)


def bad_number(options: Mapping[str, Any], key: str, *, null: bool = False) -> str | None:
    """``key: expected ...`` unless ``options[key]`` is absent or a finite number >= 0 (or
    null, with ``null``); else None."""
    v = options.get(key)
    if key not in options or (v is None and null):
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"):
        return None
    return f"{key}: expected a finite number >= 0{' or null' if null else ''}, got {v!r}"


# ---------------------------------------------------------------------- registry
POLICIES: Registry[type[Scheduler]] = Registry("policy", "known policies")


def register_policy(name: str):
    """Class decorator: register a policy under ``name`` (duplicates are an error)."""

    def wrap(cls: type[Scheduler]) -> type[Scheduler]:
        POLICIES.add(name, cls)
        cls.name = name
        return cls

    return wrap


def policy_names() -> list[str]:
    """Names of the registered policies, sorted."""
    return POLICIES.names()


def get_policy(name: str) -> type[Scheduler]:
    """The policy class registered as ``name``; ConfigError for an unknown one."""
    return POLICIES.get(name)
