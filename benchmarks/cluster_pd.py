"""Aggregated vs disaggregated serving at equal GPU count, in the simulator.

    python benchmarks/cluster_pd.py [--gpus 4] [--rates 8 16 24] [--cost-model calibrated]
        [--num-gpu-blocks N] [--ttft 0.5] [--tpot 0.05] [--limit N]

Llama-3.1-8B on H200s; the Azure conversation trace (full, 19,366 requests) at each rate
scale; policies fcfs and chunked_prefill (2,048-token budget). Layouts: ``--gpus``
aggregated replicas (router least_outstanding_tokens) and every P prefill + D decode split
with P + D = ``--gpus`` (prefill router least_outstanding_tokens, decode router least_kv,
KV over InfiniBand NDR). The cost model is the one calibrated on the lab's H200 engine
profile (profiles/h200_llama-3.1-8b.csv) or the analytic roofline. Prints one row per
layout x policy x rate: goodput (req/s within both SLOs), SLO attainment, TTFT and TPOT
p50 / p99, preemptions. Simulated results only (no wall times): they do not depend on the
machine's load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.config import validate  # noqa: E402
from lab.experiment import run_experiment  # noqa: E402


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
    ap.add_argument("--ttft", type=float, default=0.5)
    ap.add_argument("--tpot", type=float, default=0.05)
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
        "slo": {"ttft_s": args.ttft, "tpot_s": args.tpot},
    }
    if args.cost_model == "calibrated":
        base["cost_model"] = {"profile": str(ROOT / "profiles/h200_llama-3.1-8b.csv")}
    if args.num_gpu_blocks:
        base["kv_cache"] = {"num_gpu_blocks": args.num_gpu_blocks}
    print(
        f"cost model {args.cost_model}, KV blocks a replica "
        f"{args.num_gpu_blocks or 'vLLM rule'}, SLO TTFT {args.ttft} s TPOT {args.tpot} s"
    )
    print(
        "| layout | policy | rate | goodput req/s | SLO att. | TTFT p50 / p99 s | "
        "TPOT p50 / p99 ms | preempt | KV mean % |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, cluster in layouts(args.gpus):
        for run in run_experiment(validate({**base, "cluster": cluster}), progress=False):
            s = run.summary
            print(
                f"| {name} | {run.policy} | {run.rate_scale:g} | {s['goodput']:.2f} | "
                f"{s['slo_attainment']:.1%} | {s['ttft_s']['p50']:.3f} / {s['ttft_s']['p99']:.3f} | "
                f"{1e3 * s['tpot_s']['p50']:.1f} / {1e3 * s['tpot_s']['p99']:.1f} | "
                f"{s['preemptions']['recompute'] + s['preemptions']['swap']} | "
                f"{100 * s['kv_used_fraction']['mean']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
