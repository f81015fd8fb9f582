"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from sched_lab.core.errors import ConfigError
from sched_lab.core.kv_dtypes import FP8_E4M3_MAX

PREFILL_TILE_M = 64  # query rows of one prefill attention tile (the Triton kernel's BLOCK_M)
DECODE_TILE = 64  # key positions of one decode attention tile (the Triton kernel's BLOCK_N)
MAX_SPLITS = 16  # work items per decode row in the default item count (decode_items)
PREFILL_KERNELS = ("base", "exp2")  # engine.triton_prefill_kernel (set_prefill_kernel)
DECODE_TARGET_PROGRAMS = 4 * 132  # H100/H200 SXM: 132 SMs (NVIDIA H100 datasheet); 4 each


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's attention inputs, built once per step and shared by all layers.

    Device tensors:
        slot_mapping: (num_tokens,) int64 cache slot of each fed token.
        query_start_loc: (num_seqs + 1,) int32 cu_seqlens of the fed tokens.
        seq_lens: (num_seqs,) int32 context length after this step.
        seq_start_loc: (num_seqs + 1,) int32 cumulative ``seq_lens``.
        block_tables: (num_seqs, max_blocks) int32; entries past a sequence's blocks are unread.
        decode_seq_idx / prefill_seq_idx: int32 sequences fed one / more than one token;
            CUDA-graph metadata pads both with -1.
        prefill_tiles: (num_tiles, 2) int32 (sequence, tile), -1 rows are padding.

    Host: block_size (tokens per block); query_lens, seq_lens_host, block_tables_host lists;
    max_query_len, max_seq_len.

    Triton backend only (None: built per layer from the host values):
        decode_work: (num_items, 3) int32 (sequence, first pos, end pos), -1 rows padding.
        decode_work_loc: (num_decode_rows + 1,) int32; row r owns items [loc[r], loc[r+1]).
        decode_merge: False when no decode row has more than one item.
        varlen_seqs, varlen_tokens, varlen_max_len: the leading sequences whose chunks start
            at position 0 and run through FlashAttention varlen; 0 in CUDA graphs.
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
    """(num_tiles, 2) int32 (sequence, tile) of each ``tile``-row tile of the sequences fed
    more than one token. query_lens [130, 1, 64], tile 64 -> [[0,0], [0,1], [0,2], [2,0]]."""
    q = np.asarray(query_lens, dtype=np.int64)
    seqs = np.flatnonzero(q > 1)
    per_seq = -(-q[seqs] // tile)
    out = np.empty((int(per_seq.sum()), 2), dtype=np.int32)
    out[:, 0] = np.repeat(seqs, per_seq)
    out[:, 1] = np.arange(len(out)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    return out


def decode_items(rows: int, num_kv_heads: int, splits: int | None = None) -> int:
    """Decode-kernel work items for ``rows`` decode rows: ``splits`` per row plus
    ``rows // 4``; ``splits`` defaults to the smallest power of two (<= ``MAX_SPLITS``) that
    gives ``DECODE_TARGET_PROGRAMS`` programs."""
    if splits is None:
        want = -(-DECODE_TARGET_PROGRAMS // max(1, rows * num_kv_heads))
        splits = 1
        while splits < min(want, MAX_SPLITS):
            splits *= 2
    return rows * splits + rows // 4


def decode_work(
    seq_lens: np.ndarray, seq_idx: np.ndarray, num_items: int, tile: int = DECODE_TILE
) -> tuple[np.ndarray, np.ndarray]:
    """Split decode contexts into at most ``num_items`` near-equal work items (balanced
    split-K); each item covers ``k`` whole tiles of ``tile`` positions, ``k`` the smallest
    that fits.

    Args:
        seq_lens: (R,) context length of each decode row (including the fed token).
        seq_idx: (R,) sequence index of each row; -1 marks a padding row (no items).
        num_items: items of the kernel grid; unused ones are padding.
    Returns:
        work: (num_items, 3) int32 (sequence, first pos, end pos); padding (-1, 0, 0).
        loc: (R + 1,) int32; row r owns items [loc[r], loc[r + 1]).
    Raises:
        ValueError: fewer items than real rows.
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
    """:func:`decode_work` of an eager step's one-token sequences, and whether any has
    several items (the merge kernel is needed)."""
    rows = np.flatnonzero(np.asarray(query_lens) == 1)
    lens = np.asarray(seq_lens, dtype=np.int64)[rows]
    work, loc = decode_work(lens, rows, decode_items(len(rows), num_kv_heads))
    return work, loc, bool((np.diff(loc) > 1).any())


GraphKey = tuple[str, int, int]  # ("decode", size, size) or ("mixed", tokens, decode rows)


class GraphMetadata(ABC):
    """A backend's CUDA-graph attention metadata: static device buffers sized for the
    largest graph and the :class:`AttentionMetadata` views each graph reads.

    Graph keys: ``("decode", size, size)`` and ``("mixed", tokens, rows)`` (at most
    ``tokens`` tokens, ``max_seqs`` sequences, ``rows`` decodes).
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
        """Write one step, padded, into graph ``key``'s static buffers; does not wait.

        Args:
            query_lens, seq_lens: (n,) ints; query_start_loc: (n + 1,) ints.
            block_tables: (n, width) int32.
            slot_mapping: (T,) int64 on the device, T = the graph's token rows, padding -1.
        """

    def graph_prologue(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Device work each graph records before its forward (default: none)."""


class AttentionBackend(ABC):
    """Paged attention for one step: :meth:`store` then :meth:`attend`. Subclasses check at
    construction that they can run.

    Args:
        device: where the model and the KV cache live.
        dtype: dtype of q/k/v and, unless :meth:`set_kv_cache_dtype` says otherwise, of the
            cache.
        block_size: tokens per KV block.

    An FP8 cache (``torch.float8_e4m3fn``) holds k / k_scale and v / v_scale, saturated to
    +-448 on write; reads multiply by the scale. One (k_scale, v_scale) pair serves every
    layer (1.0, vLLM's value when no calibrated scales are given).
    """

    name: ClassVar[str]
    supports_graphs: ClassVar[bool] = False  # whether graph_metadata() is implemented
    supports_fp8_kv: ClassVar[bool] = False  # whether the cache may be float8_e4m3fn

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_dtype = dtype
        self.k_scale = self.v_scale = 1.0

    def set_kv_cache_dtype(
        self, kv_dtype: torch.dtype, k_scale: float = 1.0, v_scale: float = 1.0
    ) -> None:
        """Store the cache in ``kv_dtype`` (the model's dtype or ``torch.float8_e4m3fn``) with
        these scales; ConfigError if this backend cannot read an FP8 cache."""
        if kv_dtype == torch.float8_e4m3fn and not self.supports_fp8_kv:
            raise ConfigError(f"kv_cache.dtype: fp8 is not supported by attention backend "
                              f"{self.name!r}; use 'triton' or 'torch', or dtype auto")  # fmt: skip
        self.kv_dtype, self.k_scale, self.v_scale = kv_dtype, k_scale, v_scale

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
        """Store the fed tokens' k/v into their slots (mutates the caches), then attend.

        Args:
            q: (num_tokens, num_heads, head_dim).
            k, v: (num_tokens, num_kv_heads, head_dim); may be strided views.
            k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), contiguous.
            meta: the step's metadata.
            scale: softmax scale.
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
        """:meth:`attend`, also given the fed tokens' own k/v (for ``meta.varlen_seqs``)."""
        return self.attend(q, k_cache, v_cache, meta, scale)

    def set_prefill_attention(self, mode: str) -> None:
        """Choose the kernel of prefill chunks from position 0: ``auto``, ``triton`` or
        ``flash_varlen``; backends without a choice accept ``auto`` and ``triton``."""
        from sched_lab.backend.attention.flash_varlen import PREFILL_ATTENTION

        if mode not in PREFILL_ATTENTION:
            raise ConfigError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}; "
                              f"got {mode!r}")  # fmt: skip
        if mode == "flash_varlen":
            raise ConfigError(f"prefill_attention 'flash_varlen' needs the 'triton' attention "
                              f"backend; got {self.name!r}")  # fmt: skip

    def set_prefill_kernel(self, kernel: str) -> None:
        """The paged prefill kernel: ``base``, or ``exp2``
        (:mod:`sched_lab.backend.attention.prefill_exp2`, the triton backend only)."""
        if kernel not in PREFILL_KERNELS:
            raise ConfigError(f"triton_prefill_kernel must be one of {', '.join(PREFILL_KERNELS)}; "
                              f"got {kernel!r}")  # fmt: skip
        if kernel != "base":
            raise ConfigError(f"triton_prefill_kernel {kernel!r} needs the 'triton' attention "
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
        ``slot_mapping`` (num_tokens,) int64 (quantized for an FP8 cache)."""
        store_kv(k, v, k_cache, v_cache, slot_mapping, self.k_scale, self.v_scale)

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
        """An eager step's metadata with this backend's additions (default: unchanged)."""
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
        """Static CUDA-graph metadata for decode graphs of ``sizes`` rows and mixed graphs of
        ``token_sizes`` tokens over ``max_seqs`` rows. Only if ``supports_graphs``."""
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA-graph metadata")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v (num_tokens, num_kv_heads, head_dim) into the caches at ``slot_mapping``;
    an FP8 cache gets :func:`quantize_fp8` of k / k_scale and v / v_scale."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype == torch.float8_e4m3fn:  # no index_copy_ for fp8 on CPU: copy bytes
            x, cache = quantize_fp8(x, scale).view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to the nearest float8_e4m3fn, saturated to +-448 (no NaN from
    overflow), computed in float32."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached values in float32: an FP8 cache times ``scale``; others as they are."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.float() * scale
    return cache.float()
