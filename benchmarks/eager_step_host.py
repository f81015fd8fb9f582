"""Where the host time of a step with prompt tokens goes, in a CUDA graph or eagerly.

    python benchmarks/eager_step_host.py [--preset qwen3-0.6b] [--prompt 512] [--decodes 32]
    python benchmarks/eager_step_host.py --eager     # the same step without mixed graphs

Runs one mixed step (a prompt chunk plus one-token decodes), prints its wall time and the GPU
kernel time of the same step, then the host-side operations by self CPU time from
torch.profiler (Triton launches, torch ops, copies). A wall time far above the GPU time is a
host-bound step: its duration follows the host's speed, not the batch. ``--eager`` builds the
runner with ``mixed_graphs=False``, so the step runs eagerly, for comparison.
"""

from __future__ import annotations

import argparse

from common import decode_inputs, device_line, engine_runner, step_wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="no mixed-step graphs")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from sched_lab.backend.runner import SeqInput

    runner = engine_runner(args.preset, mixed_graphs=not args.eager)
    blocks = -(-(args.prompt + 1) // 16)
    seqs = [SeqInput([7] * args.prompt, 0, list(range(blocks)), True)]
    seqs += decode_inputs(args.decodes, 1024, first_block=blocks, token=7)
    wall = step_wall(runner, seqs, args.steps, warmup=3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.execute(seqs)
    events = prof.key_averages()
    gpu = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / args.steps
    launches = (
        sum(
            e.count
            for e in events
            if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
        )
        / args.steps
    )
    how = "eager" if args.eager else "graphed"
    print(
        f"# {how} step host time, {args.preset}, prompt {args.prompt} + {args.decodes} "
        f"decodes, {device_line()}"
    )
    print(
        f"step wall {wall * 1e3:.3f} ms; GPU kernel time {gpu / 1e3:.3f} ms; "
        f"kernel launches per step {launches:.0f}"
    )
    cpu = sorted(
        (e for e in events if e.device_type.name == "CPU"),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    print("| host operation | calls/step | self CPU us/step |")
    print("|---|---|---|")
    for e in cpu[:20]:
        print(
            f"| {e.key[:60]} | {e.count / args.steps:.0f} | "
            f"{e.self_cpu_time_total / args.steps:.0f} |"
        )


if __name__ == "__main__":
    main()
