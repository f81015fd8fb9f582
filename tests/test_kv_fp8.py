"""The FP8 KV cache (``kv_cache.dtype: fp8``): config, simulator capacity and cost, and the
engine's write and read paths (torch reference and Triton kernels; on CPU the kernels run
under TRITON_INTERPRET=1, tests/triton_setup.py)."""

from __future__ import annotations

import json

import pytest

import run_experiment
from sched_lab.config import validate
from sched_lab.core.errors import ConfigError
from sched_lab.setup.sim import sim_parts
from sched_lab.sim.calibrated import CalibratedCostModel, kv_bytes_ratio, profile_kv_dtype
from sched_lab.sim.cost_model import AnalyticCostModel, num_cpu_blocks, num_gpu_blocks
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS, with_kv_dtype
from sched_lab.traces.readers import parse_yaml

SYNTHETIC = (
    "{format: synthetic, num_requests: 5, arrival: {process: poisson, rate: 1}, "
    "prompt_len: 10, output_len: 5}"
)
MiB = 1 << 20


def config(kv_cache: dict, **extra):
    raw = {"trace": parse_yaml(SYNTHETIC), "model": "llama-3.1-8b", "kv_cache": kv_cache}
    return validate({**raw, **extra})


# ---------------------------------------------------------------------------- config
def test_dtype_defaults_to_auto_and_takes_fp8_and_its_alias():
    assert config({}).kv_cache.dtype == "auto"
    assert config({"dtype": "fp8"}).kv_cache.dtype == "fp8"
    assert config({"dtype": "fp8_e4m3"}).kv_cache.dtype == "fp8"  # the alias, read as fp8


def test_a_bad_dtype_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as e:
        config({"dtype": "int8"})
    msg = str(e.value)
    assert "\n" not in msg and "kv_cache.dtype" in msg
    assert "auto, fp8, fp8_e4m3" in msg and "'int8'" in msg


# ---------------------------------------------------------------------------- simulator
def test_fp8_doubles_the_8b_blocks_on_an_h200():
    """Llama-3.1-8B on an H200 at gpu_memory_utilization 0.9, 8,192 tokens and 256
    sequences a step: 141e9 * 0.9 = 126.9e9 bytes, less 16,060,522,496 of bf16 weights and
    869,531,648 of activations ((4 * 4096 + 2 * 14336) * 2 * 8192 + 256 * 128256 * 4) leaves
    109,969,945,856 bytes. A token's KV is 2 * 32 layers * 8 heads * 128 = 65,536 elements:
    131,072 bytes in bf16, 65,536 in fp8, so a 16-token block is 2 MiB or 1 MiB:
    floor(109,969,945,856 / 2 MiB) = 52,437 and / 1 MiB = 104,875 blocks. The simulator's
    default step of 2,048 tokens reserves 315,883,520 bytes of activations instead, leaving
    110,523,593,984: 52,701 and 105,403 blocks (docs/quantization.md, the quantized_8b sweep)."""
    model, hw = MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"]
    fp8 = with_kv_dtype(model, "fp8")
    assert (model.kv_bytes_per_token, fp8.kv_bytes_per_token) == (131_072, 65_536)
    assert num_gpu_blocks(model, hw, 16, 0.9, 8192, 256) == 52_437
    assert num_gpu_blocks(fp8, hw, 16, 0.9, 8192, 256) == 104_875
    assert num_gpu_blocks(model, hw, 16, 0.9, 2048, 256) == 52_701
    assert num_gpu_blocks(fp8, hw, 16, 0.9, 2048, 256) == 105_403
    # 4 GiB of swap space: 2,048 bf16 blocks of 2 MiB, 4,096 fp8 ones
    assert (num_cpu_blocks(model, 16, 4.0), num_cpu_blocks(fp8, 16, 4.0)) == (2048, 4096)
    assert with_kv_dtype(model, "auto") is model and fp8.weight_bytes == model.weight_bytes


