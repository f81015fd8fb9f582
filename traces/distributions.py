"""Token-length distributions for the ``synthetic`` format (``prompt_len`` / ``output_len``).

YAML forms, every sample in 1..MAX_TOKENS: ``512``; ``{uniform: [lo, hi]}`` (inclusive);
``{lognormal: {mean: 1000, sigma: 0.5}}`` (``mean`` in tokens, mu = ln(mean) - sigma^2 / 2,
rounded and clipped; a sigma that clips most samples is refused); ``{choice: [...]}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sched_lab.core.errors import TraceError
from sched_lab.traces.spec import check_keys, check_mapping, get_float
from sched_lab.traces.validate import MAX_TOKENS

FORMS = (
    "an integer",
    "{uniform: [lo, hi]}",
    "{lognormal: {mean:, sigma:}}",
    "{choice: [...]}",
)


class LengthDistribution(Protocol):
    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        """Token counts, shape (num_requests,), int64, each >= 1."""
        ...


@dataclass(frozen=True)
class Fixed:
    tokens: int

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(num_requests, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=num_requests, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    mean: float
    sigma: float

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma**2 / 2
        tokens = np.rint(rng.lognormal(mu, self.sigma, size=num_requests))
        return np.clip(tokens, 1, MAX_TOKENS).astype(np.int64)


@dataclass(frozen=True)
class Choice:
    values: tuple[int, ...]

    def sample(self, num_requests: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=num_requests)


def parse_length(value: Any, where: str) -> LengthDistribution:
    """Read one of the module's forms; TraceError naming ``where`` and the accepted forms."""
    if _is_count(value):
        return Fixed(value)
    if not isinstance(value, dict) or len(value) != 1:
        raise _bad(where, value)
    ((kind, params),) = value.items()
    if kind == "uniform":
        if not (isinstance(params, list) and len(params) == 2 and all(map(_is_count, params))):
            raise _bad(
                f"{where}.uniform", params, f"expected [lo, hi], integers in 1..{MAX_TOKENS:,}"
            )
        if params[0] > params[1]:
            raise _bad(f"{where}.uniform", params, "expected lo <= hi")
        return Uniform(params[0], params[1])
    if kind == "lognormal":
        params = check_mapping(params, f"{where}.lognormal")
        check_keys(params, ("mean", "sigma"), f"{where}.lognormal")
        mean = get_float(params, "mean", f"{where}.lognormal", minimum=1.0)
        if mean > MAX_TOKENS:
            raise _bad(f"{where}.lognormal.mean", mean, f"expected at most {MAX_TOKENS:,}")
        sigma = get_float(params, "sigma", f"{where}.lognormal", minimum=0.0)
        clipped = _clipped_fraction(mean, sigma)
        if clipped > 0.5:
            raise TraceError(
                f"{where}.lognormal: sigma {sigma:g} with mean {mean:g} puts {clipped:.0%} of "
                f"the samples outside 1..{MAX_TOKENS:,} tokens (clipped there, so the lengths "
                f"would not have mean {mean:g}); expected a sigma that keeps most samples inside"
            )
        return LogNormal(mean, sigma)
    if kind == "choice":
        if not (isinstance(params, list) and params and all(map(_is_count, params))):
            raise _bad(
                f"{where}.choice",
                params,
                f"expected a non-empty list of integers in 1..{MAX_TOKENS:,}",
            )
        return Choice(tuple(params))
    raise _bad(where, value)


def _clipped_fraction(mean: float, sigma: float) -> float:
    """Probability that a LogNormal(mean, sigma) sample rounds below 1 or exceeds MAX_TOKENS."""
    if sigma == 0:
        return 0.0
    mu = math.log(mean) - sigma * sigma / 2

    def below(x: float) -> float:  # P(sample < x), the normal CDF of ln(x)
        return 0.5 * math.erfc(-(math.log(x) - mu) / sigma / math.sqrt(2))

    return below(0.5) + (1.0 - below(MAX_TOKENS + 0.5))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_TOKENS


def _bad(where: str, value: Any, expected: str = "") -> TraceError:
    expected = (
        expected or f"expected one of: {'; '.join(FORMS)} (token counts in 1..{MAX_TOKENS:,})"
    )
    return TraceError(f"{where}: {expected}, got {value!r}")
