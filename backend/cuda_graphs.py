"""CUDA graphs for decode-only steps.

A decode step of a small model is launch-bound: ~50 small kernels per layer, each a few
microseconds of GPU work behind tens of microseconds of Python and launcher overhead. A CUDA
graph records the whole forward (embedding -> layers -> norm -> logits) once per batch size
and replays it with one launch.

How it works here:

* Sizes: a step of ``n`` one-token decodes runs in the graph of the smallest captured size
  ``>= n`` (:func:`pick_size`); rows ``n..size-1`` are padding.
* Static buffers, allocated once for the largest size: input ids, positions, slot mapping,
  seq lens, ``seq_start_loc``, block tables ``(max size, ceil(max_model_len / block_size))``,
  plus constants (``query_start_loc = arange``, ``decode_seq_idx = arange``, an empty
  ``prefill_seq_idx``). Each step writes its values into them (host staging + ``copy_``);
  each size's graph reads the first ``size`` rows.
* Block tables are staged incrementally: a host mirror keeps what each row holds and the
  list it came from. A sequence whose ``block_table`` is the same list object as a row of
  the previous step (lists are only appended to between steps, see ``SeqInput``) gets that
  row moved to its place and only its new entries converted; other rows are converted
  whole, and so is a known list whose last converted entry changed (a rewrite in place,
  outside the contract, is caught that way unless it keeps that entry). Python int -> int32 conversion is the cost this saves: staging a batch of 256
  with 1k-token contexts took 1.17 ms of host time, now 0.30 ms (2-core dev box).
* Padding rows: token 0 at position 0, slot -1 (the Triton store kernel skips negative slots,
  so they write nothing), seq len 1 over block table row ``[0, ...]`` (they read one cached
  position of block 0 and the result is thrown away). Real blocks are never written.
* Capture (CUDA): after the KV cache exists, largest size first, one shared memory pool;
  each size runs once eagerly on a side stream first (Triton compiles, cuBLAS warms up), with
  every row padding, so neither warm-up nor capture touches the cache.
* Sampling stays outside the graph, on the logits rows of the real sequences.

Only the ``triton`` attention backend is graph-safe (``torch`` reads host lists per step;
``flash_attn`` is untested). Mixed prefill/decode steps, batches larger than the largest size
and non-CUDA devices run eagerly. On a non-CUDA device the same padded static-buffer path can
run without capture (``capture=False``), which is how the CPU tests check the padding.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import numpy as np
import torch

from backend.attention import AttentionMetadata
from backend.inputs import SeqInput, check_seq
from backend.kv_cache import KVCache
from backend.model import Transformer

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_GRAPH_SIZES) -> list[int]:
    """The batch sizes to capture, ascending: ``sizes`` up to ``max_num_seqs``, plus
    ``max_num_seqs`` itself when it falls between two of them (so every batch the scheduler
    can form fits, unless it is larger than the largest of ``sizes``)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not sizes or min(sizes) < 1:
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