def test_sim_setup_sizes_the_cache_for_its_dtype():
    _, gpu_bf16, cpu_bf16 = sim_parts(config({}))
    _, gpu_fp8, cpu_fp8 = sim_parts(config({"dtype": "fp8"}))
    assert gpu_fp8 in (2 * gpu_bf16, 2 * gpu_bf16 + 1)  # floor of twice the same quotient
    assert cpu_fp8 == 2 * cpu_bf16


def test_analytic_decode_reads_half_the_kv_bytes():
    """A decode-only step of 64 sequences with 4,096 context tokens each, memory bound: its
    bytes are the weights + KV bytes per token * (context + 1 written) per sequence; fp8
    halves the KV part and nothing else."""
    from sched_lab.core.plan import StepFeatures

    model, hw = MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"]
    f = StepFeatures(0, 0, 0, 0.0, 64, 64 * 4096, 64, 0)
    kw = dict(flops_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.0)
    bf16 = AnalyticCostModel(model, hw, **kw).step_time(f, 16)
    fp8 = AnalyticCostModel(with_kv_dtype(model, "fp8"), hw, **kw).step_time(f, 16)
    kv_bytes = 131_072 * 64 * 4097
    assert bf16 == pytest.approx((model.weight_bytes + kv_bytes) / 4.8e12, rel=1e-12)
    assert fp8 == pytest.approx((model.weight_bytes + kv_bytes / 2) / 4.8e12, rel=1e-12)


def test_calibrated_kv_coefficients_follow_the_dtype(tmp_path):
    from pathlib import Path

    profile = Path(__file__).resolve().parents[1] / "profiles" / "h200_llama-3.1-8b.csv"
    assert profile_kv_dtype(profile) == ("auto", 2)  # bf16 model, bf16 KV
    bf16 = CalibratedCostModel(profile)
    fp8 = CalibratedCostModel(profile, kv_cache_dtype="fp8")
    assert (bf16.kv_ratio, fp8.kv_ratio) == (1.0, 0.5)
    assert fp8._dctx == pytest.approx(bf16._dctx / 2, rel=1e-12)
    assert fp8._pctx == pytest.approx(bf16._pctx / 2, rel=1e-12)
    assert fp8._swap_token == pytest.approx(bf16._swap_token / 2, rel=1e-12)
    assert fp8._mean_ctx == bf16._mean_ctx and fp8._tok == bf16._tok  # not bytes: unscaled
    # a profile made with fp8 KV fits its own bytes: used as it is by an fp8 run
    lines = profile.read_text().splitlines(keepends=True)
    lines[1] = lines[1].rstrip("\n") + ", kv_cache_dtype fp8\n"
    own = tmp_path / "fp8.csv"
    own.write_text("".join(lines))
    assert profile_kv_dtype(own) == ("fp8", 2)
    assert CalibratedCostModel(own, kv_cache_dtype="fp8").kv_ratio == 1.0
    assert kv_bytes_ratio("auto", "fp8", 2) == 2.0 and kv_bytes_ratio("fp8", "auto", 4) == 0.25


def test_h200_fp8_dense_peak_is_the_datasheet_figure_halved():
    # H200 datasheet: FP8 tensor core 3,958 TFLOPS with sparsity -> 1,979 dense
    assert HARDWARE["h200-sxm"].peak_flops_fp8 == 1979e12
    assert HARDWARE["a100-80gb"].peak_flops_fp8 is None  # Ampere has no FP8 tensor cores


MEMORY_BOUND = """
name: kv_fp8_{dtype}
trace: {{format: synthetic, num_requests: 60, arrival: {{process: poisson, rate: 100}},
        prompt_len: 512, output_len: 512, seed: 0}}
model: llama-3.1-8b
hardware: h200-sxm
kv_cache: {{gpu_memory_utilization: 0.13, dtype: {dtype}}}
policies: [fcfs]
"""


