"""Chunked prefill, decode-first (Sarathi-Serve, OSDI'24 §4; vLLM V1's scheduler).

Each step spends one token budget (max_num_batched_tokens) in this order: one token for
every decoding request, then the next chunk of prompts already being prefilled (oldest
first), then chunks of new prompts. Decodes never stall behind a long prompt, which keeps
the inter-token latency tail low; prompts take several steps, which costs TTFT. A prompt's
blocks are allocated whole when it is admitted (as Sarathi-Serve and vLLM V0 do), so only
decodes grow; when they cannot, the newest running request is recomputed.
"""

from __future__ import annotations

from lab.core.plan import SchedulerOutput
from lab.core.scheduler import Scheduler, register_policy


@register_policy("chunked_prefill")
class ChunkedPrefill(Scheduler):
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
