"""Plots drawn after the run: ``sched-lab run --no-plots`` then ``sched-lab report RESULTS``.

A folder written with ``--no-plots`` keeps what its pictures need beyond its tables in
:data:`~sched_lab.report.plot_data.PLOT_DATA`. :func:`draw_later` draws from it and from the folder's requests, events and steps the PNGs, the interactive
timelines and report.md / report.html as a run with plots writes them (report.md: the same
bytes; report.html: the same text and tables, timelines built from the files).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sched_lab.config.sections import ReportConfig
from sched_lab.core.errors import UserError
from sched_lab.core.events import EventLog
from sched_lab.core.outputs import MANIFEST
from sched_lab.report import plots
from sched_lab.report.markdown import NO_PLOTS, plot_sections
from sched_lab.report.plot_data import PLOT_DATA, read_plot_data
from sched_lab.results import fairness
from sched_lab.results.run import Run
from sched_lab.sim.records import ReplayResult


def draw_later(folder: Path) -> list[str]:
    """Draw the plots of a results folder written with ``--no-plots`` into it: the PNGs,
    report.md and report.html as a run with plots writes them; the manifest names the new
    files. Returns the files written. Files appear one by one, each whole (written beside,
    then renamed in), the manifest first.

    Raises:
        UserError: no such folder, a sweep's folder (its points are results folders), not
            a results folder, no :data:`PLOT_DATA` (plots drawn
            at run time, or written before it existed), or a damaged file (one line naming
            it: :data:`PLOT_DATA` lacking a header key or an array included).
    """
    from sched_lab.report.folder import _html, _timeline_pictures, is_results_folder
    from sched_lab.report.html import plotly_available
    from sched_lab.report.timeline import load_runs

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder")
    sweep = folder.parent if folder.name == "points" else folder
    points = sweep / "points"
    if points.is_dir() and any((sweep / f).is_file() for f in ("sweep.csv", "curve.csv")):
        first = min((p.name for p in points.iterdir() if p.is_dir()), default="p000")
        raise UserError(f"{folder}: a sweep's folder: its points' plots are drawn one point at "
                        f"a time, e.g. sched-lab report {points / first}")  # fmt: skip
    if not (folder / MANIFEST).is_file() or not is_results_folder(folder):
        raise UserError(f"{folder}: not a results folder of sched-lab run (no {MANIFEST})")
    meta, arrays = read_plot_data(folder / PLOT_DATA)
    report_md = folder / "report.md"
    try:
        text = report_md.read_text()
    except OSError as e:
        raise UserError(f"{report_md}: cannot be read ({e.strerror})") from None
    if NO_PLOTS not in text:
        raise UserError(f"{report_md}: does not say that its plots were left out (--no-plots)")
    try:  # a header or an array missing (another layout under the same version): damaged
        report_cfg = _report_config(meta["report"])
        cfg = SimpleNamespace(name=meta["name"], report=report_cfg)
        runs, tables = [], []
        loaded = load_runs(folder, [m["label"] for m in meta["runs"]])
        for i, (m, (_, requests, events, steps)) in enumerate(zip(meta["runs"], loaded)):
            runs.append(_run(i, m, requests, arrays))
            tables.append((events, steps))
    except (KeyError, TypeError, ValueError) as e:
        what = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise UserError(f"{folder / PLOT_DATA}: damaged, cannot be read ({what})") from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.report.", dir=folder.parent))
    try:
        pngs = plots.plots(tmp, runs, cfg, device=meta["kv_device"])
        pngs += fairness.plots(tmp, runs, _save_png)
        figures = []
        with_plotly = plotly_available()
        for r, (events, steps) in zip(runs, tables):
            if r.result.events is None:
                continue
            p, f = _timeline_pictures(
                tmp, report_cfg, r.label, r.requests, events, steps, with_plotly
            )
            pngs += p
            figures += f
        report = text.replace(NO_PLOTS + "\n\n", "".join(x + "\n" for x in plot_sections(pngs)))
        (tmp / "report.md").write_text(report)
        _html(tmp, cfg, runs, report, figures, True)
        new = sorted(p.name for p in tmp.iterdir())
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["files"] = sorted(set(manifest["files"]) | set(new))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp / MANIFEST, folder / MANIFEST)  # first: every file in place is named
        for name in new:
            os.replace(tmp / name, folder / name)
    except OSError as e:
        raise UserError(f"{folder}: cannot write the plots ({e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return new


def _report_config(d: dict) -> ReportConfig:
    window = d.get("timeline_window_s")
    return ReportConfig(
        metric_percentiles=tuple(d["metric_percentiles"]),
        timeline_slowest=d["timeline_slowest"],
        timeline_by=d["timeline_by"],
        timeline_ids=tuple(d["timeline_ids"]),
        timeline_window_s=None if window is None else tuple(window),
    )


def _run(i: int, m: dict, requests, arrays: dict[str, np.ndarray]) -> Run:
    """The run as the plots read it: its tables' requests, the kept series, no steps."""

    def seq(name: str) -> tuple[np.ndarray, ...]:
        out, k = [], 0
        while f"r{i}_{name}_{k}" in arrays:
            out.append(arrays[f"r{i}_{name}_{k}"])
            k += 1
        return tuple(out)

    series: dict = {
        "num_steps": m["num_steps"],
        "over_time": seq("over_time"),
        "total_blocks": m["total_blocks"],
        "prefix": seq("prefix") or None,
    }
    if m["tenants"] is not None:
        service = {t: arrays[f"r{i}_tenant_{k}"] for k, t in enumerate(m["tenants"])}
        series["tenant_service"] = (arrays[f"r{i}_tenant_edges"], service)
    result = ReplayResult(
        requests=[],
        steps={},
        tick_steps=np.empty(0, np.int64),
        wall_s=0.0,
        num_gpu_blocks=m["num_gpu_blocks"],
        failure=m["failure"],
        prefix_caching=m["prefix_caching"],
        events=EventLog() if m["events"] else None,
    )
    return Run(
        label=m["label"],
        policy=m["policy"],
        rate_scale=m["rate_scale"],
        result=result,
        requests=requests.reset_index(drop=True),
        itl_cdf_s=arrays[f"r{i}_itl_cdf_s"],
        summary=m["summary"],
        vllm=m["vllm"],
        itl_tail_s=arrays.get(f"r{i}_itl_tail_s"),
        plot_series=series,
    )


def _save_png(fig, folder: Path, name: str, caption: str) -> tuple[str, str]:
    from sched_lab.report.folder import save_png

    return save_png(fig, folder, name, caption)
