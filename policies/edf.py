"""Earliest deadline first by TTFT deadline; fcfs's prefill-first step otherwise.

A request's deadline is its arrival plus the TTFT SLO of its workload class
(``Request.ttft_slo_s``, from ``slo.ttft_s`` of its class in ``trace:``, else the top-level
``slo.ttft_s``), else plus the option ``ttft_s``; a request with neither has no deadline and
goes after every one that has (FCFS among them). Waiting requests are admitted earliest
deadline first (ties: arrival). A recomputed request keeps its deadline, long past: it goes
first. EDF is optimal for meeting deadlines when the load is feasible and degrades badly
when it is not (every request is late); compare with the SLO attainment per class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lab.core.request import Request
from lab.core.scheduler import bad_number, register_policy
from policies.fcfs import FCFS


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
