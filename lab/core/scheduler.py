"""Scheduler state and the mechanics every policy shares; the policy registry.

A policy (policies/<name>.py) subclasses :class:`Scheduler` and writes ``schedule()`` from
the shared moves here (admit waiting requests, reserve decode blocks with preemption, swap
in); they mutate the queues and the block manager and record what they did in the step's
plan, as vLLM's scheduler does. The contract with the replay loop: :meth:`Scheduler.add`,
:meth:`Scheduler.schedule`, :meth:`Scheduler.update` (and, with asynchronous scheduling,
:meth:`Scheduler.launched` between the last two). The rules (token and block conventions,
the prefix cache, asynchronous scheduling, speculative decoding) are in
docs/ARCHITECTURE.md, "Scheduler rules"; the in-flight state is lab/core/in_flight.py, the
drafts' accounting lab/core/spec_drafts.py.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from lab.core import spec_drafts
from lab.core.decode_set import DecodeSet
from lab.core.errors import ConfigError, SchedulerStuckError
from lab.core.events import ABORTED, ADMITTED, PREEMPTED, PREFILL, SWAPPED_IN, EventLog
from lab.core.in_flight import InFlight
from lab.core.kv import BlockManager, blocks_for
from lab.core.plan import PreemptionMode, SchedulerOutput, StepResult
from lab.core.registry import Registry
from lab.core.request import Request, RequestStatus
from lab.core.spec import SpeculativeConfig

log = logging.getLogger("lab.core.scheduler")

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


@dataclass(frozen=True)
class SchedulerLimits:
    """Limits every plan respects (vLLM's names).

    Attributes:
        max_num_seqs: requests in the running batch at once.
        max_num_batched_tokens: token budget of one step (prefill + decode tokens).
        max_model_len: prompt + output tokens of one request; longer ones are rejected.
        max_preemptions: preemptions of one request after which the run fails as
            thrashing (a livelock guard; no policy here comes near it in practice).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_preemptions: int = 1000


class Scheduler:
    """Queues, block manager and limits, plus the shared moves of every policy.

    The contract with the replay loop (which owns time and nothing else):

    * :meth:`add` (request, now): an arrived request joins ``waiting``, or is rejected
      with a reason if it can never run;
    * :meth:`schedule`: the policy plans the next step (a :class:`SchedulerOutput`, all an
      executor reads);
    * :meth:`update` (plan, result, now): the executed step's results are applied: sampled
      tokens, finished requests, freed blocks;
    * asynchronous scheduling only, :meth:`launched` (plan): the plan was handed to the
      executor (called before the next :meth:`schedule`; module doc).

    The scheduler is the sole owner of request state. Queues: ``waiting`` (FIFO; recompute
    victims return at the front), ``running`` (in admission order; the last one is the
    newest), ``swapped`` (FIFO). Running requests are either in ``decode_set`` or in
    ``prefilling`` (a chunked prompt not yet fully computed). The shared moves record what
    they do to each request, and why a waiting one was not admitted, in ``events``
    (:class:`lab.core.events.EventLog`, O(1) per move).

    A policy subclasses this class, registers it with :func:`register_policy` and writes
    :meth:`schedule` from the shared moves; it may override the hooks
    :meth:`admission_order` (default FCFS), :meth:`make_room` (default: never preempt to
    admit) and :meth:`pick_victim` (default: the ``preemption_victim`` rule, an option every
    policy takes, see :data:`VICTIM_RULES`).
    """

    name: ClassVar[str] = ""
    #: True if prompts may be split into chunks across steps.
    chunked_prefill: ClassVar[bool] = False
    #: How victims are preempted; the swap policy overrides it.
    preemption_mode: ClassVar[PreemptionMode] = PreemptionMode.RECOMPUTE
    #: Options a policy accepts in its YAML block, with defaults.
    options: ClassVar[dict[str, Any]] = {}
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
        self.in_flight = InFlight()  # asynchronous scheduling: the step in flight
        cls = type(self)
        if not cls.victim_rule:
            if cls.pick_victim is not Scheduler.pick_victim:
                self.victim_rule = f"the victim {cls.__name__}.pick_victim chose"
            else:
                self.victim_rule = VICTIM_WHY[self.preemption_victim]

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        """Why the policy's YAML options cannot work, as ``key: expected ..., got ...``
        (None if they can); checked by the config before any run. ``tenants``: the tenants
        the trace's classes name (empty for a single trace). Default: no check."""
        return None

    # ------------------------------------------------------------------ the contract
    def add(self, request: Request, now_s: float) -> bool:
        """Take a request that arrives at ``now_s``. Mutates ``request`` and the queues.

        Returns:
            True if it joined ``waiting``; False if it was rejected (it can never run under
            these limits: status REJECTED, ``reason`` set, ``finish_s = now_s``).
        """
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
        """Plan the next step (the policy's part). Mutates the queues and the block manager;
        the plan records every preemption, swap and abort it made."""
        raise NotImplementedError

    def update(self, plan: SchedulerOutput, result: StepResult, now_s: float) -> None:
        """Apply the executed step ``plan`` at its end time ``now_s``: append the sampled
        token ids (engine runs), advance decodes and prompt chunks, finish requests whose
        last token was sampled and free their blocks. Mutates requests and queues.

        Asynchronous scheduling: the counts advanced at :meth:`launched`; this appends the
        token ids (not those of wasted slots) and finishes the plan's ``finished``
        requests, freeing their blocks (module doc)."""
        self.now_s = now_s
        spec, flight = plan.spec_decodes, self.in_flight
        for r, token in result.sampled_token_ids.items():
            if r.status is not RequestStatus.FINISHED:  # async: a wasted slot's token is dropped
                if r in spec:  # the accepted drafts come before the sampled token
                    r.output_token_ids.extend(r.spec_token_ids[: result.num_accepted.get(r, 0)])
                r.output_token_ids.append(token)
        if not self.async_scheduling:
            step_index = self.num_steps
            self._advance(plan, now_s)
            if self.speculative is not None:
                spec_drafts.apply_drafts(self, plan, result, step_index, now_s)
            return
        for r in plan.finished:  # state as of the tick that sampled the last token
            del flight.finishing[r]
            self.decode_set.remove(r, r.join_tick + r.output_len - r.join_num_output)
            self._finish(r, now_s)
        after = flight.arrived(plan)
        if self.speculative is not None:
            spec_drafts.apply_drafts_async(self, plan, result, after)

    def launched(self, plan: SchedulerOutput) -> None:
        """Asynchronous scheduling: ``plan`` was handed to the executor (after it read the
        plan's inputs). Advances decodes and prompt chunks with placeholder tokens and sets
        the plan's ``num_wasted_tokens``, ``sampled_prefills`` and ``finished``; requests
        that sampled their last token stay running until :meth:`update`. Mutates requests
        and the decode set."""
        self._advance(plan, None)
        self.in_flight.launch(plan)

    def _advance(self, plan: SchedulerOutput, now_s: float | None) -> None:
        """Advance the counts of ``plan``'s decodes and chunks (the step's sampled tokens
        join). ``now_s``: a sync step's end time, when requests that sampled their last
        token finish; None (async): they stay in the decode set for one more (wasted) slot."""
        step_index = self.num_steps
        self.num_steps += 1
        finishing = self.in_flight.finishing
        if plan.decodes:
            plan.num_wasted_tokens = len(finishing)  # all of them decode in this step
            plan.finished = done = self.decode_set.advance(keep_done=now_s is None)
            for r in done:
                if now_s is None:
                    finishing[r] = None
                else:
                    self._finish(r, now_s)
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
            r.prefill_token_steps.append(step_index)
            plan.sampled_prefills.append(r)
            if r.num_output_tokens < r.output_len:
                self.decode_set.add(r)
            elif now_s is None:  # async: it decodes once more, in the next step's wasted slot
                self.decode_set.add(r)
                finishing[r] = None
                plan.finished.append(r)
            else:
                plan.finished.append(r)
                r.num_computed_tokens = r.num_tokens - 1
                self.running.remove(r)
                self._finish(r, now_s)

    def abort_unfinished(self, reason: str, now_s: float) -> list[Request]:
        """End every queued request as aborted with ``reason`` (a run that stopped); their
        blocks are freed. Returns them."""
        out = [*self.waiting, *self.running, *self.swapped]
        for r in out:
            self.block_manager.free(r)
            r.status, r.reason, r.finish_s = RequestStatus.ABORTED, reason, now_s
        for queue in (self.waiting, self.running, self.swapped, self.prefilling):
            queue.clear()
        self.decode_set = DecodeSet(self.block_size)
        self.in_flight.clear()
        return out

    # ------------------------------------------------------------------ hooks
    def admission_order(self) -> Iterable[Request]:
        """Waiting requests in the order :meth:`admit_waiting` tries them; it stops at the
        first that does not fit. Default: the ``waiting`` queue itself (FCFS, recompute
        victims first). Must not mutate; return ``self.waiting`` for the default order, else
        a list or a generator that does not iterate ``waiting`` itself (admission removes
        from it while the order is read, lazily)."""
        return self.waiting

    def pick_victim(self) -> Request:
        """The running request to preempt next when KV blocks are short (called with at
        least two running); it must be one of :meth:`preemptable`. Default: the largest key
        of the ``preemption_victim`` rule (:data:`VICTIM_RULES`), ties to the newest."""
        done = self.in_flight.finishing
        if self.preemption_victim == "newest":
            if not done:
                return self.running[-1]
            return next(r for r in reversed(self.running) if r not in done)
        key = VICTIM_RULES[self.preemption_victim]
        return max(enumerate(self.preemptable()), key=lambda ir: (key(self, ir[1]), ir[0]))[1]

    def make_room(self, plan: SchedulerOutput, r: Request, need: int) -> int | None:
        """Called by :meth:`admit_waiting` when waiting request ``r`` does not fit (``need``
        blocks, or no free sequence slot): preempt running requests for it, or not.
        Returns the token budget the victims held in ``plan`` (see
        :meth:`preempt_lower_ranked`), or None to stop admitting. Default: None."""
        return None

    # ------------------------------------------------------------------ queries
    def preemptable(self) -> list[Request]:
        """The running requests a policy may preempt now, in ``running`` order (the last is
        the newest): all of them except, under asynchronous scheduling, those whose last
        token is in flight (they finish when its results arrive). A new list."""
        done = self.in_flight.finishing
        return [r for r in self.running if r not in done] if done else list(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_computed_tokens(self, r: Request) -> int:
        """Tokens of ``r`` whose KV is cached, now. Use this, not
        ``r.num_computed_tokens``, for running decodes: the decode set keeps their counts in
        closed form and writes them back to the request only when it leaves the set."""
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
        return None

    def blocks_to_admit(self, r: Request) -> int:
        """GPU blocks a waiting request needs: all its tokens plus the slot it samples into."""
        return blocks_for(r.num_tokens + 1, self.block_size) - len(r.block_table)

    # ------------------------------------------------------------------ shared moves
    def admit_waiting(self, plan: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in :meth:`admission_order` while limits and free blocks
        allow; stops at the first that does not fit.

        Whole prompts unless the policy is chunked, in which case the last admitted one
        may get a partial chunk (its blocks are allocated whole). A request that does not
        fit goes to :meth:`make_room` first. Returns the budget left. The request it stops at
        is recorded as waiting, with the reason (``events``).

        With the prefix cache on, each candidate's cached prefix is looked up now, whether
        it is new or a recompute victim (never a count kept from before): its cached blocks
        are referenced, only the rest is allocated (and counted against free blocks), and
        its chunk starts after the cached tokens (at least one token is computed).
        """
        bm, queue, max_seqs = self.block_manager, self.waiting, self.limits.max_num_seqs
        self._admit_step = step = self.num_steps
        self._admitted = admitted = set()
        if not queue:
            return budget
        events = self.events
        caching = bm.enable_prefix_caching
        order = self.admission_order()
        custom = iter(order) if order is not queue else None
        while queue and budget > 0:
            r = queue[0] if custom is None else next(custom, None)
            if r is None:
                break
            if r in self.in_flight.held:  # async: a recompute victim whose token is in flight
                events.wait(step, r, "token_in_flight")
                break
            # Looked up now, at every admission attempt; a request whose prompt is already
            # computed elsewhere (its KV moved in from a prefill replica) looks nothing up.
            hits = bm.lookup(r) if caching and not r.num_computed_tokens else ()
            num_new = r.num_tokens - r.num_computed_tokens - len(hits) * self.block_size
            if num_new > budget:
                if not self.chunked_prefill:
                    events.wait(step, r, "token_budget", num_new, budget)
                    break
                num_new = budget
            need = self.blocks_to_admit(r)
            if caching:
                need -= len(hits)
            taken = need + bm.num_evictable(hits) if caching else need  # hits leave the LRU
            if len(self.running) >= max_seqs or not bm.can_allocate(
                taken, use_watermark=bool(self.running)
            ):
                regained = self.make_room(plan, r, taken)
                if regained is not None:
                    budget += regained
                    cached = len(hits) * self.block_size
                    num_new = min(r.num_tokens - r.num_computed_tokens - cached, budget)
                    need = self.blocks_to_admit(r) - len(hits)
                    taken = need + bm.num_evictable(hits) if caching else need
                if len(self.running) >= max_seqs:
                    events.wait(step, r, "max_num_seqs", max_seqs)
                    break
            if not bm.can_allocate(taken, use_watermark=bool(self.running)):
                if not self.running and taken > bm.num_free_gpu_blocks and not self.swapped:
                    self._take_waiting(r, custom is None and queue[0] is r)
                    self.abort(
                        plan,
                        r,
                        f"needs {need} KV blocks to resume, the GPU cache has {bm.num_gpu_blocks}",
                    )
                    continue
                if not events.extend(step, r, "kv_blocks"):
                    free = bm.num_free_gpu_blocks - (bm.watermark_blocks if self.running else 0)
                    events.wait(step, r, "kv_blocks", need, max(free, 0))
                break
            self._take_waiting(r, custom is None and queue[0] is r)
            events.end_wait(r)
            events.record((step, ADMITTED, id(r), need, num_new))
            admitted.add(r)
            if caching and not r.num_computed_tokens:
                self._admit_cached(plan, r, hits, need)
            else:
                bm.allocate(r, need)
            r.status = RequestStatus.RUNNING
            if r.first_scheduled_s < 0:
                r.first_scheduled_s = self.now_s
            self.running.append(r)
            if num_new < r.num_tokens - r.num_computed_tokens:
                self.prefilling.append(r)
            plan.prefills[r] = num_new
            budget -= num_new
        else:  # stopped by the loop's condition: the budget is spent
            r = (queue[0] if custom is None else next(custom, None)) if queue else None
            if r is not None:
                events.wait(step, r, "budget_spent")
        return budget

    def _admit_cached(self, plan: SchedulerOutput, r: Request, hits, num_new_blocks: int) -> None:
        """Admission with the prefix cache: reference the cached ``hits``, allocate the rest,
        jump ``num_computed_tokens`` past the cached tokens and count them: at the first
        admission in ``num_cached_tokens``, at a re-admission after a recompute preemption
        in ``num_resumed_cached_tokens``; both in the plan's ``num_cached_tokens``."""
        self.block_manager.allocate_cached(r, hits, num_new_blocks)
        cached = len(hits) * self.block_size
        r.num_computed_tokens = cached
        if r.first_scheduled_s < 0:
            r.num_cached_tokens = cached
        else:
            r.num_resumed_cached_tokens += cached
        plan.num_cached_tokens += cached
        plan.num_cached_blocks += len(hits)

    def reserve_decode_blocks(self, plan: SchedulerOutput) -> None:
        """Give each decode a block if its next token starts one, preempting
        :meth:`pick_victim` while blocks are short. A request that needs a block while
        holding the whole cache alone is aborted."""
        bm = self.block_manager
        self._slots_planned_for = plan
        if self.speculative is not None:
            return spec_drafts.reserve_draft_blocks(self, plan)
        while len(self._needing_block()) > bm.num_free_gpu_blocks:
            if len(self.running) == 1:
                self.abort(
                    plan,
                    self.running[0],
                    f"outgrew the KV cache: needs more than "
                    f"the {bm.num_gpu_blocks} GPU blocks while running alone",
                )
            else:
                self._preempt_victim(plan)
        for r in self._needing_block():
            bm.allocate(r, 1)

    def _preempt_victim(self, plan: SchedulerOutput) -> None:
        """Preempt the request :meth:`pick_victim` returns, checked to be preemptable."""
        victim = self.pick_victim()
        self._check_victim(victim, "pick_victim()")
        self.preempt(plan, victim, self.victim_rule)

    def _check_victim(self, victim: Request, hook: str) -> None:
        """Raises SchedulerStuckError naming ``hook`` unless ``victim`` is preemptable."""
        if victim.status is not RequestStatus.RUNNING:
            why = f"it is {victim.status.value}, not running"
        elif victim in self.in_flight.finishing:
            why = "its last token is in flight (asynchronous scheduling)"
        else:
            return
        raise SchedulerStuckError(
            f"policy {self.name!r}: {hook} chose request {victim.request_id}, which cannot be "
            f"preempted: {why}; a victim must be one of self.preemptable()"
        )

    def _needing_block(self) -> Iterable[Request]:
        """Decodes whose next token starts a block; async: not a wasted slot (its token is
        never written to KV)."""
        need, done = self.decode_set.needing_block(), self.in_flight.finishing
        return [r for r in need if r not in done] if done else need

    def preempt_lower_ranked(
        self, plan: SchedulerOutput, r: Request, need: int, rank: Callable[[Request], Any]
    ) -> int | None:
        """Preempt running requests that rank strictly below waiting request ``r``
        (``rank(v) > rank(r)``; lower ranks run first), the lowest-ranked first (ties: the
        newest), until ``r``'s ``need`` blocks and a sequence slot are free; none if that is
        not enough. Requests admitted in this very plan are never victims.

        A victim already planned in this step is rolled back: its prefill chunk leaves
        ``plan``, and a decode gives back its block (all its blocks are freed) and, if
        :meth:`reserve_decode_blocks` ran for ``plan``, its decode slot; it samples no token
        in this step. The victims are chosen from the ranks alone, so the result does not
        depend on the order of ``running``.

        Returns:
            The token budget the victims held in ``plan`` (chunks + decode slots), or None
            if no set of victims makes room (then nothing is preempted).
        """
        bm, lim = self.block_manager, self.limits
        order = sorted(enumerate(self.running), key=lambda iv: (rank(iv[1]), iv[0]), reverse=True)
        top = rank(r)
        free, running, victims = bm.num_free_gpu_blocks, len(self.running), []

        def fits() -> bool:
            reserve = bm.watermark_blocks if running else 0
            return running < lim.max_num_seqs and free - need >= reserve

        for _, v in order:
            if fits() or not rank(v) > top:
                break
            if v in plan.prefills and v.num_computed_tokens == 0:
                continue  # admitted in this plan
            if v in self.in_flight.finishing:
                continue  # async: its last token is in flight
            victims.append(v)
            free += len(v.block_table)
            running -= 1
        if not fits():
            return None
        regained = 0
        for v in victims:
            regained += plan.prefills.pop(v, 0)
            if v in self.decode_set and self._slots_planned_for is plan:
                regained += 1 + plan.spec_decodes.get(v, 0)
            self.preempt(plan, v, f"ranked below waiting request {r.request_id}")
        return regained

    def preempt(self, plan: SchedulerOutput, victim: Request, why: str = "") -> None:
        """Preempt ``victim`` by swap if the policy swaps and CPU space allows, else by
        recompute. Mutates queues and blocks; records the preemption in ``plan`` and in
        ``events`` with ``why`` (how the victim was chosen, e.g. "the newest running
        request").

        Raises:
            SchedulerStuckError: the victim was preempted more than
                ``limits.max_preemptions`` times (thrashing).
        """
        assert victim not in plan.prefills, "a request is never scheduled and preempted"
        self._check_victim(victim, "preempt()")
        self._leave_running(victim)
        plan.spec_decodes.pop(victim, None)
        mode = PreemptionMode.RECOMPUTE
        if self.preemption_mode is PreemptionMode.SWAP:
            if self.block_manager.can_swap_out(victim):
                mode = PreemptionMode.SWAP
            else:
                log.debug(
                    "%s: CPU swap space full (%d free blocks, %d needed): request %s is "
                    "recomputed instead",
                    self.name,
                    self.block_manager.num_free_cpu_blocks,
                    len(victim.block_table),
                    victim.request_id,
                )
        # PREEMPT_MODES: 0 recompute, 1 swap, 2 recompute because CPU swap space is full
        fallback = self.preemption_mode is PreemptionMode.SWAP
        mode_index = 1 if mode is PreemptionMode.SWAP else 2 if fallback else 0
        self.events.record(
            (self.num_steps, PREEMPTED, id(victim), mode_index, self.events.text(why))
        )
        if mode is PreemptionMode.SWAP:
            plan.swap_out.extend(self.block_manager.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            victim.num_preemptions_swap += 1
            self.swapped.append(victim)
        else:
            self.block_manager.free(victim)
            victim.num_recomputed_tokens += victim.num_computed_tokens
            victim.num_computed_tokens = 0
            victim.spec_token_ids = []  # proposals dropped; re-proposed after the re-prefill
            victim.status = RequestStatus.WAITING
            victim.num_preemptions_recompute += 1
            self.waiting.appendleft(victim)
            if self.in_flight.samples(victim):
                self.in_flight.held.add(victim)
        plan.preempted.append((victim, mode))
        if victim.num_preemptions > self.limits.max_preemptions:
            raise SchedulerStuckError(
                f"policy {self.name!r} is thrashing: request {victim.request_id} was preempted "
                f"{victim.num_preemptions} times (scheduler.max_preemptions = "
                f"{self.limits.max_preemptions}) at t={self.now_s:.6f}s"
            )

    def swap_in_swapped(self, plan: SchedulerOutput) -> None:
        """Bring swapped requests back, oldest first, while blocks and max_num_seqs allow.
        They rejoin the decode batch in this step."""
        bm, step, events = self.block_manager, self.num_steps, self.events
        while self.swapped:
            r = self.swapped[0]
            if len(self.running) >= self.limits.max_num_seqs:
                events.wait(step, r, "swap_in_max_num_seqs", self.limits.max_num_seqs)
                break
            # Its blocks plus the slot of the token it samples next (a victim rolled back
            # by preempt_lower_ranked may have taken that block out with it).
            need = max(blocks_for(r.num_tokens + 1, self.block_size), len(r.block_table))
            extra = need - len(r.block_table)
            if not bm.can_allocate(bm.blocks_to_swap_in(r) + extra, bool(self.running)):
                if not events.extend(step, r, "swap_in_blocks"):
                    free = bm.num_free_gpu_blocks - (bm.watermark_blocks if self.running else 0)
                    events.wait(step, r, "swap_in_blocks", need, max(free, 0))
                break
            self.swapped.popleft()
            events.end_wait(r)
            events.record((step, SWAPPED_IN, id(r), need, 0))
            plan.swap_in.extend(bm.swap_in(r))
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            self.decode_set.add(r)
            if extra:
                bm.allocate(r, 1)

    def abort(self, plan: SchedulerOutput, r: Request, reason: str) -> None:
        """Drop ``r`` (running, or already taken from ``waiting``) for good with ``reason``;
        its blocks are freed and the plan lists it."""
        if r.status is RequestStatus.RUNNING:
            self._leave_running(r)
            plan.spec_decodes.pop(r, None)
        self.block_manager.free(r)
        r.status, r.reason, r.finish_s = RequestStatus.ABORTED, reason, self.now_s
        plan.aborted.append(r)
        self.events.record((self.num_steps, ABORTED, id(r), 0, 0))

    def add_decodes(self, plan: SchedulerOutput) -> SchedulerOutput:
        """Put the whole decode batch in the plan (after ``reserve_decode_blocks``). The
        last move of a plan: if the plan did not try admission, the waiting queue is
        recorded as held, with the reason (swapped requests first, a preemption)."""
        if self._admit_step != self.num_steps and self.waiting:
            if self.swapped or plan.swap_in:
                why = "swapped_first"
            else:
                why = "preempted_step" if plan.preempted else "not_tried"
            self.events.wait_all(self.num_steps, why)
        if self.decode_set:
            plan.decodes = self.decode_set.requests()
            plan.decode_context_tokens = self.decode_set.context_tokens
            plan.decode_tick = self.decode_set.tick
        return plan

    # ------------------------------------------------------------------ invariants
    def check_plan(self, plan: SchedulerOutput) -> None:
        """Invariants of every plan (slow; tests and ``check_invariants`` runs): limits
        respected, no request scheduled twice or both scheduled and preempted, decodes
        holding exactly their blocks, every block owned once.

        Raises:
            AssertionError: naming the broken invariant.
        """
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
                spec_drafts.draft_blocks(self, r, drafts)
                if self.speculative is not None
                else blocks_for(
                    self.decode_set.num_tokens(r) + (r not in self.in_flight.finishing),
                    self.block_size,
                )
            )
            assert len(r.block_table) == need, f"{r.request_id}: {len(r.block_table)} != {need}"
        self.block_manager.check_integrity(list(self.running) + list(self.swapped))

    # ------------------------------------------------------------------ internals
    def _take_waiting(self, r: Request, head: bool) -> None:
        if head:
            self.waiting.popleft()
        else:
            self.waiting.remove(r)

    def _finish(self, r: Request, now_s: float) -> None:
        if r in self.running:
            self.running.remove(r)
        self.block_manager.free(r)
        r.status, r.finish_s = RequestStatus.FINISHED, now_s

    def _leave_running(self, r: Request) -> None:
        self.running.remove(r)
        if r in self.decode_set:
            self.decode_set.remove(r)
        elif r in self.prefilling:
            self.prefilling.remove(r)


def bad_number(options: Mapping[str, Any], key: str, *, null: bool = False) -> str | None:
    """For :meth:`Scheduler.check_options`: ``key: expected ...`` unless ``options[key]`` is a
    finite number >= 0 (or null, when ``null``); None when it is, or when the key is absent."""
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
    """Names of the registered policies, sorted (importing ``policies`` registers the
    built-in ones)."""
    return POLICIES.names()


def get_policy(name: str) -> type[Scheduler]:
    """The policy class registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    return POLICIES.get(name)
