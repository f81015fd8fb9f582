"""Scheduler state and the mechanics every policy shares; the policy registry.

A policy (policies/<name>.py) subclasses :class:`Scheduler` and writes one method,
``schedule()``, from the helpers here: admit waiting requests, reserve decode blocks with
preemption, swap in. The helpers mutate the queues and the block manager and record what
they did in the step's plan, as vLLM's scheduler does.

Token and block conventions (vLLM V0's block manager):
* A request holds ``num_tokens`` = prompt + output tokens so far. A step feeds new tokens
  (a prompt chunk, or the latest sampled token of a decode), writing their KV, and samples
  a token when it feeds the last one.
* The slot of a sampled token is reserved in the step that samples it, so after every step
  a request holds ceil(num_tokens / block_size) blocks. Example (block size 4, prompt 3,
  output 6): blocks held during steps 1..6 are 1, 2, 2, 2, 2, 3.
* Admission allocates the blocks of the request's whole prompt (plus the sampled slot) at
  once, also when the prompt is computed in chunks (vLLM V0 and Sarathi-Serve do so; V1
  allocates chunk by chunk, which under KV pressure preempts half-computed prompts over
  and over). After admission only decodes need new blocks.
* Recompute preemption drops all KV; the request re-enters ``waiting`` at the front and its
  re-prefill feeds prompt + output tokens so far, sampling the next token.
* Prefix cache (lab/core/kv.py PrefixCachingBlockManager, rules there): admission looks
  the cached prefix up at that moment and the prefill starts after it; a recompute victim
  drops its references but its blocks keep their keys, so its re-admission finds what is
  still cached (counted apart, ``Request.num_resumed_cached_tokens``).

Asynchronous scheduling (``async_scheduling=True``; vLLM V1's AsyncScheduler). The replay
loop plans step N+1 after step N's plan is handed to the executor and before N's results
are known. :meth:`Scheduler.update` is split in two: :meth:`Scheduler.launched` (the plan
was handed over: token counts advance, the tokens sampled in N are placeholders) and
``update`` (N's results arrive: token ids, finishes, frees); a sync run applies both at once,
in ``update``. So, with N in flight while N+1 is planned:

* a request whose prompt's last chunk is in N decodes in N+1 (feeding the placeholder), and
  a decode of N decodes again in N+1;
* a request whose last output token is sampled in N is still decoded in N+1 if N+1 has
  decodes (the trace's ``output_len`` stands for an EOS stop the scheduler cannot foresee):
  that slot is wasted, counted in ``SchedulerOutput.num_wasted_tokens``, and its token is
  dropped. Its blocks are freed when N's results arrive, after N+1 was planned: one step
  late; its finish time and token times are those of step N. Its wasted token is never
  written to KV, so it needs no new block, and it is never a preemption victim (its blocks
  free in a step anyway). Exact rule: every FINISHED request wastes one slot, except when
  the step after its last token runs no decode (a prefill-first step of fcfs and its kin);
* a request preempted in N+1 with its token of N in flight keeps that token (it was
  computed from correct KV). Swap: the token is fed after the swap-in. Recompute: the
  victim is not re-admitted by the plan made while the token is in flight (it waits, reason
  ``token_in_flight``), so its re-prefill feeds only known tokens;
* a plan that feeds no token is never launched: the loop waits for the step in flight and
  plans again (with nothing in flight it is an error, as in sync runs).

With a step time that has no host part the clock is the same as a sync run's, but the plans
differ: requests that arrive while N runs are seen by N+2's plan (N+1 was planned before
they arrived), and blocks and sequence slots of requests that finish in N free for N+2.

Speculative decoding (``speculative=``, lab/core/spec.py; vLLM V1's accounting). After a
step, the executor's proposals for each sampled request become ``Request.spec_token_ids``.
* Budget: :meth:`reserve_decode_blocks` gives every decode its one token first, then drafts
  to decodes in ``running`` order (admission order, as vLLM schedules its running requests)
  while the step's token budget lasts: a decode holding L tokens verifies d' = min(its
  proposals, k, budget left, output_len - output tokens - 1) drafts, so a request never
  drafts past its end. It runs before any prefill chunk of chunked policies, so drafts
  take budget before prompt chunks (prefill-first policies decode in steps without
  prefills). vLLM would instead cut a running request's own token when the budget is
  gone; here every decode always feeds its token (max_num_seqs <= the budget).
* KV slots: blocks for L + d' + 1 tokens (the d' drafts and the sampled slot) are held
  before the step; when free blocks are short, :meth:`pick_victim` is preempted as for a
  decode that needs a block (a request running alone has its drafts cut to what fits
  instead, and is aborted only if even its one token does not fit).
* After the step (:meth:`update`), with a of the d' drafts accepted, the request gains
  a + 1 tokens (L + a + 1), ``num_computed_tokens`` = L + a (the rejected drafts' KV is
  rolled back) and blocks beyond ceil((L + a + 1) / block_size) are freed. The decode set
  still advances every member by one; members that gained extra tokens leave and re-join
  it (O(spec decodes) per step; with speculation off nothing changes and a step stays
  O(1)). ``Request.spec_steps`` records (step, d', a); the extra tokens' times are the
  step's end.
* Preemption: recompute drops the proposals (the re-prefill feeds known tokens only, then
  the executor proposes anew); swap keeps them (they still continue the swapped request's
  tokens), used in the first step after it is back in the decode batch. Prefix cache: only
  blocks full of accepted tokens are ever keyed (``num_computed_tokens`` counts no rejected
  draft).
* With asynchronous scheduling, step N+1 is planned before N's acceptance is known. A
  request that samples in N gets k placeholder proposals for N+1 (made on the device in N,
  as vLLM's async scheduler assumes); its counts are the known ones plus N's placeholder
  (N's accepted drafts join when N's results arrive); its lookahead blocks cover N's drafts
  too (any may be accepted: L + d'_N + d'_{N+1} + 1 slots) and the drafts of N+1 stop two
  tokens short of the end counting all of N's drafts as accepted, so no step with drafts
  samples a request's last token and finishes keep async's rule (one wasted slot each).
  When N's results arrive the unneeded lookahead blocks are freed and a request whose last
  token N+1 samples (found only now) joins N+1's ``finished``. A request preempted while its
  drafts are in flight gains the accepted ones then (recompute: redone by its re-prefill;
  swap: its CPU tail beyond them is freed). Positions of N+1's decodes in the plan are the
  known lower bound (an engine adds N's accepted count on the device).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from lab.core.decode_set import DecodeSet
from lab.core.errors import ConfigError, SchedulerStuckError
from lab.core.events import (
    ABORTED,
    ADMITTED,
    PREEMPTED,
    PREFILL,
    SWAPPED_IN,
    EventLog,
)
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
        # Asynchronous scheduling (module doc). ``_finishing``: requests whose last token a
        # launched step samples, until its results arrive; ``_in_flight``: the plan launched
        # last whose results have not arrived; ``_held``: recompute victims whose token of
        # ``_in_flight`` is not known yet (not re-admitted until it is).
        self.async_scheduling = async_scheduling
        self._finishing: dict[Request, None] = {}
        self._in_flight: SchedulerOutput | None = None
        self._in_flight_decodes: set[Request] | None = None
        self._held: set[Request] = set()
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
        if not self.async_scheduling:
            spec = plan.spec_decodes
            for r, token in result.sampled_token_ids.items():
                if r in spec:  # the accepted drafts come before the sampled token
                    r.output_token_ids.extend(r.spec_token_ids[: result.num_accepted.get(r, 0)])
                r.output_token_ids.append(token)
            step_index = self.num_steps
            self._advance(plan, now_s)
            if self.speculative is not None:
                self._apply_drafts(plan, result, step_index, now_s)
            return
        spec = plan.spec_decodes
        for r, token in result.sampled_token_ids.items():
            if r.status is not RequestStatus.FINISHED:  # a wasted slot's token is dropped
                if r in spec:  # the accepted drafts come before the sampled token
                    r.output_token_ids.extend(r.spec_token_ids[: result.num_accepted.get(r, 0)])
                r.output_token_ids.append(token)
        for r in plan.finished:  # state as of the tick that sampled the last token
            del self._finishing[r]
            self.decode_set.remove(r, r.join_tick + r.output_len - r.join_num_output)
            self._finish(r, now_s)
        self._held.clear()  # their tokens of this step are known now
        after = self._in_flight if self._in_flight is not plan else None
        if self._in_flight is plan:
            self._in_flight = None
        if self.speculative is not None:
            self._apply_drafts_async(plan, result, after)

    def launched(self, plan: SchedulerOutput) -> None:
        """Asynchronous scheduling: ``plan`` was handed to the executor (after it read the
        plan's inputs). Advances decodes and prompt chunks with placeholder tokens and sets
        the plan's ``num_wasted_tokens``, ``sampled_prefills`` and ``finished``; requests
        that sampled their last token stay running until :meth:`update`. Mutates requests
        and the decode set."""
        self._advance(plan, None)
        self._in_flight, self._in_flight_decodes = plan, None

    def _advance(self, plan: SchedulerOutput, now_s: float | None) -> None:
        """Advance the counts of ``plan``'s decodes and chunks (the step's sampled tokens
        join). ``now_s``: a sync step's end time, when requests that sampled their last
        token finish; None (async): they stay in the decode set for one more (wasted) slot."""
        step_index = self.num_steps
        self.num_steps += 1
        finishing = self._finishing
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

    def _apply_drafts(self, plan: SchedulerOutput, result: StepResult, step: int, now_s: float):
        """Speculative decoding, after the decode tick: accepted drafts become tokens,
        rejected ones give back their KV slots; every decode takes its new proposals."""
        ds, bm, bs = self.decode_set, self.block_manager, self.block_size
        accepted, drafts = result.num_accepted, result.draft_token_ids
        for r, d in plan.spec_decodes.items():
            a = accepted.get(r, 0)
            if not 0 <= a <= d:
                raise ValueError(
                    f"step {step}: request {r.request_id}: {a!r} drafts accepted, "
                    f"expected 0..{d} (the drafts it verified)"
                )
            r.spec_steps.append((step, d, a))
            if a:  # leave the decode set (its state is written back), gain a tokens
                ds.remove(r)
                r.num_output_tokens += a
                r.num_computed_tokens += a
            bm.free_tail(
                r,
                len(r.block_table)
                - blocks_for(r.prompt_len + r.num_output_tokens if a else ds.num_tokens(r), bs),
            )
            if a and r.num_output_tokens >= r.output_len:
                self._finish(r, now_s)
            elif a:
                ds.add(r)
        for r in (*plan.decodes, *plan.sampled_prefills):
            if r.status is RequestStatus.RUNNING:
                r.spec_token_ids = drafts.get(r, [])

    def _apply_drafts_async(
        self, plan: SchedulerOutput, result: StepResult, after: SchedulerOutput | None
    ) -> None:
        """:meth:`_apply_drafts` under asynchronous scheduling, when ``plan``'s results
        arrive and ``after`` (the next plan, or None) is in flight: the accepted drafts join
        the counts (of a request preempted meanwhile too), blocks beyond what the request
        and ``after``'s drafts of it need are freed, and a request whose last token
        ``after`` samples becomes one of its ``finished`` (module doc)."""
        ds, bm, bs = self.decode_set, self.block_manager, self.block_size
        accepted, drafts = result.num_accepted, result.draft_token_ids
        step = self.num_steps - 1 - (after is not None)  # plan's index
        later = after.spec_decodes if after is not None else {}
        for r, d in plan.spec_decodes.items():
            a = accepted.get(r, 0)
            if not 0 <= a <= d:
                raise ValueError(
                    f"step {step}: request {r.request_id}: {a!r} drafts accepted, "
                    f"expected 0..{d} (the drafts it verified)"
                )
            r.spec_steps.append((step, d, a))
            if r.status is RequestStatus.RUNNING and r in ds:
                if a:
                    ds.remove(r)
                    r.num_output_tokens += a
                    r.num_computed_tokens += a
                    ds.add(r)  # no heap entry when ``after`` samples its last token:
                    if r.num_output_tokens >= r.output_len:  # it finishes with ``after``
                        self._finishing[r] = None
                        after.finished = [*after.finished, r]  # may be a shared empty tuple
                keep = blocks_for(ds.num_tokens(r) + later.get(r, 0), bs)
                bm.free_tail(r, len(r.block_table) - keep)
            elif r.status is RequestStatus.WAITING:  # a recompute victim: redone later
                r.num_output_tokens += a
                r.num_recomputed_tokens += a
            elif r.status is RequestStatus.SWAPPED:
                r.num_output_tokens += a
                r.num_computed_tokens += a
                bm.free_tail(r, len(r.block_table) - blocks_for(r.num_tokens, bs))
        for r in (*plan.decodes, *plan.sampled_prefills):
            if r.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED):
                r.spec_token_ids = drafts.get(r, [])
            elif r.status is RequestStatus.WAITING:
                r.spec_token_ids = []

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
        self._finishing, self._in_flight = {}, None
        self._held.clear()
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
        least two running): the largest key of the ``preemption_victim`` rule
        (:data:`VICTIM_RULES`), ties to the newest. Default rule: the newest (vLLM V0's)."""
        done = self._finishing  # async: never a request whose last token is in flight
        if self.preemption_victim == "newest":
            if not done:
                return self.running[-1]
            return next(r for r in reversed(self.running) if r not in done)
        key = VICTIM_RULES[self.preemption_victim]
        candidates = [(i, r) for i, r in enumerate(self.running) if r not in done]
        return max(candidates, key=lambda ir: (key(self, ir[1]), ir[0]))[1]

    def make_room(self, plan: SchedulerOutput, r: Request, need: int) -> int | None:
        """Called by :meth:`admit_waiting` when waiting request ``r`` does not fit (``need``
        blocks, or no free sequence slot): preempt running requests for it, or not.
        Returns the token budget the victims held in ``plan`` (see
        :meth:`preempt_lower_ranked`), or None to stop admitting. Default: None."""
        return None

    # ------------------------------------------------------------------ queries
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
            if r in self._held:  # async: a recompute victim whose token is in flight
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
            return self._reserve_draft_blocks(plan)
        while len(self._needing_block()) > bm.num_free_gpu_blocks:
            if len(self.running) == 1:
                self.abort(
                    plan,
                    self.running[0],
                    f"outgrew the KV cache: needs more than "
                    f"the {bm.num_gpu_blocks} GPU blocks while running alone",
                )
            else:
                self.preempt(plan, self.pick_victim(), self.victim_rule)
        for r in self._needing_block():
            bm.allocate(r, 1)

    def _reserve_draft_blocks(self, plan: SchedulerOutput) -> None:
        """:meth:`reserve_decode_blocks` with speculative decoding (module docstring):
        drafts from the budget left after one token per decode, then the blocks of
        L + d' + 1 tokens per decode. O(batch) per step (plus O(batch) per preemption)."""
        bm, ds, bs = self.block_manager, self.decode_set, self.block_size
        k = self.speculative.num_speculative_tokens
        budget = self.limits.max_num_batched_tokens - len(ds)
        spec = plan.spec_decodes
        # Async: drafts of the step in flight, accepted or not (unknown yet), and the
        # requests it samples, whose proposals (made on the device) are k placeholders.
        flight = self._in_flight
        unknown = flight.spec_decodes if flight is not None else {}
        sampling = set(flight.decodes) | set(flight.sampled_prefills) if flight else set()
        margin = 2 if flight is not None else 1  # async: the last token has no drafts
        finishing = self._finishing
        for r in self.running:
            if budget <= 0:
                break
            if r in ds and r not in finishing:
                props = k if r in sampling else len(r.spec_token_ids)
                most = ds.num_tokens(r) + unknown.get(r, 0) - r.prompt_len  # output tokens
                d = min(props, k, r.output_len - most - margin, budget)
                if d > 0:
                    spec[r] = d
                    budget -= d
        need = {
            r: self._draft_blocks(r, spec.get(r, 0)) - len(r.block_table) for r in ds.requests()
        }
        total = sum(need.values())
        while total > bm.num_free_gpu_blocks:
            if len(self.running) == 1:
                r = self.running[0]
                planned = spec.pop(r, 0)
                if planned:  # alone: cut its drafts to what fits
                    room = len(r.block_table) + bm.num_free_gpu_blocks
                    d = min(room * bs - self._draft_blocks_tokens(r), planned)
                    if d > 0:
                        spec[r] = d
                    need[r] = self._draft_blocks(r, max(d, 0)) - len(r.block_table)
                    total = need[r]
                    continue
                self.abort(
                    plan,
                    r,
                    f"outgrew the KV cache: needs more than "
                    f"the {bm.num_gpu_blocks} GPU blocks while running alone",
                )
            else:
                self.preempt(plan, self.pick_victim(), self.victim_rule)
            for r in [r for r in need if r not in ds]:
                total -= need.pop(r)
        for r, n in need.items():
            if n > 0:
                bm.allocate(r, n)

    def _draft_blocks_tokens(self, r: Request) -> int:
        """KV slots a decode needs before its drafts: its tokens, the drafts of the step in
        flight (async; any may be accepted) and the slot it samples into (none for a wasted
        slot)."""
        flight = self._in_flight
        unknown = flight.spec_decodes.get(r, 0) if flight is not None else 0
        return self.decode_set.num_tokens(r) + unknown + (r not in self._finishing)

    def _draft_blocks(self, r: Request, drafts: int) -> int:
        """Blocks a decode holds while it verifies ``drafts`` drafts."""
        return blocks_for(self._draft_blocks_tokens(r) + drafts, self.block_size)

    def _needing_block(self) -> Iterable[Request]:
        """Decodes whose next token starts a block; async: not a wasted slot (its token is
        never written to KV)."""
        need = self.decode_set.needing_block()
        if self._finishing:
            return [r for r in need if r not in self._finishing]
        return need

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
            if v in self._finishing:
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
            if self._in_flight is not None and self._samples_in_flight(victim):
                self._held.add(victim)
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
                self._draft_blocks(r, drafts)
                if self.speculative is not None
                else blocks_for(
                    self.decode_set.num_tokens(r) + (r not in self._finishing), self.block_size
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

    def _samples_in_flight(self, r: Request) -> bool:
        """Whether the step in flight samples a token for ``r`` (async scheduling)."""
        plan = self._in_flight
        if plan is None:
            return False
        if self._in_flight_decodes is None:
            self._in_flight_decodes = set(plan.decodes)
        return r in self._in_flight_decodes or r in plan.sampled_prefills

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
