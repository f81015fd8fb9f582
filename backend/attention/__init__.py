"""Attention backends, chosen by name: ``torch`` (reference, CPU and CUDA; the test oracle),
``triton`` (CUDA; CPU under ``TRITON_INTERPRET=1``) and ``flash_attn`` (CUDA, needs the
``flash-attn`` package, block_size % 256 == 0). Modules are named, not imported, so a missing
optional package is reported only when its backend is selected.
"""

from __future__ import annotations

import importlib

import torch

from sched_lab.backend.attention.base import AttentionBackend, AttentionMetadata, GraphMetadata
from sched_lab.backend.errors import DeviceError
from sched_lab.core.attention_names import ATTENTION_BACKENDS
from sched_lab.core.registry import Registry

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKENDS",
    "GraphMetadata",
    "get_attention_backend",
]

# name -> (module, class, pip requirement); the names (and the order errors list them in) are
# lab/core/attention_names.py's
_MODULES = {
    "torch": ("sched_lab.backend.attention.torch_ref", "TorchAttention", "torch"),
    "triton": ("sched_lab.backend.attention.triton_backend", "TritonAttention", "triton==3.6.0"),
    "flash_attn": (
        "sched_lab.backend.attention.flash_attn_backend",
        "FlashAttention",
        "flash-attn",
    ),
}
BACKENDS: Registry[tuple[str, str, str]] = Registry("attention backend", "known", sort=False)
for _name in ATTENTION_BACKENDS:
    BACKENDS.add(_name, _MODULES[_name])


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, block_size: int
) -> AttentionBackend:
    """Construct the backend called ``name``; raises DeviceError if it cannot run here."""
    module_name, class_name, requirement = BACKENDS.get(name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DeviceError(
            f"attention backend {name!r} needs a package that is not importable ({e}); "
            f"install it with `pip install {requirement}` or pick another of: {', '.join(BACKENDS)}"
        ) from e
    return getattr(module, class_name)(device, dtype, block_size)
