"""KV shortage: decode blocks with preemption, preemption by recompute or swap, swap-in.
Rules: docs/ARCHITECTURE.md, "Scheduler rules"."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from sched_lab.core.errors import SchedulerStuckError, short_repr
from sched_lab.core.events import PREEMPTED, SWAPPED_IN
from sched_lab.core.kv import blocks_for
from sched_lab.core.plan import PreemptionMode, SchedulerOutput
from sched_lab.core.request import EMPTY, Request, RequestStatus

log = logging.getLogger("sched_lab.core.scheduler")


class Preemption:
    """Mixin of :class:`~sched_lab.core.scheduler.Scheduler` (its state lives there); mutates its
    queues, blocks, events and the plan."""

    def _reserve_decode_blocks(self, plan: SchedulerOutput) -> None:
        """:meth:`Scheduler.reserve_decode_blocks` without speculative decoding."""
        bm = self.block_manager
        need = self._needing_block()
        while len(need) > bm.num_free_gpu_blocks:
            if len(self.running) == 1:
                self.abort(
                    plan,
                    self.running[0],
                    f"outgrew the KV cache: needs more than "
                    f"the {bm.num_gpu_blocks} GPU blocks while running alone",
                )
            else:
                self._preempt_victim(plan)
            need = self._needing_block()  # (the decode set changed)
        for r in need:
            bm.allocate(r, 1)

    def _needing_block(self) -> Iterable[Request]:
        """Decodes whose next token starts a block (async: not wasted slots)."""
        need, done = self.decode_set.needing_block(), self.in_flight.finishing
        return [r for r in need if r not in done] if done else need

    def _preempt_victim(self, plan: SchedulerOutput) -> None:
        victim = self.pick_victim()
        self._check_victim(victim, "pick_victim()")
        self.preempt(plan, victim, self.victim_rule)

    def _check_victim(self, victim: Request, hook: str) -> None:
        """SchedulerStuckError naming ``hook`` unless ``victim`` is one of ``preemptable()``."""
        if not isinstance(victim, Request):
            raise SchedulerStuckError(
                f"policy {self.name!r}: {hook} returned {short_repr(victim)}, not a request; "
                f"a victim must be one of self.preemptable()"
            )
        if victim.status is not RequestStatus.RUNNING:
            why = f"it is {victim.status.value}, not running"
        elif not any(v is victim for v in self.running):
            why = "it is not one of self.running (a copy?)"
        elif victim in self.in_flight.finishing:
            why = "its last token is in flight (asynchronous scheduling)"
        elif victim in self.in_flight.parked:
            why = "its drafts in flight may end it (asynchronous scheduling)"
        else:
            return
        raise SchedulerStuckError(
            f"policy {self.name!r}: {hook} chose request {victim.request_id}, which cannot be "
            f"preempted: {why}; a victim must be one of self.preemptable()"
        )

    def preempt_lower_ranked(
        self, plan: SchedulerOutput, r: Request, need: int, rank: Callable[[Request], Any]
    ) -> int | None:
        """Preempt running requests with ``rank(v) > rank(r)``, lowest-ranked first (ties: the
        newest), until waiting ``r``'s ``need`` blocks and a sequence slot are free (a victim's
        block counts once no other request holds it: prefix caching shares blocks). Never
        victims: requests admitted in this plan, (async) those with their last token in
        flight or parked. A victim already in ``plan`` is rolled back out of it.

        Returns:
            The token budget the victims held in ``plan``, or None if no set of victims
            makes room (then nothing is preempted).
        """
        bm, lim = self.block_manager, self.limits
        order = sorted(enumerate(self.running), key=lambda iv: (rank(iv[1]), iv[0]), reverse=True)
        top = rank(r)
        free, running, victims = bm.num_free_gpu_blocks, len(self.running), []
        # With prefix caching a victim frees only the blocks no other request holds, and
        # r's own cached hits it frees are taken again at once (admission looks them up).
        cached = bm.enable_prefix_caching and not r.num_computed_tokens
        hits, released = frozenset(bm.lookup(r)) if cached else frozenset(), Counter[int]()

        def fits() -> bool:
            reserve = bm.watermark_blocks if running else 0
            return running < lim.max_num_seqs and free - need >= reserve

        pinned = self.in_flight.pinned
        for _, v in order:
            if fits() or not rank(v) > top:
                break
            if v in plan.prefills and v.num_computed_tokens == 0:
                continue  # admitted in this plan
            if v in pinned:
                continue  # async: its last token is in flight, or it is parked
            victims.append(v)
            free += bm.num_freed_by(v.block_table, released, hits)
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
        recompute; recorded in ``plan`` and ``events`` with ``why`` (how it was chosen).

        Raises:
            SchedulerStuckError: not one of :meth:`preemptable`, or preempted more than
                ``limits.max_preemptions`` times.
        """
        assert victim not in plan.prefills, "a request is never scheduled and preempted"
        self._check_victim(victim, "preempt()")
        bm = self.block_manager
        self._leave_running(victim)
        plan.spec_decodes.pop(victim, None)
        mode = PreemptionMode.RECOMPUTE
        if self.preemption_mode is PreemptionMode.SWAP:
            if bm.can_swap_out(victim):
                mode = PreemptionMode.SWAP
            else:
                log.debug(
                    "%s: CPU swap space full (%d free blocks, %d needed): request %s is "
                    "recomputed instead",
                    self.name,
                    bm.num_free_cpu_blocks,
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
            plan.swap_out.extend(bm.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            victim.num_preemptions_swap += 1
            self.swapped.append(victim)
        else:
            bm.free(victim)
            victim.num_recomputed_tokens += victim.num_computed_tokens
            victim.num_computed_tokens = 0
            victim.spec_token_ids = EMPTY  # proposals dropped; re-proposed after the re-prefill
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
        """Swap requests back in, oldest first, while blocks and max_num_seqs allow; they
        decode in this step."""
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
