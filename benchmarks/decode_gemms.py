"""The layers' GEMMs of a decode step alone, by weight layout and BLAS library.

    python benchmarks/decode_gemms.py [--presets qwen3-0.6b llama-3.1-8b] [--batches 1 32 256]

For each model shape and batch (tokens) M, one CUDA graph holds the step's layer GEMMs (per
layer qkv, o, gate_up, down; distinct random bf16 weights per layer, so they are read from
HBM as in a real step) and is replayed back to back. Variants:

* ``linear``: ``F.linear(x, W)`` with W (N, K) contiguous, as the engine's ``nn.Linear``;
* ``mm_kn``: ``torch.mm(x, W_t)`` with W_t (K, N) contiguous (the transposed storage);

each with torch's default BLAS (cuBLAS) and with ``preferred_blas_library("cublaslt")``.
Printed per variant: ms per step, weight bytes / time, and the ratio to the copy-rate floor
of the same kernels (decode_floor.py's elementwise chain of the same byte counts).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import checkpoint, device_line, graph_time
from decode_floor import chain_time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    args = ap.parse_args()
    from sched_lab.backend.config import ModelConfig

    print(f"# decode GEMMs, {device_line()}")
    print("| model | M | variant | BLAS | ms / step | weights TB/s | / floor |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        cfg = ModelConfig.from_dir(checkpoint(preset))
        h, i = cfg.hidden_size, cfg.intermediate_size
        shapes = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h), (h, 2 * i), (i, h)]  # (K, N)
        nbytes = cfg.num_layers * sum(k * n * 2 for k, n in shapes)
        for m in args.batches:
            floor = chain_time([k * n * 2 for k, n in shapes] * cfg.num_layers)
            for variant in ("linear", "mm_kn"):
                weights = [
                    torch.randn((n, k) if variant == "linear" else (k, n), device="cuda",
                                dtype=torch.bfloat16) * 0.02
                    for _ in range(cfg.num_layers) for k, n in shapes
                ]  # fmt: skip
                xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes]

                def step(w=weights, xs=xs, variant=variant) -> None:
                    for j, wj in enumerate(w):
                        x = xs[j % 4]
                        F.linear(x, wj) if variant == "linear" else torch.mm(x, wj)

                for blas in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(blas)
                    t = graph_time(step)
                    print(
                        f"| {preset} | {m} | {variant} | {blas} | {t * 1e3:.3f} | "
                        f"{nbytes / t / 1e12:.2f} | {t / floor:.2f} |",
                        flush=True,
                    )
                torch.backends.cuda.preferred_blas_library("cublas")
                del weights
                torch.cuda.empty_cache()
            print(
                f"| {preset} | {m} | elementwise floor | - | {floor * 1e3:.3f} | "
                f"{nbytes / floor / 1e12:.2f} | 1.00 |",
                flush=True,
            )


if __name__ == "__main__":
    main()
