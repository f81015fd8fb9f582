"""Shared pieces of the engine benchmarks: device bandwidth/FLOP probes, checkpoints, timing.

Every ratio a benchmark prints divides a measured engine figure by a device figure measured
in the same process, so the numbers hold on a shared, noisy machine (DEVELOPERS.md).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GIB = 1 << 30


def checkpoint(preset: str, cache: Path = ROOT / "checkpoints") -> Path:
    """A random-weight bf16 checkpoint of ``preset`` (written once, then reused)."""
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.core.model_presets import PRESETS

    out = cache / preset
    if not (out / "config.json").exists():
        write_random_checkpoint(PRESETS[preset], out, "bfloat16", name=preset)
    return out


def tiny_qwen3(max_position_embeddings: int) -> dict:
    """The config of a 2-layer Qwen3 (q/k norm, GQA 2:1, tied embeddings; the shape of
    tests/triton_setup.py's QWEN3_TINY) with context ``max_position_embeddings``, for CPU
    smoke runs of the engine benchmarks."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 256,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
    }


def engine_runner(preset: str, **kwargs):
    """A ModelRunner on the GPU as the engine benchmarks use it: ``preset``'s random bf16
    checkpoint, triton attention, block size 16 (``kwargs`` go to ModelRunner)."""
    from sched_lab.backend.runner import ModelRunner

    return ModelRunner(checkpoint(preset), device="cuda", dtype="bfloat16",
                       attention_backend="triton", block_size=16, gpu_memory_utilization=0.9,
                       **kwargs)  # fmt: skip


def decode_inputs(batch: int, context: int, first_block: int = 0, token: int = 1) -> list:
    """``batch`` one-token decodes at position ``context`` (block size 16), each over its own
    consecutive blocks starting at ``first_block``."""
    return decodes_at([context] * batch, first_block, token)


def decodes_at(contexts: list[int], first_block: int = 0, token: int = 1) -> list:
    """One-token decodes at the given positions (block size 16), each over its own
    consecutive blocks, the first starting at ``first_block``."""
    from sched_lab.backend.runner import SeqInput

    seqs = []
    for ctx in contexts:
        n = -(-(ctx + 1) // 16)
        seqs.append(SeqInput([token], ctx, list(range(first_block, first_block + n)), True))
        first_block += n
    return seqs


def step_wall(runner, seqs, steps: int, warmup: int) -> float:
    """Mean wall seconds of ``runner.execute(seqs)`` (which syncs) over ``steps`` runs."""
    for _ in range(warmup):
        runner.execute(seqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.execute(seqs)
    return (time.perf_counter() - t0) / steps


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds of ``fn()`` on the GPU (synchronized around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def graph_time(fn, replays: int = 20) -> float:
    """Seconds per back-to-back replay of a CUDA graph of ``fn()`` (run once eagerly on a
    side stream first, as a warm-up; three replays before the timed ones)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays


def copy_bandwidth(nbytes: int = 2 * GIB) -> float:
    """Device-to-device copy rate in bytes/s, read + write counted."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = cuda_time(lambda: b.copy_(a))
    return 2 * nbytes / t


def matmul_flops(n: int = 8192) -> float:
    """bf16 n x n x n matmul rate in FLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b)
    return 2 * n**3 / t


def host_link_bandwidth(nbytes: int = GIB) -> tuple[float, float]:
    """Pinned host->device and device->host rates in bytes/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / cuda_time(lambda: dev.copy_(host, non_blocking=True))
    d2h = nbytes / cuda_time(lambda: host.copy_(dev, non_blocking=True))
    return h2d, d2h


def device_line() -> str:
    p = torch.cuda.get_device_properties(0)
    return (
        f"{p.name}, {p.total_memory / GIB:.0f} GiB, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
