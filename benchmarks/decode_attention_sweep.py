"""Tune the decode attention kernel: tile size, warps and pipelining stages.

    python benchmarks/decode_attention_sweep.py [--heads 16 --kv-heads 8]

Times ``decode_attention`` alone (Qwen3-0.6B heads by default, block size 16, bf16) for each
(DECODE_BLOCK_N, num_warps, num_stages) at batch 32 and 256, context 1024 and 4096, and
prints the K/V bytes read per second; the best setting is what triton_kernels.py defaults to.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from common import ROOT, device_line  # noqa: F401  (puts the repo on sys.path)
from triton.testing import do_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    from backend.attention import triton_kernels as tk

    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    print(f"# decode attention sweep, {h} heads / {kvh} kv heads x {d}, {device_line()}")
    print("| batch | context | block_n | warps | stages | us | K/V TB/s |")
    print("|---|---|---|---|---|---|---|")
    for batch, ctx in ((32, 1024), (256, 1024), (32, 4096)):
        per_seq = -(-ctx // bs)
        cache = torch.randn(2, batch * per_seq, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        tables = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int32)
        tables = tables.view(batch, per_seq)
        qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        idx = torch.arange(batch, device="cuda", dtype=torch.int32)
        nbytes = 2 * batch * ctx * kvh * d * 2
        best = None
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2)):
            tk.DECODE_BLOCK_N, tk.DECODE_NUM_WARPS, tk.DECODE_NUM_STAGES = block_n, warps, stages
            try:
                call = (q, cache[0], cache[1], out, tables, qsl, lens, idx, d**-0.5, None)
                us = 1e3 * do_bench(lambda a=call: tk.decode_attention(*a))
            except Exception as e:  # noqa: BLE001 - a config may not fit shared memory
                print(f"| {batch} | {ctx} | {block_n} | {warps} | {stages} | failed: {e!r:.60} |")
                continue
            print(f"| {batch} | {ctx} | {block_n} | {warps} | {stages} | {us:.1f} "
                  f"| {nbytes / us / 1e6:.2f} |")
            if best is None or us < best[0]:
                best = (us, block_n, warps, stages)
        print(f"best at batch {batch}, context {ctx}: {best}")


if __name__ == "__main__":
    main()
