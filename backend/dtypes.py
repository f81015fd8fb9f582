"""Choosing the model dtype and checking that the device can run it.

CUDA: float32, bfloat16 (compute capability >= 8.0), float16. CPU: float32 and bfloat16
(float16 is refused). A tiny matmul probe catches anything else the device rejects.
"""

from __future__ import annotations

import torch

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.errors import DeviceError
from sched_lab.core.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """A dtype name, or "auto" for the checkpoint's ``torch_dtype`` (float32 if unstated)."""
    if name == "auto":
        name = config.torch_dtype or "float32"
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; known: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | torch.device) -> torch.device:
    """``torch.device(name)``; raises DeviceError for CUDA when none is available."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r}: only 'cpu' and 'cuda' are supported")
    return device


def check_dtype_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Raise DeviceError if ``device`` cannot (or, by policy, should not) compute in ``dtype``."""
    if device.type == "cpu" and dtype == torch.float16:
        raise DeviceError(
            "float16 on CPU is not supported (slow, emulated half matmuls); use float32 or bfloat16"
        )
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise DeviceError(
            f"bfloat16 is not supported on {name} (needs compute capability >= 8.0); use float16"
        )
    try:
        a = torch.ones(4, 4, device=device, dtype=dtype)
        (a @ a).sum().item()
    except RuntimeError as e:
        raise DeviceError(f"{device} cannot run {dtype} matmuls: {e}") from e
