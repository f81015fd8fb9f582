"""Swap speed.

    python benchmarks/swap_bandwidth.py [--preset llama-3.1-8b] [--blocks 256 1024 4096]

Swap-out then swap-in of N scattered KV blocks through the engine's KV cache; achieved
bytes/s (both directions) divided by the pinned host<->device copy rate of one contiguous
buffer measured in the same run. Target: >= 80%.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import GIB, checkpoint, device_line, host_link_bandwidth


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--blocks", type=int, nargs="+", default=[256, 1024, 4096])
    args = ap.parse_args()
    from sched_lab.backend.runner import ModelRunner

    h2d, d2h = host_link_bandwidth()
    link = 2 / (1 / h2d + 1 / d2h)  # one out + one in of the same bytes
    runner = ModelRunner(
        checkpoint(args.preset),
        device="cuda",
        dtype="bfloat16",
        attention_backend="torch",
        block_size=16,
        num_gpu_blocks=8192,
        swap_space_bytes=16 * GIB,
    )
    block_bytes = runner.kv_cache.block_bytes
    print(
        f"# swap, {args.preset} ({block_bytes / 2**20:.1f} MiB per block over all layers), "
        f"{device_line()}; pinned H2D {h2d / 1e9:.1f} GB/s, D2H {d2h / 1e9:.1f} GB/s"
    )
    print("| blocks | MiB | out + in (ms) | GB/s | / pinned copy |")
    print("|---|---|---|---|---|")
    rng = random.Random(0)
    for n in args.blocks:
        n = min(n, runner.num_cpu_blocks, runner.num_gpu_blocks)
        gpu = rng.sample(range(runner.num_gpu_blocks), n)
        cpu = rng.sample(range(runner.num_cpu_blocks), n)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.swap_out(list(zip(gpu, cpu)))
            runner.synchronize()
            runner.swap_in(list(zip(cpu, gpu)))
            runner.synchronize()
            times.append(time.perf_counter() - t0)
        t = sorted(times)[2]
        nbytes = 2 * n * block_bytes
        print(
            f"| {n} | {n * block_bytes / 2**20:.0f} | {t * 1e3:.1f} | {nbytes / t / 1e9:.1f} "
            f"| {nbytes / t / link:.0%} |"
        )


if __name__ == "__main__":
    main()
