"""The copy-rate floor of a decode step's kernel sequence.

    python benchmarks/decode_floor.py [--preset qwen3-0.6b] [--batch 32] [--context 1024]

A decode step of the engine is a fixed sequence of kernels: per layer the input RMSNorm
(+ residual add), the qkv GEMM, q/k norm + RoPE + K/V store, decode attention, the merge of
its split-K items, the o GEMM, the post-attention RMSNorm, the gate_up GEMM, SiLU * up and
the down GEMM; then the final norm and the LM head (plus the embedding lookup and the kernel
that cuts the attention work items). This script replaces each of those kernels by one
elementwise bf16 kernel (``torch.mul(src, 1, out=dst)``) that moves the bytes the real
kernel must move (reads + writes; a GEMM reads its weights, attention its K/V), from
distinct memory per layer as the real step does, and replays the sequence in one CUDA
graph, back to back. The result is what the step would take if every kernel ran at the
speed of an elementwise kernel of its size, with no host work between steps: a floor for
any engine that runs one kernel per operation (no fusion across GEMMs).

Printed, all measured in this process: the device copy rate and the roofline
(as decode_roofline.py), the floor, the same kernel count with 16 bytes each (the fixed
cost of the sequence alone), and the engine's own step (``execute()`` wall, and its decode
graph replayed back to back).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import (
    checkpoint,
    copy_bandwidth,
    decode_inputs,
    device_line,
    engine_runner,
    graph_time,
    step_wall,
)


def step_kernels(cfg, batch: int, context: int) -> list[tuple[str, int]]:
    """(name, bytes moved) of each kernel of one decode step, in order: reads + writes of
    the real kernel (bf16 weights, K/V and activations; fp32 split-K partials)."""
    from sched_lab.backend.attention.base import decode_items

    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    act = batch * h * 2  # one (batch, hidden) bf16 activation
    items = decode_items(batch, cfg.num_kv_heads)
    layer = [
        ("input norm + residual", 4 * act),
        ("qkv GEMM", h * (q + 2 * kv) * 2),
        ("q/k norm + RoPE + KV store", 2 * batch * (q + 2 * kv) * 2),
        ("decode attention", batch * context * 2 * kv * 2),
        ("split merge", items * cfg.num_heads * cfg.head_dim * 4 + batch * q * 2),
        ("o GEMM", q * h * 2),
        ("post norm + residual", 4 * act),
        ("gate_up GEMM", h * 2 * i * 2),
        ("SiLU * up", batch * 3 * i * 2),
        ("down GEMM", i * h * 2),
    ]
    head = [("work items", 64), ("embedding", 2 * act)]
    tail = [("final norm", 2 * act), ("LM head", cfg.vocab_size * h * 2)]
    return head + layer * cfg.num_layers + tail


def chain_time(sizes: list[int], replays: int = 20) -> float:
    """Seconds per back-to-back replay of one CUDA graph holding one elementwise kernel per
    entry of ``sizes`` (bytes moved: half read from a distinct source, half written)."""
    elems = [max(8, s // 4) for s in sizes]  # bf16 elements copied: s / 2 bytes read
    src = torch.ones(sum(elems), dtype=torch.bfloat16, device="cuda")
    dst = torch.empty(max(elems), dtype=torch.bfloat16, device="cuda")
    offsets = [0]
    for n in elems[:-1]:
        offsets.append(offsets[-1] + n)

    def run() -> None:
        for off, n in zip(offsets, elems, strict=True):
            torch.mul(src[off : off + n], 1, out=dst[:n])

    return graph_time(run, replays)


def pipelined_step(graphs, graph, logits, seqs, steps: int = 50) -> float:
    """Seconds per step of a decode loop that stages step N+1 while the GPU runs step N: the
    host stages and launches N+1 right after launching N, feeds N's sampled tokens to N+1 on
    the device (a copy into the graph's input ids, queued after N+1's staged copies), and
    waits only for step N-1's tokens (copied to pinned memory). What asynchronous
    scheduling would give a decode-only stretch; the engine's replay loop does not run so."""
    n = len(seqs)
    pinned = [torch.empty(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]

    def step(i: int) -> None:
        graphs.stage(seqs, graphs.size_for(seqs))  # host work; copies queued behind step N
        if i > 0:
            graphs.input_ids[:n].copy_(tokens[0])  # step N's tokens, on the device
        graph.replay()
        tokens[0] = logits[:n].argmax(dim=-1)
        pinned[i % 2].copy_(tokens[0], non_blocking=True)
        done[i % 2].record()
        if i > 0:
            done[(i - 1) % 2].synchronize()  # step N-1's tokens are on the host

    tokens = [None]
    for i in range(5):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(5, 5 + steps):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    from sched_lab.backend.config import ModelConfig

    cfg = ModelConfig.from_dir(checkpoint(args.preset))
    bw = copy_bandwidth()
    kernels = step_kernels(cfg, args.batch, args.context)
    sizes = [s for _, s in kernels]
    floor = chain_time(sizes)
    fixed = chain_time([16] * len(sizes))
    runner = engine_runner(args.preset, max_num_seqs=max(args.batch, 1))
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes = args.batch * args.context * 2 * cfg.num_layers * cfg.kv_size * 2
    roof = (weight_bytes + kv_bytes) / bw
    seqs = decode_inputs(args.batch, args.context)
    wall = step_wall(runner, seqs, 50, warmup=5)
    graphs = runner.graphs
    size = graphs.size_for(seqs) if graphs is not None and graphs.capture else None
    replay = pipelined = None
    if size is not None:
        graph = graphs.graphs[("decode", size, size)]
        graphs.stage(seqs, size)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t0) / 50
        pipelined = pipelined_step(graphs, graph, graphs.outputs[("decode", size, size)], seqs)
    print(
        f"# decode floor, {args.preset}, batch {args.batch}, context {args.context}, "
        f"{device_line()}; device copy {bw / 1e12:.2f} TB/s"
    )
    print(
        f"{len(kernels)} kernels, {sum(sizes) / 1e9:.2f} GB moved; roofline "
        f"{roof * 1e3:.3f} ms (1.5x: {1.5 * roof * 1e3:.3f} ms)"
    )
    print("| what | ms | / roofline |\n|---|---|---|")
    rows = [
        ("floor: one elementwise kernel per kernel, its bytes, one graph", floor),
        ("fixed cost: the same kernel count, 16 bytes each", fixed),
        ("engine: execute() wall (staging, graph, sampling, sync)", wall),
    ]
    if replay is not None:
        rows.append(("engine: decode graph replayed back to back", replay))
        rows.append(("engine: pipelined loop (step N+1 staged while the GPU runs N)", pipelined))
    for name, t in rows:
        print(f"| {name} | {t * 1e3:.3f} | {t / roof:.2f} |")


if __name__ == "__main__":
    main()
