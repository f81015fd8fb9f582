"""The swapped-operand fp8/int8 kernel (backend/quant_gemv.py, ``small_m_gemm``) against the float32
dequantized reference, its split of K, its refusals and the fp8 dispatch to it; the int4
kernel likewise; the weights dequantized for cuBLAS (int4, act-order GPTQ, int8) and their
dispatch (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
from test_quant import _quantized  # noqa: E402
from triton_setup import DEVICE, needs_triton  # noqa: E402  (sets TRITON_INTERPRET)

from sched_lab.backend.quant_formats import QuantSpec  # noqa: E402


@needs_triton
@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 17, 64])
def test_small_m_matches_dequantized_reference(method, dtype, m):
    from sched_lab.backend.quant_gemv import small_m_gemm
    from sched_lab.backend.quant_kernels import _COUNTERS, SmallMConfig, weight_only_reference

    # N 128: 2 tiles of 64 rows; K 512: 4 K tiles of 128. On the interpreter's 4 "SMs":
    # split_sms 2 wants 8 programs -> K split in 2 (2 tiles each, the minimum); min_k_tiles 1
    # lets it split in 4; split_sms 1 with min_k_tiles 4 leaves K whole; the engine's tiles
    # (32 rows, K tiles of 256): 4 x 2 tiles, not split
    n, k = 128, 512
    spec, tensors = _quantized(method, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    # the kernel multiplies float16 x (exact for bf16 x here, rounded for float32 x)
    ref = weight_only_reference(x.half().to(dtype), tensors, spec)
    for config in (SmallMConfig(64, 128, 2), SmallMConfig(64, 128, 2, min_k_tiles=1),
                   SmallMConfig(64, 128, 1, min_k_tiles=4), SmallMConfig()):  # fmt: skip
        out = small_m_gemm(x, tensors["weight"], tensors["weight_scale"], method, config)
        assert out.shape == (m, n) and out.dtype == dtype
        # float32: summation order only (outputs below 128); bf16: one ulp of the largest
        # output (the interpreter truncates to 16 bits)
        tol = 1e-4 if dtype == torch.float32 else ref.float().abs().max().item() * 2**-7
        assert (out.float() - ref.float()).abs().max().item() <= tol
    assert int(_COUNTERS[x.device].abs().sum()) == 0  # each tile's last program reset its count


@needs_triton
def test_small_m_uneven_split_of_k():
    from sched_lab.backend.quant_gemv import small_m_gemm, split_of
    from sched_lab.backend.quant_kernels import SmallMConfig, weight_only_reference

    # K 640: 5 K tiles of 128 in 3 splits (2, 2 and 1 tiles; test below), 1 tile of 64 rows
    spec, tensors = _quantized("fp8", 64, 640)
    config = SmallMConfig(64, 128, 2, min_k_tiles=1)
    assert split_of(64, 640, 4, config) == (3, 256)  # the interpreter's 4 "SMs"
    x = torch.randn(2, 640, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = small_m_gemm(x, tensors["weight"], tensors["weight_scale"], "fp8", config)
    ref = weight_only_reference(x.half().float(), tensors, spec)
    assert (out - ref).abs().max().item() <= 1e-4


def test_small_m_splits_k_until_the_grid_fills():
    from sched_lab.backend.quant_gemv import split_of
    from sched_lab.backend.quant_kernels import SmallMConfig, small_m_config

    # Llama-3.1-8B on 132 SMs, 2 programs per SM wanted (264). down (N 4096, K 14336): 128
    # tiles of 32 rows, 56 K tiles of 256; split 2 (256 < 264), 4 (512), 14 K tiles each
    assert split_of(4096, 14336, 132, small_m_config(1, 4096, 14336)) == (4, 3584)
    # qkv (N 6144, K 4096): 192 tiles, 16 K tiles; split 2 (384 >= 264), 8 K tiles each
    assert split_of(6144, 4096, 132, small_m_config(1, 6144, 4096)) == (2, 2048)
    # gate_up (N 28672): 896 tiles of 32 rows (K tiles of 128), already >= 264: not split
    assert small_m_config(1, 28672, 4096).block_k == 128
    assert split_of(28672, 4096, 132, small_m_config(1, 28672, 4096)) == (1, 4096)
    # int4, qkv: 48 tiles of 128 rows, 32 K tiles of 128; up to 16 rows split until 264
    # programs (8 ways: 384), above 16 until 132 (4 ways: 192)
    assert split_of(6144, 4096, 132, small_m_config(4, 6144, 4096, "gptq")) == (8, 512)
    assert split_of(6144, 4096, 132, small_m_config(32, 6144, 4096, "awq")) == (4, 1024)
    # each split keeps >= min_k_tiles K tiles: 4 K tiles split in 2, not 4
    assert split_of(64, 512, 132, SmallMConfig(64, 128, 2)) == (2, 256)
    # K tiles that do not divide evenly: 5 tiles split 4 ways is 2 a split, so 3 splits
    # (2, 2 and 1 tiles)
    assert split_of(64, 640, 132, SmallMConfig(64, 128, 2, min_k_tiles=1)) == (3, 256)


def test_small_m_refuses_what_it_does_not_run():
    from sched_lab.backend.quant_gemv import small_m_gemm
    from sched_lab.backend.quant_kernels import SMALL_M_MAX, SmallMConfig, small_m_supported

    assert small_m_supported("fp8", SMALL_M_MAX, 128, 256)
    assert not small_m_supported("fp8", SMALL_M_MAX + 1, 128, 256)
    assert not small_m_supported("fp8", 1, 80, 256)  # N off the 32-row tiles
    assert not small_m_supported("fp8", 1, 128, 384)  # K off the K tiles of 256
    assert small_m_supported("fp8", 1, 16384, 384)  # a wide N: K tiles of 128
    assert not small_m_supported("int4", 1, 128, 256)  # not a method
    assert not small_m_supported("gptq", 1, 192, 256)  # N off the int4 tiles of 128 rows
    assert small_m_supported("gptq", 1, 128, 256)
    assert not small_m_supported("gptq", 1, 128, 256, group_size=64)  # K tile above the group
    assert not small_m_supported("awq", 1, 128, 256, SmallMConfig(64, 64))  # dots of 8 inputs
    assert small_m_supported("gptq", 4096, 128, 256)  # int4: any M, in token tiles
    assert not small_m_supported("gptq", 4096, 128, 256, SmallMConfig(128, 128, block_m=48))
    spec, tensors = _quantized("gptq", 128, 256)
    with pytest.raises(ValueError, match="takes fp8/int8"):
        small_m_gemm(torch.zeros(1, 256, device=DEVICE), tensors["qweight"],
                     tensors["scales"], "gptq")  # fmt: skip
    spec, tensors = _quantized("fp8", 80, 256)
    with pytest.raises(ValueError, match="N a multiple of 32"):
        small_m_gemm(torch.zeros(1, 256, device=DEVICE), tensors["weight"],
                     tensors["weight_scale"], "fp8")  # fmt: skip
    spec, tensors = _quantized("fp8", 256, 128)  # a weight (N, K) read as its transpose
    with pytest.raises(ValueError, match="contiguous along K"):
        small_m_gemm(torch.zeros(1, 256, device=DEVICE), tensors["weight"].t(),
                     tensors["weight_scale"], "fp8")  # fmt: skip
    spec, tensors = _quantized("fp8", 128, 256)
    with pytest.raises(ValueError, match="128 scales"):
        small_m_gemm(torch.zeros(1, 256, device=DEVICE), tensors["weight"],
                     tensors["weight_scale"][:64], "fp8")  # fmt: skip


def test_fp8_quant_linear_runs_weight_only_up_to_the_small_m_threshold(monkeypatch):
    from sched_lab.backend import quant_linear as ql
    from sched_lab.backend.quant_formats import quantize_weight
    from sched_lab.backend.quant_kernels import fp8_reference, weight_only_reference

    spec = QuantSpec("fp8")
    layer = ql.QuantLinear(256, 128, False, spec)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    for name, t in quantize_weight(w, spec).items():
        setattr(layer, name, t)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    # CPU: the weight-only reference (x not quantized), as the kernel computes on CUDA
    assert ql.gemm_path("fp8", 3) == "small_m"
    assert torch.equal(layer(x), weight_only_reference(x, layer.tensors(), spec))
    # a shape off the kernel's tiles (SmolLM2's K = 576) runs what it ran before, on CPU as
    # on CUDA: W8A8 from two tokens, the GEMV (weight-only) at one
    assert ql.gemm_path("fp8", 3, shape=(128, 256)) == "small_m"
    assert ql.gemm_path("fp8", 3, shape=(1536, 576)) == "w8a8"
    assert ql.gemm_path("fp8", 1, shape=(1536, 576)) == "gemv"
    odd = ql.QuantLinear(576, 64, False, spec)
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(3))
    for name, t in quantize_weight(w, spec).items():
        setattr(odd, name, t)
    x576 = torch.randn(3, 576, generator=torch.Generator().manual_seed(4))
    assert torch.equal(odd(x576), fp8_reference(x576, odd.weight, odd.weight_scale))
    monkeypatch.setattr(ql, "FP8_SMALL_M_MAX_TOKENS", 0)  # the A/B switch: W8A8 again
    assert ql.gemm_path("fp8", 3) == "w8a8"
    assert torch.equal(layer(x), fp8_reference(x, layer.weight, layer.weight_scale))


@needs_triton
@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 17])
def test_small_m_int4_matches_dequantized_reference(method, dtype, m):
    from sched_lab.backend.quant_gemv import small_m_int4_gemm
    from sched_lab.backend.quant_kernels import _COUNTERS, SmallMConfig, weight_only_reference

    # N 128, K 512 in 4 groups of 128, K tiles of 128 (one group). On the interpreter's 4
    # "SMs": 2 tiles of 64 rows, K split in 2 (2 K tiles each, the minimum); 4 tiles of 32
    # rows split in 4 (min_k_tiles 1); 2 tiles not split (min_k_tiles 4); the default (one
    # tile of 128 rows, split in 2)
    n, k = 128, 512
    spec, tensors = _quantized(method, n, k, repack=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    ref = weight_only_reference(x.half().to(dtype), tensors, spec)
    for config in (SmallMConfig(64, 128, 2), SmallMConfig(32, 128, 4, min_k_tiles=1),
                   SmallMConfig(64, 128, 1, min_k_tiles=4), None):  # fmt: skip
        out = small_m_int4_gemm(x, tensors, spec, n, config)
        assert out.shape == (m, n) and out.dtype == dtype
        # float32: summation order only (outputs below 400 here); bf16: one ulp of the
        # largest output (the interpreter truncates to 16 bits)
        tol = 2e-4 if dtype == torch.float32 else ref.float().abs().max().item() * 2**-7
        assert (out.float() - ref.float()).abs().max().item() <= tol
    assert int(_COUNTERS[x.device].abs().sum()) == 0


@needs_triton
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_small_m_int4_token_tiles(method):
    from sched_lab.backend.quant_gemv import small_m_int4_gemm, split_of
    from sched_lab.backend.quant_kernels import _COUNTERS, SmallMConfig, weight_only_reference

    # 40 tokens in tiles of 16 (16 + 16 + 8, the last masked): with 2 output tiles of 64
    # rows, 6 programs; on the interpreter's 4 "SMs" x 2 that is < 8, so K (4 tiles) splits
    # in 2 with min_k_tiles 2, and not at all with split_sms 1 (6 >= 4). 100 tokens with the
    # default tiles: 2 token tiles of 64 (the last 36 masked). Each x layout (permuted by a
    # copy; the tile joined, one dot) on its own.
    n, k = 128, 512
    spec, tensors = _quantized(method, n, k, repack=True)
    assert split_of(n, k, 4, SmallMConfig(64, 128, 2, block_m=16), 3) == (2, 256)
    assert split_of(n, k, 4, SmallMConfig(64, 128, 1, block_m=16), 3) == (1, 512)
    for m, config in ((40, SmallMConfig(64, 128, 2, block_m=16)),
                      (40, SmallMConfig(64, 128, 1, block_m=16)), (100, None),
                      (40, SmallMConfig(64, 128, 2, block_m=16, x_layout=1)),
                      (40, SmallMConfig(64, 128, 1, block_m=32, x_layout=3))):  # fmt: skip
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        x = x.to(torch.bfloat16)
        ref = weight_only_reference(x, tensors, spec).float()
        out = small_m_int4_gemm(x, tensors, spec, n, config)
        assert out.shape == (m, n)
        tol = ref.abs().max().item() * 2**-7  # one bf16 ulp of the largest output
        assert (out.float() - ref).abs().max().item() <= tol
    assert int(_COUNTERS[x.device].abs().sum()) == 0


@needs_triton
def test_small_m_int4_refuses_what_it_does_not_run():
    from sched_lab.backend.quant_formats import QuantSpec
    from sched_lab.backend.quant_gemv import small_m_int4_gemm
    from sched_lab.backend.quant_kernels import SmallMConfig

    x = torch.zeros(1, 256, device=DEVICE)
    spec, tensors = _quantized("gptq", 128, 256, group=64)
    with pytest.raises(ValueError, match="group 64"):  # K tiles of 128 across two groups
        small_m_int4_gemm(x, tensors, spec, 128)
    act = QuantSpec("gptq", 128, act_order=True)
    spec, tensors = _quantized("gptq", 128, 256)
    with pytest.raises(ValueError, match="act-order"):
        small_m_int4_gemm(x, tensors, act, 128)
    with pytest.raises(ValueError, match=r"K tile \(>= 128\)"):
        small_m_int4_gemm(x, tensors, spec, 128, SmallMConfig(64, 64))
    with pytest.raises(ValueError, match="power of 2 from 16 to 256"):
        small_m_int4_gemm(x, tensors, spec, 128, SmallMConfig(64, 128, block_m=48))
    spec, tensors = _quantized("awq", 128, 256)  # the checkpoint's layout, not repacked
    with pytest.raises(ValueError, match="repack"):
        small_m_int4_gemm(x, tensors, spec, 128)


@needs_triton
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dequant_int4_matmul_matches_reference_and_refuses(method):
    from sched_lab.backend.quant_gemv import dequant_int4_matmul
    from sched_lab.backend.quant_kernels import weight_only_reference

    # K 512 in 4 groups of 128 (4 programs of 16 word rows), N 200 (2 column tiles of 128,
    # the second masked); bf16: the dequantized weight is rounded to bf16 once, so 2 ulps
    n, k = 200, 512
    spec, tensors = _quantized(method, n, k, repack=True)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = weight_only_reference(x, tensors, spec)
    out = dequant_int4_matmul(x, tensors, spec, n)
    assert out.shape == (7, n) and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    xb = x.to(torch.bfloat16)
    out = dequant_int4_matmul(xb, tensors, spec, n).float()
    ref = weight_only_reference(xb, tensors, spec).float()
    assert (out - ref).abs().max().item() <= ref.abs().max().item() * 2**-6
    spec64, t64 = _quantized(method, 128, 256, group=64, repack=True)
    with pytest.raises(ValueError, match="group 64"):
        dequant_int4_matmul(torch.zeros(1, 256, device=DEVICE), t64, spec64, 128)
    with pytest.raises(ValueError, match=r"expected x \(M, K\)"):
        dequant_int4_matmul(torch.zeros(1, 128, device=DEVICE), tensors, spec, n)
    if method == "awq":  # the checkpoint's (K, N/8) layout, not repacked
        spec, raw = _quantized(method, 128, 256)
        with pytest.raises(ValueError, match="repack"):
            dequant_int4_matmul(torch.zeros(1, 256, device=DEVICE), raw, spec, 128)


@needs_triton
@pytest.mark.parametrize("group", [128, 64])
def test_dequant_int4_follows_g_idx_with_act_order(group):
    from sched_lab.backend.quant_formats import QuantSpec, unpack_gptq_rows, unpack_gptq_zeros
    from sched_lab.backend.quant_gemv import dequant_int4_matmul, dequantize_int4
    from sched_lab.backend.quant_kernels import weight_only_reference

    # act-order GPTQ: row k in group g_idx[k], shuffled; K 256 (2 programs of 128 rows, each
    # row its own group), N 136 (a second column tile of 8, masked); groups of 64 too (the
    # program's rows in 4 groups)
    n, k = 136, 256
    _, tensors = _quantized("gptq", n, k, group=group)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    tensors["g_idx"] = tensors["g_idx"][perm].contiguous()
    spec = QuantSpec("gptq", group, act_order=True)
    w = dequantize_int4(tensors, spec, n, torch.float32)  # (K, N)
    # by hand: row 5 is (q[5] - zero[g_idx[5]]) * scale[g_idx[5]], exactly, in float32
    g5 = int(tensors["g_idx"][5])
    codes, zeros = unpack_gptq_rows(tensors["qweight"]), unpack_gptq_zeros(tensors["qzeros"])
    row5 = (codes[5] - zeros[g5]).float() * tensors["scales"][g5].float()
    assert g5 != 5 // group  # not the group it would have without act-order
    assert torch.equal(w[5], row5)
    for dtype, rel in ((torch.float32, 1e-4), (torch.bfloat16, 2**-6)):
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
        ref = weight_only_reference(x, tensors, spec).float()
        out = dequant_int4_matmul(x, tensors, spec, n)
        assert out.shape == (9, n) and out.dtype == dtype
        assert (out.float() - ref).abs().max().item() <= rel * ref.abs().max().item()
    _, t192 = _quantized("gptq", 64, 192, group=64)  # K 192: not whole programs of 128 rows
    with pytest.raises(ValueError, match="K=192 group 64 act-order"):
        dequantize_int4(t192, QuantSpec("gptq", 64, act_order=True), 64, torch.float32)


def test_act_order_reorder_by_hand():
    from sched_lab.backend.quant_formats import (
        dequantize,
        pack_gptq_rows,
        pack_gptq_zeros,
        unpack_gptq_rows,
    )
    from sched_lab.backend.quant_linear import act_order_permutation, reorder_act_order

    # K 32 in 2 groups of 16, rows alternating between them (g_idx 0, 1, 0, 1, ...); row k's
    # codes are k // 2 in every column. The stable argsort takes the even rows, then the odd
    # ones, so the reordered codes are 0..15 twice
    k, n, group = 32, 8, 16
    g_idx = (torch.arange(k) % 2).to(torch.int32)
    perm = act_order_permutation(g_idx, group)
    assert perm.tolist() == list(range(0, 32, 2)) + list(range(1, 32, 2))
    codes = (torch.arange(k) // 2)[:, None].expand(k, n).to(torch.int32)
    zeros = torch.tensor([[3] * n, [11] * n], dtype=torch.int32)
    scales = torch.tensor([[0.5] * n, [2.0] * n], dtype=torch.float16)
    tensors = {"qweight": pack_gptq_rows(codes), "qzeros": pack_gptq_zeros(zeros),
               "scales": scales, "g_idx": g_idx}  # fmt: skip
    act, plain = QuantSpec("gptq", group, act_order=True), QuantSpec("gptq", group)
    reordered, perm2 = reorder_act_order(tensors, act)
    assert torch.equal(perm2, perm)
    assert unpack_gptq_rows(reordered["qweight"])[:, 0].tolist() == list(range(16)) * 2
    assert reordered["g_idx"].tolist() == [0] * 16 + [1] * 16
    assert reordered["qzeros"] is tensors["qzeros"] and reordered["scales"] is tensors["scales"]
    # the same weights, exactly: new input 17 is old input 3 (codes 1, group 1): (1 - 11) x 2
    w_act, w_new = dequantize(tensors, act), dequantize(reordered, plain)
    assert torch.equal(w_new, w_act[:, perm])
    assert w_new[0, 17].item() == w_act[0, 3].item() == -20.0
    # no reorder: a group of 17 rows and one of 15; K off the groups; a group out of range
    assert act_order_permutation(torch.tensor([0] * 17 + [1] * 15), group) is None
    assert act_order_permutation(torch.zeros(24, dtype=torch.int32), group) is None
    assert act_order_permutation(torch.tensor([0] * 16 + [2] * 16), group) is None
    assert reorder_act_order({**tensors, "g_idx": torch.tensor([0] * 17 + [1] * 15)}, act) is None


def _act_order_layer(group, g_idx=None):
    """(layer, checkpoint tensors, act-order spec): a (128, 256) act-order GPTQ projection
    on DEVICE with ``g_idx`` (default: k // group in a random row order), repacked for the
    kernels as the loader does."""
    from sched_lab.backend.quant_linear import QuantLinear

    n, k = 128, 256
    _, tensors = _quantized("gptq", n, k, group=group)
    if g_idx is None:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(15))
        g_idx = (torch.arange(k) // group)[order]
    tensors["g_idx"] = g_idx.to(DEVICE, torch.int32).contiguous()
    spec = QuantSpec("gptq", group, act_order=True)
    layer = QuantLinear(k, n, False, spec).to(DEVICE)
    for name, t in tensors.items():
        setattr(layer, name, t.clone())
    layer.repack_for_kernels()
    return layer, tensors, spec


@needs_triton
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reordered_act_order_layer_matches_the_act_order_reference(group, dtype):
    from sched_lab.backend.quant_kernels import weight_only_reference

    # K 256 in groups of 128 or 64, rows shuffled: reordered at load, then the plain paths
    # (groups of 64: no small-M kernel, the tiled one; dequant by the trivial g_idx)
    layer, tensors, spec = _act_order_layer(group)
    assert layer.reordered and layer.kernel_spec == QuantSpec("gptq", group)
    assert torch.equal(tensors["g_idx"][layer.input_perm].long().cpu(), torch.arange(256) // group)
    paths = ["gemv", "small_m", "small_m", "dequant"] if group == 128 else \
        ["gemv", "tiled", "tiled", "dequant"]  # fmt: skip
    for m, path in zip((1, 3, 40, 200), paths, strict=True):
        assert layer.path(m) == path
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        # the small-M kernel multiplies float16 x (exact for bf16 x, rounded for float32)
        xr = x.half().to(dtype) if path == "small_m" else x
        ref = weight_only_reference(xr, tensors, spec).float()  # act-order, by g_idx
        out = layer(x, kernels=True)
        assert out.shape == (m, 128) and out.dtype == dtype
        # float32: summation order only; bf16: one ulp of the largest output (the interpreter
        # truncates to 16 bits), two on the dequant path (the weight rounded to bf16 too)
        rel = 1e-5 if dtype == torch.float32 else 2**-6 if path == "dequant" else 2**-7
        assert (out.float() - ref).abs().max().item() <= rel * ref.abs().max().item()
    if DEVICE.type == "cpu":  # the float32 reference on the permuted x: the same numbers
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(16))
        ref = weight_only_reference(x, tensors, spec)
        assert (layer(x) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@needs_triton
def test_act_order_with_uneven_groups_keeps_its_order():
    from sched_lab.backend.quant_kernels import weight_only_reference

    # g_idx with a group of 129 rows and one of 127 (one row of group 1 moved into group
    # 0): no reorder; the dequantizing kernel gathers each row's group at every step, as
    # before
    order = torch.randperm(256, generator=torch.Generator().manual_seed(17))
    g_idx = (torch.arange(256) // 128)[order]
    g_idx[int((g_idx == 1).nonzero()[0])] = 0
    assert torch.bincount(g_idx).tolist() == [129, 127]
    layer, tensors, spec = _act_order_layer(128, g_idx)
    assert not layer.reordered and layer.input_perm is None
    assert layer.kernel_spec is spec and torch.equal(layer.g_idx, tensors["g_idx"])
    for m in (1, 3):
        assert layer.path(m) == "dequant"
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        ref = weight_only_reference(x, tensors, spec)
        out = layer(x, kernels=True)
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_act_order_already_in_group_order_needs_no_permute():
    # desc_act true with g_idx k // group_size (the identity order): reordered, x as given
    layer, tensors, _ = _act_order_layer(128, torch.arange(256) // 128)
    assert layer.reordered and layer.input_perm is None
    assert torch.equal(layer.qweight, tensors["qweight"])
    layer.repack_for_kernels()  # a second call changes nothing
    assert layer.reordered and torch.equal(layer.qweight, tensors["qweight"])


@needs_triton
def test_dequantize_int8_rounds_once():
    from sched_lab.backend.quant_gemv import dequantize_int8

    third = torch.tensor(1 / 3, dtype=torch.float32)
    weight = torch.tensor([[1, -2, 127, -127], [3, 48, -3, 127]], dtype=torch.int8)
    scale = torch.stack([torch.tensor(0.5), third]).reshape(2, 1)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    w32 = dequantize_int8(weight, scale, torch.float32)
    assert torch.equal(w32, weight.float() * scale)  # the reference's float32 products
    assert w32[0].tolist() == [0.5, -1.0, 63.5, -63.5]
    # bf16: 127 * float32(1/3) = 42.333336 rounds to 42.25 (steps of 0.25 there); rounding
    # the scale to bf16 first (0.333984375) would give 42.416 -> 42.5
    wb = dequantize_int8(weight, scale, torch.bfloat16)
    assert wb.dtype == torch.bfloat16
    assert wb.float().tolist() == [[0.5, -1.0, 63.5, -63.5], [1.0, 16.0, -1.0, 42.25]]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_int8_matmul_matches_reference_and_refuses(dtype):
    from sched_lab.backend.quant_gemv import dequant_int8_matmul, dequantize_int8
    from sched_lab.backend.quant_kernels import weight_only_reference

    # N 200, K 600: 13 row tiles of 16 (the last masked) x 2 K tiles of 512 (the second masked)
    n, k = 200, 600
    spec, tensors = _quantized("int8", n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    out = dequant_int8_matmul(x, tensors["weight"], tensors["weight_scale"])
    ref = weight_only_reference(x, tensors, spec).float()
    assert out.shape == (5, n) and out.dtype == dtype
    # float32: the same weights, summation order only; bf16: the weight and the output each
    # rounded once, 2 ulps of the largest output
    rel = 1e-5 if dtype == torch.float32 else 2**-6
    assert (out.float() - ref).abs().max().item() <= rel * ref.abs().max().item()
    w, s = tensors["weight"], tensors["weight_scale"]
    with pytest.raises(ValueError, match=r"\(600, 200\) \(stride \(1, 600\)\)"):
        dequantize_int8(w.t(), s, dtype)  # (K, N) read as its transpose
    with pytest.raises(ValueError, match="100 scales"):
        dequantize_int8(w, s[:100], dtype)
    with pytest.raises(ValueError, match="weight torch.float32"):
        dequantize_int8(w.float(), s, dtype)
    with pytest.raises(ValueError, match=r"expected x \(M, 600\)"):
        dequant_int8_matmul(x[:, :512], w, s)


def _quantized_layer(method: str, k: int, n: int, seed: int, device=DEVICE):
    """A QuantLinear (K=k, N=n) holding a random weight quantized by ``method`` ("gptq-act":
    GPTQ groups of 128 with act-order, its rows in shuffled groups), and its spec."""
    from sched_lab.backend import quant_linear as ql
    from sched_lab.backend.quant_formats import quantize_weight

    act = method == "gptq-act"
    spec = QuantSpec("gptq", 128, act_order=True) if act else QuantSpec(method)
    layer = ql.QuantLinear(k, n, False, spec).to(device)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    for name, t in quantize_weight(w, QuantSpec(spec.method)).items():
        setattr(layer, name, t.to(device))
    if act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(14))
        layer.g_idx = layer.g_idx[perm.to(device)]
    return layer, spec


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the kernels run in QuantLinear on CUDA only")
@pytest.mark.parametrize("method", ["gptq", "awq", "gptq-act"])
def test_int4_quant_linear_runs_each_path_by_tokens_on_cuda(method, monkeypatch):
    from sched_lab.backend import quant_gemv
    from sched_lab.backend.quant_kernels import weight_only_reference

    # gptq-act: g_idx shuffled, reordered at load; the same kernels on x's permuted columns
    act = method == "gptq-act"
    layer, spec = _quantized_layer(method, 512, 256, seed=7)
    checkpoint = {name: t.clone() for name, t in layer.tensors().items()}
    layer.repack_for_kernels()
    assert layer.reordered == act and (layer.input_perm is not None) == act
    ran = []  # the quant_gemv entry points forward called (read from the module each call)
    kernels = {"gemv": "quant_gemv", "small_m": "small_m_int4_gemm",
               "dequant": "dequant_int4_matmul"}  # fmt: skip
    for name in kernels.values():
        real = getattr(quant_gemv, name)
        monkeypatch.setattr(quant_gemv, name,
                            lambda *a, _f=real, _n=name, **k: ran.append(_n) or _f(*a, **k))  # fmt: skip
    for m, path in ((1, "gemv"), (2, "small_m"), (64, "small_m"), (128, "small_m"),
                    (129, "dequant")):  # fmt: skip
        assert layer.path(m) == path
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        x = x.to(torch.bfloat16)
        ref = weight_only_reference(x, checkpoint, spec).float()
        # one bf16 ulp of the largest output; dequant two (the weight rounded to bf16 too)
        tol = ref.abs().max().item() * (2**-6 if path == "dequant" else 2**-7)
        ran.clear()
        assert (layer(x).float() - ref).abs().max().item() <= tol
        assert ran == [kernels[path]]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the kernels run in QuantLinear on CUDA only")
@pytest.mark.parametrize("method", ["int8", "gptq-act"])
def test_int8_and_act_order_quant_linear_dequantize_above_their_thresholds_on_cuda(
    method, monkeypatch
):
    from sched_lab.backend import quant_gemv, quant_kernels
    from sched_lab.backend import quant_linear as ql
    from sched_lab.backend.quant_kernels import weight_only_reference

    act = method == "gptq-act"
    layer, spec = _quantized_layer(method, 512, 256, seed=11)
    above = ql.dequant_above_tokens(spec.method, act)
    assert above is not None
    dequant = "dequant_int4_matmul" if act else "dequant_int8_matmul"
    ran = []
    for module, name in ((quant_gemv, dequant), (quant_kernels, "weight_only_gemm")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _f=real, _n=name, **k: ran.append(_n) or _f(*a, **k))  # fmt: skip
    cases = [(m, "weight_only_gemm") for m in (above,) if m > 0]  # act-order: none
    for m, kernel in [*cases, (above + 1, dequant), (above + 100, dequant)]:
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        x = x.to(torch.bfloat16)
        ref = weight_only_reference(x, layer.tensors(), spec).float()
        tol = ref.abs().max().item() * 2**-6  # the weight and the output rounded: 2 bf16 ulps
        ran.clear()
        assert (layer(x).float() - ref).abs().max().item() <= tol
        assert ran == [kernel]


@pytest.mark.parametrize("method", ["int8", "gptq-act"])
def test_dequant_path_runs_the_float32_reference_on_cpu(method):
    from sched_lab.backend import quant_linear as ql
    from sched_lab.backend.quant_kernels import weight_only_reference

    act = method == "gptq-act"
    layer, spec = _quantized_layer(method, 256, 128, seed=12, device="cpu")
    m = ql.dequant_above_tokens(spec.method, act) + 1
    assert ql.gemm_path(spec.method, m, act, (128, 256)) == "dequant"
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(13))
    assert torch.equal(layer(x), weight_only_reference(x, layer.tensors(), spec))
