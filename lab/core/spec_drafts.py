"""Speculative decoding's accounting: drafts under the token budget, their lookahead blocks,
accepted drafts applied after a step. Rules: docs/ARCHITECTURE.md, "Scheduler rules"."""

from __future__ import annotations

from sched_lab.core.kv import blocks_for
from sched_lab.core.plan import SchedulerOutput, StepResult
from sched_lab.core.request import EMPTY, Request, RequestStatus


def _accepted(r: Request, d: int, result: StepResult, step: int) -> int:
    """Drafts of ``r`` accepted in ``step`` (0..d); records them in ``r.spec_steps``."""
    a = result.num_accepted.get(r, 0)
    if not 0 <= a <= d:
        raise ValueError(
            f"step {step}: request {r.request_id}: {a!r} drafts accepted, "
            f"expected 0..{d} (the drafts it verified)"
        )
    if r.spec_steps is EMPTY:
        r.spec_steps = [(step, d, a)]
    else:
        r.spec_steps.append((step, d, a))
    return a


class SpecDrafts:
    """Mixin of :class:`~sched_lab.core.scheduler.Scheduler` (its state lives there); used only when
    ``speculative`` is set."""

    def _lookahead_tokens(self, r: Request) -> int:
        """KV slots a decode needs before its drafts: its tokens, the in-flight step's drafts
        (async) and its sampled slot (none if wasted)."""
        unknown = self.in_flight.drafts().get(r, 0)
        return self.decode_set.num_tokens(r) + unknown + (r not in self.in_flight.finishing)

    def _draft_blocks(self, r: Request, drafts: int) -> int:
        """Blocks a decode holds while it verifies ``drafts`` drafts."""
        return blocks_for(self._lookahead_tokens(r) + drafts, self.block_size)

    def _give_drafts(self, plan: SchedulerOutput) -> None:
        """Set ``plan.spec_decodes``: d' = min(proposals, k, budget left, tokens left after
        the decode's own one), in ``running`` order. Async: the drafts in flight count as
        accepted, so no step samples past a request's end; an end by "stop" keeps one
        token more in hand (the step that samples its last token has no drafts)."""
        ds, k = self.decode_set, self.speculative.num_speculative_tokens
        budget = self.limits.max_num_batched_tokens - len(ds)
        spec = plan.spec_decodes
        # Async: drafts of the step in flight, accepted or not (unknown yet), and the
        # requests it samples, whose proposals (made on the device) are k placeholders.
        flight = self.in_flight.plan
        unknown = self.in_flight.drafts()
        sampling = set(flight.decodes) | set(flight.sampled_prefills) if flight else set()
        finishing = self.in_flight.finishing
        for r in self.running:
            if budget <= 0:
                break
            if r in ds and r not in finishing:
                props = k if r in sampling else len(r.spec_token_ids)
                most = ds.num_tokens(r) + unknown.get(r, 0) - r.prompt_len  # output tokens
                margin = 2 if flight is not None and not r.end_foreseen else 1
                d = min(props, k, r.output_len - most - margin, budget)
                if d > 0:
                    spec[r] = d
                    budget -= d

    def _reserve_draft_blocks(self, plan: SchedulerOutput) -> None:
        """``reserve_decode_blocks`` with drafts: blocks for L + d' + 1 tokens per decode,
        preempting ``pick_victim`` while short (alone: drafts cut, abort if one token does
        not fit)."""
        bm, ds, bs = self.block_manager, self.decode_set, self.block_size
        if self.in_flight.plan is not None:
            self._park_maybe_ended()
        self._give_drafts(plan)
        spec = plan.spec_decodes
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
                    d = min(room * bs - self._lookahead_tokens(r), planned)
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
                self._preempt_victim(plan)
            for r in [r for r in need if r not in ds]:
                total -= need.pop(r)
        for r, n in need.items():
            if n > 0:
                bm.allocate(r, n)

    def _park_maybe_ended(self) -> None:
        """Async: decodes (ends by length) whose drafts in flight, if all accepted, give
        them their last token leave the decode set for the plan being made (``parked``);
        :meth:`_apply_drafts_async` ends them or puts them back. vLLM likewise schedules no
        token past a request's max_tokens, so no slot is wasted on an end drafts reached."""
        ds, flight = self.decode_set, self.in_flight
        for r, d in flight.drafts().items():
            if r in ds and r.end_foreseen and ds.num_tokens(r) - r.prompt_len + d >= r.output_len:
                ds.remove(r)
                flight.parked[r] = None

    def _apply_drafts(
        self, plan: SchedulerOutput, result: StepResult, step: int, now_s: float
    ) -> None:
        """Sync, after the decode tick: accepted drafts become tokens, rejected ones free
        their slots; decodes take their new proposals."""
        ds, bm, bs = self.decode_set, self.block_manager, self.block_size
        for r, d in plan.spec_decodes.items():
            a = _accepted(r, d, result, step)
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
        drafts = result.draft_token_ids
        for r in (*plan.decodes, *plan.sampled_prefills):
            if r.status is RequestStatus.RUNNING:
                r.spec_token_ids = drafts.get(r, [])

    def _apply_drafts_async(
        self, plan: SchedulerOutput, result: StepResult, after: SchedulerOutput | None
    ) -> None:
        """Async, ``plan``'s results with ``after`` (or None) in flight: accepted drafts join
        the counts and surplus lookahead blocks are freed; a parked request ends (its drafts
        reached its end) or rejoins the decode set; one whose last token ``after`` samples
        joins its ``finished`` (:meth:`_ends_with`)."""
        ds, bm, bs, flight = self.decode_set, self.block_manager, self.block_size, self.in_flight
        step = self.num_steps - 1 - (after is not None)  # plan's index
        later = after.spec_decodes if after is not None else {}
        for r, d in plan.spec_decodes.items():
            a = _accepted(r, d, result, step)
            if r.status is RequestStatus.RUNNING and r in flight.parked:
                del flight.parked[r]
                r.num_output_tokens += a
                r.num_computed_tokens += a
                if r.num_output_tokens >= r.output_len:  # its drafts reached the end
                    self._finish(r, self.now_s)
                    continue
                ds.add(r)  # it decodes again in the next plan
                bm.free_tail(r, len(r.block_table) - blocks_for(ds.num_tokens(r), bs))
            elif r.status is RequestStatus.RUNNING and r in ds:
                if a:
                    ds.remove(r)
                    r.num_output_tokens += a
                    r.num_computed_tokens += a
                    if r.num_output_tokens >= r.output_len and not flight.samples(r):
                        self._finish(r, self.now_s)  # (``after`` does not decode it)
                        continue
                    ds.add(r)  # no heap entry when ``after`` samples its last token:
                    if r.num_output_tokens >= r.output_len:  # it ends with ``after``
                        self._ends_with(after, r)
                keep = blocks_for(ds.num_tokens(r) + later.get(r, 0), bs)
                bm.free_tail(r, len(r.block_table) - keep)
            elif r.status is RequestStatus.WAITING:  # a recompute victim: redone later
                r.num_output_tokens += a
                r.num_recomputed_tokens += a
            elif r.status is RequestStatus.SWAPPED:
                r.num_output_tokens += a
                r.num_computed_tokens += a
                bm.free_tail(r, len(r.block_table) - blocks_for(r.num_tokens, bs))
        drafts = result.draft_token_ids
        for r in (*plan.decodes, *plan.sampled_prefills):
            if r.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED):
                r.spec_token_ids = drafts.get(r, [])
            elif r.status is RequestStatus.WAITING:
                r.spec_token_ids = []

    def _ends_with(self, after: SchedulerOutput, r: Request) -> None:
        """Async: accepted drafts just showed that ``after``, in flight, samples the last
        token of ``r`` (a decode set member with no heap entry). An end by length leaves
        ``running`` now (as at a launch); a "stop" end stays for its wasted slot."""
        after.finished = [*after.finished, r]  # may be a shared empty tuple
        if r.end_foreseen:
            self.decode_set.remove(r)
            self._end_foreseen(r)
        else:
            self.in_flight.finishing[r] = None
