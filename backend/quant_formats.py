"""Quantized weight formats: the checkpoint layouts, round-to-nearest quantizers and the
``quantization_config`` of config.json.

Logical weight: W (out_features, in_features) as in ``nn.Linear``; K = in, N = out, g = group.

* ``fp8`` (W8A8): ``weight`` float8_e4m3fn (N, K), ``weight_scale`` float32 (N, 1), one per
  output channel: W = weight * weight_scale. Activations are quantized per token at run time.
  (vLLM's own ``fp8`` checkpoints carry one scale per tensor; the per-channel scale here is a
  finer case of the same formula.)
* ``int8`` (W8A16, this lab's format): ``weight`` int8 (N, K), ``weight_scale`` float32
  (N, 1), symmetric: W = weight * weight_scale; config ``{"quant_method": "int8", "bits": 8}``.
* ``awq`` (GEMM version, zero_point): ``qweight`` int32 (K, N/8), ``qzeros`` int32 (K/g, N/8),
  ``scales`` float16 (K/g, N); 8 nibbles per int32 along N in AWQ's interleaved order (nibble
  i holds column ``AWQ_PACK_ORDER[i]`` of its 8); W[n, k] = (q - z) * s of k's group.
* ``gptq`` (symmetric): ``qweight`` int32 (K/8, N), 8 nibbles along K in order;
  ``qzeros`` int32 (K/g, N/8), 8 nibbles along N in order, holding zero - 1 (GPTQ's
  convention); ``scales`` float16 (K/g, N); ``g_idx`` int32 (K,): row k's group, k // g
  with desc_act false, any order with desc_act true (act-order: groups follow the
  calibration's column order).

The engine keeps AWQ in :func:`repack_awq`'s layout (so that one int4 kernel serves both):
``qweight`` as GPTQ's (K/8, N), ``qzeros`` (K/g, N/8) in natural nibble order holding the
zero itself (0..15, which zero - 1 could not hold for 0), ``scales`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sched_lab.core.errors import ConfigError

METHODS = ("fp8", "int8", "awq", "gptq")
#: the projections that are quantized (embeddings, norms and the LM head stay)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACK = 8  # 4-bit codes per int32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (of 8) held by nibble i
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantSpec:
    """One quantization method and its options (``group_size`` for awq and gptq only;
    ``act_order``: gptq rows in any group order, row k in group ``g_idx[k]``, as written
    with ``desc_act: true``; the kernels and :func:`dequantize` follow g_idx then)."""

    method: str
    group_size: int = DEFAULT_GROUP_SIZE
    act_order: bool = False

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors of one quantized projection (after ``<name>.``)."""
        if self.method in ("fp8", "int8"):
            return ("weight", "weight_scale")
        if self.method == "awq":
            return ("qweight", "qzeros", "scales")
        return ("qweight", "qzeros", "scales", "g_idx")

    def to_config(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of config.json."""
        if self.method == "fp8":
            return {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_scale": "per_channel"}  # fmt: skip
        if self.method == "int8":
            return {"quant_method": "int8", "bits": 8, "weight_scale": "per_channel"}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}  # fmt: skip
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size,
                "desc_act": self.act_order, "sym": True}  # fmt: skip


def spec_from_config(raw: dict[str, Any] | None, source: str) -> QuantSpec | None:
    """The QuantSpec of a config.json's ``quantization_config`` (None when absent); a
    method or an option this engine lacks is one ConfigError line naming ``source``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: quantization_config: expected a mapping, got {raw!r}")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise ConfigError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; "
            f"supported: {', '.join(METHODS)}"
        )
    if method in ("awq", "gptq"):
        if raw.get("bits", 4) != 4:
            raise ConfigError(
                f"{source}: quantization_config.bits: {raw['bits']}; {method} needs 4"
            )
        if method == "awq" and str(raw.get("version", "gemm")).lower() != "gemm":
            raise ConfigError(f"{source}: quantization_config.version: expected 'gemm' for awq")
        act_order = method == "gptq" and bool(raw.get("desc_act", False))
        group = raw.get("group_size", DEFAULT_GROUP_SIZE)
        if not isinstance(group, int) or group < 16 or group % 16:
            raise ConfigError(
                f"{source}: quantization_config.group_size: expected a multiple of 16, got {group!r}"
            )
        return QuantSpec(method, group, act_order)
    if method == "int8" and raw.get("bits", 8) != 8:
        raise ConfigError(f"{source}: quantization_config.bits: {raw['bits']}; int8 needs 8")
    return QuantSpec(method)


