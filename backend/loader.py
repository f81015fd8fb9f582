"""Load a Hugging Face safetensors checkpoint (single file or sharded) into a Transformer.

The checkpoint is validated before any tensor is read (CheckpointError naming the file or
tensor); the model is built on the meta device and materialised once on the target. With a
QuantSpec the layer projections are :class:`~sched_lab.backend.quant_linear.QuantLinear`:
filled from a quantized checkpoint's packed tensors, or quantized here (round to nearest,
one projection at a time on ``device``) from an unquantized one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sched_lab.backend.attention import AttentionBackend
from sched_lab.backend.attention.torch_ref import TorchAttention
from sched_lab.backend.config import ModelConfig
from sched_lab.backend.errors import CheckpointError
from sched_lab.backend.model import Transformer
from sched_lab.backend.quant_formats import QuantSpec, quantize_weight, spec_from_config
from sched_lab.backend.quant_linear import (
    QuantLinear,
    buffer_shapes,
    concat_dim,
    quantize_projections,
)
from sched_lab.backend.rope import rope_table

INDEX_FILE = "model.safetensors.index.json"
# fused parameter -> the checkpoint's projections, concatenated along the output dim
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    kn_weights: bool = False,
    quantization: QuantSpec | None = None,
) -> Transformer:
    """Build the model for ``config`` on ``device`` in ``dtype`` and fill it from the
    checkpoint; ``kn_weights`` (CUDA only) keeps projection weights in (K, N) order;
    ``quantization``: the layer projections' format (None: ``dtype`` like the rest)."""
    index = checkpoint_index(Path(model_dir))
    with torch.device("meta"):
        model = Transformer(config, backend)
        model = model.to(dtype=dtype)
        if quantization is not None:  # after .to(dtype): packed dtypes stay as they are
            quantize_projections(model, quantization)
    model = model.to_empty(device=device)
    packed = checkpoint_quantization(Path(model_dir)) is not None
    with _Reader() as reader:
        for name, param in model.named_parameters():
            param.data.copy_(
                _read_parameter(name, tuple(param.shape), config, index, reader, Path(model_dir))
            )
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear):
                _fill_quantized(name, module, config, index, reader, Path(model_dir), packed)
                module.repack_for_kernels()
    if kn_weights and device.type == "cuda":
        _store_layer_weights_kn(model)
    model.rope_cos, model.rope_sin = rope_table(config, max_model_len, device)
    return model.eval()


def checkpoint_quantization(model_dir: Path) -> QuantSpec | None:
    """The QuantSpec of ``model_dir/config.json``'s ``quantization_config`` (None: none);
    an unknown method is one ConfigError line naming the file."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
    return spec_from_config(raw.get("quantization_config"), str(path))


def _fill_quantized(
    name: str,
    module: QuantLinear,
    config: ModelConfig,
    index: dict[str, TensorInfo],
    reader: _Reader,
    model_dir: Path,
    packed: bool,
) -> None:
    """Fill one QuantLinear: its parts' packed tensors concatenated, or its dense weight
    quantized on the module's device."""
    spec, k = module.spec, module.in_features
    if not packed:
        dense = _read_parameter(f"{name}.weight", (module.out_features, k), config, index,
                                reader, model_dir)  # fmt: skip
        device = next(iter(module.tensors().values())).device
        for tensor, value in quantize_weight(dense.to(device), spec).items():
            getattr(module, tensor).copy_(value.reshape(getattr(module, tensor).shape))
        return
    rows = part_rows(f"{name}.weight", config, module.out_features)
    for tensor, buffer in module.tensors().items():
        parts = []
        for source, n in zip(checkpoint_names(f"{name}.{tensor}"), rows, strict=True):
            shape, _ = buffer_shapes(spec, k, n)[tensor]
            info = index.get(source)
            if info is None:
                raise CheckpointError(
                    f"{model_dir}: tensor {source!r} is missing from the checkpoint"
                )
            if info.shape != shape and not (tensor == "weight_scale" and info.shape == shape[:1]):
                raise CheckpointError(
                    f"{info.file}: tensor {source!r} has shape {list(info.shape)}, expected "
                    f"{list(shape)} ({spec.method})"
                )
            parts.append(reader.get(info.file, source).reshape(shape))
        if tensor == "g_idx":
            value = _check_g_idx(parts, spec, k, f"{model_dir}: {name}.g_idx")
        else:
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=concat_dim(spec, tensor))
        buffer.copy_(value)


