"""Rotary position embeddings (RoPE), "rotate half" layout as in the Llama family: a float32
cos/sin table, rotation in the activations' dtype (as transformers does)."""

from __future__ import annotations

import math
from typing import Any

import torch

from sched_lab.backend.config import ModelConfig


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """RoPE inverse frequencies, (head_dim // 2,) float32, with the checkpoint's scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 context extension: wavelengths above ``original / low_freq_factor`` are
    divided by ``factor``, those below ``original / high_freq_factor`` kept, and blended
    linearly in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # 0 for long wavelengths (scale fully), 1 for short ones (keep), linear in between.
    keep = ((original_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def rope_table(
    config: ModelConfig, max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [0, max_len), each (max_len, head_dim // 2) float32."""
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    positions = torch.arange(max_len, dtype=torch.int64).float()
    angles = positions[:, None] * inv_freq[None, :]  # (max_len, head_dim // 2)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x by its token's angle.

    Args:
        x: (num_tokens, num_heads, head_dim).
        cos, sin: (num_tokens, head_dim // 2), float32, already gathered by position.
    Returns:
        (num_tokens, num_heads, head_dim) in x's dtype.
    """
    cos = cos[:, None, :].to(x.dtype)  # (num_tokens, 1, head_dim // 2)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
