"""FP8 vs bf16 KV cache in the engine: blocks and offline throughput.

    python benchmarks/kv_fp8.py                       # CUDA: qwen3-0.6b shape, random bf16 weights
    python benchmarks/kv_fp8.py --kv-gib 0.5          # the KV budget of the memory-bound runs
    python benchmarks/kv_fp8.py --dry-run             # CPU, a tiny model, a few requests

Workload: nano-vllm's (engine_throughput.py): prompt and output lengths uniform in
[100, 1024], seed 0, all arriving at t = 0, output lengths honoured; policy chunked_prefill,
max_num_seqs 256, token budget 8192, triton attention. For each KV dtype two runs:
``full`` sizes the cache by gpu_memory_utilization 0.9 (the block count fp8 gains; the
trace rarely fills it), ``budget`` gives the cache ``--kv-gib`` GiB (blocks = that / bytes
per block, so fp8 gets twice as many) where memory binds: preemptions and throughput.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import ROOT, checkpoint, tiny_qwen3

GIB = 1 << 30


def workload(n: int, lo: int, hi: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmark requests: prompt and output lengths uniform in [lo, hi]."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(lo, hi + 1, n)
    output_lens = rng.integers(lo, hi + 1, n)
    prompts = [rng.integers(0, 200, p).tolist() for p in prompt_lens]
    return prompts, output_lens.tolist()


def block_bytes(model_dir: Path, kv_dtype: str, model_dtype: torch.dtype) -> int:
    from sched_lab.backend.config import ModelConfig
    from sched_lab.backend.kv_cache import bytes_per_block, kv_torch_dtype

    config = ModelConfig.from_dir(model_dir)
    return bytes_per_block(config, 16, kv_torch_dtype(kv_dtype, model_dtype))


def run(model_dir: Path, prompts, outputs, kv_dtype: str, kv: dict, engine: dict) -> dict:
    """One replay; its wall seconds, output tokens, blocks and preemptions."""
    from sched_lab.config import validate
    from sched_lab.core.request import Request
    from sched_lab.run.experiment import run_experiment
    from sched_lab.setup import engine as engine_setup

    cfg = validate(
        {
            "name": "kv_fp8",
            "backend": "engine",
            "trace": {"format": "synthetic", "num_requests": 1, "prompt_len": 1,
                      "output_len": 1, "arrival": {"process": "poisson", "rate": 1.0}},
            "engine": {"model_path": str(model_dir), **engine},
            "kv_cache": {"block_size": 16, "swap_space_gib": 0, "dtype": kv_dtype, **kv},
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
            "policies": ["chunked_prefill"],
        },
        "kv_fp8",
        ROOT,
    )  # fmt: skip
    reqs = [
        Request(str(i), 0.0, len(p), o, prompt_token_ids=p)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    t0 = time.perf_counter()
    (result,) = run_experiment(cfg, progress=False, requests=reqs)
    runner = next(iter(engine_setup._RUNNER.values()))
    out = {
        "blocks": runner.num_gpu_blocks,
        "wall_s": result.result.wall_s,
        "tokens": int(result.requests["num_generated_tokens"].sum()),
        "preemptions": int(result.summary["num_preemptions"]),
        "total_s": time.perf_counter() - t0,
    }
    engine_setup._RUNNER.clear()  # free the cache before the next dtype's
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=0.5, help="KV budget of the budget runs")
    ap.add_argument("--skip-full", action="store_true", help="only the memory-bound runs")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, 8 requests")
    args = ap.parse_args()
    if args.dry_run:
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        model_dir = Path(tempfile.mkdtemp()) / "tiny"
        write_random_checkpoint(tiny_qwen3(512), model_dir, dtype="float32", std=0.2)
        prompts, outputs = workload(8, 8, 48)
        engine, model_dtype, modes = ({"device": "cpu", "dtype": "float32",
                                       "attention_backend": "torch"}, torch.float32, ["budget"])  # fmt: skip
        kv_bytes = 64 * block_bytes(model_dir, "auto", model_dtype)  # 64 float32 blocks
    elif not torch.cuda.is_available():
        sys.exit("kv_fp8.py: needs a CUDA GPU (or --dry-run)")
    else:
        model_dir = checkpoint(args.preset)
        prompts, outputs = workload(args.num_requests, 100, 1024)
        engine = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "triton"}
        model_dtype = torch.bfloat16
        modes = ["budget"] if args.skip_full else ["full", "budget"]
        kv_bytes = int(args.kv_gib * GIB)
    print(f"# KV cache dtype, {args.preset if not args.dry_run else 'tiny'} random weights, "
          f"{len(prompts)} requests, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}")  # fmt: skip
    print(f"{'run':<8}{'kv dtype':<10}{'blocks':>9}{'preempt':>9}{'tokens':>9}"
          f"{'wall s':>9}{'tok/s':>10}")  # fmt: skip
    rows = {}
    for mode in modes:
        for kv_dtype in ("auto", "fp8"):
            if mode == "full":
                kv = {"gpu_memory_utilization": 0.9}
            else:
                kv = {"num_gpu_blocks": kv_bytes // block_bytes(model_dir, kv_dtype, model_dtype)}
            r = run(model_dir, prompts, outputs, kv_dtype, kv, engine)
            rows[mode, kv_dtype] = r
            print(f"{mode:<8}{kv_dtype:<10}{r['blocks']:>9}{r['preemptions']:>9}{r['tokens']:>9}"
                  f"{r['wall_s']:>9.2f}{r['tokens'] / r['wall_s']:>10,.0f}", flush=True)  # fmt: skip
    for mode in modes:
        a, b = rows[mode, "auto"], rows[mode, "fp8"]
        print(f"{mode}: fp8 / auto blocks {b['blocks'] / a['blocks']:.2f}x, throughput "
              f"{(b['tokens'] / b['wall_s']) / (a['tokens'] / a['wall_s']):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