def test_fp8_preempts_less_on_a_memory_bound_trace(tmp_path):
    """13% of an H200 leaves about 1.4 GB of KV after the 8B weights: some 670 bf16 blocks
    (about ten 1,024-token requests at their end) or twice as many fp8 ones; 60 requests
    arriving at once outgrow both, bf16 more."""
    preemptions, blocks = {}, {}
    for dtype in ("auto", "fp8"):
        path = tmp_path / f"{dtype}.yaml"
        path.write_text(MEMORY_BOUND.format(dtype=dtype))
        out = tmp_path / dtype
        # --no-plots: the summary is what is compared
        args = [str(path), "--out", str(out), "--no-progress", "--no-plots"]
        assert run_experiment.main(args) == 0
        summary = json.loads((out / "summary.json").read_text())["fcfs"]
        preemptions[dtype] = summary["num_preemptions"]
        blocks[dtype] = sim_parts(validate(parse_yaml(path.read_text())))[1]
        assert summary["completed"] == 60
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)
    assert preemptions["auto"] > 0 and preemptions["fp8"] < preemptions["auto"]


# ---------------------------------------------------------------------------- engine
def engine():
    """(torch, triton_setup) or a skip: torch missing, or triton imported before without
    the interpreter on a machine with no GPU."""
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
    import triton_setup  # first: sets TRITON_INTERPRET on a machine without CUDA

    if not triton_setup.HAS_CUDA and not triton_setup.interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    import torch

    return torch, triton_setup


def test_quantize_saturates_and_rounds_to_nearest():
    torch, _ = engine()
    from sched_lab.backend.attention.base import quantize_fp8

    x = torch.tensor([1000.0, -1000.0, 448.0, 1.96875, 1.9, 0.1, -0.0])
    got = quantize_fp8(x, 1.0).float().tolist()
    # 1.96875 lies halfway between 1.875 and 2.0 (E4M3 steps of 0.125 in [1, 2)): to even
    assert got[:5] == [448.0, -448.0, 448.0, 2.0, 1.875]
    assert got[5] == pytest.approx(0.1015625) and str(got[6]) == "-0.0"
    assert quantize_fp8(torch.tensor([3.0]), 2.0).float().item() == 1.5  # x / scale


def test_triton_store_is_bit_exact_with_torch():
    """The kernel rounds onto the E4M3 grid itself (triton_kernels.quantize_fp8): the same
    bytes as torch's cast for values of every magnitude, saturated ones and signed zeros."""
    torch, ts = engine()
    from sched_lab.backend.attention import triton_kernels
    from sched_lab.backend.attention.base import store_kv

    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 0.05, 1.0, 40.0, 400.0]).repeat_interleave(64)
    k = (torch.randn(320, 2, 16, generator=gen) * scales[:, None, None]).to(ts.DEVICE)
    k[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-9, -1e-9])
    v = -k
    slots = torch.randperm(320, generator=gen).to(ts.DEVICE)
    caches = {}
    for name, store in (("torch", store_kv), ("triton", triton_kernels.store_kv)):
        kc = torch.zeros(40, 8, 2, 16, dtype=torch.float8_e4m3fn, device=ts.DEVICE)
        vc = torch.zeros_like(kc)
        store(k, v, kc, vc, slots, 0.5, 2.0)
        caches[name] = (kc.view(torch.uint8), vc.view(torch.uint8))
    assert torch.equal(caches["torch"][0], caches["triton"][0])
    assert torch.equal(caches["torch"][1], caches["triton"][1])


