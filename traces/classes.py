"""Workload classes: ``trace:`` as a list of named classes, merged into one trace.

Example (YAML)::

    trace:
      - name: chat                 # names the class in results (requests.csv ``class``)
        priority: 0                # Request.priority: lower runs first (policies/priority.py)
        tenant: chat-users         # Request.tenant (policies/vtc.py, fairness metrics)
        slo: {ttft_s: 1.0}         # the class's SLOs, over the top-level ``slo:`` key by key
        format: azure2023          # then any trace spec, as for a single trace
        path: traces/data/azure2023_conv.csv
        end_s: 300
      - name: batch
        priority: 1
        format: lengths
        path: traces/data/vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv
        arrival: {process: poisson, rate: 0.5}
        num_requests: 150
        rate_scale: 1.0            # each class its own load (a number, not a list)

Each class is loaded as a trace of its own (its window, limit and rate_scale; arrivals from
0; ``seed`` defaults to the experiment's seed plus the class index, so two generated classes
do not draw the same arrivals), then the classes are merged by arrival time. Ties go to the
class listed first, then to the class's own row order, so the merge is deterministic.
Request ids become ``{class}:{row}``; each request carries its class's name, priority,
tenant and TTFT SLO (``Request.ttft_slo_s``: the class's ``slo.ttft_s``, else the top-level
one). Rows a class does not replay (status dropped) stay right after the row before them in
their class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab.core.errors import TraceError
from lab.core.request import Request, RequestStatus
from traces import load_table, scale_table

CLASS_KEYS = ("name", "priority", "tenant", "slo")  # the class's own; the rest is its trace


def load_classes(
    classes: Sequence[Mapping[str, Any]],
    base_dir: Path,
    seed: int = 0,
    ttft_slo_s: float | None = None,
) -> tuple[list[Request], int]:
    """Load every class and merge them (the module docstring has the rules).

    Args:
        classes: the class mappings (validated by lab/config.py, paths absolute).
        seed: the experiment's seed; class i draws from ``seed + i`` unless it sets ``seed``.
        ttft_slo_s: the top-level TTFT SLO, for classes without their own.

    Returns:
        (the merged requests, the entries all classes' formats read: see
        :func:`traces.load_table`).

    Raises:
        TraceError: as :func:`traces.load_table`, the message naming the class.
    """
    keyed, rows = [], 0
    for i, c in enumerate(classes):
        spec = {"seed": seed + i, **{k: v for k, v in c.items() if k not in CLASS_KEYS}}
        try:
            table, n = load_table(spec, base_dir)
            table = scale_table(table, float(spec.get("rate_scale", 1.0)))
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
