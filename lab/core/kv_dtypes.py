"""KV-cache dtypes (``kv_cache.dtype``, vLLM's ``--kv-cache-dtype``), importable without torch.

``auto`` stores K and V in the model's dtype; ``fp8`` in FP8 E4M3 (1 byte, 3 mantissa bits,
largest finite value 448; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"), each
value divided by a scale on write and multiplied by it on read. ``fp8_e4m3`` is an alias.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # accepted spellings; fp8_e4m3 means fp8
KV_ALIASES = {"fp8_e4m3": "fp8"}
FP8_E4M3_MAX = 448.0  # largest finite E4M3 value: writes saturate to +-this
FP8_BYTES = 1


def canonical_kv_dtype(name: str) -> str:
    """``auto`` or ``fp8`` for an accepted spelling (KV_CACHE_DTYPES)."""
    return KV_ALIASES.get(name, name)


def kv_dtype_bytes(name: str, model_dtype_bytes: int) -> int:
    """Bytes of one cached K or V element: the model's for ``auto``, 1 for ``fp8``."""
    return FP8_BYTES if canonical_kv_dtype(name) == "fp8" else model_dtype_bytes
