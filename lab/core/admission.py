"""Admission: waiting requests join the running batch. Rules: docs/ARCHITECTURE.md,
"Scheduler rules"."""

from __future__ import annotations

from collections.abc import Sequence

from sched_lab.core.events import ADMITTED
from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.request import Request, RequestStatus

_NO_ADAPTERS: frozenset[str] = frozenset()  # the adapters admission pins without LoRA


class Admission:
    """Mixin of :class:`~sched_lab.core.scheduler.Scheduler` (its state lives there); mutates its
    queues, blocks, events and the plan."""

    def admit_waiting(self, plan: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in :meth:`admission_order` while limits and blocks allow,
        stopping at the first that does not fit even after :meth:`make_room` (recorded in
        ``events``); with LoRA (``self.lora``) one whose adapter finds no slot is skipped
        and its adapter loaded when admitted (lab/core/lora.py). A chunked policy's last
        admission may get a partial chunk. Cached
        prefixes are looked up at admission. Returns the budget left."""
        bm, queue, max_seqs = self.block_manager, self.waiting, self.limits.max_num_seqs
        self._admit_step = step = self.num_steps
        if self._admitted:  # (an empty one is kept: most plans admit nobody)
            self._admitted = set()
        if not queue:
            return budget
        events = self.events
        caching = bm.enable_prefix_caching
        order = self.admission_order()
        lora, pinned, skipped = self.lora, _NO_ADAPTERS, False
        if lora is not None:  # a request whose adapter finds no slot is skipped, not a stop
            plan.lora = True
            pinned = {q.lora_name for q in (*self.running, *self.swapped) if q.lora_name}
            order = list(order) if order is queue else order
        custom = iter(order) if order is not queue else None
        while queue and budget > 0:
            r = queue[0] if custom is None else next(custom, None)
            if r is None:
                break
            if r in self.in_flight.held:  # async: a recompute victim whose token is in flight
                events.wait(step, r, "token_in_flight")
                break
            if lora is not None and not lora.fits(r.lora_name, pinned):
                if not skipped:  # the first skipped request records the wait, as a stop does
                    events.wait(step, r, "max_loras", lora.max_loras)
                    skipped = True
                continue
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
            if len(self.running) >= max_seqs or not bm.can_allocate(taken, bool(self.running)):
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
            if not bm.can_allocate(taken, bool(self.running)):  # (use_watermark)
                if (
                    not (self.running or self.swapped or self.held)
                    and taken > bm.num_free_gpu_blocks
                ):
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
            self._admit(plan, r, hits, need, num_new)
            if lora is not None and r.lora_name:
                plan.num_lora_loads += lora.acquire(r.lora_name, pinned)
                pinned.add(r.lora_name)
            budget -= num_new
        else:  # stopped by the loop's condition: the budget is spent
            r = (queue[0] if custom is None else next(custom, None)) if queue else None
            if r is not None:
                events.wait(step, r, "budget_spent")
        return budget

    def _admit(
        self, plan: SchedulerOutput, r: Request, hits: Sequence, need: int, num_new: int
    ) -> None:
        """Start ``r`` (taken from ``waiting``): ``need`` new blocks plus cached ``hits``, a
        chunk of ``num_new`` tokens in ``plan``, a place in ``running``."""
        self.events.end_wait(r)
        self.events.record((self.num_steps, ADMITTED, id(r), need, num_new))
        self._admitted.add(r)
        if self.block_manager.enable_prefix_caching and not r.num_computed_tokens:
            self._admit_cached(plan, r, hits, need)
        else:
            self.block_manager.allocate(r, need)
        r.status = RequestStatus.RUNNING
        if r.first_scheduled_s < 0:
            r.first_scheduled_s = self.now_s
        self.running.append(r)
        if num_new < r.num_tokens - r.num_computed_tokens:
            self.prefilling.append(r)
        plan.prefills[r] = num_new

    def _admit_cached(
        self, plan: SchedulerOutput, r: Request, hits: Sequence, num_new_blocks: int
    ) -> None:
        """Reference ``hits``, allocate the rest, skip the cached tokens and count them
        (``num_cached_tokens``, or ``num_resumed_cached_tokens`` after a recompute; both in
        the plan's)."""
        self.block_manager.allocate_cached(r, hits, num_new_blocks)
        cached = len(hits) * self.block_size
        r.num_computed_tokens = cached
        if r.first_scheduled_s < 0:
            r.num_cached_tokens = cached
        else:
            r.num_resumed_cached_tokens += cached
        plan.num_cached_tokens += cached
        plan.num_cached_blocks += len(hits)
