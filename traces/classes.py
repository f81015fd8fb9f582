"""Workload classes: ``trace:`` as a list of named classes, merged into one trace.

Each class is a trace spec plus ``name``, ``priority``, ``tenant``, ``slo``, ``periods``,
``lora_name`` and ``cache_salt`` (for its requests that have none of their own),
loaded on its own (``seed`` defaults to the experiment's plus the class index), then merged
by arrival time; ties go to the class listed first, then row order. ``periods`` (the run's
clock, ``[[on_s, off_s], ...]``, the last ``off_s`` may be null) lays the class's trace
onto its on-periods (:func:`sched_lab.traces.table.apply_periods`): its clock runs only while the
class is on, so a class may start late, stop early, or leave and come back. Request ids become
``{class}:{row}``; ``Request.ttft_slo_s`` is the class's ``slo.ttft_s``, else the top-level
one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sched_lab.core.errors import TraceError, did_you_mean
from sched_lab.core.request import Request, RequestStatus
from sched_lab.traces import load_table, scale_table
from sched_lab.traces.table import CACHE_KEYS, apply_periods

CLASS_KEYS = (
    "name",
    "priority",
    "tenant",
    "slo",
    "periods",
    *CACHE_KEYS,
)  # the class's own; the rest is its trace


def load_classes(
    classes: Sequence[Mapping[str, Any]],
    base_dir: Path,
    seed: int = 0,
    ttft_slo_s: float | None = None,
) -> tuple[list[Request], int]:
    """Load every class and merge them.

    Args:
        classes: the validated class mappings (paths absolute).
        seed: the experiment's seed; class i draws from ``seed + i`` unless it sets ``seed``.
        ttft_slo_s: the top-level TTFT SLO, for classes without their own.

    Returns:
        (the merged requests, the entries all classes' formats read).

    Raises:
        TraceError: as :func:`sched_lab.traces.load_table`, naming the class.
    """
    keyed, rows = [], 0
    for i, c in enumerate(classes):
        for key in c:
            if key not in CLASS_KEYS and (hint := did_you_mean(key, CLASS_KEYS, quote=True)):
                raise TraceError(
                    _in_class(f"unknown key {key!r}{hint}; a class's own keys: "
                              f"{', '.join(CLASS_KEYS)}", i, c["name"])
                )  # fmt: skip
        spec = {"seed": seed + i, **{k: v for k, v in c.items() if k not in CLASS_KEYS}}
        try:
            table, n = load_table(spec, base_dir)
            table = scale_table(table, float(spec.get("rate_scale", 1.0)))
            if c.get("periods") is not None:
                table = apply_periods(table, c["periods"])
        except TraceError as e:
            raise TraceError(_in_class(str(e), i, c["name"])) from None
        rows += n
        slo = c.get("slo", {}).get("ttft_s", ttft_slo_s)
        anchor = -math.inf  # arrival of the replayed row before (dropped rows follow it)
        for pos, r in enumerate(table.to_requests()):
            r.request_id = f"{c['name']}:{r.request_id}"
            r.class_name, r.tenant, r.priority = (
                c["name"],
                c.get("tenant", ""),
                c.get("priority", 0),
            )
            r.ttft_slo_s = slo
            r.lora_name = r.lora_name or c.get("lora_name", "")
            r.cache_salt = r.cache_salt or c.get("cache_salt", "")
            if r.status is not RequestStatus.DROPPED:
                anchor = r.arrival_s
            keyed.append(((anchor, i, pos), r))
    keyed.sort(key=lambda kr: kr[0])
    return [r for _, r in keyed], rows


def _in_class(message: str, index: int, name: str) -> str:
    """A trace message with ``trace`` made ``trace[i]`` (class ``name``)."""
    where = f"trace[{index}] (class {name!r})"
    if message.startswith("trace.") or message.startswith("trace:"):
        return where + message[len("trace") :]
    return f"{where}: {message}"
