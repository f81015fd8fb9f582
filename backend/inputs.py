"""Turn one step's :class:`SeqInput` list into the arrays the model reads, written once.

:func:`stage_step` does the host arithmetic and validation for both paths;
:func:`prepare_inputs` copies it to the device for eager steps, :mod:`sched_lab.backend.cuda_graphs`
into padded static buffers.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from sched_lab.backend.attention import AttentionMetadata
from sched_lab.backend.attention.base import prefill_tiles


@dataclass(slots=True)
class SeqInput:
    """What one sequence feeds in one step.

    Args:
        token_ids: tokens fed this step: a prefill chunk, or the one token of a decode.
        start_pos: = num_computed_tokens; KV for positions [0, start_pos) is already cached.
        block_table: device block ids covering start_pos + len(token_ids) positions; slot of
            position p is ``block_table[p // block_size] * block_size + p % block_size``.
            Between steps a list may only be appended to (a :class:`BlockTables` mirror
            converts only new entries).
        sample: sample a next token from the last fed position.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        top_p: in [0, 1]; draw only among the most likely tokens summing to top_p (1.0 = off).
        seed: None = the runner's generator; an int = the request's own stream
            (backend/sampler.py: the token depends on the seed and its position only).
        lora_name: the LoRA adapter the sequence runs with; "" = the base model.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class DeviceFeed:
    """Token rows of a step whose ids are still on the device (sampled by the previous
    launched step); :func:`apply_feed` writes them before the forward reads them.

    Args:
        rows: (k,) int64 flat token rows of this step, ascending.
        source: (m,) int64 device tensor of the earlier step's sampled ids.
        source_rows: (k,) int64; the entry of ``source`` each row takes.
    """

    rows: np.ndarray
    source: torch.Tensor
    source_rows: np.ndarray


def apply_feed(input_ids: torch.Tensor, feed: DeviceFeed | None, pin: bool = False) -> None:
    """Write ``feed``'s device tokens into ``input_ids`` in stream order, with no host sync
    (``pin``: stage the indices in pinned memory)."""
    if feed is None or len(feed.rows) == 0:
        return
    rows, src, k = feed.rows, feed.source_rows, len(feed.rows)
    r0, s0 = int(rows[0]), int(src[0])
    if (
        int(rows[-1]) - r0 == k - 1
        and int(src[-1]) - s0 == k - 1
        and (k < 3 or (np.all(np.diff(rows) == 1) and np.all(np.diff(src) == 1)))
    ):
        input_ids[r0 : r0 + k].copy_(feed.source[s0 : s0 + k])
        return
    index = torch.empty(2 * k, dtype=torch.long, pin_memory=pin)
    flat = index.numpy()
    flat[:k], flat[k:] = rows, src
    index = index.to(input_ids.device, non_blocking=True)
    input_ids[index[:k]] = feed.source[index[k:]]


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What a step is validated against: tokens per block, device blocks, the longest
    sequence (tokens) and the vocabulary size."""

    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class HostStep:
    """The host arrays of one step of ``n`` sequences and ``num_tokens`` fed tokens.

    Attributes:
        tokens: (3 * T + num_sampled,) int64 (pinned for CUDA): input ids, positions and
            slots, each padded to ``T`` rows (token 0, position 0, slot -1), then the
            logits rows; :meth:`rows` cuts it.
        query_lens: (n,) int64; query_start_loc: (n + 1,) int64.
        seq_lens: (n,) int64 context length after the step.
        block_tables: (n, width) int32 view of the mirror, valid until its next staging.
        sampled: (num_sampled,) int64 sampled sequences (empty unless ``logits``).
    """

    tokens: torch.Tensor
    num_tokens: int
    query_lens: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    sampled: np.ndarray

    @property
    def padded_tokens(self) -> int:
        """T: token rows including padding."""
        return (self.tokens.numel() - len(self.sampled)) // 3

    def rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(input_ids, positions, slot_mapping, logits_indices) views of ``tokens``."""
        t = self.padded_tokens
        return tokens[:t], tokens[t : 2 * t], tokens[2 * t : 3 * t], tokens[3 * t :]


class BlockTables:
    """Host int32 mirror of a step's block tables. A sequence whose ``block_table`` is the
    same list object as in the previous staging has only its new entries converted; others
    (and a known list whose last converted entry changed) are converted whole."""

    def __init__(self, rows: int = 0, width: int = 0) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.row_lists: list[list[int]] = []
        self.row_lens = np.zeros(rows, dtype=np.int64)

    def _reserve(self, rows: int, width: int) -> None:
        have_rows, have_width = self.table.shape
        if rows <= have_rows and width <= have_width:
            return
        table = np.zeros((max(rows, have_rows), max(width, have_width)), dtype=np.int32)
        table[:have_rows, :have_width] = self.table
        lens = np.zeros(table.shape[0], dtype=np.int64)
        lens[:have_rows] = self.row_lens
        self.table, self.row_lens = table, lens

    def stage(self, seqs: list[SeqInput], nblocks: np.ndarray, width: int,
              limits: StepLimits) -> np.ndarray:  # fmt: skip
        """Bring the first ``len(seqs)`` rows up to date and validate them; returns the
        (n, width) view. On error the mirror is forgotten."""
        n = len(seqs)
        self._reserve(n, width)
        tb = self.table
        tables = [s.block_table for s in seqs]
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        ids, old = list(map(id, tables)), list(map(id, self.row_lists))
        self.row_lists = []  # forgotten until this staging succeeds: no row is known
        if not old:
            have = np.zeros(n, dtype=np.int64)
        elif ids == old[:n]:  # the same lists in the same rows (the common decode step)
            have = self.row_lens[:n].copy()
        else:  # rows moved, left or joined: gather the known rows to their new places
            row_of = dict(zip(old, range(len(old))))
            src = np.fromiter(map(row_of.get, ids, itertools.repeat(-1)), dtype=np.int64,
                              count=n)  # fmt: skip
            have = np.where(src >= 0, self.row_lens[np.maximum(src, 0)], 0)
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
                raise_invalid(seqs, limits)
            have[known[last != tb[known, at]]] = 0
        want = np.minimum(lens, width)
        try:
            for i in np.flatnonzero(have < want).tolist():
                lo, hi, table = int(have[i]), int(want[i]), tables[i]
                tb[i, lo:hi] = table if lo == 0 and hi == len(table) else table[lo:hi]
        except OverflowError:  # a block id beyond int32
            raise_invalid(seqs, limits)
        used = np.arange(width)[None, :] < nblocks[:, None]
        values = tb[:n, :width][used]
        if (lens < nblocks).any() or values.min() < 0 or values.max() >= limits.num_gpu_blocks:
            raise_invalid(seqs, limits)
        self.row_lists = tables
        self.row_lens[:n] = want
        return tb[:n, :width]


def stage_step(
    seqs: list[SeqInput],
    limits: StepLimits,
    tables: BlockTables | None = None,
    *,
    pad_to: int | None = None,
    logits: bool = True,
    pin: bool = False,
    decode_only: bool = False,
) -> HostStep:
    """Validate ``seqs`` (ValueError naming the first bad sequence) and compute the step's
    host arrays.

    Args:
        tables: the block-table mirror to stage into (None: a fresh one).
        pad_to: token rows T (>= the step's tokens); default the step's tokens.
        logits: also compute the sampled sequences and their logits rows.
        pin: allocate ``tokens`` in pinned memory.
        decode_only: the caller checked that every sequence feeds exactly one token.
    """
    n, bs = len(seqs), limits.block_size
    if n == 0:
        raise ValueError("step: no sequences to run")
    if decode_only:
        q, total = np.ones(n, dtype=np.int64), n
    else:
        q = np.fromiter(map(len, (s.token_ids for s in seqs)), dtype=np.int64, count=n)
        total = int(q.sum())
        if q.min() < 1:
            raise_invalid(seqs, limits)
        decode_only = total == n
    size = total if pad_to is None else pad_to
    assert size >= total, f"stage_step: {total} tokens do not fit {size} rows"
    sampled = (np.fromiter((i for i, s in enumerate(seqs) if s.sample), dtype=np.int64)
               if logits else np.zeros(0, dtype=np.int64))  # fmt: skip
    host = torch.empty(3 * size + len(sampled), dtype=torch.long, pin_memory=pin)
    flat = host.numpy()
    ids, positions, slots = flat[:size], flat[size : 2 * size], flat[2 * size : 3 * size]
    ids[total:] = 0
    positions[total:] = 0
    slots[total:] = -1  # padding rows write nowhere
    try:
        if decode_only:
            ids[:n] = [s.token_ids[0] for s in seqs]
            positions[:n] = [s.start_pos for s in seqs]
            start = positions[:n]
        else:
            ids[:total] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs),
                                      dtype=np.int64, count=total)  # fmt: skip
            start = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
    except OverflowError:  # a value beyond int64: out of range, say which sequence
        raise_invalid(seqs, limits)
    end = start + q
    if (
        start.min() < 0
        or end.max() > limits.max_model_len
        or ids[:total].min() < 0
        or ids[:total].max() >= limits.vocab_size
        or min(s.temperature for s in seqs) < 0
    ):  # before the positions size the block tables
        raise_invalid(seqs, limits)
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    if decode_only:
        row = np.arange(n)
    else:
        row = np.repeat(np.arange(n), q)
        positions[:total] = np.arange(total) - qsl[row] + start[row]
    nblocks = (end - 1) // bs + 1
    tables = BlockTables() if tables is None else tables
    tb = tables.stage(seqs, nblocks, int(nblocks.max()), limits)
    pos = positions[:total]
    # int64 before the multiply: slots reach 2**31 in caches of 2**31 / block_size blocks
    slots[:total] = tb[row, pos // bs].astype(np.int64) * bs + pos % bs
    flat[3 * size :] = qsl[1:][sampled] - 1
    return HostStep(host, total, q, qsl, end, tb, sampled)


@dataclass(frozen=True)
class StepInputs:
    """The model's inputs for one step.

    Attributes:
        input_ids, positions: (num_tokens,) int64 on the device.
        logits_indices: (num_sampled,) int64 row of each sampled seq's last fed token.
        sampled_seqs: indices into the SeqInput list of the sampled sequences, in order.
        sampled_inputs: the sampled sequences' SeqInputs, one per logits row (their sampling).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_seqs: list[int]
    sampled_inputs: list[SeqInput]


def prepare_inputs(
    seqs: list[SeqInput],
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
    vocab_size: int,
    device: torch.device,
    tables: BlockTables | None = None,
) -> StepInputs:
    """Validate ``seqs`` (ValueError naming the sequence) and build the step's device
    tensors from :func:`stage_step`'s arrays."""
    pin = device.type == "cuda"
    limits = StepLimits(block_size, num_gpu_blocks, max_model_len, vocab_size)
    step = stage_step(seqs, limits, tables, pin=pin)
    ids, positions, slots, logits_indices = step.rows(step.tokens.to(device, non_blocking=True))
    q = step.query_lens
    decodes, prefills = np.flatnonzero(q == 1), np.flatnonzero(q > 1)
    tiles = prefill_tiles(q)
    n, width = step.block_tables.shape
    parts = [step.query_start_loc, step.seq_lens, np.zeros(n + 1, dtype=np.int64), decodes,
             prefills, tiles, step.block_tables]  # fmt: skip
    sizes = [p.size for p in parts]
    packed = torch.empty(sum(sizes), dtype=torch.int32, pin_memory=pin)
    views = np.split(packed.numpy(), np.cumsum(sizes)[:-1])
    for view, part in zip(views, parts, strict=True):
        view[:] = part.reshape(-1)
    np.cumsum(step.seq_lens, out=views[2][1:])  # seq_start_loc
    qsl_d, lens_d, ssl_d, dec_d, pre_d, tiles_d, tables_d = packed.to(
        device, non_blocking=True
    ).split(sizes)
    sampled = step.sampled.tolist()
    attn = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl_d,
        seq_lens=lens_d,
        seq_start_loc=ssl_d,
        block_tables=tables_d.view(n, width),
        decode_seq_idx=dec_d,
        prefill_seq_idx=pre_d,
        block_size=block_size,
        query_lens=q.tolist(),
        seq_lens_host=step.seq_lens.tolist(),
        block_tables_host=[s.block_table for s in seqs],
        max_query_len=int(q.max()),
        max_seq_len=int(step.seq_lens.max()),
        prefill_tiles=tiles_d.view(-1, 2),
    )
    return StepInputs(
        input_ids=ids,
        positions=positions,
        attn=attn,
        logits_indices=logits_indices,
        sampled_seqs=sampled,
        sampled_inputs=[seqs[i] for i in sampled],
    )


