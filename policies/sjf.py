"""Shortest job first by predicted output length, with aging; fcfs's prefill-first step.

Admission: shortest prediction first (ties: arrival). ``predictor``, applied on arrival:
``oracle`` (the true length), ``noisy`` (true length * exp(sigma * z), z ~ N(0, 1) seeded by
(``seed``, request id)) or ``bucketed`` (the bucket of the noisy length among ``buckets``).
Aging: a request that waited ``max_wait_s`` goes ahead of younger ones (FCFS among them);
``aging_tokens_per_s`` lowers its key by that many tokens (buckets) per second waited.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Mapping
from typing import Any

from sched_lab.core.request import Request
from sched_lab.core.scheduler import bad_number, register_policy
from sched_lab.policies.fcfs import FCFS

PREDICTORS = ("oracle", "noisy", "bucketed")


@register_policy("sjf")
class SJF(FCFS):
    options = {
        "predictor": "oracle",
        "sigma": 0.0,
        "buckets": [64, 256, 1024],
        "seed": 0,
        "max_wait_s": None,
        "aging_tokens_per_s": 0.0,
    }

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        o = {**cls.options, **options}
        if o["predictor"] not in PREDICTORS:
            return f"predictor: expected one of {', '.join(PREDICTORS)}, got {o['predictor']!r}"
        b = o["buckets"]
        if not isinstance(b, list) or not b or any(bad_number({"": x}, "") for x in b):
            b = None
        if b is None or b != sorted(set(b)):
            return f"buckets: expected increasing bucket edges in tokens, got {o['buckets']!r}"
        if isinstance(o["seed"], bool) or not isinstance(o["seed"], int):
            return f"seed: expected an integer, got {o['seed']!r}"
        if not bad_number(o, "sigma") and o["sigma"] > 20:  # exp(20 z) overflows floats
            return f"sigma: expected a number in [0, 20] (log-normal error), got {o['sigma']!r}"
        if o["predictor"] == "oracle" and o["sigma"] != 0:  # sigma would be ignored
            return f"sigma: expected 0 with predictor oracle (use noisy), got {o['sigma']!r}"
        return (
            bad_number(o, "sigma")
            or bad_number(o, "aging_tokens_per_s")
            or bad_number(o, "max_wait_s", null=True)
        )

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._predicted: dict[Request, float] = {}

    def add(self, request: Request, now_s: float) -> bool:
        self._predicted[request] = self.predict(request)
        return super().add(request, now_s)

    def predict(self, r: Request) -> float:
        """Predicted output tokens (a bucket index when bucketed)."""
        length = float(r.output_len)
        if self.predictor != "oracle" and self.sigma > 0:
            z = random.Random(f"{self.seed}:{r.request_id}").gauss(0.0, 1.0)
            length *= math.exp(self.sigma * z)
        return float(bisect_right(self.buckets, length)) if self.predictor == "bucketed" else length

    def job_size(self, r: Request) -> float:
        """What the order ranks: the predicted output length (SRPT: what is left of it)."""
        return self._predicted[r]

    def rank(self, r: Request) -> tuple:
        """Smaller runs first: aged requests (FCFS), then the job size less the aging credit."""
        wait = self.now_s - r.arrival_s
        if self.max_wait_s is not None and wait >= self.max_wait_s:
            return (0, r.arrival_s)
        return (1, self.job_size(r) - self.aging_tokens_per_s * wait, r.arrival_s)

    def admission_order(self) -> list[Request]:
        return sorted(self.waiting, key=self.rank)
