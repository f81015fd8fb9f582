"""Decode step time with quantized weights vs each format's HBM roofline.

    python benchmarks/quant_decode.py                 # CUDA: Llama-3.1-8B shape, ~3 min
    python benchmarks/quant_decode.py --dry-run       # CPU: a tiny random model, measures nothing

For bf16, fp8 (W8A8), int8 (W8A16), awq and gptq (int4, group 128) weights, quantized in
memory at load time from one random bf16 checkpoint (ModelRunner ``quantization``), at batch
1 / 32 / 256 x context 1k / 4k: the decode step (ModelRunner.execute on decode-only inputs,
CUDA graphs, device sync included) divided by its roofline,
  (weight bytes as stored + KV bytes read: batch * context * 2 * layers * kv_heads *
   head_dim * 2 B) / 4.8 TB/s (the H200 datasheet's HBM3e bandwidth),
and its speed-up over bf16 at the same shape, all measured in this run.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from common import checkpoint, cuda_time, decode_inputs, device_line

HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet
METHODS = (None, "fp8", "int8", "awq", "gptq")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (packed weights and scales as stored)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, two small shapes")
    args = ap.parse_args()
    from sched_lab.backend.runner import ModelRunner

    if args.dry_run:
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        model_dir = write_random_checkpoint(TINY_LLAMA, tempfile.mkdtemp(), "float32")
        shapes, device, dtype, timer = [(1, 16), (2, 32)], "cpu", "float32", _wall_time
        print("# quant_decode dry run: CPU, tiny random Llama (measures nothing)")
    else:
        model_dir = checkpoint(args.preset)
        shapes = [(b, c) for b in (1, 32, 256) for c in (1024, 4096)]
        device, dtype, timer = "cuda", "bfloat16", cuda_time
        print(f"# quant_decode: {args.preset} shape, random weights, {device_line()}")
    print("| weights | batch | context | step (ms) | roofline (ms) | step / roofline | "
          "speed-up vs bf16 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    bf16_steps: dict[tuple[int, int], float] = {}
    for method in METHODS:
        max_ctx = max(c for _, c in shapes)
        runner = ModelRunner(model_dir, device=device, dtype=dtype, quantization=method,
                             attention_backend="triton" if device == "cuda" else "torch",
                             block_size=16, max_model_len=max_ctx + 16, max_num_seqs=256,
                             gpu_memory_utilization=0.9, cuda_graph_sizes=(1, 32, 256),
                             mixed_graphs=False, swap_space_bytes=0)  # fmt: skip
        cfg = runner.config
        kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        weights = stored_bytes(runner.model)
        name = method or "bf16"
        for batch, ctx in shapes:
            seqs = decode_inputs(batch, ctx)
            if batch * -(-(ctx + 1) // 16) > runner.num_gpu_blocks:
                print(f"| {name} | {batch} | {ctx} | - | - | KV does not fit | - |")
                continue
            step = timer(lambda s=seqs, r=runner: r.execute(s))
            roof = (weights + batch * ctx * kv_per_token) / HBM_BYTES_PER_S
            if method is None:
                bf16_steps[batch, ctx] = step
            speedup = bf16_steps.get((batch, ctx), float("nan")) / step
            print(f"| {name} | {batch} | {ctx} | {step * 1e3:.3f} | {roof * 1e3:.3f} | "
                  f"{step / roof:.2f} | {speedup:.2f} |")  # fmt: skip
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n(roofline = (weights as stored + KV bytes read) / {HBM_BYTES_PER_S / 1e12:g} TB/s)")


def _wall_time(fn, warmup: int = 1, iters: int = 2) -> float:
    import time

    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


if __name__ == "__main__":
    main()
