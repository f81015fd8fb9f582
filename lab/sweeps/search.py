"""Capacity search: the largest load that still meets a target, per policy and config.

    search: {metric: slo_attainment, target: 0.9, over: rate_scale, tolerance: 0.02}

``metric`` is ``slo_attainment`` (met when >= ``target``, a fraction in (0, 1]; the config
needs an ``slo:`` block) or a latency statistic of finished requests,
``{ttft,tpot,itl,e2e,queue}_s_{mean,p50,p90,p99}`` (met when <= ``target`` seconds).
``over`` is the key path of the load (default ``trace.rate_scale``; ``rate_scale`` for
short); the metric is assumed to get worse as it grows, as capacity in Sarathi-Serve
(OSDI'24, §5: the highest load a system serves within its SLO) and DistServe's goodput
(OSDI'24, §2) do.

The search (:func:`find_capacity`): with ``lo`` and ``hi`` given, both are tried; a ``lo``
that misses is reported ``below_range``, a ``hi`` that meets ``above_range``. Without them
the search starts at the config's own value and doubles (or halves) it, at most
:data:`MAX_EXPANSIONS` times, until one value meets and the next misses. Then it bisects
until ``hi - lo <= tolerance * lo``. The capacity is ``lo``, the largest value tried that
meets the target: the true threshold lies in ``[lo, hi)``, so the capacity is within
``tolerance`` (relative) below it when the metric is monotone. A key whose value is a whole
number (in the YAML, else its default; e.g. ``scheduler.max_num_seqs``) is searched in
whole numbers. A run that stops early
(stuck, thrashing) counts as a miss. Every value tried is kept: the sampled curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lab.config.keypaths import ALIASES, get_path, parse_path
from lab.core.errors import ConfigError, short_repr

STATS = ("mean", "p50", "p90", "p99")
LATENCY_METRICS = tuple(
    f"{m}_s_{s}" for m in ("ttft", "tpot", "itl", "e2e", "queue") for s in STATS
)
METRICS = ("slo_attainment", *LATENCY_METRICS)
SEARCH_KEYS = ("metric", "target", "over", "lo", "hi", "tolerance")
DEFAULT_TOLERANCE = 0.02  # relative width of the final bracket
MAX_EXPANSIONS = 12  # doublings or halvings to find a bracket: a factor of 4096 either way


@dataclass(frozen=True)
class SearchSpec:
    """The ``search:`` block, validated (module docstring)."""

    metric: str
    target: float
    over: str = "trace.rate_scale"
    lo: float | None = None
    hi: float | None = None
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "slo_attainment"

    def meets(self, value: float) -> bool:
        """Whether a metric value meets the target (NaN never does)."""
        if value is None or not math.isfinite(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target

    def check(self, cfg, point, where: str) -> None:
        """What a point's config must have for this search (called for every point)."""
        if self.metric == "slo_attainment" and not any(cfg.slo.to_dict().values()):
            raise ConfigError(
                f"{where}: search.metric: slo_attainment needs an slo: block with at "
                "least one of ttft_s, tpot_s, e2e_s"
            )
        if self.lo is None and self.start(cfg, point) is None:
            raise ConfigError(
                f"{where}: search: sweep point {point.name} has no single number at "
                f"{self.over} to start from; give search.lo and search.hi"
            )

    def start(self, cfg, point) -> float | None:
        """The value the search starts from without ``lo``/``hi``: the config's own."""
        if self.over == "trace.rate_scale":
            return cfg.rate_scales[0] if len(cfg.rate_scales) == 1 else None
        v = get_path(point.raw, self.over)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        return float(v) if ok and math.isfinite(v) else None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SEARCH_KEYS}


