"""Where a decode step's GPU time goes: torch.profiler over CUDA-graph decode steps.

    python benchmarks/decode_kernels.py [--preset qwen3-0.6b] [--batch 32] [--context 1024]

Prints the kernels by total GPU time over ``--steps`` steps (each step replays the graph of
its batch size), the summed GPU time per step and the step's wall time, so the gap between
them (host work: staging inputs, sampling, the sync) is visible.
"""

from __future__ import annotations

import argparse

from common import decode_inputs, device_line, engine_runner, step_wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    runner = engine_runner(args.preset, max_num_seqs=max(args.batch, 1))
    seqs = decode_inputs(args.batch, args.context)
    wall = step_wall(runner, seqs, args.steps, warmup=5)
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
