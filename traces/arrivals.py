"""Synthetic arrival times: a gamma renewal process, as vLLM's serving benchmark defines it.

vLLM ``benchmarks/benchmark_serving.py`` (``get_request``) sends a request, then waits an
interval drawn from Gamma(shape=burstiness, scale=1 / (rate * burstiness)) before the next:

- the mean interval is shape * scale = 1 / rate seconds, whatever the burstiness;
- the coefficient of variation of the intervals is 1 / sqrt(burstiness), so burstiness 1 is
  a Poisson process (exponential intervals), < 1 burstier, > 1 more regular;
- rate = inf sends every request at once (all arrive at 0).

The first request therefore arrives at 0. Newer vLLM (``vllm bench serve``) also rescales
the cumulative times so the last one lands on n / rate; this lab does not, so the intervals
keep exactly the gamma distribution above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.core.errors import TraceError
from traces.spec import check_keys, check_mapping, get_choice, get_float

PROCESSES = ("poisson", "gamma")


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
    """Read ``{process: poisson|gamma, rate: req/s, burstiness: 1.0}``.

    ``burstiness`` defaults to 1; with ``process: poisson`` it must be 1 (or absent).

    Raises:
        TraceError: unknown key, missing rate, or a value out of range.
    """
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
    if not math.isinf(rate) and not (
        rate * burstiness > 0 and math.isfinite(1.0 / (rate * burstiness))
    ):
        raise TraceError(
            f"{where}: rate {rate:g} x burstiness {burstiness:g} is too small: the mean "
            "inter-arrival time 1 / (rate x burstiness) overflows float64"
        )
    return ArrivalProcess(rate=rate, burstiness=burstiness)
