"""The decode GEMV (backend/decode_gemv.py) against x.float() @ W.float().T and the unfused
Triton ops, its refusals, and a tiny Qwen3 model's steps with ``decode_gemv`` on vs off
(Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
from triton_setup import DEVICE, QWEN3_TINY, needs_triton  # noqa: E402  (sets TRITON_INTERPRET)

from sched_lab.backend.inputs import SeqInput  # noqa: E402
from sched_lab.backend.quant_gemv import GemvConfig  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402

# N = 40 is off the 32-column tiles (2 tiles); K = 384. On the interpreter's 4 "SMs" with
# split_sms 1 (4 programs wanted): K tiles of 64 split in 2 (3 + 3 tiles); a K tile of 256
# (a full and a masked half tile) is not split
N, K = 40, 384
SPLIT, UNSPLIT = GemvConfig(32, 64, 1, 4, 2), GemvConfig(32, 256, 1, 4, 2)


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def assert_rounded_close(got, ref, dtype):
    """got (dtype) within one bf16 ulp of ref (float32; the interpreter's casts truncate,
    the GPU's round to nearest: half an ulp) plus float32 summation order."""
    assert got.dtype == dtype
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    assert ((got.float() - ref).abs() <= 1e-5 + rtol * ref.abs()).all()


@needs_triton
def test_gemv_hand_computed():
    from sched_lab.backend.decode_gemv import dense_gemv

    # one row [1, 2, 3] against W rows [1, 0, 0], [0, 1, 1], [1, 1, 1] plus bias [0, 1, -6]
    x = torch.tensor([[1.0, 2.0, 3.0]], device=DEVICE)
    w = torch.tensor([[1.0, 0, 0], [0, 1, 1], [1, 1, 1]], device=DEVICE)
    y, summed = dense_gemv(x, w, torch.tensor([0.0, 1.0, -6.0], device=DEVICE))
    assert y.tolist() == [[1.0, 6.0, 0.0]] and summed is None
    # silu_mul: gate [0, 0, 0] -> silu 0; up anything: x = 0, y = 0
    y, _ = dense_gemv(torch.tensor([[0.0, 0, 0, 5, 6, 7]], device=DEVICE), w, prologue="silu_mul")
    assert y.tolist() == [[0.0, 0.0, 0.0]]
    # rms_norm with residual: s = [1, -2, 3] + [2, 2, 1] = [3, 0, 4]:
    # rms = sqrt(25 / 3), x = s / rms * w_norm (w_norm = 1): [3, 0, 4] * sqrt(3) / 5
    y, summed = dense_gemv(torch.tensor([[1.0, -2.0, 3.0]], device=DEVICE), w,
                           prologue="rms_norm", residual=torch.tensor([[2.0, 2.0, 1.0]]).to(DEVICE),
                           norm_weight=torch.ones(3, device=DEVICE), eps=0.0)  # fmt: skip
    assert summed.tolist() == [[3.0, 0.0, 4.0]]
    r3 = 3.0**0.5
    torch.testing.assert_close(y.cpu(), torch.tensor([[3 * r3 / 5, 4 * r3 / 5, 7 * r3 / 5]]))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_float32_reference(dtype, m):
    from sched_lab.backend.decode_gemv import dense_gemv
    from sched_lab.backend.quant_kernels import _COUNTERS

    x = rand(m, K, seed=1, dtype=dtype)
    w = rand(N, K, seed=2, scale=0.05, dtype=dtype)
    bias = rand(N, seed=3, dtype=dtype)
    for config in (SPLIT, UNSPLIT):
        ref = x.float() @ w.float().T
        assert_rounded_close(dense_gemv(x, w, config=config)[0], ref, dtype)
        y, _ = dense_gemv(x, w, bias, config=config)
        assert_rounded_close(y, ref + bias.float(), dtype)
    assert int(_COUNTERS[x.device].abs().sum()) == 0  # each tile's last program reset its count


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_prologues_match_the_unfused_ops(dtype, m):
    from sched_lab.backend import triton_ops
    from sched_lab.backend.decode_gemv import dense_gemv

    w = rand(N, K, seed=2, scale=0.05, dtype=dtype)
    gate_up = rand(m, 2 * K, seed=4, dtype=dtype)
    ref = triton_ops.silu_and_mul(gate_up).float() @ w.float().T
    for config in (SPLIT, UNSPLIT):
        assert_rounded_close(dense_gemv(gate_up, w, prologue="silu_mul", config=config)[0], ref,
                             dtype)  # fmt: skip
    x, residual = rand(m, K, seed=5, dtype=dtype), rand(m, K, seed=6, dtype=dtype)
    norm_w = (1 + rand(K, seed=7, scale=0.1)).to(dtype)
    h, summed_ref = triton_ops.rms_norm(x, norm_w, 1e-6, residual)
    h0, _ = triton_ops.rms_norm(x, norm_w, 1e-6)
    for config in (SPLIT, UNSPLIT):
        y, summed = dense_gemv(x, w, prologue="rms_norm", residual=residual, norm_weight=norm_w,
                               eps=1e-6, config=config)  # fmt: skip
        assert torch.equal(summed, summed_ref)  # the residual add rounds as the unfused one
        assert_rounded_close(y, h.float() @ w.float().T, dtype)
        y, summed = dense_gemv(x, w, prologue="rms_norm", norm_weight=norm_w, eps=1e-6,
                               config=config)  # fmt: skip
        assert summed is None
        assert_rounded_close(y, h0.float() @ w.float().T, dtype)


def test_gemv_refusals():
    from sched_lab.backend.decode_gemv import dense_gemv
    from sched_lab.backend.quant_gemv import GEMV_MAX_M

    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="at most 8"):
        dense_gemv(torch.zeros(GEMV_MAX_M + 1, 16), w)
    with pytest.raises(ValueError, match="expected K_x = 32"):
        dense_gemv(torch.zeros(1, 16), w, prologue="silu_mul")
    with pytest.raises(ValueError, match="prologue 'gelu'; expected one of"):
        dense_gemv(torch.zeros(1, 16), w, prologue="gelu")
    with pytest.raises(ValueError, match="needs norm_weight"):
        dense_gemv(torch.zeros(1, 16), w, prologue="rms_norm")


