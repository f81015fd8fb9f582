"""Bands over seeded replicas (config key ``seeds``, docs/simulator.md "Bands"): every metric
of a run as the median of its replicas and their 90% band (p5-p95, linear interpolation
between order statistics, numpy's default)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sched_lab.results.names import (
    BAND_PERCENTILES,
    band_name,
    is_metric,
    is_missing,
    seed_median_name,
)


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and not is_missing(v)


def band_fields(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary keys a run with seeded replicas adds (``summaries``: one per replica, in
    seed order): ``seeds`` (their number), ``band_percentiles`` and, for every metric the
    first replica has as a number, ``X_seed_median`` and ``X_band`` ([lo, hi]) over the
    replicas that have it as a number."""
    out: dict[str, Any] = {"seeds": len(summaries), "band_percentiles": list(BAND_PERCENTILES)}
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


def inside(value: float, band: Sequence[float]) -> bool:
    """Whether ``value`` lies in the band [lo, hi] (ends included)."""
    return band[0] <= value <= band[1]


def relative_width(median: float, band: Sequence[float]) -> float:
    """(hi - lo) / median (NaN where the median is 0)."""
    return (band[1] - band[0]) / median if median else float("nan")
