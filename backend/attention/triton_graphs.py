"""CUDA-graph metadata of the triton backend: static buffers, their padding, per-step fill.

Buffers are sized for the largest graph; each graph reads views of them. Padding rows have
seq len 0 or index -1 (the kernels skip them). Decode work items are cut on the device at
the start of every replay (:meth:`TritonGraphMetadata.graph_prologue`).
"""

from __future__ import annotations

import numpy as np
import torch

from sched_lab.backend.attention.base import (
    MAX_SPLITS,
    PREFILL_TILE_M,
    AttentionMetadata,
    GraphKey,
    GraphMetadata,
    decode_items,
    prefill_tiles,
)
from sched_lab.backend.attention.triton_kernels import decode_work_device

MIXED_DECODE_PROGRAMS = 4096  # most (decode row, kv head, split) programs of a mixed graph
FEW_DECODES = 32  # decode rows of the mixed graphs' variant for steps with few decodes


def mixed_splits(decode_rows: int, num_kv_heads: int, max_splits: int) -> int:
    """Context splits of a mixed graph's decode kernel: the largest power of two <=
    ``max_splits`` keeping ``decode_rows * num_kv_heads * splits`` within
    ``MIXED_DECODE_PROGRAMS``."""
    splits = 1
    while splits < max_splits and decode_rows * num_kv_heads * splits * 2 <= MIXED_DECODE_PROGRAMS:
        splits *= 2
    return splits


