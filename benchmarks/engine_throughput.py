"""Offline throughput vs Hugging Face transformers' continuous batching.

    python benchmarks/engine_throughput.py [--preset qwen3-0.6b] [--num-requests 256] [--skip-hf]

nano-vllm's benchmark workload: 256 requests, prompt and output lengths uniform in
[100, 1024], seed 0, all arriving at t = 0, output lengths honoured (ignore_eos), random
bf16 weights. Our engine runs them through the lab's replay loop (policy chunked_prefill,
max_num_seqs 256, token budget 8192, triton attention); transformers runs the same prompts
through ``generate_batch`` with paged SDPA attention. Both report output tokens / wall s.
Target: >= 20,000 tok/s and >= 25x transformers.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from common import ROOT, checkpoint, device_line


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(100, 1025, n)
    output_lens = rng.integers(100, 1025, n)
    prompts = [rng.integers(0, 10000, p).tolist() for p in prompt_lens]
    return prompts, output_lens.tolist()


def run_ours(model_dir, prompts, outputs, attention: str, policy: str) -> tuple[float, int]:
    from sched_lab.config import validate
    from sched_lab.run.experiment import run_experiment

    cfg = validate(
        {
            "name": "throughput",
            "backend": "engine",
            "trace": {
                "format": "synthetic",
                "num_requests": 1,
                "arrival": {"process": "poisson", "rate": 1.0},
                "prompt_len": 1,
                "output_len": 1,
            },
            "engine": {
                "model_path": str(model_dir),
                "device": "cuda",
                "dtype": "bfloat16",
                "attention_backend": attention,
            },
            "kv_cache": {"block_size": 16, "gpu_memory_utilization": 0.9},
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
            "policies": [policy],
        },
        "engine_throughput",
        ROOT,
    )
    from sched_lab.core.request import Request

    reqs = [
        Request(str(i), 0.0, len(p), o, prompt_token_ids=p)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    runs = run_experiment(cfg, progress=False, requests=reqs)
    run = runs[0]
    tokens = int(run.requests["num_generated_tokens"].sum())
    print_phases(run.result.steps, run.result.wall_s)
    return run.result.wall_s, tokens


def print_phases(steps: dict, wall_s: float) -> None:
    """Where the wall time went: steps with prefill tokens vs decode-only steps (by batch),
    and the replay loop's own time (wall minus the steps' measured durations)."""
    dur, prefill = steps["duration_s"], steps["num_prefill_tokens"]
    decodes = steps["num_decode_tokens"]
    mixed = prefill > 0
    print(
        f"steps: {len(dur)}; with prefill: {int(mixed.sum())} steps, {dur[mixed].sum():.2f} s "
        f"for {int(prefill.sum())} prompt tokens"
    )
    for lo, hi in ((1, 32), (32, 128), (128, 257)):
        sel = ~mixed & (decodes >= lo) & (decodes < hi)
        if sel.any():
            print(
                f"  decode-only, batch {lo}-{hi - 1}: {int(sel.sum())} steps, "
                f"{dur[sel].sum():.2f} s, median {np.median(dur[sel]) * 1e3:.2f} ms/step"
            )
    print(f"  replay loop outside the steps: {wall_s - dur.sum():.2f} s")


def run_hf(model_dir, prompts, max_new_tokens: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM
    from transformers.generation import GenerationConfig

    last = None
    for impl in ("paged|sdpa", "sdpa_paged"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, attn_implementation=impl, dtype=torch.bfloat16, device_map="cuda"
            )
            break
        except Exception as e:  # older/newer spellings of the paged SDPA implementation
            last = e
    else:
        raise RuntimeError(f"no paged attention implementation: {last}")
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generate_batch(inputs=prompts[:8], generation_config=gen, progress_bar=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--policy", default="chunked_prefill")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    model_dir = checkpoint(args.preset)
    prompts, outputs = workload(args.num_requests)
    print(f"# offline throughput, {args.preset} random bf16, {device_line()}")
    wall, tokens = run_ours(model_dir, prompts, outputs, args.attention, args.policy)
    ours = tokens / wall
    print(
        f"ours ({args.policy}, {args.attention}): {tokens} output tokens in {wall:.2f} s "
        f"= {ours:,.0f} tok/s"
    )
    if not args.skip_hf:
        hf_wall, hf_tokens = run_hf(model_dir, prompts, args.hf_max_new_tokens)
        hf = hf_tokens / hf_wall
        print(
            f"transformers generate_batch (paged sdpa, {args.hf_max_new_tokens} new tokens "
            f"each): {hf_tokens} tokens in {hf_wall:.2f} s = {hf:,.0f} tok/s"
        )
        print(f"ratio ours / transformers: {ours / hf:.1f}x")


if __name__ == "__main__":
    main()
