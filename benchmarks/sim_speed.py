"""Simulator speed on the quickstart: wall time of the three replays and of the whole run.

    python benchmarks/sim_speed.py [experiments/quickstart.yaml] [--repeat 3]

Prints, per policy, engine steps and replay wall seconds (best of --repeat), then the sum,
the steps per second, and the wall time of the metrics + report stage, measured in the same
process. Also the replays' CPU seconds (``time.process_time``, best of --repeat): on a shared
machine they move less with the load than wall time, so A/B comparisons of two trees
(``--no-report``, each run alternately in its own checkout) use them.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sched_lab.run.experiment  # noqa: E402
from sched_lab.config import load_config  # noqa: E402
from sched_lab.report.folder import write_results  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402

CPU_S: list[float] = []  # process CPU seconds of each replay, in call order


def _timed(replay):
    def wrapper(*args, **kwargs):
        t0 = time.process_time()
        try:
            return replay(*args, **kwargs)
        finally:
            CPU_S.append(time.process_time() - t0)

    return wrapper


sched_lab.run.experiment.replay = _timed(sched_lab.run.experiment.replay)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "experiments/quickstart.yaml"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--no-report", action="store_true", help="skip writing the results")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.limit:
        cfg = cfg.with_trace(limit=args.limit)
    best: dict[str, tuple[int, float]] = {}
    cpu: dict[str, float] = {}
    totals = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        CPU_S.clear()
        runs = run_experiment(cfg, progress=False)
        totals.append(time.perf_counter() - t0)
        for r, c in zip(runs, CPU_S):
            prev = best.get(r.label)
            if prev is None or r.result.wall_s < prev[1]:
                best[r.label] = (r.summary["num_steps"], r.result.wall_s)
            cpu[r.label] = min(cpu.get(r.label, c), c)
    report_s = float("nan")
    if not args.no_report:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            write_results(Path(d) / "out", cfg, runs)
        report_s = time.perf_counter() - t0
    print(
        f"# {cfg.name} on {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}"
    )
    print("| policy | steps | replay wall (s) | steps/s | replay CPU (s) |")
    print("|---|---|---|---|---|")
    for label, (steps, wall) in best.items():
        print(f"| {label} | {steps} | {wall:.2f} | {steps / wall:,.0f} | {cpu[label]:.2f} |")
    steps = sum(s for s, _ in best.values())
    wall = sum(w for _, w in best.values())
    print(f"| all | {steps} | {wall:.2f} | {steps / wall:,.0f} | {sum(cpu.values()):.2f} |")
    print(
        f"\nreplays + trace loading + metrics (best of {args.repeat}): {min(totals):.2f} s; "
        f"writing the results folder (CSVs, JSON, plots): {report_s:.2f} s"
    )


if __name__ == "__main__":
    main()
