"""Speed of a run's output: the metrics of each run and the parts of writing its results folder.

    python benchmarks/output_speed.py [experiments/quickstart.yaml] [--limit N] [--pandas]

Replays the experiment once (not timed), then measures in the same process the metrics
(request table and summaries, per run) and every part of ``write_results``: requests.csv,
steps.csv, events (rows, then events.csv), the PNG plots, the timelines (Gantt PNGs and
plotly figures), report.md and report.html, with and without plots (``--no-plots``). Wall
and CPU seconds (``time.process_time``: on a shared machine it moves less with the load).
``--pandas`` also times pandas' ``to_csv`` of the same three tables (what the lab used before
lab/report/csv_text.py) and checks that the bytes are the same.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sched_lab.report.folder as folder  # noqa: E402
import sched_lab.run.experiment as experiment  # noqa: E402
from sched_lab.config import load_config  # noqa: E402
from sched_lab.report import timeline  # noqa: E402
from sched_lab.results import fairness  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # part -> [wall, cpu]


def _timed(module, name: str, part=None):
    """Replace ``module.name`` by a wrapper adding its wall and CPU seconds to ``TIMES``
    under ``part(args)`` (default: the name)."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            key = part(args) if part else name
            TIMES[key][0] += time.perf_counter() - w0
            TIMES[key][1] += time.process_time() - c0

    setattr(module, name, wrapper)


def _measure_parts() -> None:
    _timed(experiment, "_measure", lambda a: "metrics (request table, summary, vLLM file)")
    _timed(folder, "write_csv", lambda a: Path(a[0]).name)
    _timed(folder, "_write_run_steps", lambda a: "steps.csv")
    _timed(folder, "_append_csv", lambda a: Path(a[0]).name)
    _timed(timeline, "events_frame", lambda a: "events rows")
    _timed(folder, "_plots", lambda a: "PNG plots")
    _timed(fairness, "plots", lambda a: "PNG plots (classes)")
    _timed(timeline, "stories_for", lambda a: "timelines: stories")
    _timed(timeline, "gantt_png", lambda a: "timelines: Gantt PNGs")
    _timed(folder.html_report, "timeline_figure", lambda a: "timelines: plotly figures")
    _timed(folder, "report_markdown", lambda a: "report.md")
    _timed(folder, "_html", lambda a: "report.html")


def _pandas(runs, out: Path) -> None:
    """pandas' to_csv of requests, steps and events (the lab's text before csv_text)."""
    import pandas as pd

    tables = {
        "requests.csv": (folder.concat_requests([r.requests for r in runs]), None),
        "steps.csv": (folder._steps_frame(runs), folder.STEPS_FLOAT_FORMAT),
        "events.csv": (
            pd.concat([timeline.events_frame(r) for r in runs], ignore_index=True),
            None,
        ),
    }
    for name, (df, fmt) in tables.items():
        w0, c0 = time.perf_counter(), time.process_time()
        df.to_csv(out / f"pandas_{name}", index=False, float_format=fmt)
        TIMES[f"pandas to_csv: {name}"] = [time.perf_counter() - w0, time.process_time() - c0]
        same = (out / f"pandas_{name}").read_bytes() == (out / "results" / name).read_bytes()
        print(f"{name}: pandas' bytes {'identical' if same else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "experiments/quickstart.yaml"))
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--pandas", action="store_true", help="also time pandas' to_csv")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.limit:
        cfg = cfg.with_trace(limit=args.limit)
    _measure_parts()
    w0, c0 = time.perf_counter(), time.process_time()
    runs = experiment.run_experiment(cfg, progress=False)
    replay = [time.perf_counter() - w0, time.process_time() - c0]
    metrics = TIMES.pop("metrics (request table, summary, vLLM file)")
    whole: dict[bool, list[float]] = {}
    parts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for plots in (True, False):
            TIMES.clear()
            w0, c0 = time.perf_counter(), time.process_time()
            folder.write_results(Path(d) / "results", cfg, runs, bars=False, plots=plots)
            whole[plots] = [time.perf_counter() - w0, time.process_time() - c0]
            if plots:
                parts = dict(TIMES)
        if args.pandas:
            TIMES.clear()
            _pandas(runs, Path(d))
            parts.update(TIMES)
    steps = sum(r.summary["num_steps"] for r in runs)
    requests = sum(len(r.requests) for r in runs)
    print(
        f"# {cfg.name}: {len(runs)} runs, {requests:,} request rows, {steps:,} step rows; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}"
    )
    print("| part | wall (s) | CPU (s) |")
    print("|---|---|---|")
    rows = [("replays and metrics (not writing)", replay), ("of which metrics", metrics)]
    rows += sorted(parts.items(), key=lambda kv: kv[0].startswith("pandas"))
    rows += [("writing, all (with plots)", whole[True]), ("writing, --no-plots", whole[False])]
    for name, (wall, cpu) in rows:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