def attention(torch, ts, kv_dtype, backend_name):
    """Random q/k/v over random cached prefixes (tests/test_backend_triton.py's mixed
    batch: chunks over prefixes, multi-tile prefills and decodes); the output and caches."""
    from test_backend_triton import SMALL_BATCH

    from sched_lab.backend.attention import get_attention_backend
    from sched_lab.backend.inputs import prepare_inputs

    block_size, num_blocks, heads, kv_heads, head_dim = 4, 128, 4, 2, 16
    meta = prepare_inputs(SMALL_BATCH, block_size, num_blocks, 1 << 20, 1 << 30, ts.DEVICE).attn
    gen = torch.Generator().manual_seed(0)
    tokens = int(meta.query_start_loc[-1])
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(ts.DEVICE)
    kv = torch.randn(tokens, 2, kv_heads, head_dim, generator=gen).to(ts.DEVICE)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    backend = get_attention_backend(backend_name, ts.DEVICE, torch.float32, block_size)
    backend.set_kv_cache_dtype(kv_dtype)
    k_cache, v_cache = (c.to(ts.DEVICE, kv_dtype) for c in caches)
    out = backend.forward(q, kv[:, 0], kv[:, 1], k_cache, v_cache, meta, head_dim**-0.5)
    return out, k_cache, v_cache


def test_fp8_attention_is_within_tolerance_of_fp32_and_kernels_match_reference():
    """E4M3 keeps 3 mantissa bits: each cached value is off by at most 2**-4 (6.25%)
    relative, about 2-3% on average for normal data. Asserted: the attention output with an
    FP8 cache is within 8% of the fp32 cache's output in norm (relative Frobenius error),
    and no element is off by more than 0.1 (outputs reach about 3); the Triton kernels
    read the same FP8 bytes as the torch reference to float32 rounding (1e-5)."""
    torch, ts = engine()
    ref, _, _ = attention(torch, ts, torch.float32, "torch")
    fp8, k_ref, v_ref = attention(torch, ts, torch.float8_e4m3fn, "torch")
    err = (fp8 - ref).float()
    assert (err.norm() / ref.norm()).item() < 0.08
    assert err.abs().max().item() < 0.1
    assert (fp8 != ref).any()  # the cache really was quantized
    out, k_cache, v_cache = attention(torch, ts, torch.float8_e4m3fn, "triton")
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    torch.testing.assert_close(out, fp8, atol=1e-5, rtol=1e-5)


def runner(torch, ts, tmp_path, kv_cache_dtype, backend="torch", **kw):
    from sched_lab.backend.runner import ModelRunner
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    if not (tmp_path / "config.json").exists():
        write_random_checkpoint(ts.QWEN3_TINY, tmp_path, dtype="float32", std=0.2)
    kw = {"num_gpu_blocks": 64, "swap_space_bytes": 0, **kw}
    return ModelRunner(tmp_path, device=str(ts.DEVICE), attention_backend=backend,
                       block_size=4, kv_cache_dtype=kv_cache_dtype, **kw)  # fmt: skip


def greedy(run, prompt, steps, forced=None):
    """Greedy tokens after ``prompt``; with ``forced``, the tokens fed are those (teacher
    forcing) and the picks are returned."""
    from sched_lab.backend.inputs import SeqInput

    table = list(range(64))
    picks = [run.execute([SeqInput(prompt, 0, table, True)])[0]]
    for i in range(steps - 1):
        fed = picks[-1] if forced is None else forced[i]
        picks.append(run.execute([SeqInput([fed], len(prompt) + i, table, True)])[0])
    return picks


