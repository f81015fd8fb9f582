"""What a replay records: one row per step (``STEP_COLUMNS``) and the result of a replay.

A :class:`StepRecorder` keeps the rows in typed arrays (a list would hold a Python object
each): each row once, and for a repeated decode step only the values that differ, each
column narrowed as the replay runs, in parts of :data:`CHUNK_ROWS` rows or fewer. At the end
it hands them on as they are, as :class:`StepColumns`, which makes a numpy column when it is
read (:meth:`StepRecorder.columns`).
"""

from __future__ import annotations

import functools
import struct
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from sched_lab.core.events import EventLog
from sched_lab.core.request import Request, RequestStatus

STEP_COLUMNS = (
    "time_s", "duration_s", "num_prefill_tokens", "num_decode_tokens", "num_seqs",
    "kv_used_blocks", "cpu_used_blocks", "num_waiting", "num_running", "num_swapped",
    "num_preempted", "num_swap_out_blocks", "num_swap_in_blocks", "num_prefills",
    "prefill_context_tokens", "prefill_attention_pairs", "decode_context_tokens",
    "num_cached_tokens", "num_cached_blocks", "kv_cached_blocks", "num_wasted_tokens",
    "num_spec_tokens",
)  # fmt: skip
# With LoRA (a ``lora:`` section) only, after the others: distinct adapters among the
# step's sequences, adapters loaded into a GPU slot for it.
LORA_COLUMNS = ("num_loras", "num_lora_loads")
_FLOAT_COLUMNS = ("time_s", "duration_s", "prefill_attention_pairs")  # the rest: int64
#: The columns in which a repeated decode step differs from the step it repeats.
REPEAT_COLUMNS = (
    "time_s", "duration_s", "kv_used_blocks", "decode_context_tokens", "kv_cached_blocks",
)  # fmt: skip

#: Whole rows a :class:`StepRecorder` holds as float64 before it narrows them into a part of
#: each column (:func:`_narrow`); the repeats' integer columns are narrowed with them.
CHUNK_ROWS = 16384
# The integer types a column is narrowed to before int64 (:func:`_narrow`), and their ranges.
_INT_TYPES = (np.int8, np.int16, np.int32)
_INT_RANGES = [(int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in _INT_TYPES]

# ``array("d").fromlist`` converts each value through PyArg_Parse (slow); struct packs the
# same float64 values (``PyFloat_AsDouble``, as that parse) several times faster, and
# ``frombytes`` copies them in. A packer per number of values, made on first use.
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _packer(n: int) -> Callable[..., bytes]:
    """``struct.Struct(f"{n}d").pack``, kept."""
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"{n}d").pack
    return pack


ENDED = (
    RequestStatus.FINISHED,
    RequestStatus.REJECTED,
    RequestStatus.ABORTED,
    RequestStatus.UNFINISHED,
)
"""The statuses a request ends a replay in."""


