"""Decode steps whose contexts are uneven vs uniform ones of the same total.

    python benchmarks/decode_uneven.py [--preset qwen3-0.6b]

A decode step reads every context token's K/V once, so its time should follow the sum of
the contexts (the feature the calibrated cost model uses). Each row times one decode-only
step (``ModelRunner.execute``, CUDA graph of its batch size, sync included) with uneven
contexts and the same batch with every context set to the mean, in the same run; the ratio
uneven / uniform is 1.00 when the attention's work is balanced across the GPU.
"""

from __future__ import annotations

import argparse

import numpy as np
from common import cuda_time, decodes_at, device_line, engine_runner


def cases(rng: np.random.Generator) -> list[tuple[str, list[int]]]:
    """(name, contexts) of each uneven batch."""
    out = []
    for batch in (8, 32, 64):
        out.append((f"{batch}: one 16k, rest 1k", [16384] + [1024] * (batch - 1)))
    for batch in (4, 16, 32, 64):  # log-normal lengths, median 2k, like the code slice's
        ctx = np.clip(rng.lognormal(np.log(2048), 1.0, batch), 64, 16384).astype(int)
        out.append((f"{batch}: log-normal, median 2k", ctx.tolist()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    args = ap.parse_args()
    runner = engine_runner(args.preset)
    print(f"# decode steps with uneven contexts, {args.preset}, {device_line()}")
    print("| batch | contexts | max | total | uneven (ms) | uniform, same total (ms) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, ctx in cases(np.random.default_rng(0)):
        uneven, uniform = decodes_at(ctx), decodes_at([round(sum(ctx) / len(ctx))] * len(ctx))
        t_uneven = cuda_time(lambda s=uneven: runner.execute(s), warmup=5, iters=30)
        t_uniform = cuda_time(lambda s=uniform: runner.execute(s), warmup=5, iters=30)
        batch, what = name.split(": ")
        print(
            f"| {batch} | {what} | {max(ctx)} | {sum(ctx)} | {t_uneven * 1e3:.3f} "
            f"| {t_uniform * 1e3:.3f} | {t_uneven / t_uniform:.2f} |"
        )


if __name__ == "__main__":
    main()
