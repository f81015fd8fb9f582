"""Quantize a Hugging Face checkpoint's layer projections (round to nearest, or calibrated
on prompts: AWQ's scales, GPTQ's update) into a new Hugging Face directory whose config.json
carries the ``quantization_config``.

Formats: :mod:`sched_lab.backend.quant_formats`. Only q/k/v/o/gate/up/down projections are
quantized; embeddings, norms and the LM head are copied. Each source shard becomes one
output shard (same file names, same index), so memory holds one shard at a time. Other files
of the directory (tokenizer, generation config) are copied. Written into a temporary
sibling and renamed, so a failure leaves no half-written ``--out``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sched_lab.backend.errors import CheckpointError
from sched_lab.backend.loader import INDEX_FILE, checkpoint_index, checkpoint_quantization
from sched_lab.backend.quant_formats import PROJECTIONS, QuantSpec, quantize_weight
from sched_lab.core.errors import ConfigError

_PROJECTION = re.compile(r"(.*\.(?:" + "|".join(PROJECTIONS) + r"))\.weight")


def quantize_checkpoint(
    model_dir: str | Path,
    out: str | Path,
    method: str,
    group_size: int = 128,
    calibration: str = "rtn",
    prompts: str | Path | None = None,
    act_order: bool = False,
) -> Path:
    """Write ``model_dir`` quantized by ``method`` into ``out`` (created; must not hold
    files); returns ``out``. ``calibration``: "rtn" (round to nearest) or "data" (awq and
    gptq: :mod:`~sched_lab.backend.tools.calibration` on ``prompts``, default the repo's
    prompt file; ``act_order`` for gptq). CheckpointError for an already quantized source,
    a weight the format cannot split, or an ``out`` in use; ConfigError for a bad option."""
    src, out = Path(model_dir), Path(out)
    spec = QuantSpec(method, group_size, act_order)
    if group_size < 16 or group_size % 16:
        raise ConfigError(f"--group-size: expected a positive multiple of 16, got {group_size}")
    if calibration not in ("rtn", "data"):
        raise ConfigError(f"--calibration: expected rtn or data, got {calibration!r}")
    if calibration == "data" and method not in ("awq", "gptq"):
        raise ConfigError(f"--calibration data: awq and gptq only, not {method}")
    if act_order and (method != "gptq" or calibration != "data"):
        raise ConfigError("--act-order: needs --method gptq --calibration data")
    if prompts is not None and calibration != "data":
        raise ConfigError("--calibration-prompts: only with --calibration data (rtn reads none)")
    prompts = Path(prompts) if prompts is not None else calibration_module().DEFAULT_PROMPTS
    if calibration == "data" and not prompts.is_file():
        what = "a folder, expected a YAML file" if prompts.is_dir() else "no such file"
        raise ConfigError(f"--calibration-prompts {prompts}: {what}")
    if checkpoint_quantization(src) is not None:
        raise CheckpointError(f"{src}/config.json: already quantized (quantization_config)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out}: exists and is not empty; choose another --out")
    index = checkpoint_index(src)
    bad = unsplittable(index, method, group_size)  # checked before anything is written
    if bad is not None:
        raise CheckpointError(
            f"{index[bad].file}: tensor {bad!r} of shape {list(index[bad].shape)}: {method} "
            f"needs inputs in groups of --group-size {group_size} and outputs in packs of 8"
        )
    calibrated: dict[str, torch.Tensor] = {}
    if calibration == "data":  # every calibrated tensor in memory before any is written
        calibrated = calibration_module().calibrate(src, spec, prompts)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(src, tmp, index, spec, calibrated)
    except BaseException:  # an error or Ctrl-C: no half-written sibling left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # empty (checked above)
    tmp.rename(out)
    return out


def _write(
    src: Path,
    tmp: Path,
    index: dict,
    spec: QuantSpec,
    calibrated: dict[str, torch.Tensor],
) -> None:
    """The quantized checkpoint of ``src`` (shards, index, config, other files) into the
    empty folder ``tmp``."""
    files = sorted({info.file for info in index.values()})
    weight_map: dict[str, str] = {}
    total_bytes = 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for file in files:
        tensors = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                match = _PROJECTION.fullmatch(name)
                if name in calibrated:  # AWQ: a norm with the scales folded in
                    tensors[name] = calibrated[name].to(f.get_tensor(name).dtype)
                    continue
                if match and f"{match.group(1)}.qweight" in calibrated:
                    for tensor in spec.tensor_names:
                        tensors[f"{match.group(1)}.{tensor}"] = calibrated[
                            f"{match.group(1)}.{tensor}"
                        ]
                    continue
                w = f.get_tensor(name)
                if match is None:
                    tensors[name] = w
                    continue
                for tensor, value in quantize_weight(w.to(device), spec).items():
                    tensors[f"{match.group(1)}.{tensor}"] = value.contiguous().cpu()
        save_file(tensors, tmp / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(files) > 1:
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index_json, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = spec.to_config()
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
            "config.json", INDEX_FILE,
        ):  # fmt: skip
            shutil.copy2(extra, tmp / extra.name)


def unsplittable(index: dict, method: str, group_size: int) -> str | None:
    """The first projection weight of ``index`` (a checkpoint's tensor name -> info with a
    ``shape`` (out, in)) that ``method`` (awq, gptq: 4-bit groups of ``group_size`` inputs,
    outputs packed by 8) cannot split; None if all split, or for another method."""
    if method not in ("awq", "gptq"):
        return None
    for name, info in index.items():
        rows, cols = info.shape if _PROJECTION.fullmatch(name) else (0, 0)
        if cols % group_size or rows % 8:
            return name
    return None


def calibration_module():
    """:mod:`sched_lab.backend.tools.calibration`, imported when used (it imports the runner)."""
    from sched_lab.backend.tools import calibration

    return calibration