class StepRecorder:
    """The per-step records of one replay loop: one row per step, appended as it ends.

    A row is kept whole (every column), or, for a step that repeats the last whole row but in
    :data:`REPEAT_COLUMNS` (a decode plan moved on by a tick, ``Scheduler.repeat_decodes``),
    as those five values. Whole rows wait flat in a float64 array (every count is exact there,
    below 2**53); when :data:`CHUNK_ROWS` of them wait, each of their columns is narrowed
    (:func:`_narrow`) into a part of that column, kept as it is from then on. The
    repeats' integer columns wait as float64 until then, or until :data:`CHUNK_ROWS` of them
    wait after :meth:`append_repeats`, and are narrowed into parts the same way (their float
    columns are kept as they come). :meth:`columns` narrows what still waits and hands
    everything on.

    Attributes:
        num_steps: rows appended so far.
    """

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.names = (*STEP_COLUMNS, *extra)  # ``extra``: e.g. LORA_COLUMNS
        self._values = array("d")  # the whole rows not yet narrowed, one after the other
        self._pack_row = _packer(len(self.names))
        self._full = CHUNK_ROWS * len(self.names)  # (values of CHUNK_ROWS rows)
        self._by_column: np.ndarray | None = None  # those rows transposed, to narrow them
        self._ticks = array("q")  # the whole rows that ran a decode tick (repeats all do)
        # A column each: time_s and duration_s as kept, the others waiting as float64.
        self._repeated = tuple(array("d") for _ in REPEAT_COLUMNS)
        # The narrowed parts of each column, in order: the whole rows', the repeats' ints'.
        self._whole: list[list[np.ndarray]] = [[] for _ in self.names]
        self._repeat_parts: list[list[np.ndarray]] = [[] for _ in REPEAT_COLUMNS[2:]]
        # Per whole row: the steps it stands for (itself, then its repeats, which follow it).
        self._copies = array("q")
        self._last: list[float] | None = None  # the last whole row
        self.num_steps = 0

    def append(self, row: list[float], decodes: Collection[object]) -> None:
        """Append one step's ``row`` (``len(self.names)`` numbers in that order);
        ``decodes``: the step's decodes (not empty: it ran a decode tick). Raises TypeError
        for a value that is not a number, appending nothing."""
        values = self._values
        try:  # the same float64 values as fromlist (much faster than extend), faster still
            values.frombytes(self._pack_row(*row))
        except struct.error:  # not numbers, or another length: as fromlist has it
            values.fromlist(row)
        if decodes:
            self._ticks.append(self.num_steps)
        self.num_steps += 1
        self._last = row
        self._copies.append(1)
        if len(values) >= self._full:
            self._narrow_pending()

    def append_repeat(
        self, row: list[float], time_s: float, duration_s: float, kv_used: int, context: int,
        kv_cached: int,
    ) -> None:  # fmt: skip
        """Append a step that ran a decode tick and equals ``row``, the last row appended by
        :meth:`append` (unchanged since), but in :data:`REPEAT_COLUMNS`, whose values are
        given in order. Raises ValueError for another row."""
        self._count_repeats(row, 1)
        time_c, duration_c, used_c, context_c, cached_c = self._repeated
        time_c.append(time_s)
        duration_c.append(duration_s)
        used_c.append(kv_used)
        context_c.append(context)
        cached_c.append(kv_cached)

    def append_repeats(
        self, row: list[float], time_s: list[float], duration_s: list[float],
        kv_used: list[int], context: list[int], kv_cached: list[int],
    ) -> None:  # fmt: skip
        """:meth:`append_repeat` for several steps, each of the :data:`REPEAT_COLUMNS` given
        in order as a list of one value a step (all of one length)."""
        self._count_repeats(row, len(time_s))
        time_c, duration_c, used_c, context_c, cached_c = self._repeated
        pack = _packer(len(time_s))  # (as append: fromlist's values, faster)
        try:
            packed = pack(*time_s), pack(*duration_s), pack(*kv_used), pack(*context)
            packed_cached = pack(*kv_cached)
        except struct.error:  # not numbers, or lists of other lengths: as fromlist has it
            time_c.fromlist(time_s)
            duration_c.fromlist(duration_s)
            used_c.fromlist(kv_used)
            context_c.fromlist(context)
            cached_c.fromlist(kv_cached)
        else:
            time_c.frombytes(packed[0])
            duration_c.frombytes(packed[1])
            used_c.frombytes(packed[2])
            context_c.frombytes(packed[3])
            cached_c.frombytes(packed_cached)
        if len(cached_c) >= CHUNK_ROWS:
            self._narrow_repeats()

    def _count_repeats(self, row: list[float], num_steps: int) -> None:
        """Count ``num_steps`` more repeats of ``row``, the last whole row."""
        if row is not self._last:
            raise ValueError("StepRecorder: a repeated step must repeat the last whole row")
        self._copies[-1] += num_steps
        self.num_steps += num_steps

    def _narrow_pending(self) -> None:
        """Narrow the waiting whole rows and repeats into a part of each of their columns;
        none waits afterwards."""
        self._narrow_repeats()
        if self._values:
            rows = np.frombuffer(self._values).reshape(-1, len(self.names))
            if self._by_column is None:  # (made once: a new one each time costs page faults)
                self._by_column = np.empty((len(self.names), CHUNK_ROWS))
            # a column each, contiguous (the rows' columns are strided: slower to narrow)
            by_column = self._by_column[:, : len(rows)]
            np.copyto(by_column, rows.T)
            del rows  # (the array can go)
            self._values = array("d")
            lows, highs = by_column.min(axis=1).tolist(), by_column.max(axis=1).tolist()
            for c, parts, values, lo, hi in zip(self.names, self._whole, by_column, lows, highs):
                parts.append(_narrow(c, values, lo, hi))

    def _narrow_repeats(self) -> None:
        """Narrow the waiting repeats' integer columns into a part of each."""
        time_c, duration_c, *ints = self._repeated
        if ints[0]:
            for c, parts, values in zip(REPEAT_COLUMNS[2:], self._repeat_parts, ints):
                parts.append(_narrow(c, np.frombuffer(values, dtype=np.float64)))
            self._repeated = (time_c, duration_c, *(array("d") for _ in ints))

    def columns(self) -> tuple[StepColumns, np.ndarray]:
        """The records as :class:`StepColumns`, each column kept in parts of the narrowest
        type that holds each (:func:`_narrow`), and, for each decode tick, the step that ran
        it (int32 below 2**31 steps, else int64). The recorder hands its records on: it is
        empty afterwards (append no more)."""
        self._narrow_pending()
        time_c, duration_c, *_ = self._repeated
        repeated = [[np.frombuffer(time_c)], [np.frombuffer(duration_c)], *self._repeat_parts]
        steps = StepColumns(
            dict(zip(self.names, self._whole)),
            np.frombuffer(self._copies, dtype=np.int64),
            dict(zip(REPEAT_COLUMNS, repeated)),
        )
        ticks = steps.repeats.copy()
        ticks[np.frombuffer(self._ticks, dtype=np.int64)] = True
        self._copies, self._ticks = array("q"), array("q")
        self._by_column = None
        self._whole = [[] for _ in self.names]
        self._repeat_parts = [[] for _ in REPEAT_COLUMNS[2:]]
        self._repeated = tuple(array("d") for _ in REPEAT_COLUMNS)
        ticks = np.flatnonzero(ticks)
        return steps, ticks.astype(np.int32) if steps.num_steps < 2**31 else ticks


