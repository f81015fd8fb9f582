"""Compile the weight-streaming quantized-GEMM kernel for a GPU target on a machine without
one, for its launches on a preset's projections, and print what ptxas and the SASS say.

    python benchmarks/quant_compile_check.py                     # Hopper (sm_90), 8B shapes
    python benchmarks/quant_compile_check.py --arch 100 --tokens 1 32

The engine no longer runs this kernel (quant_linear.gemm_path);
every method's streaming launch at M <= ``STREAM_MAX_M`` (``stream_plan``'s, for
benchmarks/quant_decode.py's A/B) is compiled. Per launch (weights, projection, tokens): the plan (tiles, splits, warps), registers per
thread, stack (spills), and the global loads in the SASS by width (``LDG.E.128`` are 16-byte
loads; many ``LDG.E`` / ``.U16`` mean element-by-element loads) and ``I2F`` conversions (a
slow instruction). Launches the same kernel build serves are printed once. Arguments
divisible by 16 are marked so, as Triton's runtime specializes them; pointers are assumed
16-byte aligned (torch allocations are). Needs Triton's bundled ptxas / nvdisasm; uses
Triton's ``ASTSource`` (an internal API).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sched_lab.backend import quant_kernels as qk  # noqa: E402
from sched_lab.backend.quant_formats import QuantSpec  # noqa: E402

POINTERS = {  # method -> (QW, QZ, S, GIDX) element types as Triton names them
    "awq": ("i32", "i32", "fp16", "i32"),
    "gptq": ("i32", "i32", "fp16", "i32"),
    "int8": ("i8", "i8", "fp32", "i8"),
    "fp8": ("u8", "u8", "fp32", "u8"),
}


def projections(preset: str) -> dict[str, tuple[int, int]]:
    from sched_lab.core.model_presets import PRESETS

    cfg = PRESETS[preset]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    o = cfg["num_attention_heads"] * head_dim
    return {"qkv": (h, qkv), "o": (o, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def compile_plan(method: str, m: int, k: int, n: int, plan: qk.GemmPlan, arch: int):
    """The compiled kernel of one launch (bf16 activations)."""
    spec = QuantSpec(method)
    qw, qz, s, g = POINTERS[method]
    names = qk._wq_gemm_kernel.arg_names
    ints = {"M": m, "N": n, "K": k, "stride_xm": k, "stride_om": n,
            "stride_qw0": n // 8 if method == "awq" else (n if method == "gptq" else k),
            "stride_qz0": n // 8, "stride_s0": n, "K_PER_SPLIT": plan.k_per_split,
            "NUM_SPLITS": plan.splits}  # fmt: skip
    signature = {"X": "*bf16", "QW": f"*{qw}", "QZ": f"*{qz}", "S": f"*{s}", "GIDX": f"*{g}",
                 "Out": "*bf16", "WS": "*fp32", "CNT": "*i32"}  # fmt: skip
    signature.update({name: "i32" for name in ints})
    constants = qk.kernel_constants(spec, k, torch.bfloat16, plan)
    constants["F32_DOT"] = False
    signature.update({name: "constexpr" for name in constants})
    aligned = [name for name in signature if signature[name].startswith("*")]
    aligned += [name for name, v in ints.items() if v % 16 == 0]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(qk._wq_gemm_kernel, signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": plan.num_warps}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def sass_summary(kernel) -> str:
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([bindir / "cuobjdump", "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout  # fmt: skip
        sass = subprocess.run([bindir / "nvdisasm", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    loads = Counter(re.findall(r"\bLDG\.E[\.\w]*", sass))
    i2f = len(re.findall(r"\bI2F", sass))
    loads_text = " ".join(f"{op} {c}" for op, c in sorted(loads.items()))
    return f"regs {regs.group(1)} stack {regs.group(2)} | {loads_text} | I2F {i2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    ap.add_argument("--sms", type=int, default=132, help="SMs the plans assume (H100/H200)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    ap.add_argument("--methods", nargs="+", default=list(POINTERS))
    args = ap.parse_args()
    seen: dict[tuple, str] = {}
    for method in args.methods:
        for proj, (k, n) in projections(args.preset).items():
            for m in args.tokens:
                if m > qk.STREAM_MAX_M:  # the tiled kernel and _scaled_mm are not compiled here
                    continue
                plan = qk.stream_plan(m, n, k, QuantSpec(method), args.sms)
                key = (method, plan.block_m, plan.block_n, plan.block_k, plan.splits > 1,
                       plan.num_warps, k % 16 == 0, n % 16 == 0)  # fmt: skip
                if key not in seen:
                    try:
                        seen[key] = sass_summary(compile_plan(method, m, k, n, plan, args.arch))
                    except Exception as e:  # report every launch, not just the first failure
                        seen[key] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"{method:5s} {proj:8s} M={m:<4d} stream tiles {plan.block_m}x"
                      f"{plan.block_n}x{plan.block_k} splits {plan.splits:2d} warps "
                      f"{plan.num_warps} | {seen[key]}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
