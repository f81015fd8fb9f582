"""CUDA graphs for every step of a bounded size: decode-only steps and mixed steps.

A step of a small model is launch-bound: ~10 kernels per layer, each a few microseconds of
GPU work behind tens of microseconds of Python and launcher overhead (a 512-token chunk plus
32 decodes on Qwen3-0.6B, eagerly: 12.5 ms of wall time for 3.5 ms of GPU work; in a graph
4.3 ms, BENCHMARKS.md). A
CUDA graph records the forward once per size and replays it with one launch. Two families
share one set of static buffers and one memory pool:

* Decode graphs, one per batch size (``sizes``): a step of ``n`` one-token decodes runs in
  the graph of the smallest size ``>= n`` (:func:`pick_size`); rows ``n..size-1`` are
  padding. The whole forward, logits included, is in the graph.
* Mixed graphs, one per token count (``token_sizes``): any other step of ``N`` tokens over at
  most ``max_num_seqs`` sequences runs in the graph of the smallest token size ``>= N``
  (prefill chunks, decodes, or both). The attention kernels' grids are fixed by the size:
  prefill runs over a padded tile table (``ceil(T / 64) + min(max_num_seqs, T // 2)``
  rows, enough for any step of ``T`` tokens, see
  :func:`backend.attention.base.prefill_tiles`), decode over a fixed number of padded rows
  and work items (:meth:`StepGraphs.decode_items`, from :func:`mixed_splits` items a
  row, plus ``rows // 4`` to spare). Each token count has two variants: ``min(T, 32)``
  decode rows with 16 items a row (at most 8 kv heads), for steps with few decodes, and
  ``min(T, max_num_seqs)`` rows with fewer (2 at 256 rows, 8 kv heads). (With one variant and a fixed split count per decode, a few decodes ran in
  2 splits each, so one long context set the kernel's time: on the Azure code trace,
  2k-token chunks with ~11 decodes took 13.1 ms where the profile predicted 11.7 ms; the
  work items now share any step's contexts evenly.) Padding entries are -1 and the kernels
  skip them.
  The graph ends at the final norm; the logits of the sampled rows are computed after it
  (their number varies).

Static buffers, allocated once: token rows (input ids, positions, slot mapping) for the
largest size of either family; sequence rows (seq lens, ``seq_start_loc``, block tables
``(rows, ceil(max_model_len / block_size))``); the decode graphs' constants
(``query_start_loc = arange``, ``decode_seq_idx = arange``); the mixed graphs'
``query_start_loc``, decode index and tile table; the decode work items of either family
(:func:`backend.attention.base.decode_work`). Each step writes its values into them (host
staging + ``copy_``), except the work items: each graph starts with a kernel that cuts them
from the staged lengths (:func:`backend.attention.triton_kernels.decode_work_device`).
Made on the host, they cost ~50 us of numpy and two more copies per step, and decode steps
of uniform contexts took 4-9% longer than with the earlier fixed splits at most batch
sizes; cut on the device, 0-4% (same-machine A/B runs, BENCHMARKS.md).

* Block tables are staged incrementally: a host mirror keeps what each row holds and the
  list it came from. A sequence whose ``block_table`` is the same list object as a row of
  the previous step (lists are only appended to between steps, see ``SeqInput``) gets that
  row moved to its place and only its new entries converted; other rows are converted
  whole, and so is a known list whose last converted entry changed (a rewrite in place,
  outside the contract, is caught that way unless it keeps that entry). Python int -> int32
  conversion is the cost this saves: staging a decode batch of 256 with 1k-token contexts
  took 1.17 ms of host time, now 0.30 ms (2-core dev box).
* Padding token rows: token 0 at position 0, slot -1 (the Triton store kernel skips negative
  slots, so they write nothing). Padding rows of either family get no decode work items
  (decode padding rows have seq len 0, mixed ones decode index -1), so no attention
  program reads or writes for them and their outputs are whatever the memory held
  (row-wise ops keep that out of real rows). Real blocks are never written.
* Capture (CUDA): after the KV cache exists, mixed sizes then decode sizes, each family
  largest first, one shared memory pool; each size runs once eagerly on a side stream
  first (Triton compiles, cuBLAS warms up), with every row padding, so neither warm-up nor
  capture touches the cache.
* Sampling stays outside the graphs, on the logits rows of the real sequences.

Only the ``triton`` attention backend is graph-safe (``torch`` reads host lists per step;
``flash_attn`` is untested). Steps beyond the largest sizes and non-CUDA devices run
eagerly. On a non-CUDA device the same padded static-buffer path can run without capture
(``capture=False``), which is how the CPU tests check the padding.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import numpy as np
import torch

from backend.attention import AttentionMetadata
from backend.attention.base import MAX_SPLITS, PREFILL_TILE_M, decode_items, prefill_tiles
from backend.inputs import SeqInput, check_seq
from backend.kv_cache import KVCache
from backend.model import Transformer

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Token counts of the mixed graphs: 16, multiples of 32 below 512 (weights dominate there),
# then 16 evenly spaced sizes per octave up to 8192, so padding adds at most 1/16 of a
# larger step's tokens. (A first list of 17 sizes with steps of up to 1/3 padded a
# 544-token step to 768 tokens: +11% GPU time.)
DEFAULT_TOKEN_SIZES = (16,) + tuple(range(32, 512, 32)) + tuple(
    (1 << k) + i * (1 << k) // 16 for k in range(9, 13) for i in range(16)
) + (8192,)  # fmt: skip
MIXED_DECODE_PROGRAMS = 4096  # most (decode row, kv head, split) programs of a mixed graph
FEW_DECODES = 32  # decode rows of the mixed graphs' variant for steps with few decodes


def graph_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_GRAPH_SIZES) -> list[int]:
    """The sizes to capture, ascending: ``sizes`` up to ``max_num_seqs``, plus
    ``max_num_seqs`` itself when it falls between two of them (so every batch the scheduler
    can form fits, unless it is larger than the largest of ``sizes``). Also used for the
    token sizes, with ``max_num_batched_tokens`` as the limit. An empty ``sizes`` gives []."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not sizes:
        return []
    if min(sizes) < 1:
        raise ValueError(f"CUDA graph sizes must be >= 1, got {list(sizes)}")
    out = sorted({s for s in sizes if s <= max_num_seqs})
    if max_num_seqs <= max(sizes) and (not out or out[-1] < max_num_seqs):
        out.append(max_num_seqs)
    return out


