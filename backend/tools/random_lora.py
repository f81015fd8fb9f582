"""Write random LoRA adapters in Hugging Face PEFT format for a checkpoint, for timing and tests.

Each adapter is a folder ``lora-{i}`` with ``adapter_config.json`` and
``adapter_model.safetensors`` (PEFT's tensor names, the model's projection shapes). A and B
are ~ N(0, std); B is nonzero (unlike PEFT's initialisation), so every adapter changes the
model's outputs. A marker file lets a later call replace the folder's adapters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.errors import CheckpointError
from sched_lab.backend.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE, module_shapes, tensor_name

MARKER_FILE = "random_lora.json"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_random_loras(
    model_dir: str | Path,
    out: str | Path,
    count: int,
    rank: int,
    alpha: float | None = None,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    seed: int = 0,
    std: float = 0.02,
    dtype: str = "bfloat16",
) -> list[Path]:
    """Write ``count`` adapters of rank ``rank`` (lora_alpha ``alpha``, default 2 * rank)
    for the checkpoint in ``model_dir`` into ``out/lora-{i}``; returns the folders.
    An earlier write's adapters in ``out`` are replaced; CheckpointError (one line) for a
    bad argument or an ``out`` holding anything else."""
    from sched_lab.backend.dtypes import DTYPES

    if count < 1 or rank < 1:
        raise CheckpointError(f"--count ({count}) and --rank ({rank}) must be >= 1")
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise CheckpointError(
            f"--targets: {bad[0] if bad else 'empty'!r} is not a module; expected some of "
            f"{','.join(TARGETS)}"
        )
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: expected one of {', '.join(sorted(DTYPES))}")
    config = ModelConfig.from_dir(Path(model_dir).expanduser())
    shapes = module_shapes(config)
    side, name = min((min(shapes[t]), t) for t in targets)
    if rank > side:  # a rank past a projection's smaller side adds nothing but memory
        raise CheckpointError(
            f"--rank {rank}: larger than {name}'s smaller side ({side}); a LoRA of that rank "
            "is no longer low-rank (expected <= the smallest targeted projection's side)"
        )
    out = Path(out).expanduser()
    if (
        out.exists()
        and (not out.is_dir() or any(out.iterdir()))
        and not (out / MARKER_FILE).is_file()
    ):
        raise CheckpointError(
            f"--out {out}: exists and is not a folder of random adapters (no {MARKER_FILE}); "
            "refusing to write into it (move it, or choose another --out)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("lora-*"):  # an earlier write's adapters, some maybe past ``count``
        if old.is_dir():
            shutil.rmtree(old)
    alpha = float(2 * rank if alpha is None else alpha)
    generator = torch.Generator().manual_seed(seed)
    folders = []
    for i in range(count):
        folder = out / f"lora-{i}"
        folder.mkdir(exist_ok=True)
        tensors = {}
        for layer in range(config.num_layers):
            for m in targets:
                fan_in, fan_out = shapes[m]
                a = torch.randn(rank, fan_in, generator=generator) * std
                b = torch.randn(fan_out, rank, generator=generator) * std
                tensors[tensor_name(layer, m, "A")] = a.to(DTYPES[dtype])
                tensors[tensor_name(layer, m, "B")] = b.to(DTYPES[dtype])
        save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
        peft_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(targets),
            "base_model_name_or_path": str(Path(model_dir).expanduser()),
        }
        (folder / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2))
        folders.append(folder)
    marker = {"count": count, "rank": rank, "seed": seed, "std": std, "note": "random adapters"}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2))
    return folders
