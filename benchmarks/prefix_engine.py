"""Prefix caching on the engine vs the simulator: a Mooncake slice, caching off and on.

    # H200 (the lead's command; ~3 min):
    python benchmarks/prefix_engine.py --preset qwen3-0.6b --requests 200 --out $OUT/prefix
    # CPU smoke test (tiny random model, prompts scaled down 64x):
    python benchmarks/prefix_engine.py --tiny --requests 24 --token-scale 64 --block-size 4 \
        --num-gpu-blocks 120

The first ``--requests`` requests of the Mooncake conversation trace (their arrival times
times ``--rate-scale``) run on the engine through fcfs with the prefix cache off and on,
and through the cache-aware prefix_aware policy. Prompt tokens come from the hash ids
(traces/hash_tokens.py: each id a seeded block of random tokens), so equal ids carry equal
tokens and the engine really shares KV. ``--token-scale s`` divides prompt and output
lengths and the 512-token hash block by s (the sharing structure stays; a tiny model's
context fits). Per run: the prefix-cache hit rate, TTFT (mean, P50, P99), output
throughput, and the same-run speedup (caching on vs off, TTFT and duration).

The simulator then replays each engine run with the engine's measured step durations
(an executor that returns them in order): it must make the engine's plans exactly, so
the hit rate and every step's cached-token count are identical (checked; exit status 1
if not). The infinite-cache bound (cached tokens if nothing were ever evicted, computed
from the hash ids alone) is printed beside the hit rates. Results: ``--out``/summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from common import tiny_qwen3  # noqa: E402

from sched_lab.core.plan import StepResult  # noqa: E402
from sched_lab.core.request import Request  # noqa: E402

TINY = tiny_qwen3(4096)  # a longer context than the tests' tiny Qwen3
POLICIES = [
    {"name": "fcfs", "label": "fcfs-nocache", "enable_prefix_caching": False},
    {"name": "fcfs", "label": "fcfs-cache"},
    {"name": "prefix_aware", "label": "prefix_aware", "max_wait_s": 5.0},
]


def mooncake_slice(n: int, scale: int, rate_scale: float) -> list[Request]:
    """The first ``n`` Mooncake requests, lengths divided by ``scale``, prompt tokens
    left to the engine path (traces/hash_tokens.py: a seeded token block per hash id)."""
    from sched_lab.traces import load_trace

    spec = {"format": "mooncake", "path": "traces/data/mooncake_conversation_trace.jsonl",
            "limit": n}  # fmt: skip
    hbs = 512 // scale
    out = []
    for r in load_trace(spec, ROOT):
        prompt = max(1, r.prompt_len // scale)
        ids = r.hash_ids[: -(-prompt // hbs)]  # the prompt's hash blocks (engine rule)
        out.append(Request(r.request_id, r.arrival_s / rate_scale, prompt,
                           max(1, r.output_len // scale), None, ids, hash_block_size=hbs))  # fmt: skip
    return out


class ReplayedDurations:
    """Simulator executor: step i takes the engine's measured duration of its step i."""

    wall_clock = False

    def __init__(self, durations: np.ndarray) -> None:
        self.durations, self.i = durations, 0

    def execute(self, plan) -> StepResult:
        d = float(self.durations[self.i])
        self.i += 1
        return StepResult(d)


def sim_replay(run, requests: list[Request], cfg, pol):
    """The simulator on the engine run's own limits, blocks and step durations."""
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.run.experiment import fresh
    from sched_lab.sim.replay import replay

    limits = SchedulerLimits(**run.summary["limits"])
    bm = make_block_manager(run.result.num_gpu_blocks, 0, cfg.kv_cache.block_size,
                            cfg.kv_cache.watermark, pol.prefix_caching(cfg.kv_cache))  # fmt: skip
    sched = get_policy(pol.name)(limits, bm, **pol.options)
    return replay(fresh(requests), sched, ReplayedDurations(run.result.steps["duration_s"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b", help="random checkpoint (GPU)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--token-scale", type=int, default=1)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="default: sized by memory")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size (tokens)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    from sched_lab.config import validate
    from sched_lab.run.experiment import run_experiment
    from sched_lab.traces.prefix_bound import prefix_hit_bound

    if args.tiny:
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        model = write_random_checkpoint(TINY, Path("/tmp/prefix_engine_tiny"), "float32", std=0.2)
        engine = {"model_path": str(model), "device": "cpu", "dtype": "float32"}
        max_len, seqs, budget = 4096, 16, 4096
    else:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from common import checkpoint

        model = checkpoint(args.preset)
        engine = {"model_path": str(model), "device": "cuda", "dtype": "bfloat16",
                  "attention_backend": "triton"}  # fmt: skip
        max_len, seqs, budget = 40960, 256, 40960
    kv = {"block_size": args.block_size, "enable_prefix_caching": True, "swap_space_gib": 0.01}
    if args.num_gpu_blocks:
        kv["num_gpu_blocks"] = args.num_gpu_blocks
    cfg = validate({
        "name": "prefix_engine", "backend": "engine",
        "trace": {"format": "synthetic", "num_requests": 1},  # replaced by requests=
        "engine": engine, "kv_cache": kv,
        "scheduler": {"max_num_seqs": seqs, "max_model_len": max_len,
                      "max_num_batched_tokens": budget},
        "policies": POLICIES,
    })  # fmt: skip
    requests = mooncake_slice(args.requests, args.token_scale, args.rate_scale)
    t0 = time.perf_counter()
    runs = run_experiment(cfg, progress=False, requests=requests)
    out, ok = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "requests": len(requests), "token_scale": args.token_scale,
               # traces/prefix_bound.py, over the requests admitted (the hit rate's)
               "infinite_cache_bound": prefix_hit_bound(
                   [r for r in runs[0].result.requests if r.first_scheduled_s >= 0],
                   args.block_size).hit_rate,
               "engine_wall_s": time.perf_counter() - t0, "runs": {}}, True  # fmt: skip
    for run, pol in zip(runs, cfg.policies):
        s = run.summary
        sim = sim_replay(run, requests, cfg, pol)
        sim_cached = sum(r.num_cached_tokens for r in sim.requests)
        same = np.array_equal(sim.steps["num_cached_tokens"], run.result.steps["num_cached_tokens"])
        same = same and sim_cached == s["prefix_cache_cached_tokens"]
        ok = ok and same and sim.failure is None
        out["runs"][run.label] = {
            "hit_rate": s["prefix_cache_hit_rate"], "sim_hit_rate_same": same,
            "evicted_blocks": s["prefix_cache_evicted_blocks"], "num_gpu_blocks": s["num_gpu_blocks"],
            "ttft_mean_s": s["mean_ttft_ms"] / 1e3, "ttft_p50_s": s["p50_ttft_ms"] / 1e3,
            "ttft_p99_s": s["p99_ttft_ms"] / 1e3, "output_throughput": s["output_throughput"],
            "duration_s": s["duration"], "finished": s["completed"],
        }  # fmt: skip
    r = out["runs"]
    off, on = r["fcfs-nocache"], r["fcfs-cache"]
    out["speedup_ttft_mean"] = off["ttft_mean_s"] / on["ttft_mean_s"]
    out["speedup_duration"] = off["duration_s"] / on["duration_s"]
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(text + "\n")
    print("simulator hit rates identical:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
