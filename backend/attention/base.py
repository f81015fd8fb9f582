"""The attention backend interface and the per-step metadata every backend reads.

A step feeds each sequence a run of new tokens (a prefill chunk, or the one token of a
decode) whose KV goes into the paged cache at ``slot_mapping``; every fed token then attends
to all cached positions of its sequence up to and including its own (causal).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

PREFILL_TILE_M = 64  # query rows of one prefill attention tile (the Triton kernel's BLOCK_M)


@dataclass(frozen=True)
class AttentionMetadata:
    """What one step's attention needs, built once per step and shared by all layers.

    Device tensors (on the model's device):
        slot_mapping: (num_tokens,) int64; cache slot of each fed token,
            ``block_table[pos // block_size] * block_size + pos % block_size``.
        query_start_loc: (num_seqs + 1,) int32; token offsets of the sequences in the batch
            (cu_seqlens of the fed tokens).
        seq_lens: (num_seqs,) int32; context length after this step (start_pos + fed tokens).
        seq_start_loc: (num_seqs + 1,) int32; cumulative ``seq_lens`` (cu_seqlens of keys).
        block_tables: (num_seqs, max_blocks) int32; a row's entries beyond the blocks its
            sequence uses are never read (block 0 in eager steps, older values in CUDA-graph
            steps).
        decode_seq_idx: (num_decodes,) int32; sequences fed exactly one token.
        prefill_seq_idx: (num_prefills,) int32; sequences fed more than one token.
            CUDA-graph metadata pads both to a fixed length with -1 entries.
        prefill_tiles: (num_tiles, 2) int32; (sequence, tile) for every ``PREFILL_TILE_M``
            rows of every prefill chunk (:func:`prefill_tiles`); rows with sequence -1 are
            padding (CUDA graphs). Read by the triton backend.

    Host values:
        block_size: tokens per KV block.
        query_lens, seq_lens_host, block_tables_host: per-sequence Python lists.
        max_query_len, max_seq_len: maxima over the batch (kernel grid sizes).
        decode_splits: context splits of the triton decode kernel; None picks them from the
            batch (:func:`backend.attention.triton_kernels.num_splits`). CUDA graphs fix it.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    seq_start_loc: torch.Tensor
    block_tables: torch.Tensor
    decode_seq_idx: torch.Tensor
    prefill_seq_idx: torch.Tensor
    block_size: int
    query_lens: list[int]
    seq_lens_host: list[int]
    block_tables_host: list[list[int]]
    max_query_len: int
    max_seq_len: int
    prefill_tiles: torch.Tensor | None = None
    decode_splits: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_idx.numel())

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_idx.numel())


def prefill_tiles(query_lens: np.ndarray, tile: int = PREFILL_TILE_M) -> np.ndarray:
    """(num_tiles, 2) int32: (sequence index, tile index) of each ``tile``-row tile of the
    sequences fed more than one token, in order. query_lens: (num_seqs,) ints.

    Example: query_lens [130, 1, 64], tile 64 -> [[0, 0], [0, 1], [0, 2], [2, 0]].
    """
    q = np.asarray(query_lens, dtype=np.int64)
    seqs = np.flatnonzero(q > 1)
    per_seq = -(-q[seqs] // tile)
    out = np.empty((int(per_seq.sum()), 2), dtype=np.int32)
    out[:, 0] = np.repeat(seqs, per_seq)
    out[:, 1] = np.arange(len(out)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    return out


class AttentionBackend(ABC):
    """Paged attention for one step. Subclasses check at construction that they can run.

    Args:
        device: where the model and the KV cache live.
        dtype: dtype of q/k/v and of the cache.
        block_size: tokens per KV block.
    """

    name: ClassVar[str]

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size

    @abstractmethod
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
        """Store the fed tokens' k/v into their slots, then attend.

        Mutates ``k_cache`` and ``v_cache`` (the slots in ``meta.slot_mapping``).

        Args:
            q: (num_tokens, num_heads, head_dim).
            k, v: (num_tokens, num_kv_heads, head_dim); may be strided views.
            k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), contiguous.
            meta: the step's metadata.
            scale: softmax scale, usually head_dim ** -0.5.
        Returns:
            (num_tokens, num_heads, head_dim) in q's dtype.
        """


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k/v (num_tokens, num_kv_heads, head_dim) into the caches at ``slot_mapping``."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