class TritonGraphMetadata(GraphMetadata):
    """Static attention buffers of the triton backend's CUDA graphs.

    Args:
        sizes: decode graph sizes; token_sizes: mixed graph token counts (either may be
            empty). max_seqs: sequence rows (at least the largest decode size).
    """

    def __init__(self, device: torch.device, block_size: int, max_model_len: int,
                 num_kv_heads: int, sizes: list[int], token_sizes: list[int],
                 max_seqs: int) -> None:  # fmt: skip
        self.device, self.block_size, self.max_model_len = device, block_size, max_model_len
        self.num_kv_heads, self.max_seqs = num_kv_heads, max_seqs
        self.pin = device.type == "cuda"
        self.max_blocks = -(-max_model_len // block_size)
        big = max(token_sizes, default=0)
        tokens = max(max(sizes, default=0), big)
        rows, dev, i32 = max_seqs, device, torch.int32
        # Normal (not inference-mode) tensors, so they may be updated in and out of it.
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(rows, dtype=i32, device=dev)
        self.seq_start_loc = torch.arange(rows + 1, dtype=i32, device=dev)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=i32, device=dev)
        # Decode graphs' constants.
        self.query_start_loc = torch.arange(rows + 1, dtype=i32, device=dev)
        self.seq_idx = torch.arange(rows, dtype=i32, device=dev)
        self.no_prefill = torch.zeros(0, dtype=i32, device=dev)
        # Mixed graphs' per-step buffers (sized for the largest token count).
        self.mixed_query_start_loc = torch.zeros(rows + 1, dtype=i32, device=dev)
        self.mixed_decode_idx = torch.full((self.decode_rows(big)[-1],), -1, dtype=i32, device=dev)
        self.mixed_tiles = torch.full((self.tile_rows(big), 2), -1, dtype=i32, device=dev)
        # Decode work items of either family.
        items = [self.decode_items(s) for s in sizes]
        items += [
            self.decode_items(r, mixed=True) for t in token_sizes for r in self.decode_rows(t)
        ]
        self.decode_work = torch.full((max(items, default=0), 3), -1, dtype=i32, device=dev)
        self.decode_work_loc = torch.zeros(rows + 1, dtype=i32, device=dev)

    # -- shapes ---------------------------------------------------------------------------

    def decode_rows(self, tokens: int) -> list[int]:
        """Decode-row variants of the mixed graphs of ``tokens`` tokens, ascending: up to
        ``FEW_DECODES`` and up to one per sequence (one entry when they coincide)."""
        return sorted({min(tokens, FEW_DECODES, self.max_seqs), min(tokens, self.max_seqs)})

    def decode_items(self, rows: int, mixed: bool = False) -> int:
        """Decode work items of a graph with ``rows`` decode rows."""
        splits = mixed_splits(rows, self.num_kv_heads, MAX_SPLITS) if mixed else None
        return decode_items(rows, self.num_kv_heads, splits)

    def tile_rows(self, tokens: int) -> int:
        """Prefill tile rows enough for any mixed step of ``tokens`` tokens:
        ``tokens / 64`` plus at most ``min(max_seqs, tokens // 2)`` chunks."""
        return -(-tokens // PREFILL_TILE_M) + min(self.max_seqs, tokens // 2)

    # -- metadata ---------------------------------------------------------------------------

    def metadata(self, key: GraphKey) -> AttentionMetadata:
        kind, size, rows = key
        return self.decode_metadata(size) if kind == "decode" else self.mixed_metadata(size, rows)

    def decode_metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata of the decode graph of ``size`` rows (all decodes)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            seq_start_loc=self.seq_start_loc[: size + 1],
            block_tables=self.block_tables[:size],
            decode_seq_idx=self.seq_idx[:size],
            prefill_seq_idx=self.no_prefill,
            block_size=self.block_size,
            # Host values are read only by the torch backend, which never runs here.
            query_lens=[1] * size,
            seq_lens_host=[1] * size,
            block_tables_host=[[0]] * size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_work=self.decode_work[: self.decode_items(size)],
            decode_work_loc=self.decode_work_loc[: size + 1],
        )

    def mixed_metadata(self, tokens: int, decode_rows: int | None = None) -> AttentionMetadata:
        """Attention metadata of the mixed graph of ``tokens`` tokens and ``decode_rows``
        (default: the most of that size)."""
        rows, nt = self.max_seqs, self.tile_rows(tokens)
        dec = decode_rows or self.decode_rows(tokens)[-1]
        tiles = self.mixed_tiles[:nt]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            query_start_loc=self.mixed_query_start_loc,
            seq_lens=self.seq_lens,
            seq_start_loc=self.seq_start_loc,
            block_tables=self.block_tables,
            decode_seq_idx=self.mixed_decode_idx[:dec],
            prefill_seq_idx=tiles[:, 0],  # padded, with repeats: only its length is read
            block_size=self.block_size,
            query_lens=[1] * rows,  # host values: not read by the triton backend
            seq_lens_host=[1] * rows,
            block_tables_host=[[0]] * rows,
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
            prefill_tiles=tiles,
            decode_work=self.decode_work[: self.decode_items(dec, mixed=True)],
            decode_work_loc=self.decode_work_loc[: dec + 1],
        )

    def graph_prologue(self, meta: AttentionMetadata) -> None:
        """Cut the decode work items from the staged lengths, on the device."""
        assert meta.decode_work is not None and meta.decode_work_loc is not None
        decode_work_device(meta.seq_lens, meta.decode_seq_idx, meta.decode_work,
                           meta.decode_work_loc)  # fmt: skip

    # -- per step -----------------------------------------------------------------------------

    def prepare_for_capture(self, key: GraphKey) -> None:
        self.slot_mapping[: key[1]].fill_(-1)
        self.seq_lens.fill_(0)  # no decode work items
        self.seq_start_loc.copy_(self.query_start_loc)
        self.block_tables.zero_()
        self.mixed_query_start_loc.zero_()
        self.mixed_decode_idx.fill_(-1)
        self.mixed_tiles.fill_(-1)
        self.decode_work.fill_(-1)
        self.decode_work_loc.zero_()

    def prepare_for_replay(
        self,
        key: GraphKey,
        query_lens: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: torch.Tensor,
    ) -> None:
        kind, size, dec = key
        n, width = block_tables.shape
        self.slot_mapping[:size].copy_(slot_mapping)
        if kind == "decode":  # seq lens then seq_start_loc; padding rows: length 0
            lens = self._host((2 * size + 1,), torch.int32)
            ln = lens.numpy()
            ln[:size] = 0
            ln[:n] = seq_lens
            ln[size] = 0
            np.cumsum(ln[:size], out=ln[size + 1 :])
            tables = self._host((size, width), torch.int32)
            t = tables.numpy()
            t[:n] = block_tables
            t[n:] = 0  # padding rows read block 0
            lens_d = lens.to(self.device, non_blocking=True)
            self.seq_lens[:size].copy_(lens_d[:size])
            self.seq_start_loc[: size + 1].copy_(lens_d[size:])
            self.block_tables[:size, :width].copy_(tables.to(self.device, non_blocking=True))
            return
        # Sequence-level int32 values, packed for one copy: seq lens, seq_start_loc,
        # query_start_loc, decode rows, tile table.
        rows, nt = self.max_seqs, self.tile_rows(size)
        sizes = [rows, rows + 1, rows + 1, dec, 2 * nt]
        packed = self._host((sum(sizes),), torch.int32)
        lens, seq_start, qstart, decodes, tiles = np.split(packed.numpy(), np.cumsum(sizes)[:-1])
        lens[:] = 1
        lens[:n] = seq_lens
        seq_start[0] = 0
        np.cumsum(lens, out=seq_start[1:])
        qstart[: n + 1] = query_start_loc
        qstart[n + 1 :] = query_start_loc[-1]  # rows of no sequence: empty
        decode_idx = np.flatnonzero(query_lens == 1)
        step_tiles = prefill_tiles(query_lens)
        assert len(decode_idx) <= dec and len(step_tiles) <= nt, "mixed graph rows too few"
        decodes[:] = -1
        decodes[: len(decode_idx)] = decode_idx
        tiles[:] = -1
        tiles.reshape(nt, 2)[: len(step_tiles)] = step_tiles
        table = self._host((n, width), torch.int32)
        table.numpy()[:] = block_tables
        parts = packed.to(self.device, non_blocking=True).split(sizes)
        self.seq_lens.copy_(parts[0])
        self.seq_start_loc.copy_(parts[1])
        self.mixed_query_start_loc.copy_(parts[2])
        self.mixed_decode_idx[:dec].copy_(parts[3])
        self.mixed_tiles[:nt].copy_(parts[4].view(nt, 2))
        self.block_tables[:n, :width].copy_(table.to(self.device, non_blocking=True))

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Fresh pinned memory each step: the caching host allocator does not hand a block
        # back out until the copy that read it has finished.
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
