"""Decode step time with multi-LoRA: adapters per batch and rank, against the base step.

    # H200 (Llama-3.1-8B shape, random bf16 weights, CUDA graphs; ~3 min with the checkpoint):
    python benchmarks/lora_step.py --out $OUT/lora_step.json
    # CPU smoke test (tiny random model, torch reference LoRA, a few steps):
    python benchmarks/lora_step.py --dry-run

One runner; the base decode step (``--batch`` sequences at ``--context`` tokens, no LoRA)
is timed first, then for each rank the model gets ``max(--adapters)`` slots of random
adapters on ``--targets`` and the same step is timed with its sequences spread round-robin
over 0 (LoRA on, every sequence on the base model), 1, 4, 16 and 32 adapters. Each row
prints the step's wall time and its ratio to the base step of the same run. Adapters share
one random weight set per rank (values do not change the time; each still has its own
slot). The issue's target: 32 adapters at rank 16 within 1.3x the base step at batch 64.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import checkpoint, decode_inputs, tiny_qwen3  # noqa: E402

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def random_adapters(config, count: int, rank: int, targets: tuple[str, ...], dtype, device):
    """``count`` in-memory adapters lora-0.. of rank ``rank`` sharing one random weight set."""
    from sched_lab.backend.lora import LoraAdapter, module_shapes

    shapes = module_shapes(config)
    gen = torch.Generator(device).manual_seed(rank)
    weights = {}
    for layer in range(config.num_layers):
        for m in targets:
            fan_in, fan_out = shapes[m]
            a = torch.randn(rank, fan_in, generator=gen, device=device) * 0.02
            b = torch.randn(fan_out, rank, generator=gen, device=device) * 0.02
            weights[(layer, m)] = (a.to(dtype).cpu(), b.to(dtype).cpu())
    return {
        f"lora-{i}": LoraAdapter(f"lora-{i}", rank, 2.0, targets, weights) for i in range(count)
    }


def step_time(runner, seqs, steps: int, warmup: int) -> float:
    """Mean wall seconds of ``runner.execute(seqs)`` (it waits for the device)."""
    for _ in range(warmup):
        runner.execute(seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.execute(seqs)
    return (time.perf_counter() - t0) / steps


def with_adapters(seqs, n: int):
    """``seqs`` with sequence i on adapter lora-{i % n} (n = 0: every one on the base)."""
    from dataclasses import replace

    return [replace(s, lora_name=f"lora-{i % n}" if n else "") for i, s in enumerate(seqs)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="tokens before each decode")
    parser.add_argument("--adapters", default="1,4,16,32")
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--targets", default=ALL_TARGETS)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()

    from sched_lab.backend.runner import ModelRunner

    counts = [int(x) for x in args.adapters.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    targets = tuple(t for t in args.targets.split(",") if t)
    batch, context, steps, warmup = args.batch, args.context, args.steps, 5
    if args.dry_run:
        batch, context, steps, warmup = min(batch, 8), min(context, 32), 2, 1
        counts, ranks = [c for c in counts if c <= 4] or [1], ranks[:2]
    blocks = batch * -(-(context + 1) // 16)
    if args.dry_run:
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        model = write_random_checkpoint(tiny_qwen3(256), Path(tempfile.mkdtemp()) / "m",
                                        dtype="float32", name="tiny")  # fmt: skip
        runner = ModelRunner(model, device="cpu", attention_backend="torch", block_size=16,
                             num_gpu_blocks=blocks, max_num_seqs=batch, num_threads=1)  # fmt: skip
    else:
        runner = ModelRunner(checkpoint(args.preset), device="cuda", dtype="bfloat16",
                             attention_backend="triton", block_size=16, num_gpu_blocks=blocks,
                             max_num_seqs=batch, cuda_graph_sizes=(batch,), mixed_graphs=False,
                             max_num_batched_tokens=batch)  # fmt: skip
    seqs = decode_inputs(batch, context)
    base = step_time(runner, seqs, steps, warmup)
    name = "tiny (CPU)" if args.dry_run else args.preset
    print(f"{name}: batch {batch} decodes at context {context}, targets {','.join(targets)}")
    print(f"base step: {base * 1e3:.3f} ms\n")
    print("| rank | adapters in batch | step ms | x base |")
    print("|---:|---:|---:|---:|")
    rows = []
    for rank in ranks:
        adapters = random_adapters(runner.config, max(counts), rank, targets, runner.dtype,
                                   runner.device)  # fmt: skip
        runner.attach_lora(adapters, max_loras=max(counts), max_lora_rank=rank)
        runner.lora.ensure_loaded(list(adapters))  # every slot filled before timing
        for n in [0, *counts]:
            t = step_time(runner, with_adapters(seqs, n), steps, warmup)
            rows.append({"rank": rank, "adapters": n, "step_ms": t * 1e3, "ratio": t / base})
            print(f"| {rank} | {n} | {t * 1e3:.3f} | {t / base:.3f} |", flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"preset": name, "batch": batch, "context": context, "targets": targets,
                   "base_step_ms": base * 1e3, "rows": rows}  # fmt: skip
        out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
