"""The quantized GEMV (backend/quant_gemv.py) alone on a preset's projections, against bf16
cuBLAS and the engine's other quantized paths, over a small grid of launch configs.

    timeout 300 python benchmarks/quant_gemv.py --out results/quant_gemv     # CUDA, 8B shapes
    python benchmarks/quant_gemv.py --dry-run --out /tmp/qg     # CPU interpreter, tiny shapes

Per (method, projection, tokens): bf16 ``x @ W.T``; the tiled kernel (int4/int8) or the
streaming kernel (fp8 weight-only), as ``quant_linear`` ran them before the GEMV; then the
GEMV at each config of :func:`grid` (``nib3d``: the int4 nibbles as a (rows, 8, N) tensor
with x loaded as (rows, 8), else a static loop over the 8 nibbles). Each time is one CUDA
graph of back-to-back calls over weight copies beyond the L2, divided by the calls; ``err``
is max |out - ref| / max |ref| against the float32 dequantized reference. ``gemv.json`` and
``gemv.md`` (best config per shape, x bf16, x the old path, GB/s of stored weight bytes) are
written after each method.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from common import device_line, graph_time  # noqa: E402
from quant_decode import TINY_LLAMA, _copies, projections  # noqa: E402

METHODS = ("gptq", "int8", "fp8")


def grid(method: str, dry_run: bool) -> list[tuple]:
    """(block_n, block_k, split_sms, num_warps, num_stages, nib3d) configs."""
    if dry_run:
        return [(32, 64, 1, 4, 2, False), (32, 64, 1, 4, 2, method in ("gptq", "awq"))]
    out = []
    if method in ("gptq", "awq"):
        for nib3d in (False, True):
            for bn, bk in ((64, 128), (128, 128), (128, 64), (256, 64), (32, 128)):
                for sp in (2, 4, 8):
                    out.append((bn, bk, sp, 4, 2, nib3d))
        out += [(128, 128, 4, 8, 2, False), (128, 128, 4, 4, 3, False), (64, 128, 4, 2, 2, False)]
    else:
        for bn, bk in ((32, 256), (16, 512), (64, 128), (16, 256), (8, 512)):
            for sp in (2, 4, 8):
                out.append((bn, bk, sp, 4, 2, False))
        out += [(32, 256, 4, 8, 2, False), (32, 256, 4, 4, 3, False), (16, 512, 4, 2, 2, False)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting configs after")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    from sched_lab.backend import quant_gemv as qg
    from sched_lab.backend import quant_kernels as qk
    from sched_lab.backend.quant_formats import QuantSpec, quantize_weight

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        cfg, timer = TINY_LLAMA, wall_time
    else:
        from sched_lab.core.model_presets import PRESETS

        cfg, timer = PRESETS[args.preset], graph_time
    header = device_line() if not args.dry_run else "CPU interpreter (dry run)"
    rows: list[dict] = []
    t_start = time.perf_counter()

    def save() -> None:
        (out_dir / "gemv.json").write_text(json.dumps({"device": header, "rows": rows}, indent=1))
        (out_dir / "gemv.md").write_text(markdown(rows, header))

    for proj, (k, n) in projections(cfg).items():
        gen = torch.Generator(device=device).manual_seed(0)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        xs = {m: torch.randn(m, k, device=device, dtype=dense.dtype, generator=gen)
              for m in args.tokens}  # fmt: skip
        copies = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)] \
            if device == "cuda" else [dense]  # fmt: skip
        for m in args.tokens:
            sec = timer(lambda c=copies, x=xs[m]: [x @ w.t() for w in c]) / len(copies)
            rows.append({"method": "bf16", "projection": proj, "K": k, "N": n, "tokens": m,
                         "path": "cublas", "us": sec * 1e6, "bytes": dense.numel() * 2,
                         "err": 0.0})  # fmt: skip
        del copies
        for method in args.methods:
            spec = QuantSpec(method)
            tensors = quantize_weight(dense, spec)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            extra = _copies(size) - 1 if device == "cuda" else 0
            wc = [tensors] + [{a: t.clone() for a, t in tensors.items()} for _ in range(extra)]
            ref = qk.dequantize(tensors, spec).t()
            for m in args.tokens:
                x = xs[m]
                want = x.float() @ ref
                old = qk.weight_streaming_gemm if method == "fp8" else qk.weight_only_gemm
                paths = [("old", None, old)]
                for c in grid(method, args.dry_run):
                    if time.perf_counter() - t_start > args.budget_s:
                        break
                    gc = qg.GemvConfig(*c)
                    paths.append(
                        (
                            f"gemv n{c[0]} k{c[1]} sp{c[2]} w{c[3]} s{c[4]}"
                            + (" 3d" if c[5] else ""),
                            c,
                            lambda x, t, q, nn, gc=gc: qg.quant_gemv(x, t, q, nn, gc),
                        )
                    )
                for name, c, fn in paths:
                    try:
                        out = fn(x, wc[0], spec, n)
                    except Exception as e:
                        print(
                            f"{method} {proj} M={m} {name}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:160] if str(e) else ''}",
                            flush=True,
                        )
                        continue
                    err = ((out.float() - want).abs().max() / want.abs().max()).item()
                    calls = [lambda t=t, f=fn, x=x, q=spec, nn=n: f(x, t, q, nn) for t in wc]
                    sec = timer(lambda cs=calls: [f() for f in cs]) / len(calls)
                    rows.append({"method": method, "projection": proj, "K": k, "N": n,
                                 "tokens": m, "path": name, "config": c, "us": sec * 1e6,
                                 "bytes": size, "err": err})  # fmt: skip
                    print(
                        f"{method:5s} {proj:8s} M={m} {name:32s} {sec * 1e6:8.1f} us "
                        f"{size / sec / 1e9:7.0f} GB/s err {err:.1e}",
                        flush=True,
                    )
            del wc
            save()
    save()


def wall_time(fn) -> float:
    """Seconds of one call of ``fn`` (the dry run's timer: no CUDA graphs on the CPU)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| method | projection (K, N) | M | bf16 us | old path us | best GEMV | "
             "us | GB/s | x bf16 | x old |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    bf16 = {(r["projection"], r["tokens"]): r["us"] for r in rows if r["method"] == "bf16"}
    keys = dict.fromkeys((r["method"], r["projection"], r["tokens"]) for r in rows
                         if r["method"] != "bf16")  # fmt: skip
    for meth, proj, m in keys:
        mine = [r for r in rows if (r["method"], r["projection"], r["tokens"]) == (meth, proj, m)]
        old = next((r for r in mine if r["path"] == "old"), None)
        ok = [r for r in mine if r["path"] != "old" and r["err"] < 1e-2]
        if not ok or old is None:
            continue
        b = min(ok, key=lambda r: r["us"])
        base = bf16.get((proj, m), float("nan"))
        lines.append(f"| {meth} | {proj} ({b['K']}, {b['N']}) | {m} | {base:.1f} | {old['us']:.1f} "
                     f"| {b['path']} | {b['us']:.1f} | {b['bytes'] / b['us'] / 1e3:.0f} | "
                     f"{base / b['us']:.2f} | {old['us'] / b['us']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
