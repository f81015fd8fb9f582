"""Where a decode step's GPU time goes: torch.profiler over CUDA-graph decode steps.

    python benchmarks/decode_kernels.py [--preset qwen3-0.6b] [--batch 32] [--context 1024]

Prints the kernels by total GPU time over ``--steps`` steps (each step replays the graph of
its batch size), the summed GPU time per step and the step's wall time, so the gap between
them (host work: staging inputs, sampling, the sync) is visible; then where a step's wall
time goes, part by part (host time of staging, of the graph launch call, of sampling and
the token copy; the graph's span on the GPU between two events).
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
    print(
        f"# decode kernels, {args.preset}, batch {args.batch}, context {args.context}, "
        f"{device_line()}"
    )
    print(f"step wall {wall * 1e3:.3f} ms; GPU kernel time {total / 1e3:.3f} ms per step")
    print("| kernel | calls/step | us/step | share |")
    print("|---|---|---|---|")
    for e in events[:25]:
        us = e.device_time_total / args.steps
        print(f"| {e.key[:70]} | {e.count / args.steps:.0f} | {us:.1f} | {us / total:.0%} |")
    step_parts(runner, seqs, args.steps)


def step_parts(runner, seqs, steps: int) -> None:
    """Medians over ``steps`` decode steps, each part timed on its own (the runner's
    execute() does the same parts in this order)."""
    import time

    import numpy as np
    import torch

    from sched_lab.backend.sampler import sample

    graphs = runner.graphs
    size = graphs.size_for(seqs) if graphs is not None and graphs.capture else None
    if size is None:
        print("\n(no captured decode graph for this batch: no breakdown)")
        return
    key = ("decode", size, size)
    graph, logits = graphs.graphs[key], graphs.outputs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = {k: [] for k in ("stage (host)", "graph launch call (host)", "graph span (GPU)",
                            "sample + token copy (host, waits for the GPU)", "whole step")}  # fmt: skip
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs.stage(seqs, size)
        t1 = time.perf_counter()
        start.record()
        graph.replay()
        t2 = time.perf_counter()
        end.record()
        sample(logits[: len(seqs)], [0.0] * len(seqs), runner.generator).tolist()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        rows["stage (host)"].append(t1 - t0)
        rows["graph launch call (host)"].append(t2 - t1)
        rows["graph span (GPU)"].append(start.elapsed_time(end) / 1e3)
        rows["sample + token copy (host, waits for the GPU)"].append(t3 - t2)
        rows["whole step"].append(t3 - t0)
    # Back to back, staged once: the graph alone, launches queued ahead of the GPU.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    rows["graph replays back to back, per replay"] = [(time.perf_counter() - t0) / steps]
    print("\n| part of a step | median (us) |\n|---|---|")
    for name, v in rows.items():
        print(f"| {name} | {np.median(v) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
