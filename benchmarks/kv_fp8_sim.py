"""The simulator's prediction of benchmarks/kv_fp8.py's memory-bound runs (no GPU).

    python benchmarks/kv_fp8_sim.py                          # blocks of the 2026-12-03 H200 run
    python benchmarks/kv_fp8_sim.py --blocks 292 585         # bf16 and fp8 GPU blocks

The same requests as kv_fp8.py (nano-vllm's workload: 256 requests, prompt and output
lengths uniform in [100, 1024], seed 0, all at t = 0), chunked_prefill with max_num_seqs 256
and a token budget of 8192, replayed in the simulator with the shipped Qwen3-0.6B H200
profile (made with a bf16 cache: its KV-byte coefficients are halved for fp8,
lab/sim/calibrated.py) at the engine's block counts. Prints blocks, preemptions, duration
and output tok/s per KV dtype and the fp8 / bf16 throughput ratio, to hold next to the
engine's ratio measured by kv_fp8.py --skip-full.
"""

from __future__ import annotations

import argparse

from common import ROOT
from kv_fp8 import workload

from sched_lab.config import validate
from sched_lab.core.request import Request
from sched_lab.run.experiment import run_experiment


def simulate(blocks: int, kv_dtype: str, prompts, outputs) -> dict:
    """One simulated replay: duration (s), output tokens, preemptions."""
    cfg = validate(
        {
            "name": "kv_fp8_sim",
            "backend": "sim",
            "trace": {"format": "synthetic", "num_requests": 1},  # replaced by the requests
            "model": "qwen3-0.6b",
            "hardware": "h200-sxm",
            "cost_model": {"profile": "profiles/h200_qwen3-0.6b.csv"},
            "kv_cache": {"block_size": 16, "swap_space_gib": 0, "dtype": kv_dtype,
                         "num_gpu_blocks": blocks},
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
            "policies": ["chunked_prefill"],
        },
        "kv_fp8_sim",
        ROOT,
    )  # fmt: skip
    reqs = [Request(str(i), 0.0, len(p), o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    (run,) = run_experiment(cfg, progress=False, requests=reqs)
    return {
        "duration": float(run.summary["duration"]),
        "tokens": int(run.requests["num_generated_tokens"].sum()),
        "preemptions": int(run.summary["num_preemptions"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs=2, default=(292, 585),
                    metavar=("BF16", "FP8"), help="GPU blocks of the two runs")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=256)
    args = ap.parse_args()
    prompts, outputs = workload(args.num_requests, 100, 1024)
    print(f"# simulated kv_fp8 budget runs, qwen3-0.6b H200 profile, {len(prompts)} requests")
    print(f"{'kv dtype':<10}{'blocks':>8}{'preempt':>9}{'tokens':>9}{'sim s':>9}{'tok/s':>10}")
    rows = {}
    for kv_dtype, blocks in zip(("auto", "fp8"), args.blocks):
        r = rows[kv_dtype] = simulate(blocks, kv_dtype, prompts, outputs)
        print(f"{kv_dtype:<10}{blocks:>8}{r['preemptions']:>9}{r['tokens']:>9}"
              f"{r['duration']:>9.2f}{r['tokens'] / r['duration']:>10,.0f}")  # fmt: skip
    a, b = rows["auto"], rows["fp8"]
    ratio = (b["tokens"] / b["duration"]) / (a["tokens"] / a["duration"])
    print(f"fp8 / auto throughput {ratio:.2f}x (predicted)")


if __name__ == "__main__":
    main()
