"""The swapped-operand tensor-core kernels (backend/quant_gemv.py, ``small_m_gemm`` for fp8 and
int8, ``small_m_int4_gemm`` for gptq and awq) on a preset's projections at 1-32 tokens (int4:
any number), against bf16 cuBLAS and the paths the engine ran before them; and from 2 tokens
(int4: 32) the weight dequantized, then cuBLAS: ``dequant_int4_matmul`` (gptq, awq and
``gptq-act``, act-order GPTQ with g_idx shuffled), ``dequant_int8_matmul`` (int8, a Triton
kernel) and, for int8, torch's ``weight.to(dtype).mul_(scale)`` ("dequant-torch"). For
int4, the engine's layer too ("layer: PATH", ``QuantLinear.forward`` on the kernel
``gemm_path`` picks; gptq-act reordered at load into group order, x's columns permuted in
each call, the permute timed with it).

    timeout 200 python benchmarks/quant_small_m.py --out results/small_m      # CUDA, 8B shapes
    python benchmarks/quant_small_m.py --dry-run --out /tmp/sm     # CPU interpreter, tiny shapes
    timeout 400 python benchmarks/quant_small_m.py --methods int8 gptq-act gptq \
        --tokens 16 32 64 128 256 512 2048 --sweep-tokens 0 --out DIR    # the dequant A/B
    timeout 300 python benchmarks/quant_small_m.py --methods gptq-act gptq --skip-tiled \
        --tokens 1 2 16 64 128 256 2048 --sweep-tokens 0 --out DIR   # act-order reordered

Per (method, projection, tokens M): bf16 ``x @ W.T``; the path before this kernel ("gemv" for
fp8 and int4 at M = 1, "w8a8" ``_scaled_mm`` with the activation-quantizing kernel above for
fp8, the tiled kernel for int8 and int4); then the new kernel at each config of :func:`grid` (swept at
``--sweep-tokens``; at the other M, the configs that won there) and at the engine's
(``small_m_config``). Each time is one CUDA graph
of back-to-back calls over weight copies beyond the L2, divided by the calls; ``err`` is
max |out - ref| / max |ref| against the float32 dequantized reference (w8a8: its own
reference, activations quantized). ``small_m.json`` and ``small_m.md`` are written after
each method; ``small_m.md`` ends with each path summed over the projections.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def grid(dry_run: bool, method: str = "fp8", m: int = 1) -> list[tuple]:
    """SmallMConfig fields: (block_n, block_k, split_sms, num_warps, num_stages[, min_k_tiles,
    block_m, x_layout]). int4: the x layouts at ``m`` <= 64 on the engine's tiles; above,
    token tiles of 64 and 128 too."""
    int4 = method in ("gptq", "awq")
    if dry_run:
        if int4:
            return [(64, 128, 4, 4, 2), (64, 128, 1, 4, 2), (64, 128, 1, 4, 2, 2, 16, 1),
                    (64, 128, 1, 4, 2, 2, 16, 3)]  # fmt: skip
        return [(64, 64, 4, 4, 2), (64, 128, 1, 4, 2)]
    if int4 and m <= 64:  # K tiles of one group of 128
        return [(128, 128, 2 if m <= 16 else 1, 4, 3, 2, 64, x) for x in (0, 1, 3)]
    if int4:
        return [
            (128, 128, 1, 4, 3, 2, 64, 0), (128, 128, 1, 4, 3, 2, 64, 1),
            (128, 128, 1, 4, 3, 2, 64, 3),
            (128, 128, 1, 8, 3, 2, 64, 3), (128, 128, 1, 8, 3, 2, 128, 3),
            (128, 128, 1, 4, 4, 2, 64, 3), (256, 128, 1, 8, 3, 2, 64, 3),
            (64, 128, 1, 4, 3, 2, 128, 3), (64, 128, 1, 4, 3, 2, 64, 3),
        ]  # fmt: skip
    out = []
    for bn, bk, w, st, splits in (
        (32, 256, 4, 3, (1, 2, 4)), (32, 128, 4, 4, (1, 2)), (32, 128, 4, 5, (2,)),
        (32, 256, 4, 4, (2,)), (32, 256, 8, 3, (2,)), (32, 512, 4, 3, (2,)),
        (16, 256, 4, 3, (2,)), (16, 256, 2, 4, (2,)), (16, 512, 2, 3, (2,)),
        (64, 128, 4, 3, (2,)),
    ):  # fmt: skip
        out += [(bn, bk, sp, w, st) for sp in splits]
    return out


def wall_time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=[1, 16],
                    help="the M at which every config of the grid runs")  # fmt: skip
    ap.add_argument("--methods", nargs="+", default=["fp8", "int8"],
                    choices=["fp8", "int8", "gptq", "awq", "gptq-act"],
                    help="gptq-act: act-order GPTQ, g_idx shuffled")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping configs after")
    ap.add_argument("--skip-tiled", action="store_true",
                    help="leave out the tiled kernel's rows (the slowest for act-order)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    from sched_lab.backend import quant_kernels as qk
    from sched_lab.backend.quant_formats import QuantSpec, quantize_weight, repack_awq
    from sched_lab.backend.quant_gemv import (
        SmallMConfig,
        dequant_int4_matmul,
        dequant_int8_matmul,
        quant_gemv,
        small_m_config,
        small_m_gemm,
        small_m_int4_gemm,
        small_m_supported,
    )
    from sched_lab.backend.quant_linear import QuantLinear

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
    tokens = sorted(args.tokens)

    def save() -> None:
        (out_dir / "small_m.json").write_text(
            json.dumps({"device": header, "preset": args.preset, "rows": rows}, indent=1)
        )
        (out_dir / "small_m.md").write_text(markdown(rows, header, args.preset))

    def record(method, proj, k, n, m, path, fn, want, size, config=None, engine=False):
        try:
            out = fn()
        except Exception as e:
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            print(f"{method} {proj} M={m} {path}: {type(e).__name__}: {msg}", flush=True)
            return None
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        sec = timer(fn) / fn.calls
        row = {"method": method, "projection": proj, "K": k, "N": n, "tokens": m,
               "path": path, "config": config, "engine": engine, "us": sec * 1e6,
               "bytes": size, "err": err}  # fmt: skip
        rows.append(row)
        print(f"{method:5s} {proj:8s} M={m:2d} {path:28s} {sec * 1e6:8.1f} us "
              f"{size / sec / 1e9:7.0f} GB/s err {err:.1e}", flush=True)  # fmt: skip
        return row

    class Calls:
        """One call per weight copy; returns the first call's output."""

        def __init__(self, f, copies):
            self.f, self.copies, self.calls = f, copies, len(copies)

        def __call__(self):
            outs = [self.f(c) for c in self.copies]
            return outs[0]

    for proj, (k, n) in projections(cfg).items():
        gen = torch.Generator(device=device).manual_seed(0)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        xs = {m: torch.randn(m, k, device=device, dtype=dense.dtype, generator=gen)
              for m in tokens}  # fmt: skip
        copies = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)] \
            if device == "cuda" else [dense]  # fmt: skip
        for m in tokens:
            want = xs[m].float() @ dense.float().t()
            record("bf16", proj, k, n, m, "cublas",
                   Calls(lambda w, x=xs[m]: x @ w.t(), copies), want, dense.numel() * 2)  # fmt: skip
        del copies
        for method in args.methods:
            act = method == "gptq-act"  # act-order GPTQ: the groups' rows shuffled
            spec = QuantSpec("gptq", act_order=True) if act else QuantSpec(method)
            int4 = method in ("gptq", "awq", "gptq-act")
            t = quantize_weight(dense, QuantSpec("gptq") if act else spec)
            t = repack_awq(t) if method == "awq" else t
            if act:
                order = torch.randperm(k, generator=gen, device=device)
                t["g_idx"] = t["g_idx"][order].contiguous()
            size = sum(v.numel() * v.element_size() for v in t.values())
            extra = _copies(size) - 1 if device == "cuda" else 0
            wc = [t] + [{a: v.clone() for a, v in t.items()} for _ in range(extra)]
            if int4:
                ref = qk.dequantize(t, spec).float().t()
            else:
                ref = (t["weight"].float() * t["weight_scale"]).t()
            layers = []  # the engine's layer over each copy (act-order: reordered here)
            for tt in wc if int4 else []:
                layer = QuantLinear(k, n, False, spec)
                for a, v in tt.items():
                    setattr(layer, a, v)
                layer.repack_for_kernels()
                layers.append(layer)
            best: dict[int, tuple] = {}
            for m in tokens:
                x = xs[m]
                want = x.float() @ ref
                if method == "fp8" and m > 1:
                    fn = Calls(lambda tt, x=x: qk.fp8_gemm(x, tt["weight"], tt["weight_scale"]), wc)
                    w8 = qk.fp8_reference(x.float(), t["weight"], t["weight_scale"])
                    record(method, proj, k, n, m, "before: w8a8", fn, w8.float(), size)
                elif m == 1 and method in ("fp8", "gptq", "awq"):
                    fn = Calls(lambda tt, x=x, q=spec, nn=n: quant_gemv(x, tt, q, nn), wc)
                    record(method, proj, k, n, m, "before: gemv", fn, want, size)
                elif not args.skip_tiled:
                    fn = Calls(lambda tt, x=x, q=spec, nn=n: qk.weight_only_gemm(x, tt, q, nn), wc)
                    record(method, proj, k, n, m, "before: tiled", fn, want, size)
                if layers:
                    ly = layers[0]
                    path = "layer: " + ("reordered " if ly.reordered else "") + ly.path(m)
                    fn = Calls(lambda lyr, x=x: lyr(x, kernels=True), layers)
                    record(method, proj, k, n, m, path, fn, want, size)
                if layers and layers[0].input_perm is not None:  # its permute of x alone
                    fn = Calls(lambda lyr, x=x: x.index_select(1, lyr.input_perm), layers)
                    xp = x.index_select(1, layers[0].input_perm).float()
                    record(method, proj, k, n, m, "permute x", fn, xp, m * k * x.element_size())
                if int4 and m >= (1 if act else 32):  # the weight dequantized, then cuBLAS
                    fn = Calls(lambda tt, x=x, q=spec, nn=n: dequant_int4_matmul(x, tt, q, nn), wc)
                    record(method, proj, k, n, m, "dequant+cublas", fn, want, size)
                if method == "int8" and m >= 2:  # the Triton kernel, then torch's two ops
                    fn = Calls(lambda tt, x=x: dequant_int8_matmul(x, tt["weight"],
                                                                   tt["weight_scale"]), wc)  # fmt: skip
                    record(method, proj, k, n, m, "dequant+cublas", fn, want, size)
                    fn = Calls(lambda tt, x=x: x @ tt["weight"].to(x.dtype).mul_(
                        tt["weight_scale"]).t(), wc)  # fmt: skip
                    record(method, proj, k, n, m, "dequant-torch+cublas", fn, want, size)
                if act:  # no small-M kernel for act-order
                    continue
                sweep = m in args.sweep_tokens and time.perf_counter() - t_start < args.budget_s
                configs = grid(args.dry_run, method, m) if sweep else sorted(set(best.values()))
                engine = small_m_config(m, n, k, method)  # always timed
                if engine not in [SmallMConfig(*c) for c in configs]:
                    configs = [*configs, dataclasses.astuple(engine)]
                for c in configs:
                    sc = SmallMConfig(*c)
                    if not small_m_supported(method, m, n, k, sc, spec.group_size):
                        continue
                    if int4:
                        fn = Calls(lambda tt, x=x, sc=sc, q=spec, nn=n: small_m_int4_gemm(
                            x, tt, q, nn, sc), wc)  # fmt: skip
                    else:
                        fn = Calls(lambda tt, x=x, sc=sc, me=method: small_m_gemm(
                            x, tt["weight"], tt["weight_scale"], me, sc), wc)  # fmt: skip
                    record(method, proj, k, n, m, "small_m " + "/".join(map(str, c)), fn,
                           want, size, c, sc == engine)  # fmt: skip
                if sweep:
                    ok = [r for r in rows if (r["method"], r["projection"], r["tokens"])
                          == (method, proj, m) and r["config"] and r["err"] < 1e-2]  # fmt: skip
                    if ok:
                        best[m] = min(ok, key=lambda r: r["us"])["config"]
            del wc, layers
            save()
    save()


