"""Paged attention with the Triton kernels of :mod:`sched_lab.backend.attention.triton_kernels`: at
most three kernels per layer (store, prefill, decode). The only graph-safe backend
(:class:`TritonGraphMetadata`). Eager steps may attend chunks from position 0 with
FlashAttention varlen (``prefill_attention``; :mod:`sched_lab.backend.attention.flash_varlen`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from sched_lab.backend.attention import flash_varlen, triton_kernels
from sched_lab.backend.attention.base import (
    PREFILL_KERNELS,
    AttentionBackend,
    AttentionMetadata,
    step_decode_work,
)
from sched_lab.backend.attention.triton_graphs import TritonGraphMetadata
from sched_lab.backend.errors import DeviceError


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_graphs = True
    supports_fp8_kv = True  # the kernels dequantize FP8 tiles (triton_kernels module doc)

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        super().__init__(device, dtype, block_size)
        if device.type != "cuda" and not interpreting():
            raise DeviceError(
                f"attention backend 'triton' needs a CUDA device (got {device}); "
                "use 'torch' on CPU, or set TRITON_INTERPRET=1 before importing triton to test"
            )
        self.prefill_attention = "auto"
        self.prefill_kernel = "base"
        self._prefill = triton_kernels.prefill_attention  # the kernel set_prefill_kernel chose
        self.varlen = flash_varlen.available(device, dtype)  # auto: use it where it wins

    def set_prefill_attention(self, mode: str) -> None:
        """``auto`` (varlen where the rule says it wins, when it can run here), ``triton``,
        or ``flash_varlen`` (every eligible step; DeviceError where it cannot run)."""
        if mode not in flash_varlen.PREFILL_ATTENTION:
            super().set_prefill_attention(mode)  # the one-line error
        if mode == "flash_varlen" and not flash_varlen.available(self.device, self.dtype):
            raise DeviceError(
                f"prefill_attention 'flash_varlen' needs torch.nn.attention.varlen on CUDA with "
                f"float16/bfloat16 (got {self.device}, {self.dtype}); use 'auto' or 'triton'"
            )
        self.prefill_attention = mode

    def set_prefill_kernel(self, kernel: str) -> None:
        """``base`` (:func:`triton_kernels.prefill_attention`) or ``exp2``
        (:mod:`sched_lab.backend.attention.prefill_exp2`) for the paged prefill tiles."""
        if kernel not in PREFILL_KERNELS:
            super().set_prefill_kernel(kernel)  # the one-line error
        if kernel == "exp2":  # an option's file: imported only by an engine that runs it
            from sched_lab.backend.attention.prefill_exp2 import prefill_attention
        else:
            prefill_attention = triton_kernels.prefill_attention
        self.prefill_kernel, self._prefill = kernel, prefill_attention

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        triton_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping, self.k_scale, self.v_scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._attend(q.contiguous(), k_cache, v_cache, meta, scale, None)

    def attend_with_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The leading ``meta.varlen_seqs`` chunks through varlen_attn over their own k/v,
        the rest (decodes) through the paged kernels."""
        q = q.contiguous()
        if not meta.varlen_seqs:
            return self._attend(q, k_cache, v_cache, meta, scale, None)
        tokens = meta.varlen_tokens
        prefill = flash_varlen.varlen_prefill(
            q[:tokens], k[:tokens], v[:tokens], meta.query_start_loc[: meta.varlen_seqs + 1],
            meta.varlen_max_len, scale,
        )  # fmt: skip
        if tokens == q.shape[0]:
            return prefill
        return self._attend(q, k_cache, v_cache, meta, scale, prefill)

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        prefill: torch.Tensor | None,
    ) -> torch.Tensor:
        """Paged attention; ``prefill``: the leading chunks' output, already computed."""
        out = torch.empty_like(q)
        common = (k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens)
        if prefill is not None:
            out[: prefill.shape[0]].copy_(prefill)
        elif meta.num_prefills:
            assert meta.prefill_tiles is not None, "prefill steps need meta.prefill_tiles"
            self._prefill(q, *common, meta.prefill_tiles, scale, self.k_scale, self.v_scale)
        if meta.num_decodes:
            work, loc, merge = meta.decode_work, meta.decode_work_loc, meta.decode_merge
            if work is None or loc is None:  # built here in every layer (tests)
                w, lc, merge = step_decode_work(meta.query_lens, meta.seq_lens_host,
                                                k_cache.shape[2])  # fmt: skip
                work, loc = torch.from_numpy(w).to(q.device), torch.from_numpy(lc).to(q.device)
            triton_kernels.decode_attention(q, *common, work, loc, scale, merge,
                                            k_scale=self.k_scale, v_scale=self.v_scale)  # fmt: skip
        return out

    def prepare_metadata(self, meta: AttentionMetadata, num_kv_heads: int) -> AttentionMetadata:
        """Adds the varlen choice and the decode work items."""
        if meta.num_prefills and (self.varlen or self.prefill_attention == "flash_varlen"):
            n = flash_varlen.choose(self.prefill_attention, meta.query_lens, meta.seq_lens_host)
            if n:
                lens = meta.query_lens[:n]
                meta = dataclasses.replace(meta, varlen_seqs=n, varlen_tokens=sum(lens),
                                           varlen_max_len=max(lens))  # fmt: skip
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
            triton_kernels.warm_up(k_cache, v_cache, num_heads, 1.0, self.dtype)

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
