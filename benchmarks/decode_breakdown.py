"""Where a decode step's GPU time goes, kernel by kernel, against what each part must read.

    python benchmarks/decode_breakdown.py --out $OUT/db          # H200, ~2 min
    python benchmarks/decode_breakdown.py --out /tmp/db --presets qwen3-0.6b --batches 1

For each model shape, batch (1, 32) and context (1k, 4k): the decode CUDA graph of the engine
(``ModelRunner``, random bf16 weights, triton attention, block size 16) is replayed back to
back under torch.profiler, and its kernels are grouped by part (:func:`part_of`):

* ``gemm``: cuBLAS's kernels of the layers' projections and the LM head (split-K reduces
  included); must read every projection weight and the LM head's matrix once;
* ``attention``: the paged decode kernels (work items, split-K merge); must read the K/V of
  every context token (2 x layers x kv_heads x head_dim x 2 B a token);
* ``qkv_prepare`` (q/k norm, RoPE, the K/V write), ``rms_norm``, ``silu_and_mul``, ``other``
  (embedding, casts, copies, sampling's argmax): activations only, kilobytes.

With ``--whole-step`` each point also runs the engine's whole decode step
(``ModelRunner.execute``: staging copies, the graph, sampling, the sync) under the profiler
and lists what the GPU runs outside the graph (kernels and copies beyond those of one graph
replay, by name), per step, beside the step's wall time.

Per part: kernels per step, GPU us per step, bytes it must read, the time those bytes take at
the device copy rate measured in the same process (read + write counted, as
benchmarks/decode_roofline.py does), and the ratio. The small parts' floor is their kernel
count times the shortest kernel of the step. Writes ``decode_breakdown.json`` and ``.md``
under ``--out`` (after each shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PARTS = ("gemm", "attention", "qkv_prepare", "rms_norm", "silu_and_mul", "other")
# cuBLAS / CUTLASS kernel names on Hopper ("nvjet_*", "sm90_xmma_gemm_*", "cutlass*",
# "splitKreduce_kernel", "gemv*"), lower-cased
GEMM_MARKS = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "cublas")
TRITON_PARTS = {
    "_decode_kernel": "attention",
    "_decode_work_kernel": "attention",
    "_decode_reduce_kernel": "attention",
    "_qkv_prepare_kernel": "qkv_prepare",
    "_store_kv_kernel": "qkv_prepare",
    "_rms_norm_kernel": "rms_norm",
    "_silu_and_mul_kernel": "silu_and_mul",
}


def part_of(kernel: str) -> str:
    """The part (:data:`PARTS`) a GPU kernel's name belongs to."""
    for name, part in TRITON_PARTS.items():
        if kernel == name or kernel.startswith(name + "_") or f" {name}" in kernel:
            return part
    low = kernel.lower()
    return "gemm" if any(m in low for m in GEMM_MARKS) else "other"


def gemm_bytes(model) -> int:
    """Bytes the projections and the LM head read in one step: every 2-D weight but the
    embedding's, plus the embedding matrix again where the LM head is tied to it."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if p.dim() == 2 and "embed_tokens" not in n)  # fmt: skip
    if getattr(model, "lm_head", None) is None:
        w = model.embed_tokens.weight
        total += w.numel() * w.element_size()
    return total


def breakdown(events: list[tuple[str, int, float]], replays: int, need: dict[str, int],
              rate: float) -> dict:  # fmt: skip
    """Per part, from (kernel name, calls, total us over ``replays``) rows: kernels and us
    per step, bytes it must read (``need``), their time at ``rate`` bytes/s, the ratio."""
    out = {p: {"kernels": 0.0, "us": 0.0} for p in PARTS}
    for name, calls, us in events:
        row = out[part_of(name)]
        row["kernels"] += calls / replays
        row["us"] += us / replays
    for p, row in out.items():
        row["bytes"] = need.get(p, 0)
        row["ideal_us"] = row["bytes"] / rate * 1e6
        row["ratio"] = row["us"] / row["ideal_us"] if row["ideal_us"] and row["kernels"] else None
    return out


def by_name(events) -> dict[str, list]:
    """Profiler device events summed by name: name -> [count, GPU us]."""
    rows: dict[str, list] = {}
    for e in events:
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += e.device_time_total
    return rows


def measure(runner, seqs, replays: int) -> tuple[list[tuple[str, int, float]], float, float]:
    """(kernel rows, GPU us per replay summed over kernels, shortest kernel us) of the
    decode graph of ``seqs`` replayed ``replays`` times back to back."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.graphs
    size = graphs.size_for(seqs)
    graphs.stage(seqs, size)
    graph = graphs.graphs[("decode", size, size)]
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"
               and not e.name.startswith(("Memcpy", "Memset"))]  # fmt: skip
    rows = by_name(kernels)
    if not kernels:
        raise SystemExit("decode_breakdown: the profiler recorded no kernel of the decode graph")
    shortest = min(e.device_time_total for e in kernels)
    total = sum(r[1] for r in rows.values()) / replays
    return [(n, c, us) for n, (c, us) in rows.items()], total, shortest


