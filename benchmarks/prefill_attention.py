"""Prefill attention alone: the engine's kernel against variants of it, 8B heads, 8k tokens.

    python benchmarks/prefill_attention.py --out DIR [--tokens 8192] [--prompts 1 2 8]
    TRITON_INTERPRET=1 python benchmarks/prefill_attention.py --out DIR --tiny   # a CPU check

Issue 38 asks for prefill of 8k tokens on the Llama-3.1-8B shape at >= 70% of the bf16
matmul peak; benchmarks/prefill_mfu.py measured 68% on an H100 for one 8k prompt (2026-12-07),
74-78% for 2 x 4k and 8 x 1k. Causal attention is ~13% of that step's FLOPs; this script times
it alone. ``engine`` is :func:`sched_lab.backend.attention.triton_kernels.prefill_attention`
(64-row tiles, keys 64 at a time, the causal mask on every key tile, ``tl.exp``); the
variants (:func:`_variant_kernel`, here only, not in the engine) change one thing at a time:

* ``split``: the key tiles every row of the query tile sees (below the tile's first row's
  position) run without a mask; the mask only on the diagonal tiles;
* ``exp2``: scores scaled by scale * log2(e) once, ``tl.exp2`` (FlashAttention-2's form);
* ``rows``: 128 query rows a program (tiles of 128) instead of 64;
* ``warps`` / ``stages``: the launch's;
* ``heavy_first``: the grid walks the tiles last to first (the causal tail's long tiles first).

``exp2 (engine option)`` is the kernel the engine runs with ``triton_prefill_kernel: exp2``
(:mod:`sched_lab.backend.attention.prefill_exp2`: split + exp2, 64-row tiles), and ``flash
varlen`` FlashAttention-2 through torch's varlen_attn over unpaged k/v of the same shape
(what ``prefill_attention: auto`` runs for long chunks from position 0; its own random k/v,
so no difference is printed), where it can run.

FLOPs = 4 * heads * head_dim * (visible (query, key) pairs); times are
``triton.testing.do_bench`` medians in ms. Every variant's output is compared with the
engine's (max abs difference printed; bf16). Writes DIR/prefill_attention.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import ROOT, device_line  # noqa: F401  (puts the repo on sys.path)

from sched_lab.backend.attention import flash_varlen, prefill_exp2
from sched_lab.backend.attention import triton_kernels as tk
from sched_lab.backend.attention.base import prefill_tiles

BLOCK_SIZE = 16


@triton.jit
def _variant_kernel(
    Q, KCache, VCache, Out, BlockTables, QueryStartLoc, SeqLens, Tiles, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EXP2: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):  # fmt: skip
    """The engine's _prefill_kernel (bf16 cache, HEAD_DIM a power of 2, no prefix) with the
    module docstring's switches. ``qk_scale``: scale, times log2(e) when EXP2."""
    pid = tl.program_id(0)
    if HEAVY_FIRST:
        pid = tl.num_programs(0) - 1 - pid
    seq = tl.load(Tiles + 2 * pid)
    if seq < 0:
        return
    tile = tl.load(Tiles + 2 * pid + 1)
    head = tl.program_id(1)
    kv_head = head // GROUP
    q_start = tl.load(QueryStartLoc + seq)
    query_len = tl.load(QueryStartLoc + seq + 1) - q_start
    seq_len = tl.load(SeqLens + seq)
    prefix_len = seq_len - query_len
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < query_len
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)  # fmt: skip
    q_pos = prefix_len + rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = tl.minimum(seq_len, prefix_len + (tile + 1) * BLOCK_M)
    if SPLIT:  # keys every row sees: [0, full_end), no mask
        full_end = tl.minimum((prefix_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
        for start in range(0, full_end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE)
            kv_off = (blocks.to(tl.int64) * stride_cb + (cols % BLOCK_SIZE) * stride_cs
                      + kv_head * stride_ch)  # fmt: skip
            k = tl.load(KCache + kv_off[:, None] + dims[None, :])
            v = tl.load(VCache + kv_off[:, None] + dims[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            if EXP2:
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
            else:
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        first = full_end
    else:
        first = 0
    for start in range(first, kv_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < seq_len
        blocks = tl.load(BlockTables + seq * stride_bt + cols // BLOCK_SIZE, mask=col_mask, other=0)
        kv_off = (blocks.to(tl.int64) * stride_cb + (cols % BLOCK_SIZE) * stride_cs
                  + kv_head * stride_ch)  # fmt: skip
        k = tl.load(KCache + kv_off[:, None] + dims[None, :], mask=col_mask[:, None], other=0.0)
        v = tl.load(VCache + kv_off[:, None] + dims[None, :], mask=col_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = (cols[None, :] <= q_pos[:, None]) & col_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if EXP2:
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        else:
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(Out.dtype.element_ty), mask=row_mask[:, None])  # fmt: skip


VARIANTS = {  # name -> (rows, split, exp2, warps, stages, heavy_first)
    "engine's tiles, no change": (64, False, False, 4, 3, False),
    "split": (64, True, False, 4, 3, False),
    "split+exp2": (64, True, True, 4, 3, False),
    "split+exp2, 4 stages": (64, True, True, 4, 4, False),
    "split+exp2, heavy first": (64, True, True, 4, 3, True),
    "rows 128, 8 warps": (128, False, False, 8, 3, False),
    "rows 128, 8 warps, split+exp2": (128, True, True, 8, 3, False),
    "rows 128, 8 warps, split+exp2, heavy first": (128, True, True, 8, 3, True),
    "rows 128, 8 warps, split+exp2, 2 stages": (128, True, True, 8, 2, False),
    "rows 128, 4 warps, split+exp2": (128, True, True, 4, 3, False),
}


def case(prompts: int, length: int, heads: int, kv_heads: int, dim: int, dev: str):
    """q, a paged cache holding every prompt's K/V (blocks shuffled), tables, start locs and
    lengths of ``prompts`` prompts of ``length`` tokens each."""
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    per = -(-length // BLOCK_SIZE)
    cache = torch.randn(2, prompts * per, BLOCK_SIZE, kv_heads, dim, device=dev, dtype=dtype)
    q = torch.randn(prompts * length, heads, dim, device=dev, dtype=dtype)
    tables = torch.randperm(prompts * per, device=dev).to(torch.int32).view(prompts, per)
    qsl = torch.arange(0, prompts * length + 1, length, device=dev, dtype=torch.int32)
    lens = torch.full((prompts,), length, device=dev, dtype=torch.int32)
    return q, cache, tables, qsl, lens


def run_variant(spec, q, cache, tables, qsl, lens):
    rows, split, exp2, warps, stages, heavy = spec
    tiles = torch.from_numpy(prefill_tiles((qsl[1:] - qsl[:-1]).cpu().numpy(), rows)).to(q.device)
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 * (1.4426950408889634 if exp2 else 1.0)
    kc, vc = cache[0], cache[1]

    def call():
        _variant_kernel[(tiles.shape[0], q.shape[1])](
            q, kc, vc, out, tables, qsl, lens, tiles, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
            kc.stride(0), kc.stride(1), kc.stride(2),
            GROUP=q.shape[1] // kc.shape[2], BLOCK_SIZE=BLOCK_SIZE, HEAD_DIM=q.shape[-1],
            BLOCK_M=rows, BLOCK_N=64, SPLIT=split, EXP2=exp2, HEAVY_FIRST=heavy,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return call, out


def run_engine(q, cache, tables, qsl, lens, kernel=tk.prefill_attention):
    """(a call of ``kernel``, an engine prefill function, and its output tensor)."""
    tiles = torch.from_numpy(prefill_tiles((qsl[1:] - qsl[:-1]).cpu().numpy())).to(q.device)
    out = torch.empty_like(q)
    call = partial(kernel, q, cache[0], cache[1], out, tables, qsl, lens, tiles,
                   q.shape[-1] ** -0.5)  # fmt: skip
    return call, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--tiny", action="store_true", help="CPU check under TRITON_INTERPRET=1")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = "cpu" if args.tiny else "cuda"
    heads, kv_heads, dim = (4, 2, 16) if args.tiny else (32, 8, 128)  # Llama-3.1-8B's
    tokens = 250 if args.tiny else args.tokens  # tiles cut short too
    prompts = [1, 2] if args.tiny else args.prompts
    header = (f"# prefill attention, {heads}/{kv_heads} heads x {dim}, {tokens} tokens, "
              f"{device_line() if dev == 'cuda' else 'CPU (TRITON_INTERPRET=1)'}")  # fmt: skip
    lines = [header, "", "| prompts x tokens | kernel | ms | TFLOP/s | vs engine | max abs diff |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    results = []
    for n in prompts:
        length = tokens // n
        q, cache, tables, qsl, lens = case(n, length, heads, kv_heads, dim, dev)
        flops = 4 * heads * dim * n * length * (length + 1) / 2
        call, ref = run_engine(q, cache, tables, qsl, lens)
        call()
        base = None if args.tiny else triton.testing.do_bench(call, warmup=5, rep=50)
        runs = [("engine", base, 0.0)]
        ecall, out2 = run_engine(q, cache, tables, qsl, lens, prefill_exp2.prefill_attention)
        ecall()
        ms = None if args.tiny else triton.testing.do_bench(ecall, warmup=5, rep=50)
        runs.append(("exp2 (engine option)", ms, float((out2.float() - ref.float()).abs().max())))
        if not args.tiny and flash_varlen.available(q.device, q.dtype):
            k = torch.randn(n * length, kv_heads, dim, device=dev, dtype=q.dtype)
            vcall = partial(flash_varlen.varlen_prefill, q, k, torch.randn_like(k), qsl, length,
                            dim**-0.5)  # fmt: skip
            runs.append(("flash varlen", triton.testing.do_bench(vcall, warmup=5, rep=50),
                         float("nan")))  # fmt: skip
        for name, spec in VARIANTS.items():
            if args.tiny and spec[3] == 8:
                spec = (*spec[:3], 4, *spec[4:])  # the interpreter runs any warps alike
            vcall, out = run_variant(spec, q, cache, tables, qsl, lens)
            vcall()
            diff = float((out.float() - ref.float()).abs().max())
            ms = None if args.tiny else triton.testing.do_bench(vcall, warmup=5, rep=50)
            runs.append((name, ms, diff))
        for name, ms, diff in runs:
            tf = "-" if ms is None else f"{flops / ms / 1e9:.0f}"
            vs = "-" if ms is None or base is None else f"{base / ms:.2f}x"
            t = "-" if ms is None else f"{ms:.3f}"
            lines.append(f"| {n} x {length} | {name} | {t} | {tf} | {vs} | {diff:.1e} |")
            results.append({"prompts": n, "length": length, "kernel": name, "ms": ms,
                            "tflops": None if ms is None else flops / ms / 1e9,
                            "max_abs_diff": diff})  # fmt: skip
        print("\n".join(lines[-len(runs) :]), flush=True)
    (args.out / "prefill_attention.md").write_text("\n".join(lines) + "\n")
    (args.out / "prefill_attention.json").write_text(
        json.dumps({"device": header, "results": results}, indent=1)
    )
    print(f"wrote {args.out}/prefill_attention.md", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
