"""Paged attention with the Triton kernels of :mod:`backend.attention.triton_kernels`.

The fast path on the H200 (flash-attn is not installed there). One step launches at most
four kernels per layer: store k/v, prefill over the sequences fed several tokens, decode over
the sequences fed one (and its split merge). The model's fused path stores k/v itself
(:func:`backend.triton_ops.qkv_prepare`) and calls :meth:`TritonAttention.attend`. The only
graph-safe backend: its CUDA-graph metadata is :class:`TritonGraphMetadata`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from backend.attention import triton_kernels
from backend.attention.base import AttentionBackend, AttentionMetadata, step_decode_work
from backend.attention.triton_graphs import TritonGraphMetadata
from backend.errors import DeviceError


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_graphs = True

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        super().__init__(device, dtype, block_size)
        if device.type != "cuda" and not interpreting():
            raise DeviceError(
                f"attention backend 'triton' needs a CUDA device (got {device}); "
                "use 'torch' on CPU, or set TRITON_INTERPRET=1 before importing triton to test"
            )

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        triton_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        q = q.contiguous()
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

    def prepare_metadata(self, meta: AttentionMetadata, num_kv_heads: int) -> AttentionMetadata:
        """Adds the decode kernel's work items (:func:`step_decode_work`) when the step has
        decodes."""
        if not meta.num_decodes:
            return meta
        work, loc, merge = step_decode_work(meta.query_lens, meta.seq_lens_host, num_kv_heads)
        pin = self.device.type == "cuda"
        work_d = torch.from_numpy(work).pin_memory() if pin else torch.from_numpy(work)
        loc_d = torch.from_numpy(loc).pin_memory() if pin else torch.from_numpy(loc)
        return dataclasses.replace(
            meta,
            decode_work=work_d.to(self.device, non_blocking=True),
            decode_work_loc=loc_d.to(self.device, non_blocking=True),
            decode_merge=merge,
        )

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
        if k_cache.device.type == "cuda":  # the interpreter compiles nothing
            triton_kernels.warm_up(k_cache, v_cache, num_heads, 1.0)

    def graph_metadata(
        self,
        num_kv_heads: int,
        max_model_len: int,
        sizes: list[int],
        token_sizes: list[int],
        max_seqs: int,
    ) -> TritonGraphMetadata:
        return TritonGraphMetadata(self.device, self.block_size, max_model_len, num_kv_heads,
                                   sizes, token_sizes, max_seqs)  # fmt: skip