def resolve_quantization(requested: str | None, checkpoint: QuantSpec | None, source: str):
    """Which QuantSpec the engine runs: the checkpoint's when it has one (``requested`` must
    be null or the same method, else one ConfigError line); ``requested`` on an unquantized
    checkpoint quantizes its weights at load time (round to nearest); None: unquantized."""
    if checkpoint is not None:
        if requested is not None and requested != checkpoint.method:
            raise ConfigError(
                f"quantization: {requested!r} conflicts with {source}'s quantization_config "
                f"(quant_method {checkpoint.method!r}): set {checkpoint.method!r} or null"
            )
        return checkpoint
    if requested is None:
        return None
    if requested not in METHODS:
        raise ConfigError(f"quantization: {requested!r}; expected null, {', '.join(METHODS)}")
    return QuantSpec(requested)


# ---------------------------------------------------------------- round-to-nearest
def quantize_weight(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of W (N, K) quantized by ``spec`` (round to nearest)."""
    w = w.float()
    if spec.method == "fp8":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    if spec.method == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}
    return pack_int4(*_int4_codes(w, spec), spec)


def pack_int4(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    spec: QuantSpec,
    g_idx: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of 4-bit codes (K, N), zeros and scales (K/g, N); ``g_idx``
    (K,) row k's group (gptq; None: k // group_size)."""
    if spec.method == "awq":
        return {"qweight": pack_awq(codes), "qzeros": pack_awq(zeros), "scales": scales}
    if g_idx is None:
        k = codes.shape[0]
        g_idx = torch.arange(k, dtype=torch.int32, device=codes.device) // spec.group_size
    return {"qweight": pack_gptq_rows(codes), "qzeros": pack_gptq_zeros(zeros),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}  # fmt: skip


def _int4_codes(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, ...]:
    """Per-group 4-bit codes of W (N, K): AWQ asymmetric (zero in 0..15), GPTQ symmetric
    (zero 8). Returns codes (K, N) int32, zeros (K/g, N) int32, scales (K/g, N) float16."""
    n, k = w.shape
    g = spec.group_size
    if k % g or n % PACK:
        raise ConfigError(
            f"a ({n}, {k}) weight does not split into groups of {g} inputs and packs of 8 outputs"
        )
    groups = w.t().reshape(k // g, g, n)  # (K/g, g, N)
    scale, zero = int4_scale_zero(groups, spec.method, dim=1)  # (K/g, N)
    q = torch.round(groups / scale[:, None, :] + zero[:, None, :]).clamp(0, 15)
    return (q.reshape(k, n).to(torch.int32), zero.to(torch.int32), scale.to(torch.float16))


def fake_quantize_int4(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """W (N, K) through 4-bit codes and back, float32, without packing: equal to
    ``dequantize(quantize_weight(w, spec), spec)``, faster (calibration searches)."""
    n, k = w.shape
    codes, zeros, scales = _int4_codes(w.float(), spec)
    g = spec.group_size
    groups = codes.reshape(k // g, g, n) - zeros[:, None, :]
    return (groups.float() * scales.float()[:, None, :]).reshape(k, n).t()


def int4_scale_zero(group: torch.Tensor, method: str, dim: int) -> tuple[torch.Tensor, ...]:
    """(scale, zero) float32 of 4-bit groups reduced along ``dim``: AWQ asymmetric (zero
    in 0..15), GPTQ symmetric (zero 8); the scale already rounded to its stored float16."""
    if method == "awq":
        lo, hi = group.amin(dim=dim), group.amax(dim=dim)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    else:
        scale = (group.abs().amax(dim=dim) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    return scale.to(torch.float16).float(), zero  # the codes fit the stored scale


# ---------------------------------------------------------------- packing
def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) 4-bit codes -> (R, C/8) int32 in AWQ's interleaved nibble order."""
    r, c = codes.shape
    cols = codes.to(torch.int64).reshape(r, c // PACK, PACK)
    out = torch.zeros(r, c // PACK, dtype=torch.int64, device=codes.device)
    for nibble, col in enumerate(AWQ_PACK_ORDER):
        out |= cols[:, :, col] << (4 * nibble)
    return _to_int32(out)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/8) int32 in AWQ order -> (R, C) int32 codes."""
    r, c8 = packed.shape
    out = torch.empty(r, c8, PACK, dtype=torch.int32, device=packed.device)
    for nibble, col in enumerate(AWQ_PACK_ORDER):
        out[:, :, col] = (packed >> (4 * nibble)) & 0xF
    return out.reshape(r, c8 * PACK)


def pack_gptq_rows(codes: torch.Tensor) -> torch.Tensor:
    """(K, N) codes -> (K/8, N) int32, row k in nibble k % 8 of row k // 8."""
    k, n = codes.shape
    rows = codes.to(torch.int64).reshape(k // PACK, PACK, n)
    out = torch.zeros(k // PACK, n, dtype=torch.int64, device=codes.device)
    for nibble in range(PACK):
        out |= rows[:, nibble, :] << (4 * nibble)
    return _to_int32(out)


def unpack_gptq_rows(packed: torch.Tensor) -> torch.Tensor:
    """(K/8, N) int32 -> (K, N) int32 codes."""
    k8, n = packed.shape
    shifts = 4 * torch.arange(PACK, device=packed.device, dtype=torch.int32)
    return ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(k8 * PACK, n)


def pack_gptq_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """(K/g, N) zero points (1..15) -> (K/g, N/8) int32 holding zero - 1, in order."""
    r, n = zeros.shape
    cols = (zeros.to(torch.int64) - 1).reshape(r, n // PACK, PACK)
    out = torch.zeros(r, n // PACK, dtype=torch.int64, device=zeros.device)
    for nibble in range(PACK):
        out |= (cols[:, :, nibble] & 0xF) << (4 * nibble)
    return _to_int32(out)


def unpack_gptq_zeros(packed: torch.Tensor) -> torch.Tensor:
    """(K/g, N/8) int32 -> (K/g, N) zero points (the stored value + 1)."""
    r, n8 = packed.shape
    shifts = 4 * torch.arange(PACK, device=packed.device, dtype=torch.int32)
    return (((packed[:, :, None] >> shifts) & 0xF) + 1).reshape(r, n8 * PACK)


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """(R, C) values 0..15 -> (R, C/8) int32, column 8 w + j in nibble j of word w."""
    r, c = values.shape
    cols = values.to(torch.int64).reshape(r, c // PACK, PACK)
    out = torch.zeros(r, c // PACK, dtype=torch.int64, device=values.device)
    for nibble in range(PACK):
        out |= (cols[:, :, nibble] & 0xF) << (4 * nibble)
    return _to_int32(out)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/8) int32 -> (R, C) int32 values, nibble j of word w as column 8 w + j."""
    r, n8 = packed.shape
    shifts = 4 * torch.arange(PACK, device=packed.device, dtype=torch.int32)
    return ((packed[:, :, None] >> shifts) & 0xF).reshape(r, n8 * PACK)


def repack_awq(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An AWQ projection's checkpoint tensors in the engine's layout (module docstring):
    qweight (K, N/8) -> (K/8, N) packed along K; qzeros (K/g, N/8) in natural nibble order
    holding the zero; scales as they are. Same device; the same W, exactly."""
    qweight, qzeros = tensors["qweight"], tensors["qzeros"]
    if qweight.shape[0] % PACK:
        raise ValueError(f"repack_awq: qweight {list(qweight.shape)}; K must divide by 8")
    return {
        "qweight": pack_gptq_rows(unpack_awq(qweight)),
        "qzeros": pack_columns(unpack_awq(qzeros)),
        "scales": tensors["scales"],
    }


def awq_is_repacked(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether AWQ ``tensors`` are in :func:`repack_awq`'s layout: qweight as wide as scales
    (N columns) rather than N/8."""
    return tensors["qweight"].shape[1] == tensors["scales"].shape[1]


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return (x - ((x >> 31) & 1) * (1 << 32)).to(torch.int32)


# ---------------------------------------------------------------- dequantization
def dequantize(tensors: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """W (N, K) float32 from a projection's checkpoint tensors (AWQ: either layout; the
    references' weight)."""
    if spec.method in ("fp8", "int8"):
        return tensors["weight"].float() * tensors["weight_scale"].float().reshape(-1, 1)
    scales = tensors["scales"].float()
    if spec.method == "awq" and awq_is_repacked(tensors):
        codes, zeros = unpack_gptq_rows(tensors["qweight"]), unpack_columns(tensors["qzeros"])
    elif spec.method == "awq":
        codes, zeros = unpack_awq(tensors["qweight"]), unpack_awq(tensors["qzeros"])
    else:
        codes, zeros = unpack_gptq_rows(tensors["qweight"]), unpack_gptq_zeros(tensors["qzeros"])
    if spec.act_order:
        group = tensors["g_idx"].long()  # (K,): row k's group
    else:
        group = torch.arange(codes.shape[0], device=codes.device) // spec.group_size
    w_kn = (codes - zeros[group]).float() * scales[group]
    return w_kn.t()
