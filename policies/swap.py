"""FCFS with preemption by swap (vLLM V0 with ``preemption_mode="swap"``).

As fcfs, but a preempted request's KV blocks move to CPU swap space and come back (oldest
first, before any new admission) once GPU blocks free up, so no work is recomputed; the
cost is the copy over the host link. When CPU swap space is full the victim is recomputed
instead (logged at debug level; counted as a recompute preemption).
"""

from __future__ import annotations

from lab.core.plan import PreemptionMode
from lab.core.scheduler import register_policy
from policies.fcfs import FCFS


@register_policy("swap")
class Swap(FCFS):
    preemption_mode = PreemptionMode.SWAP
