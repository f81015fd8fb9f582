"""A projection whose weight stays quantized (packed) in memory, and the swap of a model's
projections for it at load time.

The buffers are the checkpoint's tensors of :mod:`sched_lab.backend.quant_formats` (fused
projections concatenated along the output features); AWQ's are repacked after loading
(:meth:`QuantLinear.repack_for_kernels`) into the GPTQ qweight layout, so that AWQ and GPTQ
run one int4 kernel; act-order GPTQ whose groups each hold group_size rows is reordered
then into plain GPTQ (rows in group order, x's columns permuted at each call). ``forward``
calls the kernels of :mod:`sched_lab.backend.quant_kernels`
and :mod:`sched_lab.backend.quant_gemv` by the method, the number of tokens M and the
projection's shape (:func:`gemm_path`); on CPU
the float32 references of the same arithmetic (the tests run the kernels themselves under
the interpreter).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from sched_lab.backend.quant_formats import (
    PACK,
    QuantSpec,
    awq_is_repacked,
    pack_gptq_rows,
    repack_awq,
    unpack_gptq_rows,
)

FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")
#: tokens per step up to which fp8 runs weight-only (W8A16: the GEMV at one token, else the
#: streaming kernel; no activation quantization) where the small-M kernel below does not
#: take the step; above, W8A8 ``torch._scaled_mm``. With the
#: activations quantized by one kernel, W8A8 beat the streaming kernel at every M from 2 to
#: 32 (8B projections summed, H100: 148 vs 203 us at M = 2..16, docs/quantization.md); with
#: the nine-kernel quantizer before, the streaming kernel had won up to 16 on the H200
FP8_WEIGHT_ONLY_MAX_TOKENS = 1
#: tokens per step up to which fp8 runs weight-only on tensor cores with the operands
#: swapped (:func:`sched_lab.backend.quant_gemv.small_m_gemm`), before the rules above; 0
#: turns it off (benchmarks/quant_decode.py's A/B). Llama-3.1-8B projections summed, H200:
#: 1.28x the GEMV at M = 1, 1.8-1.9x W8A8 at M = 2..16, 1.22x at 32, 0.95x at 64
#: (BENCHMARKS.md, 2026-12-06)
FP8_SMALL_M_MAX_TOKENS = 32
#: the same for int4 (gptq, awq; not act-order) on
#: :func:`sched_lab.backend.quant_gemv.small_m_int4_gemm`, from 2 tokens (the GEMV keeps one:
#: 88 vs 98 us there); 0 turns it off. Llama-3.1-8B projections summed, H100: 1.17-1.22x
#: the tiled kernel at M = 2..16, 1.56x at 32, 2.28x at 64, 1.77x at 128 (BENCHMARKS.md,
#: 2026-12-06)
INT4_SMALL_M_MAX_TOKENS = 128
#: int4 steps (not act-order) of more tokens than this dequantize each weight for cuBLAS
#: (:func:`sched_lab.backend.quant_gemv.dequant_int4_matmul`); the same projections, H100:
#: 1.4x the small-M kernel at 256 tokens, 2.1x at 512, 3.5x its gathering layout at 2048
#: (1.2x bf16's time there, where the tiled kernel took 7.8x) (BENCHMARKS.md, 2026-12-06).
#: None turns it off (the tiled kernel).
INT4_DEQUANT_ABOVE_TOKENS: int | None = 128
#: the same for act-order GPTQ left in its order (each row's zeros and scales by g_idx: a
#: group not holding exactly group_size rows; reordered layers follow the int4 rules above),
#: against the tiled kernel, its only other path: 0, every step. The same projections, H100:
#: 0.30x the tiled kernel's time at 1 token (704 vs 2,376 us), 0.14x at 256, 0.04x at 2048
#: (1.5x bf16's time there) (BENCHMARKS.md, 2026-12-06, night). None turns it off.
INT4_ACT_ORDER_DEQUANT_ABOVE_TOKENS: int | None = 0
#: the same for int8 (:func:`sched_lab.backend.quant_gemv.dequant_int8_matmul`) against the
#: tiled kernel, which runs 64-token tiles above 32 tokens: H100, 1.24x slower than it at
#: 192 tokens (424 vs 341 us: three tiles), 1.10x faster at 193 (four), 1.55x at 512, 2.2x at
#: 2048 (1.22x bf16's time there) (BENCHMARKS.md, 2026-12-06, night). None turns it off.
INT8_DEQUANT_ABOVE_TOKENS: int | None = 192


#: methods whose one-row steps run :mod:`sched_lab.backend.quant_gemv`: on the H200 (8B
#: projections, BENCHMARKS.md 2026-12-04) it beat the old paths at M = 1 for int4 (1.4x the
#: tiled kernel) and fp8 (1.7x the streaming kernel), lost for int8 (0.7-0.9x the tiled
#: kernel) and at M = 4 for every method (fp8: where the small-M kernel does not take it)
GEMV_METHODS = ("awq", "gptq", "fp8")


def dequant_above_tokens(method: str, act_order: bool = False) -> int | None:
    """The token count above which ``method`` runs the "dequant" path (None: never)."""
    if method == "int8":
        return INT8_DEQUANT_ABOVE_TOKENS
    if method in ("gptq", "awq"):
        return INT4_ACT_ORDER_DEQUANT_ABOVE_TOKENS if act_order else INT4_DEQUANT_ABOVE_TOKENS
    return None


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input order that makes act-order GPTQ groups contiguous: ``argsort(g_idx)``,
    stable, int64 on g_idx's device, so that ``g_idx[perm]`` is ``k // group_size``. None
    where that cannot be (K not a multiple of the group, a group that does not hold
    exactly ``group_size`` rows, a group outside 0..K/g - 1)."""
    k = g_idx.numel()
    if k == 0 or k % group_size or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group_size:
        return None
    counts = torch.bincount(g_idx.long(), minlength=k // group_size)
    if not bool((counts == group_size).all()):
        return None
    return torch.argsort(g_idx.long(), stable=True)


def permute_gptq_rows(qweight: torch.Tensor, perm: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """GPTQ qweight (K/8, N) whose row (input) i holds the old row ``perm[i]``: the nibbles
    unpacked, gathered along K and packed again, ``chunk`` columns at a time (bounds the
    int64 scratch); a new tensor, same device."""
    out = torch.empty_like(qweight)
    for c0 in range(0, qweight.shape[1], chunk):
        codes = unpack_gptq_rows(qweight[:, c0 : c0 + chunk])
        out[:, c0 : c0 + chunk] = pack_gptq_rows(codes.index_select(0, perm))
    return out


def reorder_act_order(
    tensors: dict[str, torch.Tensor], spec: QuantSpec
) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """Act-order GPTQ ``tensors`` as plain GPTQ: (tensors, perm) with qweight's rows
    permuted by :func:`act_order_permutation` and g_idx ``k // group_size`` (qzeros and
    scales, indexed by group, unchanged), so that x @ W.T == x[:, perm] @ W'.T with the same
    weights, exactly. None where :func:`act_order_permutation` is None."""
    perm = act_order_permutation(tensors["g_idx"], spec.group_size)
    if perm is None:
        return None
    k = perm.numel()
    trivial = torch.arange(k, dtype=torch.int32, device=perm.device) // spec.group_size
    out = dict(tensors)
    out["qweight"] = permute_gptq_rows(tensors["qweight"], perm)
    out["g_idx"] = trivial.to(tensors["g_idx"].dtype)
    return out, perm


def gemm_path(
    method: str,
    tokens: int,
    act_order: bool = False,
    shape: tuple[int, int] | None = None,
    group_size: int = 128,
    reordered: bool = False,
) -> str:
    """Which GEMM a step of ``tokens`` rows runs for ``method``, on CUDA and (as its float32
    reference) on CPU: "dequant" (the weight dequantized, then cuBLAS) above
    :func:`dequant_above_tokens` rows: int8 (any shape), int4 without act-order where the
    group and K (``shape`` (N, K), if given) are multiples of 128, act-order GPTQ where K is;
    "small_m" (weight-only on tensor cores, operands swapped: fp8 up to FP8_SMALL_M_MAX_TOKENS
    rows, int4 without act-order from 2 to INT4_SMALL_M_MAX_TOKENS, where ``shape``, if given,
    fits the tiles for ``group_size``), "gemv" (the one-row kernel), "stream" (weight-only
    streaming kernel), "tiled" (weight-only tiled kernel) or "w8a8" (fp8 ``_scaled_mm``).
    Otherwise int8, gptq and awq (repacked) run the tiled kernel: on the H200 the streaming
    kernel was slower for int8 and gptq at every M. ``reordered``: act-order GPTQ put in
    group order at load (:meth:`QuantLinear.repack_for_kernels`, x permuted at each call):
    the rules of int4 without act-order, except that "dequant" takes any group as
    act-order's does."""
    gathers = act_order and not reordered  # each row's group read from g_idx at run time
    int4 = method in ("gptq", "awq") and not gathers
    above = dequant_above_tokens(method, gathers)
    if above is not None and tokens > above:
        k_ok = shape is None or shape[1] % 128 == 0
        if method == "int8" or (act_order and k_ok) or (group_size % 128 == 0 and k_ok):
            return "dequant"
    if method == "fp8":
        small_m = FP8_SMALL_M_MAX_TOKENS
    elif int4 and tokens > 1:
        small_m = INT4_SMALL_M_MAX_TOKENS
    else:
        small_m = 0
    if tokens <= small_m:
        if shape is None:
            return "small_m"
        from sched_lab.backend.quant_kernels import small_m_supported

        if small_m_supported(method, tokens, *shape, group_size=group_size):
            return "small_m"
    if tokens == 1 and method in GEMV_METHODS and not gathers:
        return "gemv"
    if method == "fp8":
        return "stream" if tokens <= FP8_WEIGHT_ONLY_MAX_TOKENS else "w8a8"
    return "tiled"


def buffer_shapes(spec: QuantSpec, in_features: int, out_features: int):
    """name -> (shape, dtype) of one projection's quantized checkpoint tensors, (N, K) =
    (out, in) (AWQ's before :meth:`QuantLinear.repack_for_kernels`)."""
    k, n, g = in_features, out_features, spec.group_size
    if spec.method in ("fp8", "int8"):
        dtype = torch.float8_e4m3fn if spec.method == "fp8" else torch.int8
        return {"weight": ((n, k), dtype), "weight_scale": ((n, 1), torch.float32)}
    shapes = {
        "qweight": ((k, n // PACK) if spec.method == "awq" else (k // PACK, n), torch.int32),
        "qzeros": ((k // g, n // PACK), torch.int32),
        "scales": ((k // g, n), torch.float16),
    }
    if spec.method == "gptq":
        shapes["g_idx"] = ((k,), torch.int32)
    return shapes


def concat_dim(spec: QuantSpec, tensor: str) -> int:
    """The dim along which a fused projection's parts are concatenated (the output one)."""
    return 0 if spec.method in ("fp8", "int8") else 1


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W quantized by ``spec``; x (tokens, in_features).
    ``kernel_spec``: the layout the buffers hold now (``spec``, or plain GPTQ once an
    act-order one is ``reordered``); ``input_perm``: x's column order for it (None: as
    given)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: QuantSpec) -> None:
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        for name, (shape, dtype) in buffer_shapes(spec, in_features, out_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel_spec = spec
        self.register_buffer("input_perm", None, persistent=False)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The quantized weight's buffers by checkpoint name (not ``input_perm``)."""
        return {n: b for n, b in self.named_buffers(recurse=False) if n != "input_perm"}

    def repack_for_kernels(self) -> None:
        """After the buffers are filled with the checkpoint's tensors: AWQ's become
        :func:`~sched_lab.backend.quant_formats.repack_awq`'s layout (same W, exactly);
        act-order GPTQ whose groups each hold group_size rows becomes plain GPTQ by
        :func:`reorder_act_order` (``input_perm`` kept, None where the order was already
        k // group_size; other g_idx stay as they are and run the act-order paths); other
        methods and already repacked buffers are left as they are. On CUDA, the device's split-K counters are made here, before any CUDA graph
        capture."""
        first = next(iter(self.tensors().values()))
        if first.is_cuda:
            from sched_lab.backend.quant_kernels import _split_counters

            _split_counters(first.device)
        if self.spec.method == "gptq" and self.spec.act_order and not self.reordered:
            done = reorder_act_order(self.tensors(), self.spec)
            if done is None:
                return
            tensors, perm = done
            self.qweight, self.g_idx = tensors["qweight"], tensors["g_idx"]
            identity = torch.equal(perm, torch.arange(perm.numel(), device=perm.device))
            self.input_perm = None if identity else perm
            self.kernel_spec = replace(self.spec, act_order=False)
            return
        if self.spec.method != "awq" or awq_is_repacked(self.tensors()):
            return
        for name, value in repack_awq(self.tensors()).items():
            setattr(self, name, value)

    @property
    def reordered(self) -> bool:
        """Whether act-order GPTQ buffers were put in group order at load."""
        return self.spec.act_order and not self.kernel_spec.act_order

    def path(self, tokens: int) -> str:
        """:func:`gemm_path` of a step of ``tokens`` rows for this projection."""
        spec = self.spec
        shape = (self.out_features, self.in_features)
        return gemm_path(spec.method, tokens, spec.act_order, shape, spec.group_size,
                         self.reordered)  # fmt: skip

    def forward(self, x: torch.Tensor, kernels: bool | None = None) -> torch.Tensor:
        """x (M, in_features) -> (M, out_features) in x's dtype by :meth:`path`: the Triton
        kernels where ``kernels`` (None: x on CUDA; True on CPU runs them in Triton's
        interpreter), else the float32 references; x's columns permuted by ``input_perm``
        first."""
        from sched_lab.backend import quant_gemv as qg
        from sched_lab.backend import quant_kernels as qk

        spec, n = self.kernel_spec, self.out_features
        path = self.path(x.shape[0])
        if self.input_perm is not None:
            x = x.index_select(1, self.input_perm)
        if path == "w8a8":  # CPU: its float32 reference
            y = qk.fp8_gemm(x, self.weight, self.weight_scale)
        elif not (x.is_cuda if kernels is None else kernels):
            y = qk.weight_only_reference(x, self.tensors(), spec)
        elif path == "small_m" and spec.method == "fp8":
            y = qg.small_m_gemm(x, self.weight, self.weight_scale, "fp8")
        elif path == "small_m":
            y = qg.small_m_int4_gemm(x, self.tensors(), spec, n)
        elif path == "dequant" and spec.method == "int8":
            y = qg.dequant_int8_matmul(x, self.weight, self.weight_scale)
        elif path == "dequant":  # int4; by g_idx (a reordered one's trivial) off 128-groups
            dq = spec if spec.group_size % 128 == 0 else self.spec
            y = qg.dequant_int4_matmul(x, self.tensors(), dq, n)
        elif path == "gemv":
            y = qg.quant_gemv(x, self.tensors(), spec, n)
        elif path == "stream":  # fp8 only
            y = qk.weight_streaming_gemm(x, self.tensors(), spec, n)
        else:
            y = qk.weight_only_gemm(x, self.tensors(), spec, n)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.spec.method}"


def quantize_projections(model: nn.Module, spec: QuantSpec) -> list[str]:
    """Replace every layer projection (``nn.Linear`` named in FUSED_PROJECTIONS) of
    ``model`` with an empty QuantLinear on the same device; returns their names."""
    names = []
    for parent_name, parent in model.named_modules():
        for child_name, child in list(parent.named_children()):
            if child_name in FUSED_PROJECTIONS and isinstance(child, nn.Linear):
                q = QuantLinear(child.in_features, child.out_features, child.bias is not None, spec)
                if child.bias is not None:
                    q.bias = nn.Parameter(torch.empty_like(child.bias))
                setattr(parent, child_name, q)
                names.append(f"{parent_name}.{child_name}")
    return names
