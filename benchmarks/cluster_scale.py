"""Cluster simulator speed: a 16-replica cluster on the Azure conversation trace at 16x its
rate against one replica on the trace at 1x (the same requests, the same load per replica).

    python benchmarks/cluster_scale.py [--repeat 2] [--routers round_robin least_kv ...]

Each case runs in a fresh process (its peak RSS is its own), cases alternate over the
repeats, and the best replay wall time of each is printed with the engine steps it
simulated (the simulated work), the wall time per step and the peak RSS. Llama-3.1-8B on
H200s, KV cache sized by vLLM's rule (gpu_memory_utilization 0.9), fcfs.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRACE = {"format": "azure2023", "path": str(ROOT / "traces/data/azure2023_conv.csv")}


def one(replicas: int, router: str, rate_scale: float) -> dict:
    """Run one case in this process; returns its figures."""
    from sched_lab.config import validate
    from sched_lab.run.experiment import run_experiment

    raw = {"trace": {**TRACE, "rate_scale": rate_scale}, "policies": ["fcfs"]}
    if replicas > 1:
        raw["cluster"] = {"replicas": replicas, "router": router}
    run = run_experiment(validate(raw), progress=False)[0]
    return {
        "replay_wall_s": run.result.wall_s,
        "num_steps": run.summary["num_steps"],
        "finished": run.summary["completed"],
        "ttft_p99_s": run.summary["p99_ttft_ms"] / 1e3,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--routers", nargs="+", default=["round_robin", "least_outstanding_tokens"])
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # replicas router rate_scale
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], float(args.one[2]))))
        return
    cases = [(1, "round_robin", 1.0)] + [(16, r, 16.0) for r in args.routers]
    best: dict = {}
    for _ in range(args.repeat):
        for case in cases:
            cmd = [sys.executable, __file__, "--one", *map(str, case)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            if case not in best or out["replay_wall_s"] < best[case]["replay_wall_s"]:
                best[case] = out
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    base = best[cases[0]]
    print(
        "| replicas | router | rate_scale | steps | replay wall s | us/step | x 1-replica wall | peak RSS MB | TTFT p99 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, router, scale), b in best.items():
        print(
            f"| {n} | {router if n > 1 else '-'} | {scale:g} | {b['num_steps']:,} | "
            f"{b['replay_wall_s']:.2f} | {1e6 * b['replay_wall_s'] / b['num_steps']:.0f} | "
            f"{b['replay_wall_s'] / base['replay_wall_s']:.2f} | {b['peak_rss_mb']:.0f} | "
            f"{b['ttft_p99_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
