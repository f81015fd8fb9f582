"""Shortest remaining processing time: SJF ranked by predicted output tokens still to
generate (bucketed: by bucket alone). ``preempt_longer: true`` lets a waiting request that
does not fit preempt running ones with more left.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.request import Request
from sched_lab.core.scheduler import register_policy
from sched_lab.policies.sjf import SJF


@register_policy("srpt")
class SRPT(SJF):
    options = {**SJF.options, "preempt_longer": False}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        if not isinstance(options.get("preempt_longer", False), bool):
            return f"preempt_longer: expected true or false, got {options['preempt_longer']!r}"
        return super().check_options(options, tenants)

    def job_size(self, r: Request) -> float:
        if self.predictor == "bucketed":
            return self._predicted[r]
        tokens = self.decode_set.num_tokens(r) if r in self.decode_set else r.num_tokens
        return max(self._predicted[r] - (tokens - r.prompt_len), 0.0)

    def make_room(self, plan: SchedulerOutput, r: Request, need: int) -> int | None:
        if not self.preempt_longer:
            return None
        return self.preempt_lower_ranked(plan, r, need, rank=self.rank)