def test_greedy_tokens_mostly_agree_with_the_full_precision_cache(tmp_path):
    """Six random 24-token prompts, 16 greedy steps on the tiny random Qwen3 (fp32): the
    fp8 engine, fed the fp32-cache engine's tokens (teacher forcing, so one flip does not
    derail the rest), picks the same token at >= 85% of the 96 steps (87 here), and the
    same first token (after a prefill over its quantized prompt) for every prompt. Run
    freely, one flip changes all later tokens (53 of 96 agree). A random model's logits lie
    close together, so this is harsher than a trained model. The counts are the CPU's fp32
    arithmetic: on an H200 (2026-12-03) one prompt's first token differed, so the test runs
    on the CPU only."""
    torch, ts = engine()
    if ts.DEVICE.type != "cpu":
        pytest.skip("agreement counts measured with the CPU's fp32 arithmetic")
    full, fp8 = runner(torch, ts, tmp_path, "auto"), runner(torch, ts, tmp_path, "fp8")
    assert fp8.kv_cache.gpu.dtype == torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(1)
    same = total = 0
    for _ in range(6):
        prompt = torch.randint(0, 256, (24,), generator=gen).tolist()
        ref = greedy(full, prompt, 16)
        got = greedy(fp8, prompt, 16, forced=ref)
        assert got[0] == ref[0]
        same += sum(a == b for a, b in zip(got, ref, strict=True))
        total += len(ref)
    assert same / total >= 0.85


def test_triton_engine_with_fp8_matches_torch_with_fp8(tmp_path):
    """The fused Triton path (qkv_prepare writes the FP8 cache, the paged kernels read it)
    gives the torch reference's logits over the same FP8 cache."""
    torch, ts = engine()
    from sched_lab.backend.inputs import SeqInput

    a, b = [5, 60, 7, 33, 2, 41, 19, 50], [8, 1, 63, 12, 30, 44, 9, 27]
    steps = [
        [SeqInput(list(range(30)), 0, a, True), SeqInput(list(range(9, 20)), 0, b, False)],
        [SeqInput([5], 30, a, True), SeqInput(list(range(40, 50)), 11, b, True)],
        [SeqInput([6], 31, a, True), SeqInput([7], 21, b, True)],
    ]
    logits = {}
    for backend in ("torch", "triton"):
        run = runner(torch, ts, tmp_path, "fp8", backend)
        logits[backend] = [x for step in steps for x in run.execute_logits(step) if x is not None]
    for got, ref in zip(logits["triton"], logits["torch"], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_fp8_cache_has_twice_the_blocks_and_swaps_its_bytes(tmp_path):
    torch, ts = engine()
    from sched_lab.backend.config import ModelConfig
    from sched_lab.backend.kv_cache import KVCache, bytes_per_block

    run = runner(torch, ts, tmp_path, "fp8")
    cfg = ModelConfig.from_dir(tmp_path)
    # 2 (K, V) * 2 layers * 4 tokens * 2 kv heads * 32 dims = 1,024 elements a block
    assert bytes_per_block(cfg, 4, torch.float8_e4m3fn) == 1024
    assert bytes_per_block(cfg, 4, torch.bfloat16) == 2048
    assert run.kv_cache.block_bytes == 1024
    cache = KVCache(cfg, 4, 8, 4, torch.float8_e4m3fn, ts.DEVICE)
    cache.gpu.copy_(torch.randn(cache.gpu.shape).to(torch.float8_e4m3fn))
    before = cache.gpu.view(torch.uint8).clone()
    cache.swap_out([(3, 0), (5, 1)])
    cache.gpu.zero_()
    cache.swap_in([(0, 6), (1, 2)])
    after = cache.gpu.view(torch.uint8)
    assert torch.equal(after[:, :, 6], before[:, :, 3]) and torch.equal(
        after[:, :, 2], before[:, :, 5]
    )


def test_a_backend_without_fp8_reads_refuses_it():
    torch, ts = engine()
    from sched_lab.backend.attention.base import AttentionBackend

    class NoFp8(AttentionBackend):
        name = "no_fp8"

        def attend(self, q, k_cache, v_cache, meta, scale):
            raise NotImplementedError

    with pytest.raises(
        ConfigError, match=r"^kv_cache.dtype: fp8 is not supported by attention backend 'no_fp8'"
    ):
        NoFp8(ts.DEVICE, torch.float32, 4).set_kv_cache_dtype(torch.float8_e4m3fn)
