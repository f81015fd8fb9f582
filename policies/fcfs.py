"""FCFS with preemption by recompute: vLLM V0's default scheduler.

Prefill-first: while waiting requests fit (token budget, max_num_seqs, free blocks above
the watermark), a step prefills whole prompts and running decodes wait. Otherwise the step
decodes every running request; when a decode needs a block and none is free, the newest
running request is preempted and recomputed later from scratch.
"""

from __future__ import annotations

from lab.core.plan import SchedulerOutput
from lab.core.scheduler import Scheduler, register_policy


@register_policy("fcfs")
class FCFS(Scheduler):
    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        if not self.swapped:  # swapped requests come back before new admissions
            self.admit_waiting(plan, self.limits.max_num_batched_tokens)
        if plan.prefills:
            return plan
        self.reserve_decode_blocks(plan)
        if not plan.preempted:
            self.swap_in_swapped(plan)
        return self.add_decodes(plan)
