"""Paged attention through flash-attn 2.x (``flash_attn_varlen_func`` with a block table for
steps with prefill chunks, ``flash_attn_with_kvcache`` for all-decode steps).

UNTESTED: flash-attn is not installed on any machine this lab runs on; written against its
documented API. Needs ``page_block_size`` a multiple of 256 and fp16/bf16 tensors.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from sched_lab.backend.attention.base import AttentionBackend, AttentionMetadata
from sched_lab.backend.errors import DeviceError


class FlashAttention(AttentionBackend):
    name = "flash_attn"

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        super().__init__(device, dtype, block_size)
        if device.type != "cuda":
            raise DeviceError(f"attention backend 'flash_attn' needs a CUDA device (got {device})")
        if dtype not in (torch.float16, torch.bfloat16):
            raise DeviceError(
                f"attention backend 'flash_attn' runs float16/bfloat16 only (got {dtype})"
            )
        if block_size % 256 != 0:
            raise DeviceError(
                f"attention backend 'flash_attn' needs block_size a multiple of 256 for its paged "
                f"KV cache (got {block_size}); use 'triton' for smaller blocks"
            )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.num_prefills == 0:  # every sequence feeds one token
            out = flash_attn_with_kvcache(
                q.unsqueeze(1),  # (num_seqs, 1, num_heads, head_dim)
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.seq_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