def pick_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None if none does."""
    for s in sorted(sizes):
        if s >= num_seqs:
            return s
    return None


def mixed_splits(decode_rows: int, num_kv_heads: int, max_splits: int) -> int:
    """Context splits of a mixed graph's decode kernel: the largest power of two, at most
    ``max_splits``, that keeps ``decode_rows * num_kv_heads * splits`` within
    ``MIXED_DECODE_PROGRAMS`` (the grid is fixed, and padded rows are most of it when a
    step has few decodes). Example: 256 rows, 8 kv heads -> 2; 32 rows -> 16 (of 16)."""
    splits = 1
    while splits < max_splits and decode_rows * num_kv_heads * splits * 2 <= MIXED_DECODE_PROGRAMS:
        splits *= 2
    return splits


class StepGraphs:
    """Static buffers and (on CUDA) one captured graph per size, for decode-only steps
    (``sizes``, batch sizes) and mixed steps (``token_sizes``, token counts).

    Args:
        model: the loaded model; its attention backend must be ``triton``.
        kv_cache: the runner's cache; graphs bake in its per-layer tensors.
        block_size: tokens per block. max_model_len: sizes the static block-table width.
        vocab_size: for validating each step's inputs.
        sizes: decode batch sizes (see :func:`graph_sizes`).
        token_sizes: mixed-step token counts (may be empty: no mixed graphs).
        max_num_seqs: most sequences of a mixed step (sizes the sequence rows).
        capture: record CUDA graphs (CUDA only); False runs the same padded static-buffer
            forward eagerly (CPU tests).
    """

    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        sizes: Sequence[int],
        token_sizes: Sequence[int],
        max_num_seqs: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.sizes = sorted(sizes)
        self.token_sizes = sorted(token_sizes)
        self.capture = capture
        self.device = kv_cache.gpu.device
        self.pin = self.device.type == "cuda"
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.max_seqs = max(self.max_size, max_num_seqs if self.token_sizes else 0)
        self.max_blocks = -(-max_model_len // block_size)  # static block-table width
        tokens = max(self.max_size, self.token_sizes[-1] if self.token_sizes else 0)
        rows, dev = self.max_seqs, self.device
        # Normal (not inference-mode) tensors, so they may be updated in and out of it.
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.seq_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev)
        # Decode graphs' constants.
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.seq_idx = torch.arange(rows, dtype=torch.int32, device=dev)
        self.no_prefill = torch.zeros(0, dtype=torch.int32, device=dev)
        # Mixed graphs' per-step buffers (sized for the largest token size).
        big = self.token_sizes[-1] if self.token_sizes else 0
        self.mixed_query_start_loc = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.mixed_decode_idx = torch.full((self.decode_rows(big)[-1],), -1, dtype=torch.int32,
                                           device=dev)  # fmt: skip
        self.mixed_tiles = torch.full((self.tile_rows(big), 2), -1, dtype=torch.int32,
                                      device=dev)  # fmt: skip
        # Decode work items of either family (backend.attention.base.decode_work).
        self.num_kv_heads = model.config.num_kv_heads
        items = [self.decode_items(s) for s in self.sizes]
        items += [self.decode_items(r, mixed=True) for t in self.token_sizes
                  for r in self.decode_rows(t)]  # fmt: skip
        self.decode_work = torch.full((max(items, default=0), 3), -1, dtype=torch.int32,
                                      device=dev)  # fmt: skip
        self.decode_work_loc = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        # The mixed graphs' output: final hidden states, copied here at each graph's end so
        # the graphs' own activations (pool memory) are not kept per graph.
        self.hidden = torch.zeros(big, model.config.hidden_size,
                                  dtype=model.embed_tokens.weight.dtype, device=dev)  # fmt: skip
        # Host mirror of the block tables staged last step (see the module doc): the rows,
        # the list each row was converted from (kept referenced, so ids stay unique) and
        # how many of its entries the row holds.
        self._tables = np.zeros((rows, self.max_blocks), dtype=np.int32)
        self._row_lists: list[list[int]] = []
        self._row_lens = np.zeros(rows, dtype=np.int64)
        # ("decode", size, size) or ("mixed", tokens, decode rows) -> graph, and its static
        # output: logits (size, vocab) float32 for decode graphs, a view of ``hidden`` for
        # mixed graphs.
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int, int], torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def decode_rows(self, tokens: int) -> list[int]:
        """Decode rows of the mixed graphs of ``tokens`` tokens, ascending: one variant for
        few decodes (``FEW_DECODES``), one for any number (one per token, at most one per
        sequence); a single entry when the two coincide."""
        return sorted({min(tokens, FEW_DECODES, self.max_seqs), min(tokens, self.max_seqs)})

    def decode_items(self, rows: int, mixed: bool = False) -> int:
        """Decode work items of a graph with ``rows`` decode rows: as an eager step of that
        many decodes for decode graphs; ``mixed_splits`` per row for mixed graphs."""
        splits = mixed_splits(rows, self.num_kv_heads, MAX_SPLITS) if mixed else None
        return decode_items(rows, self.num_kv_heads, splits)

    def tile_rows(self, tokens: int) -> int:
        """Prefill tile rows of the mixed graph of ``tokens`` tokens: chunks of ``q_i >= 2``
        tokens summing to at most ``tokens`` have at most ``tokens / 64 + (number of chunks)``
        tiles of 64 rows, and there are at most ``min(max_seqs, tokens // 2)`` chunks."""
        return -(-tokens // PREFILL_TILE_M) + min(self.max_seqs, tokens // 2)

    # -- per step ---------------------------------------------------------------------------

    def size_for(self, seqs: list[SeqInput]) -> int | None:
        """The decode graph size for this step, or None when it is not decode-only or is
        larger than the largest decode size."""
        if not seqs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        return pick_size(len(seqs), self.sizes)

    def token_size_for(self, seqs: list[SeqInput]) -> int | None:
        """The mixed graph size (tokens) for this step, or None when it has more tokens than
        the largest token size or more sequences than the sequence rows."""
        if not seqs or len(seqs) > self.max_seqs:
            return None
        return pick_size(sum(len(s.token_ids) for s in seqs), self.token_sizes)

    def run(self, seqs: list[SeqInput]) -> tuple[list[int], list[float], torch.Tensor] | None:
        """Run a step in a graph: (sampled seq indices, their temperatures, their logits
        (num_sampled, vocab) float32); None when no graph fits (run it eagerly).

        The logits may be a view of a graph's static output: use them before the next step.
        """
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        temps = [seqs[i].temperature for i in sampled]
        size = self.size_for(seqs)
        if size is not None:
            self._ensure_captured(("decode", size, size))
            self.stage(seqs, size)
            logits = self._replay(("decode", size, size))
            if len(sampled) == len(seqs):
                return sampled, temps, logits[: len(seqs)]
            index = torch.tensor(sampled, dtype=torch.long).to(self.device)
            return sampled, temps, logits[index]
        tokens = self.token_size_for(seqs)
        if tokens is None:
            return None
        decodes = sum(len(s.token_ids) == 1 for s in seqs)
        rows = next(r for r in self.decode_rows(tokens) if r >= decodes)
        self._ensure_captured(("mixed", tokens, rows))
        last_rows = self.stage_mixed(seqs, tokens, rows)
        hidden = self._replay(("mixed", tokens, rows))
        return sampled, temps, self.model.compute_logits(hidden[last_rows])

    def stage(self, seqs: list[SeqInput], size: int) -> None:
        """Validate a decode-only step (ValueError naming the first bad sequence, as
        :func:`backend.inputs.check_seq`) and write it, padded to ``size`` rows, into the
        static buffers. Host work: one pass over the sequences plus numpy."""
        n, bs = len(seqs), self.block_size
        tokens = self._host((3, size), torch.long)  # ids, positions, slots
        t = tokens.numpy()
        t[:, n:] = 0
        t[2, n:] = -1  # padding rows write nowhere
        positions = t[1, :n]
        try:
            t[0, :n] = [s.token_ids[0] for s in seqs]
            positions[:] = [s.start_pos for s in seqs]
        except OverflowError:  # an id beyond int64: out of range, say which sequence
            self._raise_invalid(seqs)
        self._check_ranges(seqs, t[0, :n], positions, positions + 1)
        nblocks = positions // bs + 1
        width = int(nblocks.max())
        tb = self._stage_tables(seqs, nblocks, width)
        tb[n:size, 0] = 0  # padding rows read block 0
        # int64 before the multiply: slots reach 2**31 in caches of 2**31 / block_size blocks
        t[2, :n] = tb[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        lens = self._host((2 * size + 1,), torch.int32)  # seq lens, then seq_start_loc
        ln = lens.numpy()
        ln[:size] = 0  # padding rows: no context, so no decode work items
        ln[:n] = positions + 1
        ln[size] = 0
        np.cumsum(ln[:size], out=ln[size + 1 :])
        # Columns >= nblocks of a row hold older values: never read.
        tables = self._host((size, width), torch.int32)
        tables.numpy()[:] = tb[:size, :width]
        tokens_d = tokens.to(self.device, non_blocking=True)
        lens_d = lens.to(self.device, non_blocking=True)
        tables_d = tables.to(self.device, non_blocking=True)
        self.input_ids[:size].copy_(tokens_d[0])
        self.positions[:size].copy_(tokens_d[1])
        self.slot_mapping[:size].copy_(tokens_d[2])
        self.seq_lens[:size].copy_(lens_d[:size])
        self.seq_start_loc[: size + 1].copy_(lens_d[size:])
        self.block_tables[:size, :width].copy_(tables_d)

    def stage_mixed(self, seqs: list[SeqInput], tokens: int,
                    decode_rows: int | None = None) -> torch.Tensor:  # fmt: skip
        """Validate any step (ValueError as :meth:`stage`) and write it, padded to
        ``tokens`` token rows and ``decode_rows`` (default: the most of that size),
        into the static buffers of the mixed graphs. Returns the device rows (num_sampled,)
        int64 of the sampled sequences' last fed tokens."""
        n, bs = len(seqs), self.block_size
        q = np.fromiter(map(len, (s.token_ids for s in seqs)), dtype=np.int64, count=n)
        total = int(q.sum())
        host = self._host((3, tokens), torch.long)  # ids, positions, slots
        t = host.numpy()
        t[:, total:] = 0
        t[2, total:] = -1  # padding rows write nowhere
        ids, positions = t[0, :total], t[1, :total]
        try:
            ids[:] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs),
                                 dtype=np.int64, count=total)  # fmt: skip
            start = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        except OverflowError:
            self._raise_invalid(seqs)
        self._check_ranges(seqs, ids, start, start + q)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        row = np.repeat(np.arange(n), q)
        positions[:] = np.arange(total) - qsl[row] + start[row]
        nblocks = (start + q - 1) // bs + 1
        width = int(nblocks.max())
        tb = self._stage_tables(seqs, nblocks, width)
        t[2, :total] = tb[row, positions // bs].astype(np.int64) * bs + positions % bs
        # Sequence-level int32 values, packed for one copy: seq lens, seq_start_loc,
        # query_start_loc, decode rows, tile table, the sampled sequences' last rows.
        rows, nt = self.max_seqs, self.tile_rows(tokens)
        dec = decode_rows or self.decode_rows(tokens)[-1]
        sampled = np.fromiter((i for i, s in enumerate(seqs) if s.sample), dtype=np.int64)
        sizes = [rows, rows + 1, rows + 1, dec, 2 * nt, len(sampled)]
        packed = self._host((sum(sizes),), torch.int32)
        lens, seq_start, qstart, decodes, tiles, last = np.split(packed.numpy(),
                                                                 np.cumsum(sizes)[:-1])
        lens[:] = 1
        lens[:n] = start + q
        seq_start[0] = 0
        np.cumsum(lens, out=seq_start[1:])
        qstart[: n + 1] = qsl
        qstart[n + 1 :] = total  # rows of no sequence: empty
        decode_idx = np.flatnonzero(q == 1)
        step_tiles = prefill_tiles(q)
        assert len(decode_idx) <= dec and len(step_tiles) <= nt, "mixed graph rows too few"
        decodes[:] = -1
        decodes[: len(decode_idx)] = decode_idx
        tiles[:] = -1
        tiles.reshape(nt, 2)[: len(step_tiles)] = step_tiles
        last[:] = qsl[1:][sampled] - 1
        table = self._host((n, width), torch.int32)
        table.numpy()[:] = tb[:n, :width]
        host_d = host.to(self.device, non_blocking=True)
        parts = packed.to(self.device, non_blocking=True).split(sizes)
        table_d = table.to(self.device, non_blocking=True)
        self.input_ids[:tokens].copy_(host_d[0])
        self.positions[:tokens].copy_(host_d[1])
        self.slot_mapping[:tokens].copy_(host_d[2])
        self.seq_lens.copy_(parts[0])
        self.seq_start_loc.copy_(parts[1])
        self.mixed_query_start_loc.copy_(parts[2])
        self.mixed_decode_idx[:dec].copy_(parts[3])
        self.mixed_tiles[:nt].copy_(parts[4].view(nt, 2))
        self.block_tables[:n, :width].copy_(table_d)
        return parts[5].long()

    def _check_ranges(self, seqs: list[SeqInput], ids: np.ndarray, start: np.ndarray,
                      end: np.ndarray) -> None:  # fmt: skip
        """Token ids, positions and temperatures in range, before the positions size the
        block tables (ValueError naming the first bad sequence otherwise)."""
        if (
            start.min() < 0
            or (end <= start).any()  # a sequence with no tokens to feed
            or end.max() > self.max_model_len
            or ids.min() < 0
            or ids.max() >= self.vocab_size
            or min(s.temperature for s in seqs) < 0
        ):
            self._raise_invalid(seqs)

    def _stage_tables(self, seqs: list[SeqInput], nblocks: np.ndarray, width: int) -> np.ndarray:
        """Bring the host mirror's first ``len(seqs)`` rows up to date (first ``width``
        columns) and validate the entries the step reads; returns the mirror. On any error
        the mirror is forgotten (no row is known), so the next step converts every row."""
        n, tb = len(seqs), self._tables
        tables = [s.block_table for s in seqs]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        ids, old = list(map(id, tables)), list(map(id, self._row_lists))
        self._row_lists = []  # forgotten until this staging succeeds: no row is known
        if ids == old[:n]:  # the same lists in the same rows (the common decode step)
            have = self._row_lens[:n].copy()
        else:  # rows moved, left or joined: gather the known rows to their new places
            row_of = dict(zip(old, range(len(old))))
            src = np.fromiter(map(row_of.get, ids, itertools.repeat(-1)), dtype=np.int64,
                              count=n)  # fmt: skip
            have = np.where(src >= 0, self._row_lens[np.maximum(src, 0)], 0)
            tb[:n, :width] = tb[np.maximum(src, 0), :width]
        np.minimum(have, width, out=have)  # only the first width columns were moved
        have[have > lens] = 0  # shrank in place: not the list it was; convert it whole
        # Outside the contract, but cheap to catch in most cases: a list rewritten in
        # place whose last converted entry changed is converted whole.
        known = np.flatnonzero(have)
        if known.size:
            at = have[known] - 1
            rows = map(tables.__getitem__, known.tolist())
            try:
                last = np.fromiter(map(operator.getitem, rows, at.tolist()), dtype=np.int64,
                                   count=known.size)  # fmt: skip
            except OverflowError:  # rewritten in place to an id beyond int64
                self._raise_invalid(seqs)
            have[known[last != tb[known, at]]] = 0
        want = np.minimum(lens, width)
        try:
            for i in np.flatnonzero(have < want).tolist():
                lo, hi, table = int(have[i]), int(want[i]), tables[i]
                tb[i, lo:hi] = table if lo == 0 and hi == len(table) else table[lo:hi]
        except OverflowError:  # a block id beyond int32
            self._raise_invalid(seqs)
        used = np.arange(width)[None, :] < nblocks[:, None]
        values = tb[:n, :width][used]
        if (lens < nblocks).any() or values.min() < 0 or values.max() >= self.kv_cache.num_gpu_blocks:
            self._raise_invalid(seqs)
        self._row_lists = tables
        self._row_lens[:n] = want
        return tb

    def _raise_invalid(self, seqs: list[SeqInput]) -> None:
        for i, s in enumerate(seqs):
            check_seq(i, s, self.block_size, self.kv_cache.num_gpu_blocks, self.max_model_len,
                      self.vocab_size)  # fmt: skip
        # Only ids in a table's unused entries are left: beyond int32 they cannot be staged.
        raise ValueError("step: a block table holds an id beyond int32 in its unused entries")

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Fresh pinned memory each step: the caching host allocator does not hand a block
        # back out until the copy that read it has finished.
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    # -- the forward --------------------------------------------------------------------------

    def metadata(self, size: int) -> AttentionMetadata:
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
            # Host values are only read by the torch backend, which never runs here.
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
        (default: the most of that size): every sequence row, padded decode rows and tile
        table (-1 entries are skipped)."""
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

    def _forward(self, key: tuple[str, int, int]) -> torch.Tensor:
        from backend.attention.triton_kernels import decode_work_device  # graphs need triton

        kind, size, rows = key
        meta = self.metadata(size) if kind == "decode" else self.mixed_metadata(size, rows)
        # The decode work items, cut on the device from the staged lengths (no host work).
        decode_work_device(meta.seq_lens, meta.decode_seq_idx, meta.decode_work,
                           meta.decode_work_loc)  # fmt: skip
        hidden = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_cache.layers, meta
        )  # fmt: skip
        if kind == "mixed":  # the sampled rows' logits follow the replay
            return self.hidden[:size].copy_(hidden)  # (tokens, hidden)
        return self.model.compute_logits(hidden)  # (size, vocab) float32

    def _ensure_captured(self, key: tuple[str, int, int]) -> None:
        """Capture ``key`` if :meth:`capture_all` has not (before staging: a capture pads
        every row)."""
        if self.capture and key not in self.graphs:
            self.capture_one(key)

    def _replay(self, key: tuple[str, int, int]) -> torch.Tensor:
        if not self.capture:
            return self._forward(key)
        self.graphs[key].replay()
        return self.outputs[key]

    def _set_padding(self, key: tuple[str, int, int]) -> None:
        """Make every row the graph ``key`` reads padding (used before warm-up and capture)."""
        size = key[1]
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens.fill_(0)  # no decode work items
        self.seq_start_loc.copy_(self.query_start_loc)
        self.block_tables.zero_()
        self.mixed_query_start_loc.zero_()
        self.mixed_decode_idx.fill_(-1)
        self.mixed_tiles.fill_(-1)
        self.decode_work.fill_(-1)
        self.decode_work_loc.zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size: mixed then decode, largest first (smaller graphs reuse the
        pool's memory)."""
        keys = [("mixed", t, r) for t in reversed(self.token_sizes)
                for r in reversed(self.decode_rows(t))]  # fmt: skip
        keys += [("decode", s, s) for s in reversed(self.sizes)]
        for key in keys:
            if key not in self.graphs:
                self.capture_one(key)

    @torch.inference_mode()
    def capture_one(self, key: tuple[str, int, int]) -> None:
        self._set_padding(key)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(key)  # warm-up: compiles Triton kernels, picks cuBLAS kernels
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(key)
        torch.cuda.synchronize(self.device)
        self.graphs[key] = graph
        self.outputs[key] = out
