"""Prefill compute efficiency.

    python benchmarks/prefill_mfu.py [--preset llama-3.1-8b] [--tokens 8192]

Times prefill batches of ``--tokens`` tokens (1 x 8k, 2 x 4k, 8 x 1k prompts, and with
``--prefix`` one chunk of 8k over an 8k prefix, as chunked prefill runs a long prompt's later
chunks) on the engine and divides the achieved FLOP/s by a bf16 8192^3 matmul's FLOP/s
measured in the same run. FLOPs = 2 * layer weights * tokens + causal attention 4 * layers *
heads * head_dim * pairs + the LM head for the sampled rows. Target (issue 38): >= 70%.

``--triton-prefill-kernel`` (``engine.triton_prefill_kernel``: base, exp2) and
``--prefill-attention`` are set when the runner is made: steps of up to 8192 tokens replay
mixed CUDA graphs captured then, which keep the Triton kernels (FlashAttention varlen runs
only in eager steps), so an A/B is two processes.
"""

from __future__ import annotations

import argparse

from common import checkpoint, cuda_time, device_line, matmul_flops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--prefill-attention", default="auto")
    ap.add_argument("--triton-prefill-kernel", default="base", choices=("base", "exp2"))
    ap.add_argument("--prefix", action="store_true", help="also a chunk over a prefix")
    args = ap.parse_args()
    from sched_lab.backend.runner import ModelRunner, SeqInput

    peak = matmul_flops()
    runner = ModelRunner(
        checkpoint(args.preset),
        device="cuda",
        dtype="bfloat16",
        attention_backend=args.attention,
        block_size=16,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=args.tokens,
        prefill_attention=args.prefill_attention,
        triton_prefill_kernel=args.triton_prefill_kernel,
    )
    c = runner.config
    layer_params = sum(
        p.numel() for n, p in runner.model.named_parameters() if n.startswith("layers.")
    )
    print(f"# prefill MFU, {args.preset}, {device_line()}; matmul {peak / 1e12:.0f} TFLOP/s")
    print("| prompts x tokens | prefill_attention:kernel | step (ms) | TFLOP/s | / matmul |")
    print("|---|---|---|---|---|")
    mode = f"{args.prefill_attention}:{args.triton_prefill_kernel}"
    cases = [(n, args.tokens // n, 0) for n in (1, 2, 8)]
    if args.prefix:
        cases.append((1, args.tokens, args.tokens))  # (prompts, tokens each, prefix each)
    for n, length, prefix in cases:
        blocks = -(-(prefix + length + 1) // 16)
        seqs = [
            SeqInput(list(range(1, length + 1)), prefix,
                     list(range(i * blocks, (i + 1) * blocks)), True)
            for i in range(n)
        ]  # fmt: skip
        pairs = n * (length * prefix + length * (length + 1) / 2)
        flops = (
            2 * layer_params * n * length
            + 4 * c.num_layers * c.num_heads * c.head_dim * pairs
            + 2 * c.hidden_size * c.vocab_size * n
        )
        t = cuda_time(lambda s=seqs: runner.execute(s), warmup=2, iters=5)
        where = f" (over {prefix})" if prefix else ""
        print(f"| {n} x {length}{where} | {mode} | {t * 1e3:.2f} | {flops / t / 1e12:.0f} "
              f"| {flops / t / peak:.0%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