def markdown(rows: list[dict], header: str, preset: str) -> str:
    lines = [header, "", f"{preset} projections; us per call (CUDA graphs, weights beyond the L2)",
             "", "| method | projection (K, N) | M | bf16 us | path before | us | small_m best | us | "
             "GB/s | x bf16 | x before |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    bf16 = {(r["projection"], r["tokens"]): r["us"] for r in rows if r["method"] == "bf16"}
    keys = dict.fromkeys((r["method"], r["projection"], r["tokens"]) for r in rows
                         if r["method"] != "bf16")  # fmt: skip
    for meth, proj, m in keys:
        mine = [r for r in rows if (r["method"], r["projection"], r["tokens"]) == (meth, proj, m)]
        before = next((r for r in mine if r["path"].startswith("before")), None)
        ok = [r for r in mine if r["path"].startswith("small_m") and r["err"] < 1e-2]
        if not ok or before is None:
            continue
        b = min(ok, key=lambda r: r["us"])
        base = bf16.get((proj, m), float("nan"))
        lines.append(f"| {meth} | {proj} ({b['K']}, {b['N']}) | {m} | {base:.1f} | "
                     f"{before['path'][8:]} | {before['us']:.1f} | {b['path'][8:]} | {b['us']:.1f} | "
                     f"{b['bytes'] / b['us'] / 1e3:.0f} | {base / b['us']:.2f} | "
                     f"{before['us'] / b['us']:.2f} |")  # fmt: skip
    return "\n".join(lines + summed(rows)) + "\n"


SUMMED = (("before", lambda r: r["path"].startswith("before")),
          ("small_m (engine's)", lambda r: r.get("engine")),
          ("dequant+cublas", lambda r: r["path"] == "dequant+cublas"),
          ("dequant-torch+cublas", lambda r: r["path"] == "dequant-torch+cublas"),
          ("engine layer", lambda r: r["path"].startswith("layer: ")),
          ("of which permute x", lambda r: r["path"] == "permute x"))  # fmt: skip


def summed(rows: list[dict]) -> list[str]:
    """Markdown lines: per method and M, bf16 and each path of SUMMED in us summed over the
    projections ("-": not timed for every projection)."""
    projs = list(dict.fromkeys(r["projection"] for r in rows))

    def total(method: str, m: int, pick) -> str:
        got = {r["projection"]: r["us"] for r in rows
               if (r["method"], r["tokens"]) == (method, m) and pick(r)}  # fmt: skip
        return f"{sum(got.values()):,.1f}" if len(got) == len(projs) else "-"

    lines = ["", f"Summed over the projections ({', '.join(projs)}), us:", "",
             "| method | M | bf16 | " + " | ".join(name for name, _ in SUMMED) + " |",
             "|---|---|---|" + "---|" * len(SUMMED)]  # fmt: skip
    keys = dict.fromkeys((r["method"], r["tokens"]) for r in rows if r["method"] != "bf16")
    for meth, m in keys:
        cells = [total("bf16", m, lambda r: True)] + [total(meth, m, f) for _, f in SUMMED]
        lines.append(f"| {meth} | {m} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
