"""Paged attention with the Triton kernels of :mod:`backend.attention.triton_kernels`.

The fast path on the H200 (flash-attn is not installed there). One step launches at most
four kernels per layer: store k/v, prefill over the sequences fed several tokens, decode over
the sequences fed one (and its split merge). The model's fused path stores k/v itself
(:func:`backend.triton_ops.qkv_prepare`) and calls :meth:`TritonAttention.attend`.
"""

from __future__ import annotations

import torch
import triton

from backend.attention import triton_kernels
from backend.attention.base import AttentionBackend, AttentionMetadata, step_decode_work
from backend.errors import DeviceError


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        super().__init__(device, dtype, block_size)
        if device.type != "cuda" and not interpreting():
            raise DeviceError(
                f"attention backend 'triton' needs a CUDA device (got {device}); "
                "use 'torch' on CPU, or set TRITON_INTERPRET=1 before importing triton to test"
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        triton_kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q.contiguous(), k_cache, v_cache, meta, scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of q (num_tokens, num_heads, head_dim), contiguous, over caches that
        already hold this step's k/v (the fused path of :mod:`backend.triton_ops` stores them)."""
        out = torch.empty_like(q)
        common = (k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens)
        if meta.num_prefills:
            assert meta.prefill_tiles is not None, "prefill steps need meta.prefill_tiles"
            triton_kernels.prefill_attention(q, *common, meta.prefill_tiles, scale)
        if meta.num_decodes:
            work, loc, merge = meta.decode_work, meta.decode_work_loc, meta.decode_merge
            if work is None or loc is None:  # built here in every layer (tests)
                w, lc, merge = step_decode_work(meta.query_lens, meta.seq_lens_host,
                                                k_cache.shape[2])  # fmt: skip
                work, loc = torch.from_numpy(w).to(q.device), torch.from_numpy(lc).to(q.device)
            triton_kernels.decode_attention(q, *common, work, loc, scale, merge)
        return out
