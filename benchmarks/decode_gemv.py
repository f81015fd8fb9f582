"""The decode GEMV (backend/decode_gemv.py, ``decode_gemv``) on the GPU: GEMMs alone and
whole decode steps, off vs on.

    timeout 420 python benchmarks/decode_gemv.py --out results/decode_gemv     # CUDA (H200)
    python benchmarks/decode_gemv.py --tiny --out /tmp/dg      # CPU interpreter, tiny shapes

Part ``gemm``: per preset (Qwen3-0.6B, Llama-3.1-8B) projection (qkv, o, gate_up, down,
lm_head) and M in 1, 2, 4, 8: bf16 cuBLAS ``F.linear`` and the GEMV at the default tiles and
at each config of :func:`grid`, each a CUDA graph of back-to-back calls over weight copies
beyond the L2, us per call; ``err`` = max |y - ref| / max |ref| (ref: float32). Part
``step``: two runners of the same random weights (decode_gemv off / on), decode graphs,
batch 1, 4, 8 x 1k context: step ms (execute, synced), ratio to the HBM roofline (weights +
KV over the device copy rate), kernels per graph replay (torch.profiler, as
kernels_step.py), max |logit diff| and greedy agreement. Each part runs in its own
subprocess under a timeout; ``decode_gemv.json`` and ``decode_gemv.md`` are written under
--out after each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import astuple
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

PRESETS = ("qwen3-0.6b", "llama-3.1-8b")
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}  # fmt: skip
L2_FLUSH_BYTES = 256 << 20  # weight copies per graph so that they exceed the H200's L2


def grid(tiny: bool) -> list[tuple]:
    """(block_n, block_k, split_sms, num_warps, num_stages) configs of the sweep; block_k
    is the one-row K tile, divided by the padded rows at larger M (as the default's)."""
    if tiny:
        return [(32, 64, 1, 4, 2)]
    return [(16, 512, 2, 4, 2), (16, 512, 4, 4, 2), (32, 256, 2, 4, 2), (32, 256, 4, 4, 2),
            (8, 512, 4, 4, 2), (16, 1024, 2, 4, 2), (16, 1024, 4, 8, 2), (16, 512, 2, 4, 3)]  # fmt: skip


def config_of(preset: str) -> dict:
    from sched_lab.core.model_presets import PRESETS as ALL

    return TINY if preset == "tiny" else ALL[preset]


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of one layer's fused projections and the LM head."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    o = cfg["num_attention_heads"] * head_dim
    return {"qkv": (h, qkv), "o": (o, h), "gate_up": (h, 2 * inter), "down": (inter, h),
            "lm_head": (h, cfg["vocab_size"])}  # fmt: skip


def timer(tiny: bool):
    """fn -> seconds per call: a CUDA graph of fn replayed (CUDA), one eager call (tiny)."""

    def run(fn) -> float:
        if tiny:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        from common import graph_time

        return graph_time(fn)

    return run


# ---------------------------------------------------------------- part 1: GEMMs alone
def part_gemm(tiny: bool, save) -> list[dict]:
    import torch.nn.functional as F

    from sched_lab.backend.decode_gemv import dense_gemv
    from sched_lab.backend.quant_gemv import GemvConfig

    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    time_of = timer(tiny)
    rows = []
    for preset in ("tiny",) if tiny else PRESETS:
        for proj, (k, n) in projections(config_of(preset)).items():
            gen = torch.Generator(device=device).manual_seed(0)
            w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * 0.02
            copies = 1 if tiny else max(1, min(32, -(-L2_FLUSH_BYTES // (w.numel() * 2))))
            ws = [w] + [w.clone() for _ in range(copies - 1)]
            for m in (1, 3) if tiny else (1, 2, 4, 8):
                x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
                ref = x.float() @ w.float().T
                base = {"preset": preset, "projection": proj, "K": k, "N": n, "tokens": m,
                        "weight_MB": w.numel() * w.element_size() / 1e6}  # fmt: skip
                cublas_us = (
                    time_of(lambda x=x, ws=ws: [F.linear(x, wi) for wi in ws]) / copies * 1e6
                )
                rows.append({**base, "path": "cublas", "config": "-", "us": cublas_us, "err": 0.0})
                bm = triton.next_power_of_2(m)  # K tiles cut so rows x N x K stays the same
                configs = [None] + [GemvConfig(bn, max(32, bk // bm), *rest)
                                    for bn, bk, *rest in grid(tiny)]  # fmt: skip
                mine = []
                for c in configs:
                    try:
                        y = dense_gemv(x, w, config=c)[0]
                        err = float((y.float() - ref).abs().max() / ref.abs().max())
                        t = time_of(
                            lambda x=x, c=c, ws=ws: [dense_gemv(x, wi, config=c) for wi in ws]
                        )
                        us = t / copies * 1e6
                    except Exception as e:  # noqa: BLE001 - one config's failure is a row
                        us, err = None, float("nan")
                        print(f"{preset} {proj} M={m} {c}: {e!r}", flush=True)
                    name = "default" if c is None else ",".join(map(str, astuple(c)[:5]))
                    mine.append({**base, "path": "gemv", "config": name, "us": us, "err": err})
                rows += mine
                best = min((r for r in mine if r["us"] is not None), key=lambda r: r["us"],
                           default=None)  # fmt: skip
                if best is not None:
                    print(f"{preset} {proj} M={m}: cublas {cublas_us:.1f} us, gemv best "
                          f"{best['us']:.1f} us ({best['config']})", flush=True)  # fmt: skip
            save(rows)
    return rows


# ---------------------------------------------------------------- part 2: decode steps
def random_runner(preset: str, tiny: bool, decode_gemv: bool, **kwargs):
    """A ModelRunner of ``preset``'s shapes with random weights drawn on the device (seed 0,
    N(0, 0.02), norms 1: the same weights for every call), no checkpoint on disk."""
    import sched_lab.backend.runner as runner_mod
    from sched_lab.backend.model import Transformer
    from sched_lab.backend.rope import rope_table

    def random_model(model_dir, config, backend, device, dtype, max_model_len, *rest):
        with torch.device("meta"):
            model = Transformer(config, backend)
        model = model.to(dtype=dtype).to_empty(device=device)
        gen = torch.Generator(device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.2 if tiny else 0.02, generator=gen)
        model.rope_cos, model.rope_sin = rope_table(config, max_model_len, device)
        return model.eval()

    tmp = Path(tempfile.mkdtemp(prefix="decode_gemv_"))
    (tmp / "config.json").write_text(json.dumps(config_of(preset)))
    saved = runner_mod.load_model
    runner_mod.load_model = random_model
    try:
        return runner_mod.ModelRunner(
            tmp, device="cpu" if tiny else "cuda", dtype="float32" if tiny else "bfloat16",
            attention_backend="triton", block_size=16, swap_space_bytes=0,
            decode_gemv=decode_gemv, **kwargs,
        )  # fmt: skip
    finally:
        runner_mod.load_model = saved


def part_step(tiny: bool, save) -> list[dict]:
    from common import decode_inputs
    from kernels_step import Bench, heads_of, kernels_per_replay

    b = Bench(tiny)
    batches, context = ((1, 3), 40) if tiny else ((1, 4, 8), 1024)
    bw = b.copy_rate()
    rows = []
    for preset in ("tiny",) if tiny else PRESETS:
        cfg = config_of(preset)
        per_seq = -(-(context + 1) // 16)
        opts = dict(max_num_seqs=max(batches), mixed_graphs=False, max_model_len=2 * context,
                    num_gpu_blocks=max(batches) * per_seq + 16, cuda_graphs=True,
                    cuda_graph_sizes=batches)  # fmt: skip
        runners = {name: random_runner(preset, tiny, on, **opts)
                   for name, on in (("off", False), ("gemv", True))}  # fmt: skip
        weights = sum(p.numel() * p.element_size() for p in runners["off"].model.parameters())
        _, kv_heads, head_dim = heads_of(cfg)
        kv_per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * b.dtype.itemsize
        for r in runners.values():  # the same random KV in both
            r.kv_cache.gpu.normal_(generator=torch.Generator(b.device).manual_seed(1))
        for batch in batches:
            seqs = decode_inputs(batch, context)
            logits = [r.execute_logits(seqs) for r in runners.values()]
            diff = max(float((x - y).abs().max()) for x, y in zip(*logits, strict=True))
            agree = sum(int(x.argmax()) == int(y.argmax()) for x, y in zip(*logits, strict=True))
            roof = (weights + batch * context * kv_per_token) / bw
            row = {"preset": preset, "batch": batch, "context": context,
                   "roofline_ms": roof * 1e3, "logits_max_diff": diff,
                   "greedy_agree": f"{agree}/{batch}"}  # fmt: skip
            for _ in range(2):  # A B A B: the better of two
                for name, r in runners.items():
                    t = b.time(lambda r=r, s=seqs: r.execute(s))
                    key = f"{name}_step_ms"
                    row[key] = min(row.get(key, math.inf), t * 1e3)
            for name, r in runners.items():
                kernels, replay = kernels_per_replay(b, r.graphs, seqs)
                row[f"{name}_kernels"] = kernels
                row[f"{name}_replay_ms"] = replay * 1e3
                row[f"{name}_ratio"] = row[f"{name}_step_ms"] / row["roofline_ms"]
            row["speedup"] = row["off_step_ms"] / row["gemv_step_ms"]
            rows.append(row)
            save(rows)
            print(row, flush=True)
        del runners
        if not tiny:
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- report
def markdown(results: dict) -> str:
    lines = [f"# decode GEMV, {results.get('device', '?')}", ""]
    gemm = results.get("gemm") or []
    if gemm:
        lines += ["GEMMs alone (us per call in CUDA graphs, weights beyond the L2; x = cuBLAS us /"
                  " GEMV us; config: block_n, block_k, split_sms, warps, stages)", "",
                  "| preset | projection (K, N) | M | cuBLAS us | GEMV default us | best config |"
                  " best us | x cuBLAS (best) | GB/s (best) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        keys = dict.fromkeys((r["preset"], r["projection"], r["tokens"]) for r in gemm)
        for key in keys:
            mine = [r for r in gemm if (r["preset"], r["projection"], r["tokens"]) == key]
            cub = next(r for r in mine if r["path"] == "cublas")
            ok = [
                r for r in mine if r["path"] == "gemv" and r["us"] is not None and r["err"] < 1e-2
            ]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["us"])
            d = next((r["us"] for r in ok if r["config"] == "default"), math.nan)
            gbs = best["weight_MB"] * 1e6 / (best["us"] * 1e-6) / 1e9
            lines.append(f"| {key[0]} | {key[1]} ({cub['K']}, {cub['N']}) | {key[2]} | "
                         f"{cub['us']:.1f} | {d:.1f} | {best['config']} | {best['us']:.1f} | "
                         f"{cub['us'] / best['us']:.2f} | {gbs:.0f} |")  # fmt: skip
        lines.append("")
    step = results.get("step") or []
    if step:
        lines += ["Decode steps, decode_gemv off vs on (same weights and KV; step = execute, "
                  "synced; ratio = step / HBM roofline; kernels per graph replay)", "",
                  "| preset | batch | context | off ms | gemv ms | speed-up | off ratio | gemv "
                  "ratio | off kernels | gemv kernels | max logit diff | greedy agree |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in step:
            lines.append(f"| {r['preset']} | {r['batch']} | {r['context']} | "
                         f"{r['off_step_ms']:.3f} | {r['gemv_step_ms']:.3f} | {r['speedup']:.2f} | "
                         f"{r['off_ratio']:.2f} | {r['gemv_ratio']:.2f} | {r['off_kernels']} | "
                         f"{r['gemv_kernels']} | {r['logits_max_diff']:.3g} | "
                         f"{r['greedy_agree']} |")  # fmt: skip
    for part, err in results.get("errors", {}).items():
        lines.append(f"\n{part}: {err}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter dry run, tiny shapes")
    ap.add_argument("--parts", nargs="+", default=["gemm", "step"], choices=["gemm", "step"])
    ap.add_argument("--part-timeout", type=float, nargs=2, default=[170, 220],
                    metavar=("GEMM_S", "STEP_S"), help="seconds each part may run")  # fmt: skip
    ap.add_argument("--part", help=argparse.SUPPRESS)  # the subprocess: run this part only
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        path = out / f"{args.part}.json"
        path.unlink(missing_ok=True)
        (part_gemm if args.part == "gemm" else part_step)(
            args.tiny, lambda rows: path.write_text(json.dumps(rows, indent=1))
        )
        return
    from common import device_line

    device = "CPU interpreter (--tiny)" if args.tiny else device_line()
    print(f"# {' '.join(sys.argv)}\n# {device}", flush=True)
    results: dict = {"device": device, "command": " ".join(sys.argv), "errors": {}}
    limits = dict(zip(("gemm", "step"), args.part_timeout, strict=True))
    for part in args.parts:
        cmd = [sys.executable, __file__, "--out", str(out), "--part", part]
        cmd += ["--tiny"] if args.tiny else []
        try:
            rc = subprocess.run(cmd, timeout=limits[part]).returncode
            if rc:
                results["errors"][part] = f"exit status {rc}"
        except subprocess.TimeoutExpired:
            results["errors"][part] = f"timed out after {limits[part]:.0f} s (rows so far kept)"
        path = out / f"{part}.json"
        results[part] = json.loads(path.read_text()) if path.exists() else []
        (out / "decode_gemv.json").write_text(json.dumps(results, indent=1))
        (out / "decode_gemv.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
