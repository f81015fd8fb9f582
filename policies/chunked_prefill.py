"""Chunked prefill, decode-first (Sarathi-Serve, OSDI'24 §4; vLLM V1's scheduler).

Each step's token budget (max_num_batched_tokens) goes to one token per decode, then the
chunks of prompts being prefilled (oldest first), then new prompts. When decodes run out of
blocks, the newest running request is recomputed.
"""

from __future__ import annotations

from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.scheduler import Scheduler, register_policy


@register_policy("chunked_prefill")
class ChunkedPrefill(Scheduler):
    fast_forward = True  # lab/core/scheduler.py: the plan depends on queues and blocks only
    chunked_prefill = True

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        self.reserve_decode_blocks(plan)
        # One token per decode, plus the drafts they verify (speculative decoding).
        budget = self.limits.max_num_batched_tokens - len(self.decode_set) - plan.num_spec_tokens
        for r in self.prefilling:  # their prompts' blocks are held since admission
            if budget == 0:
                break
            chunk = min(budget, r.num_tokens - r.num_computed_tokens)
            plan.prefills[r] = chunk
            budget -= chunk
        if not plan.preempted:
            self.admit_waiting(plan, budget)
        return self.add_decodes(plan)