def test_plan_splits_until_the_grid_fills():
    from sched_lab.backend.decode_gemv import _plan, dense_gemv_config

    # Qwen3-0.6B down_proj at M = 1: N 1024 / 16 = 64 tiles, 132 SMs x 2 = 264 wanted: split
    # 4 (256 programs); K 3072 / 512 = 6 tiles: split 4 needs 8 tiles -> split 2, 3 tiles each
    c = dense_gemv_config(1, 1024, 3072)
    assert (c.block_n, c.block_k) == (16, 512)
    assert _plan(1, 1024, 3072, 132, c) == (1, 2, 1536)
    # M = 3 pads to 4 rows: K tile 128; K 3072 -> 24 tiles, split 8 (512 programs >= 264),
    # 3 tiles of 128 each
    c = dense_gemv_config(3, 1024, 3072)
    assert c.block_k == 128 and _plan(3, 1024, 3072, 132, c) == (4, 8, 384)


def _runner(path, decode_gemv, **kw):
    from sched_lab.backend.runner import ModelRunner

    return ModelRunner(path, device=str(DEVICE), attention_backend="triton", block_size=4,
                       num_gpu_blocks=64, swap_space_bytes=0, decode_gemv=decode_gemv, **kw)  # fmt: skip


@needs_triton
def test_model_steps_with_decode_gemv_match_without(tmp_path):
    # bf16 tiny Qwen3 (QK-norm): a 9-token prefill (above GEMV_MAX_M: the unfused path), a
    # 3-token prefill (GEMV path, first layer without residual) and two decode steps of 2
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(QWEN3_TINY, tmp_path, dtype="bfloat16", std=0.2)
    a, b = [5, 60, 7, 33], [8, 1, 63]
    steps = [
        [SeqInput(list(range(9)), 0, a, True)],
        [SeqInput([3, 4, 5], 0, b, True)],
        [SeqInput([11], 9, a, True), SeqInput([12], 3, b, True)],
        [SeqInput([13], 10, a, True), SeqInput([14], 4, b, True)],
    ]
    logits = {}
    for on in (False, True):
        runner = _runner(tmp_path, on, dtype="bfloat16")
        assert [layer.gemv_max_tokens for layer in runner.model.layers] == [8 * on] * 2
        logits[on] = [x for s in steps for x in runner.execute_logits(s) if x is not None]
    assert len(logits[True]) == 6
    for got, ref in zip(logits[True], logits[False], strict=True):
        assert int(got.argmax()) == int(ref.argmax())  # greedy tokens equal
        assert (got - ref).abs().max() <= 0.05 * ref.abs().max()  # bf16 roundings apart


def test_decode_gemv_option_refusals(tmp_path):
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(QWEN3_TINY, tmp_path, dtype="float32", std=0.2)
    with pytest.raises(ConfigError, match="decode_gemv must be true or false, got 'yes'"):
        _runner(tmp_path, "yes")
    with pytest.raises(ConfigError, match="decode_gemv: needs attention_backend 'triton'"):
        from sched_lab.backend.runner import ModelRunner

        ModelRunner(tmp_path, attention_backend="torch", num_gpu_blocks=8, swap_space_bytes=0,
                    decode_gemv=True)  # fmt: skip


@needs_triton
def test_quantized_projections_keep_their_path(tmp_path):
    # int8 layers keep QuantLinear's kernels (no GEMV); the bf16 LM head (tied embedding) runs
    # the GEMV; a decode step still matches the run without decode_gemv
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(QWEN3_TINY, tmp_path, dtype="float32", std=0.2)
    step = [SeqInput([3, 4, 5], 0, [0, 1], True)]
    logits = {}
    for on in (False, True):
        runner = _runner(tmp_path, on, quantization="int8")
        assert [layer.gemv_max_tokens for layer in runner.model.layers] == [0, 0]
        assert runner.model.gemv_max_tokens == 8 * on
        logits[on] = runner.execute_logits(step)[0]
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)
