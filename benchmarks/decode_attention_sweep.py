"""Tune the decode attention kernel: cache layout, block size, tile size, warps, stages.

    python benchmarks/decode_attention_sweep.py [--heads 16 --kv-heads 8] [--layouts nhd hnd]
        [--block-sizes 16] [--tiles all|default]

Times ``decode_attention`` alone (Qwen3-0.6B heads by default, bf16) at batch 32 and 256,
context 1024 and 4096, and prints the K/V bytes read per second. Layouts: ``nhd`` is the
engine's cache, ``(blocks, block_size, kv_heads, head_dim)`` in memory; ``hnd`` stores
``(blocks, kv_heads, block_size, head_dim)`` (a block of one kv head is contiguous) and passes
the kernel the same logical view through strides. ``--tiles all`` sweeps (DECODE_BLOCK_N,
num_warps, num_stages); ``default`` times only the settings in triton_kernels.py.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from common import ROOT, device_line  # noqa: F401  (puts the repo on sys.path)
from triton.testing import do_bench


def make_cache(layout: str, blocks: int, bs: int, kvh: int, d: int) -> torch.Tensor:
    """(2, blocks, bs, kvh, d) logical view over the layout's memory order."""
    if layout == "nhd":
        return torch.randn(2, blocks, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    return torch.randn(2, blocks, kvh, bs, d, device="cuda", dtype=torch.bfloat16).transpose(2, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layouts", nargs="+", default=["nhd"], choices=["nhd", "hnd"])
    ap.add_argument("--block-sizes", nargs="+", type=int, default=[16])
    ap.add_argument("--tiles", default="all", choices=["all", "default"])
    args = ap.parse_args()
    from sched_lab.backend.attention import triton_kernels as tk
    from sched_lab.backend.attention.base import decode_items, decode_work

    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    default = (tk.DECODE_BLOCK_N, tk.DECODE_NUM_WARPS, tk.DECODE_NUM_STAGES)
    tiles = (
        list(itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)))
        if args.tiles == "all"
        else [default]
    )
    print(f"# decode attention sweep, {h} heads / {kvh} kv heads x {d}, {device_line()}")
    print("| layout | block size | batch | context | block_n | warps | stages | us | K/V TB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, bs in itertools.product(args.layouts, args.block_sizes):
        for batch, ctx in ((32, 1024), (256, 1024), (32, 4096), (256, 4096)):
            per_seq = -(-ctx // bs)
            cache = make_cache(layout, batch * per_seq, bs, kvh, d)
            q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            tables = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int32)
            tables = tables.view(batch, per_seq)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            items = decode_items(batch, kvh)
            nbytes = 2 * batch * ctx * kvh * d * 2
            best = None
            for block_n, warps, stages in tiles:
                tk.DECODE_BLOCK_N, tk.DECODE_NUM_WARPS, tk.DECODE_NUM_STAGES = (
                    block_n,
                    warps,
                    stages,
                )
                # work items of whole block_n tiles, as decode_work_device cuts them
                work, loc = (torch.from_numpy(a).cuda() for a in decode_work(
                    [ctx] * batch, range(batch), items, tile=block_n))  # fmt: skip
                try:
                    call = (q, cache[0], cache[1], out, tables, qsl, lens, work, loc, d**-0.5)
                    us = 1e3 * do_bench(lambda a=call: tk.decode_attention(*a))
                except Exception as e:  # noqa: BLE001 - a config may not fit shared memory
                    print(
                        f"| {layout} | {bs} | {batch} | {ctx} | {block_n} | {warps} | {stages} "
                        f"| failed: {e!r:.60} | |"
                    )
                    continue
                print(
                    f"| {layout} | {bs} | {batch} | {ctx} | {block_n} | {warps} | {stages} "
                    f"| {us:.1f} | {nbytes / us / 1e6:.2f} |"
                )
                if best is None or us < best[0]:
                    best = (us, block_n, warps, stages)
            if len(tiles) > 1:
                print(f"best, {layout} block size {bs}, batch {batch}, context {ctx}: {best}")
            del cache
    tk.DECODE_BLOCK_N, tk.DECODE_NUM_WARPS, tk.DECODE_NUM_STAGES = default


if __name__ == "__main__":
    main()
