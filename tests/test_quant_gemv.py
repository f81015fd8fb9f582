"""The quantized GEMV (backend/quant_gemv.py) against the float32 dequantized reference, its
split-K plan and its refusals (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
from test_quant import _assert_close_to_reference, _quantized  # noqa: E402
from triton_setup import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET)

from sched_lab.backend.quant_formats import QuantSpec  # noqa: E402


@needs_triton
@pytest.mark.parametrize("method", ["awq", "gptq", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_dequantized_reference(method, dtype, m):
    from sched_lab.backend.quant_gemv import GemvConfig, quant_gemv
    from sched_lab.backend.quant_kernels import _COUNTERS

    # N = 40 is off the 32-column tiles (2 tiles); K = 384, 3 groups of 128 (int4). On the
    # interpreter's 4 "SMs" with split_sms 1 (4 programs wanted): K tiles of 64 split in 2
    # (int4: 6 tiles, splits of 4 and 2 on group boundaries; 8 bits: 3 + 3); 128 (int4, 3
    # tiles) and 256 (8 bits, a full and a masked half tile) are not split
    n, k = 40, 384
    spec, tensors = _quantized(method, n, k, repack=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    for block_k in (256, 64) if method in ("int8", "fp8") else (128, 64):
        config = GemvConfig(32, block_k, 1, 4, 2)
        out = quant_gemv(x, tensors, spec, n, config)
        _assert_close_to_reference(out, x, tensors, spec, n)
        if m == 1 and method in ("awq", "gptq"):  # the nibbles as one (rows, 8, N) tensor
            out = quant_gemv(x, tensors, spec, n, GemvConfig(32, block_k, 1, 4, 2, True))
            _assert_close_to_reference(out, x, tensors, spec, n)
    assert int(_COUNTERS[x.device].abs().sum()) == 0  # each tile's last program reset its count


def test_gemv_plan_splits_k_on_whole_groups():
    from sched_lab.backend.quant_gemv import GemvConfig, gemv_plan

    gptq = QuantSpec("gptq", 128)
    # N 4096 / 128 = 32 tiles; 132 SMs x 4 = 528 programs wanted: split 16 (32 x 16 = 512);
    # K 4096 / 128 = 32 tiles, 2 per split
    plan = gemv_plan(1, 4096, 4096, gptq, 132, GemvConfig(128, 128, 4, 4, 3))
    assert (plan.block_m, plan.block_k, plan.splits, plan.k_per_split) == (1, 128, 16, 256)
    # a K tile of 256 is cut to the group (128); a split of 3 tiles is not whole K tiles of
    # the group... groups of 64: K tile 64, 8 tiles; split 4 -> 2 tiles (one group of 64 each)
    plan = gemv_plan(3, 64, 512, QuantSpec("awq", 64), 8, GemvConfig(32, 256, 2, 4, 3))
    assert (plan.block_m, plan.block_k, plan.splits, plan.k_per_split) == (4, 64, 4, 128)
    # 8 bits: no groups; K 384 in tiles of 256 -> 2 tiles, never split below 2 tiles each
    plan = gemv_plan(1, 40, 384, QuantSpec("int8"), 132, GemvConfig(32, 256, 4, 4, 3))
    assert (plan.splits, plan.k_per_split) == (1, 512)


def test_gemv_refuses_what_it_does_not_run():
    from sched_lab.backend.quant_gemv import GEMV_MAX_M, gemv_supported, quant_gemv

    assert gemv_supported(QuantSpec("gptq"), GEMV_MAX_M)
    assert not gemv_supported(QuantSpec("gptq"), GEMV_MAX_M + 1)
    assert not gemv_supported(QuantSpec("gptq", 128, act_order=True), 1)
    spec, tensors = _quantized("awq", 16, 128)  # checkpoint layout, not repacked
    with pytest.raises(ValueError, match="repack_awq"):
        quant_gemv(torch.zeros(1, 128, device=DEVICE), tensors, spec, 16)
    with pytest.raises(ValueError, match="act-order"):
        quant_gemv(torch.zeros(1, 128), {}, QuantSpec("gptq", 128, act_order=True), 16)
    spec, tensors = _quantized("int8", 16, 128)
    with pytest.raises(ValueError, match="at most"):
        quant_gemv(torch.zeros(GEMV_MAX_M + 1, 128, device=DEVICE), tensors, spec, 16)
