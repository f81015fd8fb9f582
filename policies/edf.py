"""Earliest deadline first by TTFT deadline; fcfs's prefill-first step otherwise.

Deadline: arrival + ``Request.ttft_slo_s`` (its class's ``slo.ttft_s``), else + the option
``ttft_s``; requests with neither go after all others (FCFS among them). Ties: arrival. A
recomputed request keeps its deadline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sched_lab.core.request import Request
from sched_lab.core.scheduler import bad_number, register_policy
from sched_lab.policies.fcfs import FCFS


@register_policy("edf")
class EDF(FCFS):
    options = {"ttft_s": None}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        return bad_number(options, "ttft_s", null=True)

    def deadline_s(self, r: Request) -> float:
        slo = r.ttft_slo_s if r.ttft_slo_s is not None else self.ttft_s
        return r.arrival_s + (slo if slo is not None else math.inf)

    def admission_order(self) -> list[Request]:
        return sorted(self.waiting, key=lambda r: (self.deadline_s(r), r.arrival_s))