class DecodeGraphs:
    """Static buffers and (on CUDA) one captured graph per batch size for decode-only steps.

    Args:
        model: the loaded model; its attention backend must be ``triton``.
        kv_cache: the runner's cache; graphs bake in its per-layer tensors.
        block_size: tokens per block. max_model_len: sizes the static block-table width.
        vocab_size, num_gpu_blocks: for validating each step's inputs.
        sizes: the batch sizes (see :func:`graph_sizes`).
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
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.sizes = sorted(sizes)
        self.capture = capture
        self.device = kv_cache.gpu.device
        self.pin = self.device.type == "cuda"
        self.max_size = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)  # static block-table width
        n, dev = self.max_size, self.device
        # Normal (not inference-mode) tensors, so they may be updated in and out of it.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.seq_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # constant
        self.seq_idx = torch.arange(n, dtype=torch.int32, device=dev)  # constant
        self.no_prefill = torch.zeros(0, dtype=torch.int32, device=dev)  # constant
        # Host mirror of the block tables staged last step (see the module doc): the rows,
        # the list each row was converted from (kept referenced, so ids stay unique) and
        # how many of its entries the row holds.
        self._tables = np.zeros((n, self.max_blocks), dtype=np.int32)
        self._row_lists: list[list[int]] = []
        self._row_lens = np.zeros(n, dtype=np.int64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> static logits (size, vocab)
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    # -- per step ---------------------------------------------------------------------------

    def size_for(self, seqs: list[SeqInput]) -> int | None:
        """The graph size for this step, or None when it must run eagerly."""
        if not seqs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        return pick_size(len(seqs), self.sizes)

    def run(self, seqs: list[SeqInput]) -> tuple[list[int], list[float], torch.Tensor] | None:
        """Run a decode-only step padded to its size: (sampled seq indices, their
        temperatures, their logits (num_sampled, vocab) float32); None if not graph-able.

        The logits may be a view of the graph's static output: use them before the next step.
        """
        size = self.size_for(seqs)
        if size is None:
            return None
        self.stage(seqs, size)
        logits = self._replay(size)
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        temps = [seqs[i].temperature for i in sampled]
        if len(sampled) == len(seqs):
            rows = logits[: len(seqs)]
        else:
            rows = logits[torch.tensor(sampled, dtype=torch.long).to(self.device)]
        return sampled, temps, rows

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
        if (  # before sizing the tables by the positions
            positions.min() < 0
            or positions.max() >= self.max_model_len
            or t[0, :n].min() < 0
            or t[0, :n].max() >= self.vocab_size
            or min(s.temperature for s in seqs) < 0
        ):
            self._raise_invalid(seqs)
        nblocks = positions // bs + 1
        width = int(nblocks.max())
        try:
            tb = self._stage_tables(seqs, nblocks, width)
        except OverflowError:  # a block id beyond int32
            self._raise_invalid(seqs)
        tb[n:size, 0] = 0  # padding rows read block 0
        t[2, :n] = tb[np.arange(n), positions // bs] * bs + positions % bs
        lens = self._host((2 * size + 1,), torch.int32)  # seq lens, then seq_start_loc
        ln = lens.numpy()
        ln[:size] = 1
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
            last = np.fromiter(map(operator.getitem, rows, at.tolist()), dtype=np.int64,
                               count=known.size)  # fmt: skip
            have[known[last != tb[known, at]]] = 0
        want = np.minimum(lens, width)
        for i in np.flatnonzero(have < want).tolist():
            lo, hi, table = int(have[i]), int(want[i]), tables[i]
            tb[i, lo:hi] = table if lo == 0 and hi == len(table) else table[lo:hi]
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
        raise ValueError("decode step: a block table holds an id beyond int32 in its unused "
                         "entries")

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Fresh pinned memory each step: the caching host allocator does not hand a block
        # back out until the copy that read it has finished.
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    # -- the forward --------------------------------------------------------------------------

    def metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata over the static buffers' first ``size`` rows (all decodes)."""
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
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_cache.layers,
            self.metadata(size),
        )  # fmt: skip
        return self.model.compute_logits(hidden)  # (size, vocab) float32

    def _replay(self, size: int) -> torch.Tensor:
        if not self.capture:
            return self._forward(size)
        if size not in self.graphs:
            self.capture_size(size)
        self.graphs[size].replay()
        return self.outputs[size]

    def _set_padding(self, size: int) -> None:
        """Make the first ``size`` rows padding (used before warm-up and capture)."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        self.seq_start_loc[: size + 1].copy_(self.query_start_loc[: size + 1])
        self.block_tables[:size].zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (smaller graphs reuse the pool's memory)."""
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self.capture_size(size)

    @torch.inference_mode()
    def capture_size(self, size: int) -> None:
        self._set_padding(size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size)  # warm-up: compiles Triton kernels, picks cuBLAS kernels
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(size)
        torch.cuda.synchronize(self.device)
        self.graphs[size] = graph
        self.outputs[size] = out
