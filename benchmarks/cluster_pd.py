"""Aggregated vs disaggregated serving at equal GPU count, in the simulator.

    python benchmarks/cluster_pd.py [--gpus 4] [--rates 8 16 24] [--cost-model calibrated]
        [--num-gpu-blocks N] [--slos 0.5:0.05 0.5:0.02] [--limit N]

Llama-3.1-8B on H200s; the Azure conversation trace (full, 19,366 requests) at each rate
scale; policies fcfs and chunked_prefill (2,048-token budget). Layouts: ``--gpus``
aggregated replicas (router least_outstanding_tokens) and every P prefill + D decode split
with P + D = ``--gpus`` (prefill router least_outstanding_tokens, decode router least_kv,
KV over InfiniBand NDR). The cost model is the one calibrated on the lab's H200 engine
profile (profiles/h200_llama-3.1-8b.csv) or the analytic roofline. Prints one row per
layout x policy x rate: TTFT and TPOT p50 / p99, preemptions, KV use, and for each SLO
pair TTFT:TPOT (seconds) the goodput (finished requests within both, per second) and the
SLO attainment. Simulated results only (no wall times): they do not depend on the
machine's load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.config import validate  # noqa: E402
from sched_lab.results.metrics import meets_slo  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402


def layouts(gpus: int) -> list[tuple[str, dict]]:
    out = [(f"{gpus} aggregated", {"replicas": gpus, "router": "least_outstanding_tokens"})]
    for p in range(1, gpus):
        out.append(
            (
                f"{p}P + {gpus - p}D",
                {
                    "prefill": {"replicas": p, "router": "least_outstanding_tokens"},
                    "decode": {"replicas": gpus - p, "router": "least_kv"},
                    "kv_transfer": "ib-ndr",
                },
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--rates", type=float, nargs="+", default=[8.0, 16.0, 24.0])
    ap.add_argument("--cost-model", choices=("calibrated", "analytic"), default="calibrated")
    ap.add_argument("--num-gpu-blocks", type=int, help="KV blocks a replica (default: vLLM's rule)")
    ap.add_argument("--slos", nargs="+", default=["0.5:0.05", "0.5:0.02"])
    ap.add_argument("--limit", type=int)
    args = ap.parse_args()
    trace = {"format": "azure2023", "path": str(ROOT / "traces/data/azure2023_conv.csv")}
    if args.limit:
        trace["limit"] = args.limit
    base = {
        "trace": {**trace, "rate_scale": args.rates},
        "model": "llama-3.1-8b",
        "hardware": "h200-sxm",
        "policies": ["fcfs", {"name": "chunked_prefill", "max_num_batched_tokens": 2048}],
    }
    if args.cost_model == "calibrated":
        base["cost_model"] = {"profile": str(ROOT / "profiles/h200_llama-3.1-8b.csv")}
    if args.num_gpu_blocks:
        base["kv_cache"] = {"num_gpu_blocks": args.num_gpu_blocks}
    print(f"cost model {args.cost_model}, KV blocks a replica {args.num_gpu_blocks or 'vLLM rule'}")
    slos = [dict(zip(("ttft_s", "tpot_s"), map(float, s.split(":")))) for s in args.slos]
    heads = [f"goodput / att. @ {s}" for s in args.slos]
    print(
        "| layout | policy | rate | TTFT p50 / p99 s | TPOT p50 / p99 ms | preempt | KV mean % | "
        + " | ".join(heads)
        + " |"
    )
    print("|---" * (7 + len(slos)) + "|")
    for name, cluster in layouts(args.gpus):
        for run in run_experiment(validate({**base, "cluster": cluster}), progress=False):
            s = run.summary
            good = [meets_slo(run.requests, slo) for slo in slos]
            print(
                f"| {name} | {run.policy} | {run.rate_scale:g} | "
                f"{s['p50_ttft_ms'] / 1e3:.3f} / {s['p99_ttft_ms'] / 1e3:.3f} | "
                f"{s['p50_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} | "
                f"{s['num_preemptions']} | "
                f"{100 * s['mean_kv_cache_usage']:.0f} | "
                + " | ".join(f"{g.sum() / s['duration']:.1f} / {g.mean():.1%}" for g in good)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
