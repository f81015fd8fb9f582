"""Peak memory of ``sched-lab run`` by phase, on the conversation trace at 2x (benchmarks/sim_speed_conv2x.yaml) tiled to N requests.

    python benchmarks/run_memory.py --requests 250000 [--policies fcfs swap] [--no-plots]
        [--work DIR] [--out DIR] [--tracemalloc]

Builds (once, in ``--work``) the conversation trace repeated back to back up to N requests
(``sim_speed_vidur.py``'s tiled Mooncake JSONL), then runs ``sched-lab run`` in this process
with a thread sampling the resident set every 20 ms. Prints, per phase (trace, each replay,
each run's metrics, writing), the peak RSS inside it and the RSS at its end, then the
process's peak RSS and CPU seconds. ``--tracemalloc``: also the 15 largest allocation sites
alive when the last run's metrics end (slow: about 3x the run's time). ``--parts``: also
the peak RSS inside each of the functions in :data:`PARTS` (the parts of the metrics and of
writing a run), above the RSS at its start.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from sim_speed_vidur import load_base, tiled_trace  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
# (module, function): the parts of a run's metrics and writing that --parts measures; none
# calls another
PARTS = [
    ("sched_lab.results.metrics", "request_table"),
    ("sched_lab.results.metrics", "latency_stats"),
    ("sched_lab.results.metrics", "cdf_points"),
    ("sched_lab.report.timeline", "_event_columns"),  # events.csv's rows (whole or in parts)
    ("sched_lab.report.folder", "_append_csv"),
    ("sched_lab.report.folder", "_write_run_steps"),
    ("sched_lab.report.plots", "run_series"),
    ("sched_lab.report.folder", "concat_requests"),
]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler(threading.Thread):
    """The largest RSS seen since the last :meth:`cut`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.02)

    def cut(self) -> tuple[int, int]:
        now = rss_bytes()
        peak, self.peak = max(self.peak, now), now
        return peak, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=250_000)
    ap.add_argument("--policies", nargs="+", default=["fcfs"])
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--parts", action="store_true", help="peak RSS inside each of PARTS")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "run-memory")
    ap.add_argument("--out", type=Path, help="the results folder (default: in --work)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = load_base(ROOT / "benchmarks" / "sim_speed_conv2x.yaml")
    trace = args.work / f"tiled_{args.requests}.jsonl"
    if not trace.exists():
        tiled_trace(cfg, args.requests, trace)
    cfg["name"] = f"memory_{args.requests}"
    cfg["trace"] = {"format": "mooncake", "path": str(trace),
                    "rate_scale": cfg["trace"].get("rate_scale", 1.0)}  # fmt: skip
    known = {(p if isinstance(p, str) else p["name"]): p for p in cfg["policies"]}
    cfg["policies"] = [known.get(name, name) for name in args.policies]
    path = args.work / f"memory_{args.requests}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = args.out or args.work / f"out_{args.requests}"

    import logging

    from sched_lab.report import progress

    sampler = Sampler()
    sampler.start()
    rows: list[tuple[str, float, int, int]] = []
    original_close = progress.Phase.close
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(8)

    def close(self, ok: bool = True):
        open_ = self.t0 is not None
        original_close(self, ok)
        if open_:
            peak, now = sampler.cut()
            rows.append((self.name, time.process_time(), peak, now))
            if args.tracemalloc and self.name.endswith("metrics"):
                global SNAPSHOT
                SNAPSHOT = tracemalloc.take_snapshot()

    progress.Phase.close = close
    part_rows: list[tuple[str, int, int]] = []  # (function, RSS at its start, peak inside)
    logging.disable(logging.INFO)
    from sched_lab.cli import run_main

    if args.parts:
        import functools
        import importlib

        def measured(name, fn):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                # a peak of its own, folded back into the phase's when it returns
                outer, before = sampler.peak, rss_bytes()
                sampler.peak = before
                try:
                    return fn(*a, **k)
                finally:
                    inner = max(sampler.peak, rss_bytes())
                    sampler.peak = max(outer, inner)
                    part_rows.append((name, before, inner))

            return wrapper

        for module, name in PARTS:  # every module's binding, `from x import f` ones too
            fn = getattr(importlib.import_module(module), name)
            wrapped = measured(name, fn)
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("sched_lab"):
                    for attr, value in list(vars(mod).items()):
                        if value is fn:
                            setattr(mod, attr, wrapped)
    argv = [str(path), "--out", str(out), "--no-progress", "-q"]
    argv += ["--no-plots"] if args.no_plots else []
    c0 = time.process_time()
    with open(os.devnull, "w") as null:
        saved, sys.stdout = sys.stdout, null
        try:
            code = run_main(argv)
        finally:
            sys.stdout = saved
    sampler.stop = True
    mib = 1 << 20
    print(f"# {args.requests:,} requests, policies {' '.join(args.policies)}"
          f"{', --no-plots' if args.no_plots else ''}; exit {code}")  # fmt: skip
    print("| phase | CPU at end (s) | peak RSS in it (MiB) | RSS at end (MiB) |")
    print("|---|---|---|---|")
    for what, cpu, peak, now in rows:
        print(f"| {what} | {cpu - c0:.1f} | {peak / mib:,.0f} | {now / mib:,.0f} |")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"process: {time.process_time() - c0:.1f} CPU s, peak RSS {maxrss:,.0f} MiB "
          f"({maxrss * 1024 / args.requests / len(args.policies):,.1f} KiB per request-run)")  # fmt: skip
    if part_rows:
        print("\n| part (call) | RSS at its start (MiB) | peak inside, above the start (MiB) |")
        print("|---|---|---|")
        for name, before, peak in part_rows:
            print(f"| {name} | {before / mib:,.0f} | +{(peak - before) / mib:,.0f} |")
    if args.tracemalloc and "SNAPSHOT" in globals():
        print("\n# largest allocation sites alive after the last run's metrics")
        for stat in SNAPSHOT.statistics("traceback")[:15]:
            last = reversed(stat.traceback[-4:])  # the allocating frame first, then its callers
            frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in last)
            print(f"{stat.size / mib:8.1f} MiB {stat.count:>10,}  {frames}")


if __name__ == "__main__":
    main()
