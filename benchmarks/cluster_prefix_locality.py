"""How much prefix reuse each router keeps: the infinite-cache hit-rate bound per replica.

    python benchmarks/cluster_prefix_locality.py [--replicas 4] [--mooncake-limit 4000]

A prefix cache can only reuse KV that its own replica computed. For each router, the
cluster replays the trace (fcfs) and ``sched_lab.traces.prefix_bound.prefix_hit_bound`` is taken over
the requests each replica served, in arrival order: the cached prompt tokens an unlimited
cache on that replica would have. The table gives their sum over all prompt tokens (the
cluster's bound), the same bound for one replica holding every request, the load balance
(most requests on a replica / the mean) and TTFT p50 / p99. Traces:
experiments/synthetic_prefix.yaml (8 system prompts of 2,048 tokens, multi-turn
conversations, hash ids at 16 tokens) and the first ``--mooncake-limit`` rows of the
Mooncake conversation trace (hash ids at 512 tokens, every request's first id shared).
Simulated results (independent of the machine's load).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.config import load_config, validate  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402
from sched_lab.traces.prefix_bound import prefix_hit_bound  # noqa: E402

ROUTERS = [
    "round_robin",
    "least_outstanding_tokens",
    "power_of_two",
    {"name": "prefix_affinity", "prefix_blocks": 2},
    {"name": "prefix_affinity", "prefix_blocks": 130},
]


def configs(mooncake_limit: int):
    synthetic = load_config(ROOT / "experiments/synthetic_prefix.yaml")
    yield "synthetic_prefix", dataclasses.replace(synthetic, policies=synthetic.policies[:1])
    yield (
        f"mooncake (first {mooncake_limit})",
        validate(
            {
                "trace": {
                    "format": "mooncake",
                    "path": str(ROOT / "traces/data/mooncake_conversation_trace.jsonl"),
                    "limit": mooncake_limit,
                },
                "model": "qwen3-8b",
                "kv_cache": {"block_size": 16, "gpu_memory_utilization": 0.5},
                "policies": [{"name": "chunked_prefill", "max_num_batched_tokens": 8192}],
            }
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--mooncake-limit", type=int, default=4000)
    args = ap.parse_args()
    print(
        "| trace | router | hit-rate bound, cluster | one replica | max / mean requests | "
        "TTFT p50 / p99 s |"
    )
    print("|---|---|---|---|---|---|")
    for name, cfg in configs(args.mooncake_limit):
        bs = cfg.kv_cache.block_size
        for router in ROUTERS:
            c = validate(
                {**cfg.to_dict(), "cluster": {"replicas": args.replicas, "router": router}}
            )
            run = run_experiment(c, progress=False)[0]
            res = run.result
            cached = prompt = 0
            for rr in res.replica_results:
                b = prefix_hit_bound(sorted(rr.requests, key=lambda r: r.arrival_s), bs)
                cached, prompt = cached + b.total_cached_tokens, prompt + b.prompt_tokens
            one = prefix_hit_bound(res.requests, bs).hit_rate
            counts = [len(rr.requests) for rr in res.replica_results]
            label = (
                router
                if isinstance(router, str)
                else f"prefix_affinity k={router['prefix_blocks']}"
            )
            s = run.summary
            print(
                f"| {name} | {label} | {cached / prompt:.3f} | {one:.3f} | "
                f"{max(counts) / (sum(counts) / len(counts)):.2f} | "
                f"{s['p50_ttft_ms'] / 1e3:.3f} / {s['p99_ttft_ms'] / 1e3:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
