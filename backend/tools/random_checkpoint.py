"""Write a checkpoint with a real model's shapes and random weights, for timing the engine.

Writes config.json, safetensors shards of at most ``max_shard_bytes`` (plus an index when
several) and ``random_weights.json`` (random weights, no tokenizer). Weights ~ N(0, 0.02),
norms 1; drawn on the GPU when there is one, so a seed gives other weights with CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.dtypes import DTYPES
from sched_lab.backend.errors import CheckpointError
from sched_lab.backend.loader import INDEX_FILE, checkpoint_shapes

MARKER_FILE = "random_weights.json"
DEFAULT_MAX_SHARD_BYTES = 2 << 30  # 2 GiB


def write_random_checkpoint(
    config: dict[str, Any],
    out: str | Path,
    dtype: str = "bfloat16",
    seed: int = 0,
    std: float = 0.02,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    name: str = "custom",
) -> Path:
    """Write ``config`` with random weights into ``out`` (created); returns ``out``.
    An earlier random checkpoint in ``out`` is replaced (its shards, index and config
    removed); the marker is written first and config.json last, so a write stopped half way
    can be run again. CheckpointError if ``out`` holds anything else."""
    out = Path(out)
    if (
        out.exists()
        and (not out.is_dir() or any(out.iterdir()))
        and not (out / MARKER_FILE).is_file()
    ):
        raise CheckpointError(
            f"--out {out}: exists and is not a random checkpoint (no {MARKER_FILE}); "
            "refusing to write into it (move it, or choose another --out)"
        )
    out.mkdir(parents=True, exist_ok=True)
    # an earlier random checkpoint's shards and index, which the loader would read first;
    # config.json last, so that a folder stopped while writing is ours but not loadable
    for old in [*out.glob("*.safetensors"), out / INDEX_FILE, out / "config.json"]:
        old.unlink(missing_ok=True)
    marker = {
        "preset": name,
        "seed": seed,
        "std": std,
        "note": "random weights for timing; no tokenizer",
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2))
    torch_dtype = DTYPES[dtype]
    shapes = checkpoint_shapes(ModelConfig.from_dict(config, source=f"preset {name}"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    shards = _split_into_shards(shapes, torch_dtype.itemsize, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {n: _random_tensor(n, shapes[n], torch_dtype, std, generator) for n in names}
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        total = sum(torch.Size(s).numel() for s in shapes.values()) * torch_dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(
        json.dumps({**config, "torch_dtype": str(torch_dtype).removeprefix("torch.")}, indent=2)
    )
    return out


def _split_into_shards(
    shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _random_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float, gen: torch.Generator
) -> torch.Tensor:
    if name.endswith("norm.weight"):  # input/post-attention/final/q/k norms
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen, device=gen.device) * std).to(dtype).cpu()