def table(results: list[dict]) -> str:
    """The markdown of ``results`` (one block per shape, batch and context)."""
    lines = []
    for r in results:
        lines += [
            f"\n### {r['preset']}, batch {r['batch']}, context {r['context']}: "
            f"{r['gpu_us']:.0f} us of kernels a step, {r['kernels']:.0f} kernels "
            f"({r['kernels'] / r['layers']:.1f} a layer), roofline {r['roofline_us']:.0f} us "
            f"({r['gpu_us'] / r['roofline_us']:.2f}x); shortest kernel {r['shortest_us']:.1f} us",
            "",
            "| part | kernels/step | us/step | share | must read (MB) | at copy rate (us) | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in PARTS:
            row = r["parts"][p]
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            lines.append(
                f"| {p} | {row['kernels']:.0f} | {row['us']:.0f} "
                f"| {row['us'] / max(r['gpu_us'], 1e-9):.0%} "
                f"| {row['bytes'] / 1e6:.1f} | {row['ideal_us']:.0f} | {ratio} |"
            )
        small = sum(r["parts"][p]["kernels"] for p in PARTS[2:])
        lines.append(
            f"\nSmall parts: {small:.0f} kernels, "
            f"{sum(r['parts'][p]['us'] for p in PARTS[2:]):.0f} us; floor at the shortest "
            f"kernel {small * r['shortest_us']:.0f} us. Top kernels (us/step):"
        )
        for name, calls, us in r["top"]:
            lines.append(f"- `{name[:90]}`: {calls} a step, {us:.1f} us ({part_of(name)})")
        if "whole_step" in r:
            w = r["whole_step"]
            lines.append(
                f"\nThe whole step (`ModelRunner.execute`): {w['wall_us']:.0f} us of wall a "
                f"step; outside the graph the GPU runs {w['outside_us']:.0f} us a step:"
            )
            for name, calls, us in w["rows"][:10]:
                lines.append(f"- `{name[:90]}`: {calls:g} a step, {us:.1f} us")
    return "\n".join(lines) + "\n"


def outside_graph(runner, seqs, steps: int, graph: dict[str, tuple[float, float]]) -> dict:
    """What ``steps`` calls of ``runner.execute(seqs)`` run on the GPU besides one replay
    of the decode graph (``graph``: name -> (kernels, us) a replay): {"wall_us": a step,
    "outside_us": a step, "rows": [(name, count a step, us a step)]}, largest first. A name
    the graph also runs counts its excess over the graph's (a copy kernel runs both inside
    and outside)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.execute(seqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.execute(seqs)
        wall = time.perf_counter() - t0
    rows = by_name(e for e in prof.events() if e.device_type.name == "CUDA")
    out = []
    for name, (count, us) in rows.items():
        in_count, in_us = graph.get(name, (0, 0.0))
        extra = (count / steps - in_count, us / steps - in_us)
        if extra[0] > 0.01:
            out.append((name, *extra))
    out.sort(key=lambda r: -r[2])
    return {"wall_us": wall / steps * 1e6, "outside_us": sum(r[2] for r in out), "rows": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--whole-step", action="store_true", help="also what runs outside the graph")
    args = ap.parse_args()
    import torch
    from common import copy_bandwidth, decode_inputs, device_line, engine_runner

    args.out.mkdir(parents=True, exist_ok=True)
    rate = copy_bandwidth()
    head = f"# decode breakdown, {device_line()}; device copy {rate / 1e12:.2f} TB/s\n"
    results = []
    for preset in args.presets:
        runner = engine_runner(preset, max_num_seqs=max(args.batches))
        cfg, model = runner.config, runner.model
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        weights = gemm_bytes(model)
        for batch in args.batches:
            for ctx in args.contexts:
                if batch * -(-(ctx + 1) // 16) > runner.num_gpu_blocks:
                    continue
                events, gpu_us, shortest = measure(runner, decode_inputs(batch, ctx), args.replays)
                need = {"gemm": weights, "attention": batch * ctx * kv_per_token}
                parts = breakdown(events, args.replays, need, rate)
                top = sorted(events, key=lambda e: -e[2])[:8]
                results.append({
                    "preset": preset, "batch": batch, "context": ctx, "layers": cfg.num_layers,
                    "gpu_us": gpu_us, "shortest_us": shortest,
                    "kernels": sum(p["kernels"] for p in parts.values()),
                    "roofline_us": (need["gemm"] + need["attention"]) / rate * 1e6,
                    "parts": parts,
                    "top": [(n, round(c / args.replays), us / args.replays) for n, c, us in top],
                })  # fmt: skip
                if args.whole_step:
                    seqs = decode_inputs(batch, ctx)
                    graph = {n: (c / args.replays, us / args.replays) for n, c, us in events}
                    out = outside_graph(runner, seqs, args.replays, graph)
                    results[-1]["whole_step"] = out
                print(table(results[-1:]), flush=True)
                (args.out / "decode_breakdown.json").write_text(
                    json.dumps(
                        {"device": head.strip(), "copy_rate": rate, "results": results}, indent=2
                    )
                    + "\n"  # fmt: skip
                )
                (args.out / "decode_breakdown.md").write_text(head + table(results))
        del runner, model
        torch.cuda.empty_cache()
    if results:
        ratios = [r["gpu_us"] / r["roofline_us"] for r in results]
        print(f"step / roofline: median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
