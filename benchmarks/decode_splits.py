"""How many work items a decode attention launch should have, by batch and context.

    python benchmarks/decode_splits.py --out DIR [--presets qwen3-0.6b llama-3.1-8b]
        [--batches 1 4 8 16 32 64 128 256] [--contexts 1024 4096] [--splits 1 2 4 8 16 32]
    TRITON_INTERPRET=1 python benchmarks/decode_splits.py --out DIR --tiny   # a CPU check

For each preset's head shape, batch and context (every row at that context), times
``decode_attention`` alone for each number of splits a row (``decode_items(rows, kv_heads,
splits)`` work items: ``rows * splits + rows // 4``, cut by ``decode_work`` as the engine
cuts them) with the merge fused into the kernel and apart, and beside them the engine's
default (``decode_items`` without ``splits``, the fused-merge rule of ``decode_attention``).
Times are ``triton.testing.do_bench`` medians (the L2 cache flushed before each call), in
us; the roofline is the K/V bytes at the device copy rate measured in the same process.
Every variant's output is checked against the default's (max abs difference printed).

Writes DIR/decode_splits.{md,json}. ``--tiny``: a 2-row, 256-position case per split on
the CPU under ``TRITON_INTERPRET=1`` (outputs compared, times not meaningful).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from common import ROOT, copy_bandwidth, device_line  # noqa: F401  (puts the repo on sys.path)

from sched_lab.backend.attention import triton_kernels as tk
from sched_lab.backend.attention.base import decode_items, decode_work
from sched_lab.core.model_presets import PRESETS

BLOCK_SIZE = 16


def case(heads: int, kv_heads: int, head_dim: int, batch: int, ctx: int, dev: str):
    """Random q and a paged K/V cache of ``batch`` rows at ``ctx`` positions (blocks in a
    shuffled order), and the launch arguments that do not depend on the split."""
    per_seq = -(-ctx // BLOCK_SIZE)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cache = torch.randn(2, batch * per_seq, BLOCK_SIZE, kv_heads, head_dim, device=dev,
                        dtype=dtype)  # fmt: skip
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    tables = torch.randperm(batch * per_seq, device=dev).to(torch.int32).view(batch, per_seq)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return q, cache, tables, qsl, lens


def run_one(q, cache, tables, qsl, lens, items: int, fused: bool | None, timed: bool):
    """(us or None, output) of one decode_attention launch with ``items`` work items."""
    batch, dev = q.shape[0], q.device
    work, loc = (torch.from_numpy(a).to(dev) for a in decode_work(
        [int(lens[0])] * batch, range(batch), items))  # fmt: skip
    out = torch.empty_like(q)
    merge = bool((loc.diff() > 1).any())
    args = (q, cache[0], cache[1], out, tables, qsl, lens, work, loc, q.shape[-1] ** -0.5)

    def call():
        tk.decode_attention(*args, merge=merge, fused_merge=fused)

    call()
    us = None
    if timed:
        from triton.testing import do_bench

        us = 1e3 * do_bench(call)
    return us, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--tiny", action="store_true", help="a CPU check (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("error: --tiny runs the kernels on the CPU: set TRITON_INTERPRET=1")
        args.presets, args.batches, args.contexts = ["qwen3-0.6b"], [2], [256]
        args.splits = [1, 2, 4]
    dev = "cpu" if args.tiny else "cuda"
    timed = not args.tiny
    rate = copy_bandwidth() if timed else float("nan")
    head = f"decode attention by splits, {device_line() if timed else 'CPU (TRITON_INTERPRET)'}"
    lines = [f"# {head}" + (f"; device copy {rate / 1e12:.2f} TB/s" if timed else ""), ""]
    lines += ["Each cell: us (its ratio to the K/V bytes at the copy rate); columns: splits "
              "a row, merge fused or apart; **bold**: the row's best; default: the engine's "
              "choice (decode_items, the fused-merge rule) and its items.", ""]  # fmt: skip
    cols = [f"{s} {m}" for s in args.splits for m in ("fused", "apart")]
    lines += ["| preset | batch | context | default | " + " | ".join(cols) + " | max diff |"]
    lines += ["|" + "---|" * (len(cols) + 5)]
    rows = []
    for preset in args.presets:
        p = PRESETS[preset]
        heads, kv_heads = p["num_attention_heads"], p["num_key_value_heads"]
        head_dim = p.get("head_dim") or p["hidden_size"] // heads
        for batch in args.batches:
            for ctx in args.contexts:
                t = case(heads, kv_heads, head_dim, batch, ctx, dev)
                nbytes = 2 * batch * ctx * kv_heads * head_dim * t[1].element_size()
                floor_us = nbytes / rate * 1e6
                d_items = decode_items(batch, kv_heads)
                d_us, ref = run_one(*t, d_items, None, timed)
                found, diff = {}, 0.0
                for s in args.splits:
                    for fused in (True, False):
                        us, out = run_one(*t, decode_items(batch, kv_heads, s), fused, timed)
                        found[f"{s} {'fused' if fused else 'apart'}"] = us
                        diff = max(diff, (out.float() - ref.float()).abs().max().item())
                best = min(found, key=found.__getitem__) if timed else None
                row = {"preset": preset, "batch": batch, "context": ctx, "bytes": nbytes,
                       "default_items": d_items, "default_us": d_us, "us": found,
                       "max_abs_diff": diff, "best": best}  # fmt: skip
                rows.append(row)

                def cell(us, bold=False, floor_us=floor_us):
                    if us is None:
                        return "-"
                    text = f"{us:.1f} ({us / floor_us:.2f})"
                    return f"**{text}**" if bold else text

                cells = [cell(found[c], c == best) for c in cols]
                lines.append(f"| {preset} | {batch} | {ctx} | {cell(d_us)} ({d_items} items) | "
                             + " | ".join(cells) + f" | {diff:.1e} |")  # fmt: skip
                print(lines[-1], flush=True)
                del t
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_splits.md").write_text("\n".join(lines) + "\n")
    meta = {"device": head, "copy_rate": rate if timed else None,
            "started": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    (args.out / "decode_splits.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print("\n".join(lines[:4]))


if __name__ == "__main__":
    main()
