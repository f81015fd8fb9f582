"""Bands over seeded replicas (config key ``seeds``, docs/simulator.md "Bands"): every metric
of a run as the median of its replicas and their 90% band (p5-p95, linear interpolation
between order statistics, numpy's default)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sched_lab.results.names import (
    BAND_PERCENTILES,
    band_name,
    format_value,
    is_count,
    is_metric,
    is_missing,
    seed_median_name,
)


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and not is_missing(v)


def band_fields(
    summaries: Sequence[Mapping[str, Any]], requested: int | None = None
) -> dict[str, Any]:
    """The summary keys a run with seeded replicas adds (``summaries``: one per replica, in
    seed order): ``seeds`` (their number), ``band_percentiles`` and, for every metric the
    first replica has as a number, ``X_seed_median`` and ``X_band`` ([lo, hi]) over the
    replicas that have it as a number. ``requested``: the replicas asked for; when more than
    ``summaries`` (a run interrupted), also ``seeds_requested``."""
    out: dict[str, Any] = {"seeds": len(summaries), "band_percentiles": list(BAND_PERCENTILES)}
    if requested is not None and requested > len(summaries):
        out["seeds_requested"] = requested
    for name, v in summaries[0].items():
        if not is_metric(name) or not _number(v):
            continue
        values = np.array([s[name] for s in summaries if _number(s.get(name))], float)
        lo, hi = np.percentile(values, BAND_PERCENTILES)
        out[seed_median_name(name)] = float(np.median(values))
        out[band_name(name)] = [float(lo), float(hi)]
    return out


def band_of(summary: Mapping[str, Any], name: str) -> tuple[float, float, float] | None:
    """(median, lo, hi) of metric ``name`` in a summary with bands, else None."""
    band = summary.get(band_name(name))
    if band is None:
        return None
    return summary[seed_median_name(name)], band[0], band[1]


def band_text(
    name: str,
    band: tuple[float, float, float],
    spec: str,
    unit: Callable[[float], float] = lambda x: x,
) -> str:
    """A table cell ``median [lo, hi]`` of metric ``name`` (``band``: :func:`band_of`'s
    triple), each in the table's ``unit`` and formatted with ``spec``. A count (preemptions,
    requests: :func:`~sched_lab.results.names.is_count`) prints whole numbers, as a single
    run's count does: the median rounded half to even (Python's ``round``; the median of an
    even number of replicas can lie halfway between two counts, x.5), the band's ends rounded
    outward (lo down, hi up), so the printed band holds the computed one. summary.json keeps
    the computed values."""
    m, lo, hi = (unit(x) for x in band)
    if is_count(name):
        m, lo, hi = round(m), math.floor(round(lo, 6)), math.ceil(round(hi, 6))
        spec = "d"
    elif spec == "d":
        spec = "g"
    m, lo, hi = (format_value(x, spec) for x in (m, lo, hi))
    return f"{m} [{lo}, {hi}]"


def inside(value: float, band: Sequence[float]) -> bool:
    """Whether ``value`` lies in the band [lo, hi] (ends included)."""
    return band[0] <= value <= band[1]


def relative_width(median: float, band: Sequence[float]) -> float:
    """(hi - lo) / median (NaN where the median is 0)."""
    return (band[1] - band[0]) / median if median else float("nan")
