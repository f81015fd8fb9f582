"""The attention backend names (``engine.attention_backend``), importable without torch."""

from __future__ import annotations

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")
