"""The attention backend names (``engine.attention_backend``), as plain data.

One list for the config, which checks the key without importing torch, and for
``backend/attention/``, which maps each name to its module.
"""

from __future__ import annotations

ATTENTION_BACKENDS = ("torch", "triton", "flash_attn")
