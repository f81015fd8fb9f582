"""FCFS with preemption by recompute: vLLM V0's default scheduler.

Prefill-first: while waiting requests fit, a step prefills whole prompts; otherwise it
decodes every running request, recomputing the newest when a decode needs a block.
"""

from __future__ import annotations

from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.scheduler import Scheduler, register_policy


@register_policy("fcfs")
class FCFS(Scheduler):
    fast_forward = True  # lab/core/scheduler.py: the plan depends on queues and blocks only

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
