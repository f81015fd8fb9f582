"""Simulator speed with the prefix cache on vs off: the whole Mooncake trace per policy.

    python benchmarks/prefix_sim_speed.py [--limit N] [--repeat 1]

The Mooncake conversation trace (12,031 requests, prompts up to 126k tokens) as
experiments/mooncake_prefix.yaml replays it (Qwen3-8B, H200 preset, 40,000 KV blocks of 16
tokens) at rate_scale 0.3 (benchmarks/soak.py's load: the engine ~90% busy; the whole
trace is ~3x overloaded at 1), through fcfs, swap, chunked_prefill and prefix_aware, each with
caching off and on. Prints per policy the replay wall seconds (best of --repeat, replay
only, metrics excluded), the ratio on / off, and the hit rate. Target: on / off <= 1.5.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.config import load_config, validate  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402

POLICIES = ["fcfs", "swap", {"name": "chunked_prefill", "max_num_batched_tokens": 8192},
            "prefix_aware"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rate-scale", type=float, default=0.3, help="0.3: ~90% busy (soak.py)")
    args = ap.parse_args()
    raw = load_config(ROOT / "experiments/mooncake_prefix.yaml").to_dict()
    raw["trace"].pop("limit")
    raw["trace"]["rate_scale"] = args.rate_scale
    if args.limit:
        raw["trace"]["limit"] = args.limit
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}")  # fmt: skip
    print("| policy | steps | off (s) | on (s) | on / off | hit rate |")
    print("|---|---|---|---|---|---|")
    for pol in POLICIES:
        times = {}
        for caching in (False, True):
            kv = {**raw["kv_cache"], "enable_prefix_caching": caching}
            cfg = validate({**raw, "kv_cache": kv, "policies": [pol]})
            best = None
            for _ in range(args.repeat):
                run = run_experiment(cfg, progress=False)[0]
                if best is None or run.result.wall_s < best.result.wall_s:
                    best = run
            times[caching] = best
        off, on = times[False], times[True]
        print(f"| {on.label} | {on.summary['num_steps']:,} | {off.result.wall_s:.2f} "
              f"| {on.result.wall_s:.2f} | {on.result.wall_s / off.result.wall_s:.2f} "
              f"| {on.summary['prefix_cache_hit_rate']:.1%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
