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

from lab.core.errors import ConfigError

PREFILL_TILE_M = 64  # query rows of one prefill attention tile (the Triton kernel's BLOCK_M)
DECODE_TILE = 64  # key positions of one decode attention tile (the Triton kernel's BLOCK_N)
MAX_SPLITS = 16  # work items per decode row in the default item count (decode_items)
DECODE_TARGET_PROGRAMS = 4 * 132  # H100/H200 SXM: 132 SMs (NVIDIA H100 datasheet); 4 each


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
            sequence uses are never read and may hold any value.
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

    Read by the triton backend only (set by its ``prepare_metadata`` and graph metadata;
    None: it builds them from the host values in every layer):
        decode_work: (num_items, 3) int32 device tensor; the decode kernel's work items,
            (sequence, first key position, end key position), from :func:`decode_work`;
            rows with sequence -1 are padding (CUDA graphs).
        decode_work_loc: (num_decode_rows + 1,) int32 device tensor; decode row ``r`` (an
            entry of ``decode_seq_idx``) owns items ``[loc[r], loc[r + 1])``.
        decode_merge: False when no decode row has more than one item (the merge kernel is
            then not launched); CUDA graphs keep it True.
        varlen_seqs: the leading sequences whose chunks start at position 0 and attend
            through FlashAttention's varlen kernel over their own k/v
            (:mod:`backend.attention.flash_varlen`); 0: none (always so in CUDA graphs).
        varlen_tokens: their tokens (the first rows of the step); varlen_max_len: their
            longest chunk (the kernel's grid).
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
    decode_work: torch.Tensor | None = None
    decode_work_loc: torch.Tensor | None = None
    decode_merge: bool = True
    varlen_seqs: int = 0
    varlen_tokens: int = 0
    varlen_max_len: int = 0

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


def decode_items(rows: int, num_kv_heads: int, splits: int | None = None) -> int:
    """How many work items the decode kernel gets for ``rows`` decode rows (its grid is
    items x kv heads): ``splits`` per row, plus ``rows // 4`` so that one long context can
    take more than an even share (:func:`decode_work`).

    ``splits`` defaults to the smallest power of two, at most ``MAX_SPLITS``, that gives
    ``DECODE_TARGET_PROGRAMS`` programs (several per SM): batch 1 with 8 kv heads -> 16 items,
    batch 32 -> 32 x 4 + 8 = 136, batch 256 -> 256 + 64 = 320.
    """
    if splits is None:
        want = -(-DECODE_TARGET_PROGRAMS // max(1, rows * num_kv_heads))
        splits = 1
        while splits < min(want, MAX_SPLITS):
            splits *= 2
    return rows * splits + rows // 4


def decode_work(
    seq_lens: np.ndarray, seq_idx: np.ndarray, num_items: int, tile: int = DECODE_TILE
) -> tuple[np.ndarray, np.ndarray]:
    """Split the decodes' contexts into at most ``num_items`` work items of near-equal length
    (balanced split-K, so that the longest context does not set the decode kernel's time).

    Every item covers ``k`` whole tiles of ``tile`` key positions (the last item of a
    context fewer), with ``k`` the smallest that needs at most ``num_items`` items in all;
    a context of L positions gets ``ceil(L / (k * tile))`` items.

    Args:
        seq_lens: (R,) ints; context length of each decode row (cached positions plus the
            fed token).
        seq_idx: (R,) ints; each row's sequence index in the step; -1 marks a padding row,
            which gets no items.
        num_items: items of the kernel grid (:func:`decode_items`); unused ones are padding.
    Returns:
        work: (num_items, 3) int32 rows (sequence, first position, end position), in row
            order; padding rows (-1, 0, 0).
        loc: (R + 1,) int32; row ``r`` owns items ``[loc[r], loc[r + 1])``.
    Raises:
        ValueError: fewer items than real rows.

    Example: lengths [300, 40], 4 items, tile 64 -> k = 2 tiles (1 tile needs 5 + 1 items):
    work [[0, 0, 128], [0, 128, 256], [0, 256, 300], [1, 0, 40]], loc [0, 3, 4].
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    idx = np.asarray(seq_idx, dtype=np.int64)
    tiles = (lens + (tile - 1)) // tile
    tiles[idx < 0] = 0
    real = int(np.count_nonzero(tiles))  # real rows: at least one position, one tile
    total = int(tiles.sum())
    if real > num_items:
        raise ValueError(f"decode_work: {real} decode rows need at least as many items, "
                         f"got {num_items}")  # fmt: skip
    # The smallest k with sum(ceil(tiles / k)) <= num_items lies in [lo, hi]: below lo even
    # exact division needs too many; hi fits, since ceil(t / k) <= t / k + 1 per row (or
    # it is the longest context: one item a row).
    lo = max(1, -(-total // max(1, num_items)))
    hi = int(tiles.max(initial=1))
    if num_items > real:
        hi = max(lo, min(hi, -(-total // (num_items - real))))
    while lo < hi:
        mid = (lo + hi) // 2
        if int(((tiles + (mid - 1)) // mid).sum()) <= num_items:
            hi = mid
        else:
            lo = mid + 1
    k = lo
    counts = (tiles + (k - 1)) // k
    loc = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(counts, out=loc[1:])
    total = int(loc[-1])
    row = np.repeat(np.arange(len(lens)), counts)
    work = np.empty((num_items, 3), dtype=np.int32)
    work[total:] = (-1, 0, 0)
    first = (np.arange(total) - loc[row]) * (k * tile)
    work[:total, 0] = idx[row]
    work[:total, 1] = first
    work[:total, 2] = np.minimum(first + k * tile, lens[row])
    return work, loc


def step_decode_work(
    query_lens: list[int], seq_lens: list[int], num_kv_heads: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Decode work items of an eager step from its host values: :func:`decode_work` of the
    sequences fed one token over :func:`decode_items` items; also whether any decode has
    several items (the merge kernel is needed)."""
    rows = np.flatnonzero(np.asarray(query_lens) == 1)
    lens = np.asarray(seq_lens, dtype=np.int64)[rows]
    work, loc = decode_work(lens, rows, decode_items(len(rows), num_kv_heads))
    return work, loc, bool((np.diff(loc) > 1).any())


GraphKey = tuple[str, int, int]  # ("decode", size, size) or ("mixed", tokens, decode rows)


class GraphMetadata(ABC):
    """A backend's CUDA-graph attention metadata: static device buffers sized for the
    largest graph, the :class:`AttentionMetadata` each graph reads from them, and how a
    step fills them. The graph runner (:mod:`backend.cuda_graphs`) stages the host arrays
    (:func:`backend.inputs.stage_step`), calls :meth:`prepare_for_replay`, and replays.

    Graph keys: ``("decode", size, size)``: ``size`` one-token rows; ``("mixed", tokens,
    rows)``: any step of at most ``tokens`` tokens over at most ``max_seqs`` sequences, with
    at most ``rows`` decodes (a variant of :meth:`decode_rows`).
    """

    @abstractmethod
    def decode_rows(self, tokens: int) -> list[int]:
        """The decode-row variants of the mixed graphs of ``tokens`` tokens, ascending."""

    @abstractmethod
    def metadata(self, key: GraphKey) -> AttentionMetadata:
        """The metadata graph ``key`` reads: views of the static buffers (no copies)."""

    @abstractmethod
    def prepare_for_capture(self, key: GraphKey) -> None:
        """Make every row graph ``key`` reads padding (before its warm-up and capture), so
        neither writes the KV cache."""

    @abstractmethod
    def prepare_for_replay(
        self,
        key: GraphKey,
        query_lens: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write one step into the static buffers of graph ``key``, padded (issues the
        copies; returns without waiting for them).

        Args:
            query_lens, seq_lens: (n,) ints; query_start_loc: (n + 1,) ints.
            block_tables: (n, width) int32; entries beyond a sequence's blocks are not read.
            slot_mapping: (T,) int64 on the device, T = the graph's token rows, padding -1.
        """

    def graph_prologue(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Device work each graph records before its forward (default: none)."""


class AttentionBackend(ABC):
    """Paged attention for one step. Subclasses check at construction that they can run.

    A step is :meth:`store` (write the fed tokens' k/v into their slots) then :meth:`attend`;
    the model's fused path (:mod:`backend.triton_ops`) stores k/v itself and calls
    :meth:`attend` alone.

    Args:
        device: where the model and the KV cache live.
        dtype: dtype of q/k/v and of the cache.
        block_size: tokens per KV block.
    """

    name: ClassVar[str]
    supports_graphs: ClassVar[bool] = False  # whether graph_metadata() is implemented

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size

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
        self.store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend_with_kv(q, k, v, k_cache, v_cache, meta, scale)

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
        """:meth:`attend`, also given the fed tokens' own k/v (already stored in the
        caches), for backends that attend chunks from position 0 over them
        (``meta.varlen_seqs``). Default: :meth:`attend`."""
        return self.attend(q, k_cache, v_cache, meta, scale)

    def set_prefill_attention(self, mode: str) -> None:
        """Choose the kernel of prefill chunks that start at position 0: ``auto``,
        ``triton`` (the backend's own kernels) or ``flash_varlen``
        (:mod:`backend.attention.flash_varlen`). Backends without a choice accept ``auto``
        and ``triton`` (both mean their own kernels)."""
        from backend.attention.flash_varlen import PREFILL_ATTENTION

        if mode not in PREFILL_ATTENTION:
            raise ConfigError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}; "
                              f"got {mode!r}")  # fmt: skip
        if mode == "flash_varlen":
            raise ConfigError(f"prefill_attention 'flash_varlen' needs the 'triton' attention "
                              f"backend; got {self.name!r}")  # fmt: skip

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write k/v (num_tokens, num_kv_heads, head_dim) into the caches at
        ``slot_mapping`` (num_tokens,) int64."""
        store_kv(k, v, k_cache, v_cache, slot_mapping)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of q (num_tokens, num_heads, head_dim) over caches that already
        hold this step's k/v. Returns (num_tokens, num_heads, head_dim) in q's dtype; does
        not mutate the caches."""

    def prepare_metadata(self, meta: AttentionMetadata, num_kv_heads: int) -> AttentionMetadata:
        """An eager step's metadata with what this backend adds, built once per step rather
        than in every layer (default: ``meta`` unchanged)."""
        return meta

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:  # noqa: B027
        """Compile or load this backend's kernels for these caches (default: nothing)."""

    def graph_metadata(
        self,
        num_kv_heads: int,
        max_model_len: int,
        sizes: list[int],
        token_sizes: list[int],
        max_seqs: int,
    ) -> GraphMetadata:
        """The static CUDA-graph metadata for decode graphs of ``sizes`` rows and mixed
        graphs of ``token_sizes`` tokens over ``max_seqs`` sequence rows (block tables
        ``ceil(max_model_len / block_size)`` wide). Only backends with ``supports_graphs``."""
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA-graph metadata")


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
