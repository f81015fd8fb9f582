"""The exp2 paged prefill kernel (engine.triton_prefill_kernel: exp2;
backend/attention/prefill_exp2.py) against the base kernel and the torch reference, on the CPU
under TRITON_INTERPRET=1 (compiled on a GPU); the option's checks and fingerprint."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import DEVICE, HAS_CUDA, QWEN3_TINY, batch, needs_triton  # noqa: F401  (first: sets TRITON_INTERPRET)

from sched_lab.backend.attention import get_attention_backend  # noqa: E402
from sched_lab.backend.inputs import SeqInput, prepare_inputs  # noqa: E402
from sched_lab.backend.profile import engine_fingerprint  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402

pytestmark = needs_triton


# Key tiles are 64 positions, query tiles 64 rows: a 200-token prompt (4 query tiles, the
# later ones with 1-2 unmasked key tiles), a 70-token chunk over a 150-token prefix (every
# key tile below 150 unmasked), a 20-token chunk over 7, a decode, a 64-token prompt (one
# tile, exactly one key tile: the diagonal), a 65-token chunk over 63.
SPECS = [(0, 200), (150, 70), (7, 20), (90, 1), (0, 64), (63, 65)]


def attend(seqs, heads, kv_heads, head_dim, block_size, num_blocks, dtype, kv_dtype=None,
           seed=0):  # fmt: skip
    """Outputs of the torch backend, the triton backend's base kernel and its exp2 kernel
    for random q/k/v fed as ``seqs`` over identical random caches."""
    gen = torch.Generator().manual_seed(seed)
    meta = prepare_inputs(seqs, block_size, num_blocks, 1 << 20, 1 << 30, DEVICE).attn
    tokens = meta.query_start_loc[-1].item()

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = rand(tokens, heads, head_dim)
    kv = rand(tokens, 2, kv_heads, head_dim)
    caches = rand(2, num_blocks, block_size, kv_heads, head_dim)
    if kv_dtype is not None:
        caches = caches.to(kv_dtype)
    out = {}
    for name, kernel in (("torch", None), ("triton", "base"), ("triton", "exp2")):
        backend = get_attention_backend(name, DEVICE, dtype, block_size)
        if kv_dtype is not None:
            backend.set_kv_cache_dtype(kv_dtype)
        if kernel is not None:
            backend.set_prefill_kernel(kernel)
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        o = backend.forward(q, kv[:, 0], kv[:, 1], k_cache, v_cache, meta, head_dim**-0.5)
        out[kernel or name] = o
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 1, 24)])
def test_exp2_kernel_matches_the_base_kernel_and_the_reference(heads, kv_heads, head_dim):
    out = attend(batch(SPECS, 4, 256), heads, kv_heads, head_dim, 4, 256, torch.float32)
    torch.testing.assert_close(out["exp2"], out["base"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["exp2"], out["torch"], atol=1e-5, rtol=1e-5)
    assert not torch.equal(out["exp2"], torch.zeros_like(out["exp2"]))


def test_exp2_kernel_reads_an_fp8_cache_as_the_base_kernel_does():
    out = attend(batch(SPECS, 16, 64), 4, 2, 16, 16, 64, torch.float32,
                 kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    torch.testing.assert_close(out["exp2"], out["base"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["exp2"], out["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_exp2_kernel_on_llama_8b_heads_in_bf16():
    specs = [(0, 1000), (700, 333), (0, 64), (129, 1)]
    out = attend(batch(specs, 16, 256), 32, 8, 128, 16, 256, torch.bfloat16)
    # both kernels round float32 sums to bf16 once: at most a bf16 ulp apart (|out| < 4)
    torch.testing.assert_close(out["exp2"], out["base"], atol=2e-2, rtol=1e-2)


def test_the_option_is_refused_by_other_backends_and_unknown_kernels_in_one_line():
    torch_backend = get_attention_backend("torch", DEVICE, torch.float32, 4)
    torch_backend.set_prefill_kernel("base")  # the default: accepted everywhere
    with pytest.raises(ConfigError, match="triton_prefill_kernel 'exp2' needs the 'triton'"):
        torch_backend.set_prefill_kernel("exp2")
    triton_backend = get_attention_backend("triton", DEVICE, torch.float32, 4)
    with pytest.raises(ConfigError, match=r"must be one of base, exp2; got 'exp3'"):
        triton_backend.set_prefill_kernel("exp3")


def test_runner_with_exp2_gives_the_base_logits_and_names_the_option(tmp_path, monkeypatch):
    from sched_lab.backend.attention import prefill_exp2

    calls = []  # the exp2 kernel's launches (one a layer of a prefill step)
    kernel = prefill_exp2.prefill_attention
    monkeypatch.setattr(prefill_exp2, "prefill_attention",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))  # fmt: skip
    write_random_checkpoint(QWEN3_TINY, tmp_path, dtype="float32", std=0.2)
    a = list(range(0, 24))  # a block table of 4-token blocks
    # a 70-token prompt (its second query tile sees key tile 0 unmasked), then a decode
    steps = [[SeqInput(list(range(70)), 0, a, True)], [SeqInput([5], 70, a, True)]]
    logits, prints = {}, {}
    for name in ("base", "exp2"):
        runner = ModelRunner(tmp_path, device=str(DEVICE), attention_backend="triton",
                             block_size=4, num_gpu_blocks=96, swap_space_bytes=0,
                             cuda_graphs=False,  # (captures would launch it too)
                             triton_prefill_kernel=name)  # fmt: skip
        logits[name] = [x for s in steps for x in runner.execute_logits(s) if x is not None]
        prints[name] = engine_fingerprint(runner)
        assert len(calls) == (0 if name == "base" else QWEN3_TINY["num_hidden_layers"])
    assert len(logits["exp2"]) == 2  # the sampled rows
    for got, ref in zip(logits["exp2"], logits["base"], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert "backend_sources_prefill_exp2" not in prints["base"]
    assert "triton_prefill_kernel" not in prints["base"]["options"]
    assert prints["exp2"]["options"]["triton_prefill_kernel"] == "exp2"
    assert prints["exp2"]["backend_sources"] == prints["base"]["backend_sources"]
    assert len(prints["exp2"]["backend_sources_prefill_exp2"]) == 64
