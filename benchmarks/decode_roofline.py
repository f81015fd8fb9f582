"""Decode step time vs the HBM roofline.

    python benchmarks/decode_roofline.py [--presets qwen3-0.6b llama-3.1-8b] [--kn-weights]

For each model shape, batch 1 / 32 / 256 and context 1k / 4k: the engine's decode step time
(ModelRunner.execute on decode-only inputs, device sync included) divided by the time the
bytes it must read take at the device copy rate measured in the same run:
  bytes = weights + KV of every context token (2 * layers * kv_heads * head_dim * 2 B).
Target: <= 1.5 at batch >= 32. Shapes whose KV does not fit in memory are skipped.
"""

from __future__ import annotations

import argparse

import torch
from common import checkpoint, copy_bandwidth, cuda_time, device_line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--attention", default="triton")
    ap.add_argument(
        "--kn-weights",
        action="store_true",
        help="projection weights in (K, N) memory order (ModelRunner kn_weights)",
    )
    args = ap.parse_args()
    from sched_lab.backend.runner import ModelRunner, SeqInput

    bw = copy_bandwidth()
    kn = ", (K, N) weights" if args.kn_weights else ""
    print(f"# decode roofline{kn}, {device_line()}; device copy {bw / 1e12:.2f} TB/s")
    print("| model | batch | context | step (ms) | roofline (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for preset in args.presets:
        model_dir = checkpoint(preset)
        runner = None
        for batch in (1, 32, 256):
            for ctx in (1024, 4096):
                block = 16
                blocks_per_seq = -(-(ctx + 1) // block)
                if runner is None:
                    runner = ModelRunner(model_dir, device="cuda", dtype="bfloat16",
                                         attention_backend=args.attention, block_size=block,
                                         gpu_memory_utilization=0.9,
                                         kn_weights=args.kn_weights)  # fmt: skip
                cfg = runner.config
                kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
                if batch * blocks_per_seq > runner.num_gpu_blocks:
                    print(f"| {preset} | {batch} | {ctx} | - | - | KV does not fit |")
                    continue
                seqs = [
                    SeqInput(
                        [1], ctx, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True
                    )
                    for i in range(batch)
                ]
                step = cuda_time(lambda s=seqs, r=runner: r.execute(s), warmup=5, iters=20)
                weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
                nbytes = weight_bytes + batch * ctx * kv_per_token
                roof = nbytes / bw  # copy rate counts read + write traffic, as a read does
                print(
                    f"| {preset} | {batch} | {ctx} | {step * 1e3:.3f} | {roof * 1e3:.3f} "
                    f"| {step / roof:.2f} |"
                )
        del runner
        torch.cuda.empty_cache()
    print("\n(roofline = (weights + KV bytes read) / device copy rate, read + write counted)")


if __name__ == "__main__":
    main()