def _check_g_idx(parts: list[torch.Tensor], spec: QuantSpec, k: int, where: str) -> torch.Tensor:
    """The one g_idx of a (fused) GPTQ projection: k // group_size without act-order; with
    it, any group of each row in 0..K/g - 1, the same in every fused part (they share their
    input, so GPTQ orders their columns alike). Otherwise one CheckpointError line."""
    value = parts[0]
    if not spec.act_order:
        if not torch.equal(value.long(), torch.arange(k) // spec.group_size):
            raise CheckpointError(
                f"{where} is not k // group_size, but quantization_config.desc_act is false"
            )
        return value
    if any(not torch.equal(p, value) for p in parts[1:]):
        raise CheckpointError(f"{where}: the fused parts' g_idx differ (act-order); not supported")
    if int(value.min()) < 0 or int(value.max()) >= k // spec.group_size:
        raise CheckpointError(
            f"{where}: values outside 0..{k // spec.group_size - 1} (groups of {spec.group_size})"
        )
    return value


def _store_layer_weights_kn(model: Transformer) -> None:
    """Keep each layer projection's (N, K) weight in (K, N) memory order (same logical
    tensor); the embedding and LM head keep theirs."""
    for module in model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


def checkpoint_index(model_dir: Path) -> dict[str, TensorInfo]:
    """Tensor name -> (file, shape) over all shards, after checking every file is whole."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e!r})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {INDEX_FILE} is missing")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors files (and no {INDEX_FILE})")
    index: dict[str, TensorInfo] = {}
    for f in files:
        for name, shape in read_header(f).items():
            index[name] = TensorInfo(f, shape)
    return index


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; CheckpointError if the file is cut
    short."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if header_len < 0 or 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from e
    header.pop("__metadata__", None)
    data_end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: its header needs {8 + header_len + data_end} bytes, "
            f"the file has {size}"
        )
    return {name: tuple(info["shape"]) for name, info in header.items()}


def checkpoint_names(param_name: str) -> list[str]:
    """The checkpoint tensors that make up one of our parameters, in concatenation order."""
    prefix = "" if param_name.startswith("lm_head.") else "model."
    for fused, parts in FUSED.items():
        if f".{fused}." in param_name:
            return [prefix + param_name.replace(fused, part) for part in parts]
    return [prefix + param_name]


def part_rows(param_name: str, config: ModelConfig, rows: int) -> list[int]:
    """Output rows of each checkpoint tensor of a (possibly fused) parameter."""
    if ".qkv_proj." in param_name:
        return [config.q_size, config.kv_size, config.kv_size]
    if ".gate_up_proj." in param_name:
        return [config.intermediate_size] * 2
    return [rows]


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for ``config`` must hold, name -> shape, in model order."""
    with torch.device("meta"):
        model = Transformer(
            config, TorchAttention(torch.device("meta"), torch.float32, block_size=16)
        )
    shapes = {}
    for name, param in model.named_parameters():
        for source, rows in zip(
            checkpoint_names(name), part_rows(name, config, param.shape[0]), strict=True
        ):
            shapes[source] = (rows, *param.shape[1:])
    return shapes


def _read_parameter(
    name: str,
    shape: tuple[int, ...],
    config: ModelConfig,
    index: dict[str, TensorInfo],
    reader: _Reader,
    model_dir: Path,
) -> torch.Tensor:
    parts = []
    for source, rows in zip(checkpoint_names(name), part_rows(name, config, shape[0]), strict=True):
        expected = (rows, *shape[1:])
        info = index.get(source)
        if info is None:
            raise CheckpointError(f"{model_dir}: tensor {source!r} is missing from the checkpoint")
        if info.shape != expected:
            raise CheckpointError(
                f"{info.file}: tensor {source!r} has shape {list(info.shape)}, expected {list(expected)}"
            )
        parts.append(reader.get(info.file, source))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


class _Reader:
    """Keeps one open safetensors handle per file while the parameters are filled."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def get(self, file: Path, name: str) -> torch.Tensor:
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file].get_tensor(name)  # type: ignore[attr-defined]

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
