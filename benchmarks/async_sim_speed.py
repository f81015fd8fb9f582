"""Simulator speed, synchronous vs asynchronous scheduling, in the same run (issue 17's
target: async leaves the simulator's speed unchanged).

    OMP_NUM_THREADS=1 python benchmarks/async_sim_speed.py [experiments/quickstart.yaml] [--repeat 3]

Runs the experiment as written (sync) and with ``scheduler.async_scheduling: true``,
alternately, ``--repeat`` times each, in this process. Prints per policy and mode the
engine steps, the best replay CPU seconds (``time.process_time``; on a shared machine it
moves less with the load than wall time), the best replay wall seconds, and steps per CPU
second (async runs have a few more steps: one wasted step per finished request's batch is
not always shared), and the async/sync ratio of CPU seconds and of steps per second.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim_speed import CPU_S  # noqa: E402  (importing it times every replay's CPU seconds)

from sched_lab.config import validate  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402
from sched_lab.traces.readers import load_yaml_file  # noqa: E402


def configs(path: Path, limit: int | None):
    """The experiment as written (sync) and with async scheduling on."""
    raw = load_yaml_file(path)
    out = {}
    for mode, on in (("sync", False), ("async", True)):
        r = copy.deepcopy(raw)
        r.setdefault("scheduler", {})["async_scheduling"] = on
        cfg = validate(r, str(path), path.parent)
        out[mode] = cfg.with_trace(limit=limit) if limit else cfg
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "experiments/quickstart.yaml"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    args = ap.parse_args()
    cfgs = configs(Path(args.config), args.limit)
    best: dict[tuple[str, str], list[float]] = {}  # (mode, policy) -> [steps, cpu, wall]
    for _ in range(args.repeat):
        for mode, cfg in cfgs.items():
            CPU_S.clear()
            runs = run_experiment(cfg, progress=False)
            for r, cpu in zip(runs, CPU_S, strict=True):
                b = best.setdefault((mode, r.label), [r.summary["num_steps"], cpu, r.result.wall_s])
                b[1], b[2] = min(b[1], cpu), min(b[2], r.result.wall_s)
    print(
        f"# {cfgs['sync'].name} on {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, best of {args.repeat} alternating runs"
    )
    print("| policy | mode | steps | replay CPU (s) | replay wall (s) | steps / CPU s |")
    print("|---|---|---|---|---|---|")
    for (mode, label), (steps, cpu, wall) in sorted(best.items(), key=lambda kv: kv[0][::-1]):
        print(f"| {label} | {mode} | {steps:,.0f} | {cpu:.2f} | {wall:.2f} | {steps / cpu:,.0f} |")
    labels = sorted({label for _, label in best})
    cpu_ratio = sum(best["async", x][1] for x in labels) / sum(best["sync", x][1] for x in labels)
    rate = {m: sum(best[m, x][0] for x in labels) / sum(best[m, x][1] for x in labels)
            for m in ("sync", "async")}  # fmt: skip
    print(
        f"\nall policies: async/sync replay CPU {cpu_ratio:.3f}, "
        f"steps per CPU second {rate['async'] / rate['sync']:.3f}"
    )


if __name__ == "__main__":
    main()
