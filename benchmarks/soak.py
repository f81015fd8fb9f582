"""Soak: the whole Mooncake conversation trace through every policy under tight KV memory.

    python benchmarks/soak.py [--rate-scale 0.3] [--num-gpu-blocks 8192] [--limit N]
                              [--policies fcfs swap ...]

12,031 requests, prompts up to 126k tokens (mean 12k), on Llama-3.1-8B (131,072-token
context) with the H200 preset. The KV cache is 8,192 blocks of 16 tokens = 131,072 tokens,
exactly the model's context, so ``max_model_len`` = 131,072 and every request of the trace
(longest: 126,527 tokens) fits the cache alone: none may be rejected or aborted. That is
16 GiB of KV, a sixth of what sizing by gpu_memory_utilization 0.9 (as vLLM does) gives,
so long prompts queue for blocks and growing decodes force preemptions now and then.

Each policy runs in a fresh child process, so its peak RSS (``ru_maxrss``) is its own. The
child checks what must hold at the end: every request ended, all KV blocks free (GPU and
CPU, ``check_integrity``), step limits respected. A policy that raises
``SchedulerStuckError`` (no progress, or a request preempted more than max_preemptions
times) is reported as stuck with the message, not as a crash of the soak.

Prints one markdown table row per policy: replay wall time, peak RSS (and the RSS after
loading the trace, before the replay), steps, finished / rejected / aborted, preemptions
(recompute / swap, most of one request), prefill tokens computed (the trace has 144.8 M;
more means recomputation), simulated time and the engine's busy fraction, TTFT P50 / P99.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = "traces/data/mooncake_conversation_trace.jsonl"
MODEL, HARDWARE = "llama-3.1-8b", "h200-sxm"
BLOCK_SIZE = 16  # tokens
NUM_GPU_BLOCKS = 8192  # 131,072 tokens = Llama-3.1-8B's context (16 GiB of KV)
RATE_SCALE = 0.3  # see BENCHMARKS.md: the engine is busy ~90% of the time, not saturated


def config(policy: str, rate_scale: float, num_gpu_blocks: int, limit: int | None):
    from sched_lab.config import validate

    trace = {"format": "mooncake", "path": TRACE, "rate_scale": rate_scale}
    if limit:
        trace["limit"] = limit
    return validate(
        {
            "name": "soak",
            "trace": trace,
            "model": MODEL,
            "hardware": HARDWARE,
            "kv_cache": {"block_size": BLOCK_SIZE, "num_gpu_blocks": num_gpu_blocks},
            "policies": [policy],
        },
        "soak",
        ROOT,
    )


def worker(policy: str, rate_scale: float, num_gpu_blocks: int, limit: int | None) -> dict:
    """Replay the trace through one policy in this process; returns the row as a dict."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from sched_lab.core.errors import SchedulerStuckError
    from sched_lab.core.kv import BlockManager
    from sched_lab.policies import get_policy
    from sched_lab.results import metrics
    from sched_lab.run.experiment import resolve_limits
    from sched_lab.setup.sim import sim_parts
    from sched_lab.sim.cost_model import CostModelExecutor
    from sched_lab.sim.models import MODELS
    from sched_lab.sim.replay import replay
    from sched_lab.traces import load_trace

    cfg = config(policy, rate_scale, num_gpu_blocks, limit)
    cost_model, gpu, cpu = sim_parts(cfg)
    pol, bs = cfg.policies[0], cfg.kv_cache.block_size
    cls = get_policy(pol.name)
    limits = resolve_limits(
        cfg, pol, gpu * bs, MODELS[MODEL].max_position_embeddings, cls.chunked_prefill
    )
    requests = [
        r
        for r in load_trace({**cfg.trace.spec, "seed": cfg.seed}, ROOT)
        if r.status.value != "dropped"
    ]  # trace rows that are never replayed
    bm = BlockManager(gpu, cpu, bs, cfg.kv_cache.watermark)
    scheduler = cls(limits, bm)
    row = {
        "policy": policy,
        "requests": len(requests),
        "gpu_blocks": gpu,
        "cpu_blocks": cpu,
        "max_model_len": limits.max_model_len,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "rss_before_replay_mib": _max_rss_mib(),
    }
    t0 = time.perf_counter()
    try:
        result = replay(requests, scheduler, CostModelExecutor(cost_model, bs))
    except SchedulerStuckError as e:
        preempted = max(requests, key=lambda r: r.num_preemptions)
        row.update(
            stuck=str(e),
            wall_s=time.perf_counter() - t0,
            peak_rss_mib=_max_rss_mib(),
            most_preempted=f"{preempted.request_id} ({preempted.num_preemptions})",
        )
        return row
    row["wall_s"] = result.wall_s
    row["peak_rss_mib"] = _max_rss_mib()
    # What must hold at the end (cheap, vectorized; check_invariants per step is too slow).
    bm.check_integrity([])
    assert not scheduler.has_unfinished()
    s = result.steps
    assert np.all(s["kv_used_blocks"] <= gpu) and np.all(s["cpu_used_blocks"] <= cpu)
    assert np.all(s["num_prefill_tokens"] + s["num_decode_tokens"] <= limits.max_num_batched_tokens)
    assert np.all(s["num_running"] <= limits.max_num_seqs)
    df, itl = metrics.request_table(result, policy, rate_scale)
    summary = metrics.summarize(df, itl, result, cfg.slo.to_dict())
    busy_s = float(s["duration_s"].sum())
    row.update(
        steps=summary["num_steps"],
        finished=summary["completed"],
        rejected=summary["rejected"],
        aborted=summary["aborted"],
        preempt_recompute=summary["num_preemptions_recompute"],
        preempt_swap=summary["num_preemptions_swap"],
        max_preemptions_one_request=int(df["num_preemptions"].max()),
        prefill_tokens=int(s["num_prefill_tokens"].sum()),
        sim_s=summary["duration"],
        busy_fraction=busy_s / summary["duration"],
        ttft_p50_s=summary["p50_ttft_ms"] / 1e3,
        ttft_p99_s=summary["p99_ttft_ms"] / 1e3,
        reasons=sorted(set(df.loc[df.status != "finished", "reason"]))[:3],
    )
    return row


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-scale", type=float, default=RATE_SCALE)
    ap.add_argument("--num-gpu-blocks", type=int, default=NUM_GPU_BLOCKS)
    ap.add_argument("--limit", type=int, help="first N requests only (a quick check)")
    ap.add_argument("--policies", nargs="+", help="default: every registered policy")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one policy, print JSON
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rate_scale, args.num_gpu_blocks, args.limit)))
        return
    sys.path.insert(0, str(ROOT))
    from sched_lab.policies import policy_names

    policies = args.policies or policy_names()
    print(
        f"# soak: {TRACE}, {MODEL} on {HARDWARE}, {args.num_gpu_blocks} GPU blocks of "
        f"{BLOCK_SIZE} tokens, rate_scale {args.rate_scale:g}"
        + (f", first {args.limit} requests" if args.limit else "")
    )
    print(
        f"# {platform.machine()}, python {platform.python_version()}, one child process per policy"
    )
    print(
        "| policy | replay wall (s) | peak RSS (MiB) (before replay) | steps "
        "| finished / rejected / aborted | preemptions rec / swap (max of one request) "
        "| prefill tokens | sim time (s) | busy | TTFT p50 / p99 (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    for policy in policies:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            policy,
            "--rate-scale",
            str(args.rate_scale),
            "--num-gpu-blocks",
            str(args.num_gpu_blocks),
        ]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            failed = True
            print(f"| {policy} | crashed: {proc.stderr.strip().splitlines()[-1:]} |", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        if "stuck" in r:
            failed = True
            print(
                f"| {policy} | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} | STUCK: "
                f"{r['stuck']} (most preempted: {r['most_preempted']}) |",
                flush=True,
            )
            continue
        print(
            f"| {policy} | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} "
            f"({r['rss_before_replay_mib']:.0f}) | {r['steps']:,} "
            f"| {r['finished']} / {r['rejected']} / {r['aborted']} "
            f"| {r['preempt_recompute']} / {r['preempt_swap']} "
            f"({r['max_preemptions_one_request']}) | {r['prefill_tokens'] / 1e6:.1f} M "
            f"| {r['sim_s']:,.0f} | {r['busy_fraction']:.0%} "
            f"| {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} |",
            flush=True,
        )
        if r["reasons"]:
            print(f"<!-- {policy}: not finished because: {r['reasons']} -->")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
