"""Synthetic arrival times: the gamma renewal process of vLLM's
``benchmarks/benchmark_serving.py`` (``get_request``): intervals ~ Gamma(shape=burstiness,
scale=1 / (rate * burstiness)), mean 1 / rate, CV 1 / sqrt(burstiness) (1 = Poisson); the
first request at 0; rate = inf sends all at 0. Unlike ``vllm bench serve``, times are not
rescaled to end at n / rate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sched_lab.core.errors import TraceError
from sched_lab.traces.spec import check_keys, check_mapping, get_choice, get_float

PROCESSES = ("poisson", "gamma")
# Finite rates (requests/s) up to this: above, arrivals come closer than a microsecond, less
# than any server takes to accept a request (write .inf for all at once). Slow rates are
# bounded by the clock (traces/table.py).
MAX_RATE = 1e6


@dataclass(frozen=True)
class ArrivalProcess:
    """Args: rate: requests per second (> 0, may be inf); burstiness: gamma shape (> 0)."""

    rate: float
    burstiness: float = 1.0

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        """Arrival times in seconds, shape (num_requests,), non-decreasing, first = 0."""
        if num_requests == 0:
            return np.zeros(0)
        if math.isinf(self.rate):
            return np.zeros(num_requests)
        scale_s = 1.0 / (self.rate * self.burstiness)
        intervals_s = rng.gamma(shape=self.burstiness, scale=scale_s, size=num_requests - 1)
        return np.concatenate(([0.0], np.cumsum(intervals_s)))


def parse_arrival(spec: Any, where: str) -> ArrivalProcess:
    """Read ``{process: poisson|gamma, rate: req/s, burstiness: 1.0}`` (poisson needs
    burstiness 1); TraceError on an unknown key, a missing rate or a value out of range."""
    spec = check_mapping(spec, where)
    check_keys(spec, ("process", "rate", "burstiness"), where)
    process = get_choice(spec, "process", where, PROCESSES, default="poisson")
    rate = get_float(spec, "rate", where, strict=True, allow_inf=True)
    burstiness = get_float(spec, "burstiness", where, default=1.0, strict=True)
    if process == "poisson" and burstiness != 1.0:
        raise TraceError(
            f"{where}.burstiness: a poisson process has burstiness 1, got {burstiness:g} "
            "(use process: gamma)"
        )
    if MAX_RATE < rate < math.inf:
        raise TraceError(
            f"{where}.rate: expected at most {MAX_RATE:g} requests/s (arrivals under a "
            f"microsecond apart), or .inf for every request at t = 0; got {rate:.6g}"
        )
    if not math.isinf(rate) and not (
        rate * burstiness > 0 and math.isfinite(1.0 / (rate * burstiness))
    ):
        raise TraceError(
            f"{where}: rate {rate:g} x burstiness {burstiness:g} is too small: the mean "
            "inter-arrival time 1 / (rate x burstiness) overflows float64"
        )
    return ArrivalProcess(rate=rate, burstiness=burstiness)
