"""Decode step time with multi-LoRA: adapters per batch and rank, against the base step.

    # H200 (Llama-3.1-8B shape, random bf16 weights, CUDA graphs), the two LoRA paths A/B:
    python benchmarks/lora_step.py --paths old new --steps 30 --out $OUT/lora_step.json
    # CPU smoke test (tiny random model, torch reference LoRA, a few steps):
    python benchmarks/lora_step.py --dry-run --paths old new

One runner; the base decode step (``--batch`` sequences at ``--context`` tokens, no LoRA)
is timed first. Then for each rank the model gets ``max(--adapters)`` slots of random
adapters on ``--targets``, and for each path of ``--paths`` the same step is timed with its
sequences spread round-robin over 0 (LoRA on, every sequence on the base model), 1, 4, 16
and 32 adapters. Paths (:class:`sched_lab.backend.lora.LoraOptions`):

* ``old``: the kernels' grid over every slot, run in every step (no LoRA-free graph);
* ``new``: the grid over the step's tiles, and no LoRA op in a step without adapters;
* ``new:key=value,...``: ``new`` with other tile sizes (:class:`sched_lab.backend.lora.Tiling`
  fields: k_per_split, expand_block_n, num_warps), e.g. ``new:k_per_split=256``.

Each row has the step's wall time and its ratio to the base step of the same run, and the
LoRA ops alone (every layer's, for the step's rows, in one CUDA graph on the GPU) with the
adapter bytes they read per ms of them (GB/s). Adapters share one random weight set per rank
(values do not change the time; each still has its own slot). The rows go to ``--out`` as
they are measured. The issue's target: 32 adapters at rank 16 within 1.3x the base step at
batch 64.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
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


def path_options(spec: str):
    """The LoraOptions of a ``--paths`` entry; SystemExit naming it when malformed."""
    from sched_lab.backend.lora import LoraOptions, Tiling

    name, _, params = spec.partition(":")
    if name == "old" and not params:
        return LoraOptions(grid="slots", skip_idle=False)
    if name != "new":
        raise SystemExit(f"--paths: {spec!r}: expected old, new or new:key=value,...")
    known = {f.name for f in fields(Tiling)}
    values = {}
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        if key not in known or not value.isdigit():
            raise SystemExit(f"--paths: {spec!r}: {item!r} is not one of {sorted(known)} "
                             "= a positive integer")  # fmt: skip
        values[key] = int(value)
    try:
        return LoraOptions(tiling=Tiling(**values))
    except ValueError as e:
        raise SystemExit(f"--paths: {spec!r}: {e}") from None


def step_time(runner, seqs, steps: int, warmup: int) -> float:
    """Mean wall seconds of ``runner.execute(seqs)`` (it waits for the device)."""
    for _ in range(warmup):
        runner.execute(seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.execute(seqs)
    return (time.perf_counter() - t0) / steps


def lora_ops_time(runner, seqs, steps: int) -> float:
    """Mean seconds of the LoRA ops of ``seqs``' step alone: every layer's fused projections
    on random inputs, in one CUDA graph on the GPU (eagerly on the CPU); 0 when the step runs
    none (no sequence with an adapter, idle steps skipped)."""
    lora = runner.lora
    q = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    lora.stage([s.lora_name for s in seqs], q, int(q.sum()))
    if not lora.active:
        return 0.0
    rows, gen = int(q.sum()), torch.Generator(runner.device).manual_seed(0)
    io = {}
    for proj, w in lora.layers[0].items():  # every layer has the same projections
        x = torch.randn(rows, w.a.shape[2], generator=gen, device=runner.device)
        io[proj] = (x.to(runner.dtype), torch.zeros(rows, w.b.shape[1], dtype=runner.dtype,
                                                    device=runner.device))  # fmt: skip

    def ops():
        for i, layer in enumerate(lora.layers):
            for proj in layer:
                lora.apply(i, proj, *io[proj])

    with torch.inference_mode():
        ops()  # compiles the kernels
        if runner.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(steps):
                ops()
            return (time.perf_counter() - t0) / steps
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / steps


def adapter_bytes(lora) -> int:
    """Bytes of one slot's tensors (A and B at the storage rank, every layer): what the
    kernels read per distinct adapter in a step."""
    return sum((w.a[0].numel() + w.b[0].numel()) * w.a.element_size()
               for layer in lora.layers for w in layer.values())  # fmt: skip


def with_adapters(seqs, n: int):
    """``seqs`` with sequence i on adapter lora-{i % n} (n = 0: every one on the base)."""
    return [replace(s, lora_name=f"lora-{i % n}" if n else "") for i, s in enumerate(seqs)]


def print_table(rows: list[dict], paths: list[str]) -> None:
    """One line per (rank, adapters), each path's step ms, x base and LoRA ops ms / GB/s."""
    head = "| rank | adapters |" + "".join(
        f" {p} ms | {p} x base | {p} LoRA ms (GB/s) |" for p in paths
    )
    print("\n" + head)
    print("|---:|---:|" + "---:|---:|---:|" * len(paths))
    cells = {(r["rank"], r["adapters"], r["path"]): r for r in rows}
    for rank, n in dict.fromkeys((r["rank"], r["adapters"]) for r in rows):
        line = f"| {rank} | {n} |"
        for p in paths:
            r = cells.get((rank, n, p))
            line += (
                " - | - | - |"
                if r is None
                else f" {r['step_ms']:.3f} | {r['ratio']:.3f} | "
                f"{r['lora_ops_ms']:.3f} ({r['lora_gbps']:.0f}) |"
            )
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="tokens before each decode")
    parser.add_argument("--adapters", default="1,4,16,32")
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--targets", default=ALL_TARGETS)
    parser.add_argument("--paths", nargs="+", default=["new"],
                        help="LoRA paths to time: old, new, new:key=value,... (see the doc)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()

    from sched_lab.backend.runner import ModelRunner

    counts = [int(x) for x in args.adapters.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    targets = tuple(t for t in args.targets.split(",") if t)
    paths = {spec: path_options(spec) for spec in args.paths}
    out = Path(args.out) if args.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
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
    print(f"base step: {base * 1e3:.3f} ms; paths: {', '.join(paths)}", flush=True)
    rows: list[dict] = []
    summary = {"preset": name, "batch": batch, "context": context, "targets": targets,
               "steps": steps, "base_step_ms": base * 1e3,
               "paths": {p: repr(o) for p, o in paths.items()}, "rows": rows}  # fmt: skip
    for rank in ranks:
        adapters = random_adapters(runner.config, max(counts), rank, targets, runner.dtype,
                                   runner.device)  # fmt: skip
        for spec, options in paths.items():  # paths of one rank side by side in time
            runner.attach_lora(adapters, max_loras=max(counts), max_lora_rank=rank,
                               options=options)  # fmt: skip
            runner.lora.ensure_loaded(list(adapters))  # every slot filled before timing
            per_adapter = adapter_bytes(runner.lora)
            for n in [0, *counts]:
                step = with_adapters(seqs, n)
                t = step_time(runner, step, steps, warmup)
                ops = lora_ops_time(runner, step, steps)
                gbps = n * per_adapter / ops / 1e9 if ops else 0.0
                rows.append({"path": spec, "rank": rank, "adapters": n, "step_ms": t * 1e3,
                             "ratio": t / base, "lora_ops_ms": ops * 1e3,
                             "lora_gbps": gbps})  # fmt: skip
                print(f"{spec} rank {rank} adapters {n}: {t * 1e3:.3f} ms ({t / base:.3f}x), "
                      f"LoRA ops {ops * 1e3:.3f} ms ({gbps:.0f} GB/s)", flush=True)  # fmt: skip
                if out is not None:  # what was measured survives a timeout
                    out.write_text(json.dumps(summary, indent=2))
    print_table(rows, list(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
