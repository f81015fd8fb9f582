"""FCFS with preemption by swap (vLLM V0 with ``preemption_mode="swap"``): victims' blocks
go to CPU and come back (oldest first, before new admissions); recompute when CPU is full.
"""

from __future__ import annotations

from sched_lab.core.plan import PreemptionMode
from sched_lab.core.scheduler import register_policy
from sched_lab.policies.fcfs import FCFS


@register_policy("swap")
class Swap(FCFS):
    fast_forward = True  # lab/core/scheduler.py: the plan depends on queues and blocks only
    preemption_mode = PreemptionMode.SWAP