def _narrow(
    name: str, values: np.ndarray, lo: float | None = None, hi: float | None = None
) -> np.ndarray:
    """A recorded column or part of one (float64; ``lo`` and ``hi``, if given: its min and
    max) as :class:`StepColumns` keeps it, a new array: float64 for :data:`_FLOAT_COLUMNS`,
    else the first of int8, int16, int32 and int64 whose range holds it (its values then read
    back as int64 are ``values.astype(np.int64)``)."""
    if name in _FLOAT_COLUMNS:
        return np.array(values, dtype=np.float64)
    if len(values):
        if lo is None or hi is None:
            lo, hi = values.min(), values.max()
        for kind, (least, most) in zip(_INT_TYPES, _INT_RANGES):  # (NaN: none; int64)
            if least <= lo and hi <= most:
                return values.astype(kind)
    return values.astype(np.int64)


class StepColumns(Mapping[str, np.ndarray]):
    """A replay's step columns as recorded: ``steps[name]`` is one value a step, float64
    (:data:`_FLOAT_COLUMNS`) or int64, made from the records on each read and not kept;
    :meth:`rows` makes rows [start, stop) of every column. A column set on it
    (``steps[name] = values``, :meth:`update`) is kept as given and read as it is.

    Args:
        whole: for each recorded column, in order, (whole rows,): its value in each row
            recorded whole (float64 for :data:`_FLOAT_COLUMNS`, else any integer type), one
            array or in parts (a list of arrays, joined in order; types may differ by part).
        copies: (whole rows,) int64: the steps each whole row stands for, itself first, then
            its repeats (at least 1).
        repeated: for each of :data:`REPEAT_COLUMNS`, (repeats,): its value in each repeated
            step, in step order (types and parts as in ``whole``).

    Attributes:
        num_steps: the steps (the length of every column).
        repeats: (num_steps,) bool: whether the step repeats the whole row before it.
    """

    def __init__(
        self,
        whole: Mapping[str, np.ndarray | list[np.ndarray]],
        copies: np.ndarray,
        repeated: Mapping[str, np.ndarray | list[np.ndarray]],
    ) -> None:
        self._whole = {c: _Parts(c, v) for c, v in whole.items()}
        self._repeated = {c: _Parts(c, v) for c, v in repeated.items()}
        # (num_steps,): the whole row each step is or repeats
        rows = np.arange(len(copies), dtype=np.int32 if len(copies) < 2**31 else np.int64)
        self._source = np.repeat(rows, copies)
        self.num_steps = len(self._source)
        self.repeats = np.zeros(self.num_steps, dtype=bool)
        self.repeats[1:] = self._source[1:] == self._source[:-1]
        self._set: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._set:
            return self._set[name]
        if name not in self._whole:
            raise KeyError(name)
        return self._rows(name, 0, self.num_steps)

    def __iter__(self) -> Iterator[str]:
        yield from self._whole
        yield from (c for c in self._set if c not in self._whole)

    def __len__(self) -> int:
        return len(self._whole) + sum(c not in self._whole for c in self._set)

    def __contains__(self, name: object) -> bool:
        return name in self._whole or name in self._set

    def __setitem__(self, name: str, values: np.ndarray) -> None:
        self._set[name] = values

    def update(self, columns: Mapping[str, np.ndarray]) -> None:
        """Set each of ``columns`` (:meth:`__setitem__`)."""
        for name, values in columns.items():
            self[name] = values

    def dtype(self, name: str) -> np.dtype:
        """The dtype of column ``name``, without making it."""
        if name in self._set:
            return self._set[name].dtype
        if name not in self._whole:
            raise KeyError(name)
        return np.dtype(np.float64 if name in _FLOAT_COLUMNS else np.int64)

    def rows(
        self, start: int, stop: int, columns: Iterable[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Rows [start, stop) of every column (``0 <= start <= stop <= num_steps``), in the
        order of iteration; with ``columns``, of those of them it has (only those made)."""
        names = self if columns is None else [c for c in columns if c in self]
        return {c: self._rows(c, start, stop) for c in names}

    def _rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if name in self._set:
            return self._set[name][start:stop]
        source = self._source[start:stop]
        if len(source):  # the whole rows' values
            lo = int(source[0])  # (source does not decrease)
            rows = self._whole[name].take(lo, int(source[-1]) + 1)
            column = rows[source - lo if lo else source]
        else:
            column = self._whole[name].take(0, 0)
        if name not in _FLOAT_COLUMNS:
            column = column.astype(np.int64, copy=False)
        values = self._repeated.get(name)
        if values is not None and len(source):
            repeats = self.repeats[start:stop]
            # repeats before ``start``: steps before it less the whole rows before it
            first = start - int(self._source[start]) - int(self.repeats[start])
            column[repeats] = values.take(first, first + int(np.count_nonzero(repeats)))
        return column


class _Parts:
    """A recorded column (:class:`StepColumns`) as given: one array, or its parts in order.

    Args:
        name: the column (its type when empty: float64 for :data:`_FLOAT_COLUMNS`, else
            int64).
        parts: one array, or a list of them (types may differ).
    """

    def __init__(self, name: str, parts: np.ndarray | list[np.ndarray]) -> None:
        parts = [parts] if isinstance(parts, np.ndarray) else parts
        self._parts = [p for p in parts if len(p)]
        self._starts = [0]  # where each part starts, then the length
        for p in self._parts:
            self._starts.append(self._starts[-1] + len(p))
        self._empty = np.float64 if name in _FLOAT_COLUMNS else np.int64

    def take(self, start: int, stop: int) -> np.ndarray:
        """Values [start, stop) (``0 <= start <= stop <=`` the length) as one array (a view
        of a part or the parts' values joined, in the type that holds every part's), to be
        read only; empty: float64 or int64."""
        if start >= stop:
            return np.zeros(0, self._empty)
        first = bisect_right(self._starts, start) - 1
        last = bisect_left(self._starts, stop, lo=first)  # parts [first, last) hold them
        pieces = [
            part[max(start - at, 0) : stop - at]
            for part, at in zip(self._parts[first:last], self._starts[first:last])
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@dataclass
class ReplayResult:
    """What one replay produced.

    Attributes:
        requests: every trace request in its final state (finished, rejected, aborted).
        steps: per-step columns (``STEP_COLUMNS``), one array each (a replay's:
            :class:`StepColumns`, a column made on each read); ``time_s`` is the
            step's start and ``kv_used_blocks`` the GPU blocks held while it runs (a
            block shared by several requests once). Prefix cache: ``num_cached_tokens``
            and ``num_cached_blocks`` found cached by the step's admissions,
            ``kv_cached_blocks`` the GPU blocks holding a key (used or cached free).
            ``num_wasted_tokens``: decode slots of requests already finished (async).
            ``num_spec_tokens``: draft tokens verified by decodes (speculative decoding;
            step tokens = prefill + decode + spec tokens). With LoRA also
            ``LORA_COLUMNS``.
        tick_steps: for each decode tick, the index of the step that ran it (an integer
            array: int32 from a replay of fewer than 2**31 steps).
        wall_s: wall-clock seconds the replay took.
        num_gpu_blocks: size of the GPU KV cache, for usage fractions.
        failure: None, or why the run stopped early (see :func:`sched_lab.sim.replay.replay`).
        prefix_caching: whether the block manager cached prefixes.
        num_evicted_blocks: blocks evicted from the prefix cache.
        events: what the scheduler's shared moves did to each request, and why requests
            waited (:class:`sched_lab.core.events.EventLog`; step indices are rows of ``steps``).
        async_scheduling: whether the scheduler planned asynchronously.
    """

    requests: list[Request]
    steps: Mapping[str, np.ndarray]
    tick_steps: np.ndarray
    wall_s: float
    num_gpu_blocks: int = 0
    failure: str | None = None
    prefix_caching: bool = False
    num_evicted_blocks: int = 0
    events: EventLog | None = None
    async_scheduling: bool = False

    @functools.cached_property
    def step_end_s(self) -> np.ndarray:
        """End time (seconds) of each step: when its sampled tokens exist."""
        return self.steps["time_s"] + self.steps["duration_s"]

    @property
    def num_steps(self) -> int:
        """The steps recorded (the length of every column of ``steps``)."""
        if isinstance(self.steps, StepColumns):
            return self.steps.num_steps  # (no column made to count it)
        return len(self.steps["time_s"])

    def step_rows(
        self, start: int, stop: int, columns: Iterable[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Rows [start, stop) of every step column, in the order of ``steps`` (of
        :class:`StepColumns`, without making the whole columns); with ``columns``, of those
        of them the steps have (a column not asked for is not made)."""
        if isinstance(self.steps, StepColumns):
            return self.steps.rows(start, stop, columns)
        names = self.steps if columns is None else [c for c in columns if c in self.steps]
        return {c: self.steps[c][start:stop] for c in names}

    def token_times(self, r: Request) -> np.ndarray:
        """Times (seconds) at which ``r`` received each of its output tokens."""
        end = self.step_end_s
        parts = [end[np.asarray(r.prefill_token_steps, dtype=np.int64)]]
        parts += [end[self.tick_steps[a:b]] for a, b in r.decode_segments]
        if r.spec_steps:  # accepted drafts: their tokens exist at their step's end too
            parts.append(
                end[np.repeat([s for s, _, _ in r.spec_steps], [a for *_, a in r.spec_steps])]
            )
        return np.sort(np.concatenate(parts))

    def num_token_times(self, r: Request) -> int:
        """``len(self.token_times(r))``, without computing them."""
        n = len(r.prefill_token_steps) + sum(b - a for a, b in r.decode_segments)
        return n + r.num_accepted_tokens if r.spec_steps else n

    def num_tokens_received(self, r: Request) -> int:
        """Output tokens ``r`` received by the end of the run: those of recorded steps. For a
        request the run stopped (aborted) this, unlike :meth:`num_token_times`, counts the
        decode ticks since it last joined the decode batch (whose state is written back to
        it only when it leaves) and no token of a step that never ended (async scheduling
        plans a step ahead)."""
        steps, ticks = self.num_steps, len(self.tick_steps)
        n = sum(s < steps for s in r.prefill_token_steps)
        n += sum(max(min(b, ticks) - a, 0) for a, b in r.decode_segments)
        if r.join_tick >= 0:  # still in the decode batch when the run stopped
            n += max(ticks - r.join_tick, 0)
        return n + sum(a for s, _, a in r.spec_steps if s < steps)
