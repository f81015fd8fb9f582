"""Where a decode step's GPU time goes: torch.profiler over CUDA-graph decode steps.

    python benchmarks/decode_kernels.py [--preset qwen3-0.6b] [--batch 32] [--context 1024]

Prints the kernels by total GPU time over ``--steps`` steps (each step replays the graph of
its batch size), the summed GPU time per step and the step's wall time, so the gap between
them (host work: staging inputs, sampling, the sync) is visible.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import checkpoint, device_line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from backend.runner import ModelRunner, SeqInput

    runner = ModelRunner(checkpoint(args.preset), device="cuda", dtype="bfloat16",
                         attention_backend="triton", block_size=16, gpu_memory_utilization=0.9,
                         max_num_seqs=max(args.batch, 1))
    per_seq = -(-(args.context + 1) // 16)
    seqs = [SeqInput([1], args.context, list(range(i * per_seq, (i + 1) * per_seq)), True)
            for i in range(args.batch)]
    for _ in range(5):
        runner.execute(seqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        runner.execute(seqs)
    wall = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.execute(seqs)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / args.steps
    print(f"# decode kernels, {args.preset}, batch {args.batch}, context {args.context}, "
          f"{device_line()}")
    print(f"step wall {wall * 1e3:.3f} ms; GPU kernel time {total / 1e3:.3f} ms per step")
    print("| kernel | calls/step | us/step | share |")
    print("|---|---|---|---|")
    for e in events[:25]:
        us = e.device_time_total / args.steps
        print(f"| {e.key[:70]} | {e.count / args.steps:.0f} | {us:.1f} | {us / total:.0%} |")


if __name__ == "__main__":
    main()
