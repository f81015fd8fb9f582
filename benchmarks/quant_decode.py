"""Quantized GEMMs alone and decode steps with quantized weights, against bf16 and each
format's HBM roofline.

    timeout 300 python benchmarks/quant_decode.py --out results/quant_decode   # CUDA, 8B shape
    python benchmarks/quant_decode.py --dry-run --out /tmp/qd    # CPU interpreter, tiny shapes
    timeout 330 python benchmarks/quant_decode.py --sweep --no-steps --out results/qd_sweep

Two parts, each written to ``--out`` (``gemm.json``/``gemm.md``, then ``steps.json``/
``steps.md``) as soon as it is done, so a run cut short keeps what it measured:

1. **GEMMs alone** (``--no-gemm`` skips; saved after each projection): each layer projection of the preset (fused qkv,
   o, gate_up, down) at M = 1, 8, 16, 32, 64 tokens: bf16 (cuBLAS, ``x @ W.T``), and for
   fp8, int8, awq, gptq (group 128) the weight-streaming kernel (M <= 64), the large-M path
   (int4/int8: the tiled Triton kernel at every M, AWQ repacked as the engine keeps it;
   fp8: W8A8 ``torch._scaled_mm`` at every M > 1), at M = 1 the streaming kernel's
   other one-row product (``stream-alt``). Each time is
   one CUDA graph of back-to-back calls over enough weight copies to exceed the L2 cache,
   divided by the calls. Roofline: bytes as stored / the card's HBM bandwidth (datasheets:
   H200 4.8 TB/s, H100 3.35). Each path's output is checked against the float32 dequantized
   reference (``err``: max |out - ref| / max |ref|).
   ``gemm.md`` ends with the token threshold at which the streaming kernel stops winning
   (for quant_linear.STREAM_MAX_TOKENS / FP8_WEIGHT_ONLY_MAX_TOKENS).
2. **Decode steps** (``--no-steps`` skips): ModelRunner.execute on decode-only inputs (CUDA
   graphs, device sync included) for bf16 and each method quantized at load time from one
   random bf16 checkpoint, at the batch x context shapes below, with the current dispatch;
   roofline = (weight bytes as stored + KV bytes read) / that bandwidth. Written again after
   each format (the first run also writes the random 8B checkpoint, ~16 GB, under checkpoints/).

``--sweep`` replaces part 1 by a tile sweep of the tiled kernel (:func:`sweep_rows`):
int4 (GPTQ layout, group 128) and int8 on the four projections at M = 1 and 16, over
``TileConfig``s (BLOCK_N 32..256, BLOCK_K 64..256 (int4: <= 128), split-K until 1/2/4
programs per SM, 4/8 warps, int4 words loaded per code or once, at 3 stages, then 2 and 4
stages for each shape's winner; ~50 configs for int4, ~40 for int8), each
in a CUDA graph as above; ``sweep.json`` / ``sweep.md`` (best per shape, its us, the
current ``tile_config``'s us, and x bf16 cuBLAS) are written after every config. It stops
starting configs when ``--sweep-budget-s`` (shared by the two formats by grid size) is
spent; a config that fails to compile or launch is logged and skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

if "--dry-run" in sys.argv:  # before triton is imported: run the kernels in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from common import checkpoint, cuda_time, decode_inputs, device_line, graph_time  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet; main() sets the card's own (datasheet_hbm)
METHODS = ("awq", "gptq", "fp8", "int8")  # the furthest from their targets first
GEMM_TOKENS = (1, 8, 16, 32, 64)
STEP_SHAPES = ((1, 1024), (1, 4096), (32, 1024), (32, 4096), (256, 1024))
L2_FLUSH_BYTES = 256 << 20  # weight copies per timed graph: > 4x the H200's 50 MB L2
TARGETS = "batch 1: fp8 >= 1.6x and int4 >= 2.5x faster than bf16; batch >= 32: <= 1.5x roofline"
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


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of one layer's fused projections."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    o = cfg["num_attention_heads"] * head_dim
    return {"qkv": (h, qkv), "o": (o, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---------------------------------------------------------------- part 1: GEMMs alone
def gemm_rows(cfg: dict, device: str, timer, log, save, methods=METHODS,
              tokens=GEMM_TOKENS) -> list[dict]:  # fmt: skip
    """One row per (projection, tokens, method, path): us per call, roofline, error;
    ``save(rows)`` after each projection."""
    from sched_lab.backend import quant_kernels as qk
    from sched_lab.backend.quant_formats import QuantSpec, quantize_weight, repack_awq

    tokens = tokens if device == "cuda" else (1, 16, 32)
    rows = []
    for proj, (k, n) in projections(cfg).items():
        gen = torch.Generator(device=device).manual_seed(0)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        xs = {m: torch.randn(m, k, device=device, dtype=dense.dtype, generator=gen) for m in tokens}
        for method in (None, *(m for m in methods if m in METHODS)):
            if method is None:
                tensors, spec = {"weight": dense}, None
            else:
                spec = QuantSpec(method)
                tensors = quantize_weight(dense, spec)
            size = nbytes(tensors)
            copies = [tensors] + [
                {name: t.clone() for name, t in tensors.items()}
                for _ in range(min(63, L2_FLUSH_BYTES // size) if device == "cuda" else 0)
            ]
            # the tiled kernel reads AWQ as the engine keeps it (repacked at load)
            repacked = [repack_awq(t) for t in copies] if method == "awq" else copies
            ref = None if method is None else qk.dequantize(tensors, spec).t()
            for m in tokens:
                x = xs[m]
                paths = _paths(method, m, qk, (n, k))
                for path, fn in paths.items():
                    use = repacked if path == "tiled" else copies
                    out = fn(x, use[0], spec, n)
                    err = float("nan")
                    if ref is not None:
                        want = x.float() @ ref
                        err = ((out.float() - want).abs().max() / want.abs().max()).item()
                    calls = [lambda t=t, f=fn, x=x, q=spec, n=n: f(x, t, q, n) for t in use]
                    sec = timer(lambda c=calls: [f() for f in c]) / len(calls)
                    row = {"projection": proj, "K": k, "N": n, "tokens": m,
                           "weights": method or "bf16", "path": path, "us": sec * 1e6,
                           "roofline_us": (size + 2 * m * (k + n)) / HBM_BYTES_PER_S * 1e6,
                           "err": err}  # fmt: skip
                    rows.append(row)
                    log(f"{proj:8s} M={m:3d} {method or 'bf16':5s} {path:7s} {sec * 1e6:9.1f} us "
                        f"(x{sec * 1e6 / row['roofline_us']:.2f} roofline) err {err:.1e}")  # fmt: skip
            del copies, repacked
        save(rows)
    return rows


def _paths(method, m, qk, shape) -> dict:
    """path name -> fn(x, tensors, spec, n) timed for ``method`` at ``m`` tokens on a weight
    of ``shape`` (N, K)."""
    from sched_lab.backend.quant_gemv import dequant_int4_matmul, small_m_gemm, small_m_int4_gemm
    from sched_lab.backend.quant_kernels import small_m_supported

    if method is None:
        return {"cublas": lambda x, t, spec, n: x @ t["weight"].t()}
    paths = {}
    if m <= qk.STREAM_MAX_M:
        paths["stream"] = qk.weight_streaming_gemm
    if m == 1:  # the other one-row product (tl.dot vs multiply-and-sum)
        tiles = qk.STREAM_TILES[method in ("awq", "gptq"), True]
        alt = replace(tiles, dot=not tiles.dot, num_warps=4)
        paths["stream-alt"] = lambda x, t, spec, n, a=alt: qk.weight_streaming_gemm(
            x, t, spec, n, a
        )
    if method == "fp8" and small_m_supported("fp8", m, *shape):  # the engine's, <= 32 tokens
        paths["small_m"] = lambda x, t, spec, n: small_m_gemm(
            x, t["weight"], t["weight_scale"], "fp8"
        )
    if method in ("gptq", "awq") and small_m_supported(method, m, *shape):
        paths["small_m"] = small_m_int4_gemm
    if method in ("gptq", "awq") and m > 1 and shape[1] % 128 == 0:  # groups of 128 here
        paths["dequant"] = dequant_int4_matmul
    if m > 1 and method == "fp8":
        paths["w8a8"] = lambda x, t, spec, n: qk.fp8_gemm(x, t["weight"], t["weight_scale"])
    elif method != "fp8":  # the engine's path at every M
        paths["tiled"] = qk.weight_only_gemm
    return paths


def gemm_markdown(rows: list[dict], header: str) -> str:
    from sched_lab.backend.quant_linear import gemm_path

    def us(proj, m, weights, path):
        for r in rows:
            if (r["projection"], r["tokens"], r["weights"], r["path"]) == (proj, m, weights, path):
                return r
        return None

    lines = [header, "", "Per call, us (x roofline); speed-up vs bf16 cuBLAS in brackets; "
             "each format: the path quant_linear.gemm_path picks.", "",
             "| projection (K, N) | M | bf16 | " + " | ".join(
                 f"{w}" for w in METHODS) + " |",
             "|---|---|---|" + "---|" * len(METHODS)]  # fmt: skip
    projs = list(dict.fromkeys(r["projection"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    for proj in projs:
        for m in tokens:
            base = us(proj, m, "bf16", "cublas")
            if base is None:
                continue
            k, n = base["K"], base["N"]
            cells = [f"{base['us']:.1f} (x{base['us'] / base['roofline_us']:.2f})"]
            for w in METHODS:
                r = us(proj, m, w, gemm_path(w, m, shape=(n, k)))
                cells.append("-" if r is None else
                             f"{r['us']:.1f} (x{r['us'] / r['roofline_us']:.2f}) "
                             f"[{base['us'] / r['us']:.2f}x]")  # fmt: skip
            lines.append(f"| {proj} ({k}, {n}) | {m} | " + " | ".join(cells) + " |")
    lines += ["", "Streaming kernel vs the large-M path, summed over the four projections (us):", "",
              "| weights | " + " | ".join(f"M={m}" for m in tokens) + " | stream wins up to |",
              "|---|" + "---|" * len(tokens) + "---|"]  # fmt: skip
    worst = max((r["err"] for r in rows if r["err"] == r["err"]), default=float("nan"))
    for w in METHODS:
        other = "w8a8" if w == "fp8" else "tiled"
        cells, up_to, lost = [], "-", False
        for m in tokens:
            s, o = _total(rows, w, "stream", m), _total(rows, w, other, m)
            cells.append(f"{s:.0f} / {o:.0f}" if s and o else (f"{s:.0f} / -" if s else "-"))
            if s and o and not lost:
                lost = s > o
                up_to = f"< {m}" if lost and up_to == "-" else (up_to if lost else str(m))
        lines.append(f"| {w} (stream / {other}) | " + " | ".join(cells) + f" | {up_to} |")
    alt = [f"{w} {_total(rows, w, 'stream', 1):.0f} / {_total(rows, w, 'stream-alt', 1):.0f}"
           for w in METHODS]  # fmt: skip
    lines += ["", "One row, summed over the projections (us): STREAM_TILES's choice / the other "
              "product (tl.dot vs multiply-and-sum, 4 warps): " + ", ".join(alt)]  # fmt: skip
    lines += ["", f"Largest relative error against the float32 dequantized reference: {worst:.2e} "
              "(fp8 w8a8 includes its activation rounding)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _total(rows: list[dict], weights: str, path: str, tokens: int) -> float:
    """Microseconds of ``path`` summed over the projections (0: not timed)."""
    return sum(
        r["us"] for r in rows if (r["weights"], r["path"], r["tokens"]) == (weights, path, tokens)
    )


# ---------------------------------------------------------------- --sweep: tiled tiles
SWEEP_TOKENS = (1, 16)
SWEEP_METHODS = ("gptq", "int8")


def sweep_grid(method: str) -> list[tuple]:
    """(block_n, block_k, split_sms, num_warps, words_once) at 3 stages, pruned to ~45 per
    format: int4 K tiles <= the group (128), each config with the packed words loaded per
    code and once (``words_once``; per code, 256 x 128 needs more than the 227 KB of shared
    memory at 3 stages: left out); (256, 256) left out (register-bound); 8 warps beside 4
    only at 16384 weights a tile (4 below, 8 above)."""
    grid = []
    for bn in (32, 64, 128, 256):
        for bk in (64, 128) if method != "int8" else (64, 128, 256):
            if (bn, bk) == (256, 256) or (method != "int8" and (bn, bk) == (32, 64)):
                continue
            area = bn * bk
            warps = (4, 8) if area == 16384 else ((4,) if area < 16384 else (8,))
            once = (False,) if method == "int8" else (True, False)
            for split in (1, 2, 4):
                for w in warps:
                    grid += [(bn, bk, split, w, o) for o in once
                             if o or method == "int8" or (bn, bk) != (256, 128)]  # fmt: skip
    return grid


def sweep_rows(cfg: dict, device: str, timer, budget_s: float, log, save, dry_run: bool):
    """One row per (method, projection, tokens, config): us per call (``graph_time`` over
    weight copies beyond the L2), error against the float32 reference, and per (projection,
    tokens) one bf16 cuBLAS row; ``save(rows)`` after every config."""
    from sched_lab.backend import quant_kernels as qk
    from sched_lab.backend.quant_formats import QuantSpec, quantize_weight

    rows: list[dict] = []
    t_start = time.perf_counter()
    shapes = list(projections(cfg).items())
    tokens = SWEEP_TOKENS
    data = {}  # proj -> (dense copies, x by m)
    for proj, (k, n) in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        xs = {m: torch.randn(m, k, device=device, dtype=dense.dtype, generator=gen) for m in tokens}
        data[proj] = (dense, xs)
        if device == "cuda":
            copies = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
            for m in tokens:
                x = xs[m]
                sec = timer(lambda c=copies, x=x: [x @ w.t() for w in c]) / len(copies)
                rows.append({"method": "bf16", "projection": proj, "K": k, "N": n, "tokens": m,
                             "config": "cublas", "us": sec * 1e6, "err": 0.0})  # fmt: skip
            del copies
    for i, method in enumerate(SWEEP_METHODS):
        spec = QuantSpec(method)
        left = budget_s - (time.perf_counter() - t_start)  # shared by grid size
        sizes = [len(sweep_grid(mt)) for mt in SWEEP_METHODS[i:]]
        deadline = time.perf_counter() + left * sizes[0] / sum(sizes)
        weights = {}
        for proj in data:
            tensors = quantize_weight(data[proj][0], spec)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            extra = _copies(size) - 1 if device == "cuda" else 0
            copies = [tensors] + [{a: t.clone() for a, t in tensors.items()} for _ in range(extra)]
            weights[proj] = (copies, qk.dequantize(tensors, spec).t())
        default = {(p, m): qk.tile_config(m, n, k, spec) for p, (k, n) in shapes for m in tokens}
        grid = [None] + [(bn, bk, sp, w, 3, o) for bn, bk, sp, w, o in sweep_grid(method)]
        if dry_run:
            grid = grid[:3]
        done: set = set()
        best: dict = {}
        phase2 = False
        while grid:
            choice = grid.pop(0)
            if time.perf_counter() > deadline:
                log(f"{method}: sweep budget spent; {len(grid) + 1} configs not timed")
                break
            for proj, (k, n) in shapes:
                copies, ref = weights[proj]
                for m in tokens:
                    base = default[proj, m]
                    if choice is None:
                        c, name = base, "default"
                    else:
                        bn, bk, sp, w, st, once = choice
                        c = qk.TileConfig(base.block_m, bn, bk, sp, w, st, once)
                        name = f"n{bn} k{bk} split{sp}x w{w} s{st}" + (" once" if once else "")
                    if (method, proj, m, c) in done:
                        continue
                    done.add((method, proj, m, c))
                    x = data[proj][1][m]
                    fn = functools.partial(qk.weight_only_gemm, config=c)
                    try:  # compiles here, before any capture: a config that fails is noted
                        out = fn(x, copies[0], spec, n)
                    except Exception as e:  # e.g. out of shared memory at this tile size
                        log(f"{method} {proj} M={m} {name}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160] if str(e) else ''}")  # fmt: skip
                        rows.append({"method": method, "projection": proj, "K": k, "N": n,
                                     "tokens": m, "config": name, "us": None,
                                     "err": float("inf"), "error": type(e).__name__})  # fmt: skip
                        continue
                    want = x.float() @ ref
                    err = ((out.float() - want).abs().max() / want.abs().max()).item()
                    calls = [lambda t=t, x=x, n=n, f=fn, q=spec: f(x, t, q, n) for t in copies]
                    sec = timer(lambda cs=calls: [f() for f in cs]) / len(calls)
                    row = {"method": method, "projection": proj, "K": k, "N": n, "tokens": m,
                           "config": name, "block_m": c.block_m, "block_n": c.block_n,
                           "block_k": c.block_k, "split_sms": c.split_sms,
                           "num_warps": c.num_warps, "num_stages": c.num_stages,
                           "words_once": c.words_once,
                           "us": sec * 1e6, "err": err}  # fmt: skip
                    rows.append(row)
                    if err < 1e-2 and (best.get((proj, m)) is None or sec < best[proj, m][0]):
                        best[proj, m] = (sec, c)
            log(f"{method} {'default' if choice is None else choice}: "
                f"{time.perf_counter() - t_start:.0f} s")  # fmt: skip
            save(rows)
            if not grid and not phase2:  # each shape's winner at 2 and 4 stages
                phase2 = True
                winners = dict.fromkeys(c for _, c in best.values())
                grid = [(c.block_n, c.block_k, c.split_sms, c.num_warps, st, c.words_once)
                        for c in winners for st in (2, 4)]  # fmt: skip
                if dry_run:
                    grid = grid[:1]
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _copies(nbytes: int) -> int:
    """Weight copies per timed graph so that they exceed the L2 (at most 64)."""
    return max(1, min(64, -(-L2_FLUSH_BYTES // nbytes)))


def sweep_markdown(rows: list[dict], header: str) -> str:
    """Best config per (method, projection, tokens), against the default and bf16 cuBLAS."""
    lines = [header, "", "Tiled quantized GEMM tile sweep (us per call in CUDA graphs, weights "
             "beyond the L2; speed-up = bf16 cuBLAS us / us). Config: BLOCK_N, BLOCK_K, split K "
             "until N programs per SM, warps, stages, 'once': int4 words loaded once; BLOCK_M 16.", "",
             "| method | projection (K, N) | M | best config | best us | x bf16 | default us "
             "| bf16 us | configs timed |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    bf16 = {(r["projection"], r["tokens"]): r["us"] for r in rows if r["method"] == "bf16"}
    keys = list(dict.fromkeys((r["method"], r["projection"], r["tokens"]) for r in rows
                              if r["method"] != "bf16"))  # fmt: skip
    for method, proj, m in keys:
        mine = [r for r in rows if (r["method"], r["projection"], r["tokens"]) == (method, proj, m)]
        ok = [r for r in mine if r["err"] < 1e-2 and r["us"] is not None]
        if not ok:
            continue
        b = min(ok, key=lambda r: r["us"])
        d = next((r["us"] for r in mine if r["config"] == "default"), None) or float("nan")
        base = bf16.get((proj, m), float("nan"))
        lines.append(f"| {method} | {proj} ({b['K']}, {b['N']}) | {m} | {b['config']} | "
                     f"{b['us']:.1f} | {base / b['us']:.2f} | {d:.1f} | {base:.1f} | "
                     f"{len(mine)} |")  # fmt: skip
    bad = [r for r in rows if r["err"] >= 1e-2 and r["us"] is not None]
    failed = [r for r in rows if r["us"] is None]
    lines += ["", f"Timings with a relative error >= 1e-2 (left out of 'best'): {len(bad)}; "
              f"launches that failed (compile or resources): {len(failed)}."]  # fmt: skip
    lines += ["", "Set the winners in backend/quant_kernels.py tile_config()."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- part 2: decode steps
def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (packed weights and scales as stored)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def step_rows(model_dir, shapes, device, dtype, timer, log, save, methods=METHODS) -> list[dict]:
    """One row per (weights, batch, context); ``save(rows)`` after each weight format.
    ``fp8-torch-act`` is fp8 with W8A8's activations quantized by nine torch kernels (the
    path before ``quantize_activations_fp8_kernel``; the small-M kernel off too, so that
    W8A8 runs from two tokens): the A/B of that kernel.
    ``fp8-no-small-m`` is fp8 without the swapped-operand kernel (quant_gemv.small_m_gemm): the GEMV
    at one token, W8A8 above, the A/B of that kernel; ``gptq-no-small-m`` and
    ``awq-no-small-m`` likewise for int4 (the GEMV at one token, the tiled kernel above: no
    small-M kernel, no dequantized cuBLAS)."""
    from sched_lab.backend import quant_kernels as qk
    from sched_lab.backend import quant_linear as ql
    from sched_lab.backend.runner import ModelRunner

    rows, bf16 = [], {}
    for label in (None, *methods):
        method = "fp8" if label == "fp8-torch-act" else label
        if label is not None and label.endswith("-no-small-m"):
            method = label.removesuffix("-no-small-m")
        qk.ACT_QUANT_KERNEL = label != "fp8-torch-act"  # read when the graphs are captured
        small_m = (
            ql.FP8_SMALL_M_MAX_TOKENS,
            ql.INT4_SMALL_M_MAX_TOKENS,
            ql.INT4_DEQUANT_ABOVE_TOKENS,
        )
        if label != method:
            ql.FP8_SMALL_M_MAX_TOKENS = ql.INT4_SMALL_M_MAX_TOKENS = 0
            ql.INT4_DEQUANT_ABOVE_TOKENS = None
        try:
            max_ctx = max(c for _, c in shapes)
            runner = ModelRunner(model_dir, device=device, dtype=dtype, quantization=method,
                                 attention_backend="triton" if device == "cuda" else "torch",
                                 block_size=16, max_model_len=max_ctx + 16,
                                 max_num_seqs=max(b for b, _ in shapes), gpu_memory_utilization=0.9,
                                 cuda_graph_sizes=tuple(sorted({b for b, _ in shapes})),
                                 mixed_graphs=False, swap_space_bytes=0)  # fmt: skip
            cfg = runner.config
            kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
            weights = stored_bytes(runner.model)
            for batch, ctx in shapes:
                row = {"weights": label or "bf16", "batch": batch, "context": ctx}
                if batch * -(-(ctx + 1) // 16) > runner.num_gpu_blocks:
                    rows.append({**row, "step_ms": None, "note": "KV does not fit"})
                    continue
                seqs = decode_inputs(batch, ctx)
                step = timer(lambda s=seqs, r=runner: r.execute(s))
                roof = (weights + batch * ctx * kv_per_token) / HBM_BYTES_PER_S
                if method is None:
                    bf16[batch, ctx] = step
                row.update(step_ms=step * 1e3, roofline_ms=roof * 1e3, x_roofline=step / roof,
                           speedup_vs_bf16=bf16.get((batch, ctx), float("nan")) / step)  # fmt: skip
                rows.append(row)
                log(f"step {row['weights']:5s} batch {batch:3d} ctx {ctx:5d}: {step * 1e3:.3f} ms "
                    f"(x{step / roof:.2f} roofline, {row['speedup_vs_bf16']:.2f}x bf16)")  # fmt: skip
            del runner
        finally:
            qk.ACT_QUANT_KERNEL = True
            ql.FP8_SMALL_M_MAX_TOKENS, ql.INT4_SMALL_M_MAX_TOKENS, ql.INT4_DEQUANT_ABOVE_TOKENS = (
                small_m
            )
        save(rows)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def steps_markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| weights | batch | context | step (ms) | roofline (ms) | "
             "step / roofline | speed-up vs bf16 |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["step_ms"] is None:
            lines.append(f"| {r['weights']} | {r['batch']} | {r['context']} | - | - | "
                         f"{r['note']} | - |")  # fmt: skip
        else:
            lines.append(f"| {r['weights']} | {r['batch']} | {r['context']} | {r['step_ms']:.3f} | "
                         f"{r['roofline_ms']:.3f} | {r['x_roofline']:.2f} | "
                         f"{r['speedup_vs_bf16']:.2f} |")  # fmt: skip
    lines += ["", f"(roofline = (weights as stored + KV bytes read) / "
              f"{HBM_BYTES_PER_S / 1e12:g} TB/s; targets: {TARGETS})"]  # fmt: skip
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main
def datasheet_hbm(device_name: str) -> float:
    """HBM bytes/s of the named card from its datasheet: H100 SXM 3.35 TB/s, else (H200 or
    unknown) 4.8 TB/s."""
    return 3.35e12 if "H100" in device_name else 4.8e12


def main() -> None:
    global HBM_BYTES_PER_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gemm/steps .json and .md")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--no-gemm", action="store_true", help="skip part 1")
    ap.add_argument("--no-steps", action="store_true", help="skip part 2")
    ap.add_argument("--gemm-tokens", nargs="+", type=int, default=list(GEMM_TOKENS),
                    help=f"part 1's token counts M (default: {GEMM_TOKENS})")  # fmt: skip
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    choices=[*METHODS, "fp8-torch-act", "fp8-no-small-m", "gptq-no-small-m",
                             "awq-no-small-m"],
                    help="the quantized formats after bf16 (default: all four; part 2 "
                         "also takes fp8-torch-act: fp8 W8A8 with the activations quantized "
                         "by torch ops, and fp8/gptq/awq-no-small-m: without quant_gemv's small-M "
                         "kernels)")  # fmt: skip
    ap.add_argument("--batches", nargs="+", type=int, default=None,
                    help="part 2's batch sizes, each at 1k and 4k context (default: "
                         "STEP_SHAPES, 256 at 1k only)")  # fmt: skip
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="tile sweep of the tiled kernel instead of part 1 (sweep.json/.md)",
    )
    ap.add_argument(
        "--sweep-budget-s",
        type=float,
        default=200.0,
        help="seconds after which the sweep starts no more configs (default 200)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from sched_lab.core.model_presets import PRESETS

    if args.dry_run:
        cfg, device, dtype, timer = TINY_LLAMA, "cpu", "float32", _wall_time
        header = "# quant_decode dry run: CPU, Triton interpreter, tiny shapes (measures nothing)"
    else:
        cfg, device, dtype = PRESETS[args.preset], "cuda", "bfloat16"
        timer = graph_time
        HBM_BYTES_PER_S = datasheet_hbm(torch.cuda.get_device_name())
        header = f"# quant_decode: {args.preset} shape, random weights, {device_line()}"
    t0 = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {line}", flush=True)

    if args.sweep:

        def save_sweep(rows: list[dict]) -> None:
            (out / "sweep.json").write_text(json.dumps(rows, indent=1))
            (out / "sweep.md").write_text(sweep_markdown(rows, header))

        rows = sweep_rows(cfg, device, timer, args.sweep_budget_s, log, save_sweep, args.dry_run)
        print(sweep_markdown(rows, header), flush=True)
    elif not args.no_gemm:

        def save_gemm(rows: list[dict]) -> None:
            (out / "gemm.json").write_text(json.dumps(rows, indent=1))
            (out / "gemm.md").write_text(gemm_markdown(rows, header))

        rows = gemm_rows(cfg, device, timer, log, save_gemm, args.methods, args.gemm_tokens)
        print(gemm_markdown(rows, header), flush=True)
    if not args.no_steps:
        if args.dry_run:
            from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

            model_dir = write_random_checkpoint(TINY_LLAMA, tempfile.mkdtemp(), "float32")
            shapes, step_timer = ((1, 16), (2, 32)), _wall_time
        else:
            model_dir, shapes, step_timer = checkpoint(args.preset), STEP_SHAPES, cuda_time
            if args.batches:
                shapes = tuple((b, c) for b in args.batches for c in (1024, 4096))
            log(f"checkpoint {model_dir}")

        def save(rows: list[dict]) -> None:
            (out / "steps.json").write_text(json.dumps(rows, indent=1))
            (out / "steps.md").write_text(steps_markdown(rows, header))

        rows = step_rows(model_dir, shapes, device, dtype, step_timer, log, save, args.methods)
        print(steps_markdown(rows, header), flush=True)
    log(f"done: {out}")


def _wall_time(fn, warmup: int = 1, iters: int = 1) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


if __name__ == "__main__":
    main()
