"""The Triton paged-attention backend against the torch reference.

Without CUDA the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set by
tests/triton_setup.py before triton is first imported. With CUDA the
same small cases run compiled on the GPU, and the ``gpu``-marked cases add realistic shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import DEVICE, HAS_CUDA, QWEN3_TINY, batch, interpreting, needs_triton, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

from sched_lab.backend.attention import get_attention_backend  # noqa: E402
from sched_lab.backend.inputs import SeqInput, prepare_inputs  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402

pytestmark = needs_triton


def run_both(seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed=0):
    """Feed random q/k/v for ``seqs`` to both backends over identical caches; return both."""
    gen = torch.Generator().manual_seed(seed)
    meta = prepare_inputs(seqs, block_size, num_blocks, 1 << 20, 1 << 30, DEVICE).attn
    tokens = meta.query_start_loc[-1].item()

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = rand(tokens, num_heads, head_dim)
    kv = rand(tokens, 2, num_kv_heads, head_dim)  # k and v as strided views, as in the model
    k, v = kv[:, 0], kv[:, 1]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = rand(2, *cache_shape)  # cached prefixes hold random KV
    results = {}
    for name in ("torch", "triton"):
        backend = get_attention_backend(name, DEVICE, dtype, block_size)
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
        results[name] = (out, k_cache, v_cache)
    return results


def assert_backends_agree(results, atol, rtol):
    ref_out, ref_k, ref_v = results["torch"]
    out, k_cache, v_cache = results["triton"]
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # stores are exact copies
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)


# a chunk over a prefix, a decode over 3 key tiles, a 70-token prefill (2 query tiles),
# a first token (1-token context), a short chunk over a long prefix
SMALL_BATCH = batch([(7, 20), (150, 1), (0, 70), (0, 1), (61, 5)], block_size=4, num_blocks=128)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (4, 4, 24), (6, 1, 32)]
)
def test_small_batch_matches_reference(num_heads, num_kv_heads, head_dim):
    results = run_both(
        SMALL_BATCH,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size=4,
        num_blocks=128,
        dtype=torch.float32,
    )
    assert_backends_agree(results, atol=1e-5, rtol=1e-5)


def test_block_size_16_decode_only():
    seqs = batch([(0, 1), (15, 1), (16, 1), (80, 1), (64, 1)], block_size=16, num_blocks=64)
    results = run_both(seqs, 4, 2, 16, block_size=16, num_blocks=64, dtype=torch.float32)
    assert_backends_agree(results, atol=1e-5, rtol=1e-5)


def test_runner_tokens_match_torch_backend(tmp_path):
    write_random_checkpoint(QWEN3_TINY, tmp_path, dtype="float32", std=0.2)
    a, b = [5, 60, 7, 33, 2, 41, 19, 50], [8, 1, 63, 12, 30, 44, 9, 27]  # block tables
    steps = [
        [SeqInput(list(range(30)), 0, a, True), SeqInput(list(range(9, 20)), 0, b, False)],
        [SeqInput([5], 30, a, True), SeqInput(list(range(40, 50)), 11, b, True)],
        [SeqInput([6], 31, a, True), SeqInput([7], 21, b, True)],
    ]
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tmp_path, device=str(DEVICE), attention_backend=backend, block_size=4, num_gpu_blocks=64,
                             swap_space_bytes=0)  # fmt: skip
        logits[backend] = [
            x for step in steps for x in runner.execute_logits(step) if x is not None
        ]
    for got, ref in zip(logits["triton"], logits["torch"], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


AOT_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sched_lab.backend import triton_ops as ops
from sched_lab.backend.attention import prefill_exp2 as pe
from sched_lab.backend.attention import triton_kernels as tk

dtype = sys.argv[1]
ptr = "*" + dtype
precision = "ieee" if dtype == "fp32" else "tf32"
attn = dict(Q=ptr, KCache=ptr, VCache=ptr, Out=ptr, BlockTables="*i32", QueryStartLoc="*i32",
            SeqLens="*i32", Work="*i32", Tiles="*i32", scale="fp32", PartialOut="*fp32",
            PartialLse="*fp32", Counters="*i32", k_scale="fp32", v_scale="fp32", qk_scale="fp32")
fp8 = dict(attn, KCache="*fp8e4nv", VCache="*fp8e4nv")  # kv_cache.dtype: fp8
dims = dict(GROUP=4, BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_N=64)
store = dict(K=ptr, V=ptr, KCache=ptr, VCache=ptr, SlotMapping="*i64", k_scale="fp32",
             v_scale="fp32")
store_dims = dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_P=8, HEAD_DIM_P=128)
kernels = [
    (tk._store_kv_kernel, store, dict(store_dims, KV_FP8=False)),
    (tk._store_kv_kernel, dict(store, KCache="*fp8e4nv", VCache="*fp8e4nv"),
     dict(store_dims, KV_FP8=True)),
    (tk._prefill_kernel, attn, dict(dims, BLOCK_M=64, DOT_PRECISION=precision, KV_FP8=False)),
    (tk._prefill_kernel, fp8, dict(dims, BLOCK_M=64, DOT_PRECISION=precision, KV_FP8=True)),
    (pe._prefill_exp2_kernel, attn, dict(dims, BLOCK_M=64, DOT_PRECISION=precision,
                                         KV_FP8=False)),
    (pe._prefill_exp2_kernel, fp8, dict(dims, BLOCK_M=64, DOT_PRECISION=precision,
                                        KV_FP8=True)),
    (tk._decode_reduce_kernel, dict(PartialOut="*fp32", PartialLse="*fp32", Out=ptr,
                                    QueryStartLoc="*i32", Work="*i32", WorkLoc="*i32"),
     dict(HEAD_DIM=128, HEAD_DIM_P=128, MERGE_BLOCK=16)),
    (tk._decode_kernel, attn, dict(dims, GROUP_P=16, DOT_PRECISION=precision, FUSED_MERGE=True,
                                   KV_FP8=False)),
    (tk._decode_kernel, attn, dict(dims, GROUP_P=16, DOT_PRECISION=precision, FUSED_MERGE=False,
                                   KV_FP8=False)),
    (tk._decode_kernel, fp8, dict(dims, GROUP_P=16, DOT_PRECISION=precision, FUSED_MERGE=True,
                                  KV_FP8=True)),
    (tk._decode_work_kernel, dict(SeqLens="*i32", DecodeIdx="*i32", Work="*i32",
                                  WorkLoc="*i32"), dict(TILE=64, ROWS_P=256, BLOCK=32)),
    (ops._rms_norm_kernel, dict(X=ptr, Residual=ptr, ResidualOut=ptr, W=ptr, Out=ptr, eps="fp32"),
     dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True)),
    (ops._silu_and_mul_kernel, dict(X=ptr, Out=ptr), dict(INTER=14336, BLOCK=1024)),
]
for qk_norm, cache in ((True, ptr), (False, ptr), (True, "*fp8e4nv")):
    kernels.append((ops._qkv_prepare_kernel,
                    dict(QKV=ptr, QOut=ptr, KCache=cache, VCache=cache, SlotMapping="*i64",
                         Cos="*fp32", Sin="*fp32", QNormW=ptr, KNormW=ptr, eps="fp32",
                         k_scale="fp32", v_scale="fp32"),
                    dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_P=32, KV_HEADS_P=8,
                         HALF_P=64, QK_NORM=qk_norm, K_IN_PLACE=qk_norm,
                         KV_FP8=cache != ptr)))
for fn, types, consts in kernels:
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_kernels_compile_for_h200_without_a_gpu(tmp_path):
    # Triton ships ptxas, so the kernels compile for sm_90 (H100/H200) on any machine; this
    # catches what the interpreter cannot (types, layouts, shared memory) before the GPU run.
    # bf16 only, the engine's GPU dtype (fp16 and fp32 compile too, fp32 takes ~15 s).
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the checkout first, then the caller's path (a `pip install --target` copy of sched_lab
    # is found only through it)
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT, "bf16"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_realistic_shapes_on_gpu(dtype):
    # Llama-3.1-8B attention shapes: 32 query heads, 8 kv heads, head_dim 128, block_size 16.
    seqs = batch(
        [(0, 1000), (1500, 300), (3000, 1), (777, 1), (0, 1), (16, 513), (4095, 1)], 16, 4096
    )
    results = run_both(seqs, 32, 8, 128, block_size=16, num_blocks=4096, dtype=dtype)
    assert_backends_agree(results, atol=2e-2, rtol=2e-2)