def raise_invalid(seqs: list[SeqInput], limits: StepLimits) -> NoReturn:
    """Raise :func:`check_seq`'s error for the first bad sequence of a step that failed a
    vectorized check."""
    for i, s in enumerate(seqs):
        check_seq(i, s, limits.block_size, limits.num_gpu_blocks, limits.max_model_len,
                  limits.vocab_size)  # fmt: skip
    # Only ids in a table's unused entries are left: beyond int32 they cannot be staged.
    raise ValueError("step: a block table holds an id beyond int32 in its unused entries")


def check_seq(
    i: int, seq: SeqInput, block_size: int, num_gpu_blocks: int, max_model_len: int, vocab_size: int
) -> None:
    """ValueError naming sequence ``i`` if it cannot run (see :class:`SeqInput`)."""
    where = f"seq {i}"
    if not seq.token_ids:
        raise ValueError(f"{where}: no token_ids to feed")
    if seq.start_pos < 0:
        raise ValueError(f"{where}: start_pos {seq.start_pos} < 0")
    end = seq.start_pos + len(seq.token_ids)
    if end > max_model_len:
        raise ValueError(f"{where}: positions up to {end} exceed max_model_len {max_model_len}")
    needed = -(-end // block_size)
    if len(seq.block_table) < needed:
        raise ValueError(
            f"{where}: block_table has {len(seq.block_table)} blocks, {needed} needed for {end} tokens "
            f"at block_size {block_size}"
        )
    used = seq.block_table[:needed]
    if min(used) < 0 or max(used) >= num_gpu_blocks:
        raise ValueError(
            f"{where}: block ids must be in [0, {num_gpu_blocks}): {seq.block_table[:needed]}"
        )
    if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab_size:
        raise ValueError(f"{where}: token ids must be in [0, {vocab_size})")
    if seq.temperature < 0:
        raise ValueError(f"{where}: temperature {seq.temperature} < 0")
