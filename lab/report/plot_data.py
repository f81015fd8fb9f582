"""What drawing a run's plots later needs (``sched-lab run --no-plots``, then ``sched-lab
report RESULTS``, lab/report/later.py), kept in the results folder as :data:`PLOT_DATA`.

A run's PNGs read a few things its tables do not hold: the tail of every inter-token gap,
the steps binned over time, and with workload classes each tenant's service over time.
:data:`PLOT_DATA` keeps them as numpy arrays with one JSON header (no pickles), with what the
pictures need of the config: ``r{i}_{name}`` arrays of the i-th run, ``meta`` the header.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from sched_lab.core.errors import UserError
from sched_lab.report import plots
from sched_lab.results import fairness
from sched_lab.results.run import Run

PLOT_DATA = "plot_data.npz"
_VERSION = 1  # of PLOT_DATA's layout


def plot_data(run: Run) -> dict:
    """What the plots read of ``run`` beyond its tables (:func:`plots.run_series`, and with
    workload classes ``tenant_service``); taken before its steps are released."""
    series = plots.run_series(run)
    if "classes" in run.summary:
        series["tenant_service"] = fairness.tenant_series(run)
    return series


def write_plot_data(path: Path, cfg, runs: list[Run], series: list[dict]) -> None:
    """Write :data:`PLOT_DATA` for ``runs`` and their :func:`plot_data` ``series``."""
    arrays: dict[str, np.ndarray] = {}
    metas = []
    for i, (r, s) in enumerate(zip(runs, series, strict=True)):
        arrays[f"r{i}_itl_cdf_s"] = np.asarray(r.itl_cdf_s, dtype=np.float64)
        if r.itl_tail_s is not None:
            arrays[f"r{i}_itl_tail_s"] = r.itl_tail_s
        for k, a in enumerate(s["over_time"]):
            arrays[f"r{i}_over_time_{k}"] = a
        if s["prefix"] is not None:
            for k, a in enumerate(s["prefix"]):
                arrays[f"r{i}_prefix_{k}"] = a
        tenants = None
        if "tenant_service" in s:
            edges, service = s["tenant_service"]
            arrays[f"r{i}_tenant_edges"] = edges
            tenants = list(service)
            for k, t in enumerate(tenants):
                arrays[f"r{i}_tenant_{k}"] = service[t]
        res = r.result
        metas.append({
            "label": r.label, "policy": r.policy, "rate_scale": r.rate_scale,
            "summary": r.summary, "vllm": r.vllm, "num_steps": s["num_steps"],
            "total_blocks": s["total_blocks"], "failure": res.failure,
            "prefix_caching": res.prefix_caching, "num_gpu_blocks": res.num_gpu_blocks,
            "events": res.events is not None, "tenants": tenants,
        })  # fmt: skip
    meta = {
        "version": _VERSION,
        "name": cfg.name,
        "report": dataclasses.asdict(cfg.report),
        "kv_device": plots.kv_device(cfg),
        "runs": metas,
    }
    arrays["meta"] = np.array(json.dumps(meta))  # NaN kept (json's own extension)
    with path.open("wb") as f:
        np.savez(f, **arrays)


def read_plot_data(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The header and arrays of :data:`PLOT_DATA` at ``path``. Raises UserError: no such
    file, or a damaged one."""
    if not path.is_file():
        raise UserError(
            f"{path.parent}: no {PLOT_DATA}: its plots were drawn when it was run (or it was "
            "written before sched-lab run --no-plots kept what they need)"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(str(arrays.pop("meta")))
        if meta.get("version") != _VERSION:
            raise ValueError(f"layout version {meta.get('version')!r}, expected {_VERSION}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: damaged, cannot be read ({e})") from None
    return meta, arrays