def parse_search(raw: Any, where: str, swept: tuple[str, ...] = ()) -> SearchSpec:
    """Validate a ``search:`` block; ``swept``: the sweep's key paths (``over`` is not one).

    Raises:
        ConfigError: one line naming the key: an unknown metric, a target outside (0, 1]
            for slo_attainment (or not > 0 seconds for a latency), ``lo`` >= ``hi``, ...
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: search: expected a mapping, got {short_repr(raw)}")
    for k in raw:
        if k not in SEARCH_KEYS:
            raise ConfigError(f"{where}: unknown key search.{k}; allowed: {', '.join(SEARCH_KEYS)}")
    metric = raw.get("metric")
    if metric not in METRICS:
        raise ConfigError(
            f"{where}: search.metric: unknown metric {short_repr(metric)}; known: "
            "slo_attainment, or a latency {ttft,tpot,itl,e2e,queue}_s_{mean,p50,p90,p99}"
        )
    target = raw.get("target")
    number = isinstance(target, (int, float)) and not isinstance(target, bool)
    if metric == "slo_attainment":
        if not number or not 0 < target <= 1:
            raise ConfigError(
                f"{where}: search.target: expected a fraction in (0, 1] for slo_attainment, "
                f"got {short_repr(target)}"
            )
    elif not number or not (math.isfinite(target) and target > 0):
        raise ConfigError(
            f"{where}: search.target: expected seconds > 0 for {metric}, got {short_repr(target)}"
        )
    over = raw.get("over", "trace.rate_scale")
    if not isinstance(over, str):
        raise ConfigError(f"{where}: search.over: expected a key path, got {short_repr(over)}")
    over = ALIASES.get(over, over)
    parse_path(over, f"{where}: search.over")
    if over in swept:
        raise ConfigError(
            f"{where}: search.over: {over} is a sweep key too; the search sets it itself"
        )
    bounds = []
    for key in ("lo", "hi"):
        v = raw.get(key)
        if v is not None and (
            not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 < v < math.inf)
        ):
            raise ConfigError(f"{where}: search.{key}: expected a number > 0, got {short_repr(v)}")
        bounds.append(None if v is None else float(v))
    lo, hi = bounds
    if (lo is None) != (hi is None):
        raise ConfigError(f"{where}: search: give both lo and hi, or neither")
    if lo is not None and not lo < hi:
        raise ConfigError(f"{where}: search: expected lo < hi, got lo {lo:g}, hi {hi:g}")
    tol = raw.get("tolerance", DEFAULT_TOLERANCE)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not 0 < tol < 1:
        raise ConfigError(
            f"{where}: search.tolerance: expected a fraction in (0, 1) (the final bracket's "
            f"width relative to its lower end), got {short_repr(tol)}"
        )
    return SearchSpec(metric, float(target), over, lo, hi, float(tol))


@dataclass
class Capacity:
    """The outcome of one search.

    ``status``: ``found`` (threshold in [lo, hi)), ``below_range`` (the smallest value tried
    misses; capacity NaN), ``above_range`` (the largest value tried meets; capacity is that
    value, a lower bound). ``samples``: (value, met) in the order tried.
    """

    capacity: float
    lo: float | None
    hi: float | None
    status: str
    samples: list[tuple[float, bool]] = field(default_factory=list)


def find_capacity(
    meets: Callable[[float], bool],
    spec: SearchSpec,
    start: float | None,
    integer: bool = False,
) -> Capacity:
    """Bracket then bisect for the largest value ``x`` with ``meets(x)`` (module docstring).

    Args:
        meets: runs the experiment at load ``x`` and says whether it meets the target.
        start: where to start without ``spec.lo``/``spec.hi``.
        integer: the key takes whole numbers (e.g. ``scheduler.max_num_seqs``): every value
            tried is an int >= 1, halving rounds down, bisection takes the floor of the
            midpoint and stops once the bracket is ``max(1, tolerance * lo)`` wide.
    """
    samples: list[tuple[float, bool]] = []
    whole = int if integer else float

    def probe(x: float) -> bool:
        ok = bool(meets(x))
        samples.append((x, ok))
        return ok

    if spec.lo is not None:
        lo, hi = spec.lo, spec.hi
        if integer:
            lo, hi = max(1, int(lo)), math.ceil(hi)
        if not probe(lo):
            return Capacity(math.nan, None, lo, "below_range", samples)
        if probe(hi):
            return Capacity(hi, hi, None, "above_range", samples)
    else:
        x = whole(start)
        if probe(x):
            lo = hi = x
            for _ in range(MAX_EXPANSIONS):
                hi = 2 * lo
                if not probe(hi):
                    break
                lo = hi
            else:
                return Capacity(lo, lo, None, "above_range", samples)
        else:
            hi = x
            for _ in range(MAX_EXPANSIONS):
                lo = hi // 2 if integer else hi / 2
                if lo < 1 and integer:
                    return Capacity(math.nan, None, hi, "below_range", samples)
                if probe(lo):
                    break
                hi = lo
            else:
                return Capacity(math.nan, None, hi, "below_range", samples)
    while hi - lo > (max(1, spec.tolerance * lo) if integer else spec.tolerance * lo):
        mid = (lo + hi) // 2 if integer else (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, lo, hi, "found", samples)
