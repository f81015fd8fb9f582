"""Priority scheduling with vLLM's semantics (vLLM V1 ``--scheduling-policy priority``).

Steps as chunked_prefill; admission in (priority, arrival) order, lower first; the victim
is the largest (priority, arrival). ``priority_preemption: true`` also preempts strictly
lower-priority running requests to admit a waiting one that does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.request import Request
from sched_lab.core.scheduler import register_policy
from sched_lab.policies.chunked_prefill import ChunkedPrefill


@register_policy("priority")
class Priority(ChunkedPrefill):
    preemption_victim = "lowest_priority"
    options = {"priority_preemption": False}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        if not isinstance(options.get("priority_preemption", False), bool):
            got = options["priority_preemption"]
            return f"priority_preemption: expected true or false, got {got!r}"
        return None

    def admission_order(self) -> list[Request]:
        return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_s))

    def make_room(self, plan: SchedulerOutput, r: Request, need: int) -> int | None:
        if not self.priority_preemption:
            return None
        return self.preempt_lower_ranked(plan, r, need, rank=lambda v: v.priority)
