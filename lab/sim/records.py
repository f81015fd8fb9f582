"""What a replay records: one row per step (``STEP_COLUMNS``) and the result of a replay.

A :class:`StepRecorder` keeps the rows in a typed array (``array.array``, 8 bytes a value
while the replay runs: a list would hold a Python object each) and makes them numpy
columns once, at the end (:meth:`StepRecorder.arrays`).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Collection
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

ENDED = (
    RequestStatus.FINISHED,
    RequestStatus.REJECTED,
    RequestStatus.ABORTED,
    RequestStatus.UNFINISHED,
)
"""The statuses a request ends a replay in."""


class StepRecorder:
    """The per-step records of one replay loop: one row per step, appended as it ends.

    A row is kept whole (every column, flat in one float64 array: every count is exact there,
    below 2**53), or, for a step that repeats the last whole row but in
    :data:`REPEAT_COLUMNS` (a decode plan moved on by a tick, ``Scheduler.repeat_decodes``),
    as those five values: 40 bytes a step, not 8 per column. :meth:`arrays` expands both
    into ``columns``, float64 or int64.

    Attributes:
        num_steps: rows appended so far.
    """

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.columns = (*STEP_COLUMNS, *extra)  # ``extra``: e.g. LORA_COLUMNS
        self._values = array("d")  # the whole rows, one after the other
        self._ticks = array("q")  # the whole rows that ran a decode tick (repeats all do)
        self._repeated = tuple(array("d") for _ in REPEAT_COLUMNS)  # a column each
        # Runs of steps in order: their count and the whole row they repeat (-1: whole rows).
        self._run_len, self._run_template = array("q"), array("q")
        self._last: list[float] | None = None  # the last whole row
        self._repeating = False  # whether the last run is one of repeats
        self.num_steps = 0

    def append(self, row: list[float], decodes: Collection[object]) -> None:
        """Append one step's ``row`` (``len(self.columns)`` numbers in that order);
        ``decodes``: the step's decodes (not empty: it ran a decode tick). Raises TypeError
        for a value that is not a number, appending nothing."""
        self._values.fromlist(row)  # (much faster than extend for a list)
        if decodes:
            self._ticks.append(self.num_steps)
        self.num_steps += 1
        self._last = row
        if self._run_len and not self._repeating:
            self._run_len[-1] += 1
        else:
            self._repeating = False
            self._run_len.append(1)
            self._run_template.append(-1)

    def append_repeat(
        self, row: list[float], time_s: float, duration_s: float, kv_used: int, context: int,
        kv_cached: int,
    ) -> None:  # fmt: skip
        """Append a step that ran a decode tick and equals ``row``, the last row appended by
        :meth:`append` (unchanged since), but in :data:`REPEAT_COLUMNS`, whose values are
        given in order. Raises ValueError for another row."""
        self._open_run(row, 1)
        time_c, duration_c, used_c, context_c, cached_c = self._repeated
        time_c.append(time_s)
        duration_c.append(duration_s)
        used_c.append(kv_used)
        context_c.append(context)
        cached_c.append(kv_cached)

    def append_repeats(self, row: list[float], *columns: list[float] | list[int]) -> None:
        """:meth:`append_repeat` for several steps, each of the :data:`REPEAT_COLUMNS` given
        as a list of one value a step."""
        self._open_run(row, len(columns[0]))
        for column, values in zip(self._repeated, columns, strict=True):
            column.fromlist(values)

    def _open_run(self, row: list[float], num_steps: int) -> None:
        """Count ``num_steps`` more repeats of ``row`` (a run of its own unless the last)."""
        if row is not self._last:
            raise ValueError("StepRecorder: a repeated step must repeat the last whole row")
        if not self._repeating:
            self._repeating = True
            self._run_template.append(len(self._values) // len(self.columns) - 1)
            self._run_len.append(0)
        self._run_len[-1] += num_steps
        self.num_steps += num_steps

    def arrays(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The columns (contiguous copies) and, for each decode tick, the step that ran it."""
        width, n = len(self.columns), self.num_steps
        run_template = np.frombuffer(self._run_template, dtype=np.int64)
        template = np.repeat(run_template, np.frombuffer(self._run_len, dtype=np.int64))
        repeat = template >= 0
        whole = np.frombuffer(self._values, dtype=np.float64).reshape(-1, width)
        template = template[repeat]
        repeated = dict(zip(REPEAT_COLUMNS, self._repeated))
        steps = {}
        for i, c in enumerate(self.columns):
            if len(template):
                column = np.empty(n)
                column[~repeat] = whole[:, i]
                if c in repeated:
                    column[repeat] = np.frombuffer(repeated[c], dtype=np.float64)
                else:
                    column[repeat] = whole[template, i]
            else:
                column = whole[:, i]
            steps[c] = column.astype(np.float64 if c in _FLOAT_COLUMNS else np.int64)
        ticks = repeat.copy()
        ticks[np.frombuffer(self._ticks, dtype=np.int64)] = True
        return steps, np.flatnonzero(ticks).astype(np.int64)


@dataclass
class ReplayResult:
    """What one replay produced.

    Attributes:
        requests: every trace request in its final state (finished, rejected, aborted).
        steps: per-step columns (``STEP_COLUMNS``), one array each; ``time_s`` is the
            step's start and ``kv_used_blocks`` the GPU blocks held while it runs (a
            block shared by several requests once). Prefix cache: ``num_cached_tokens``
            and ``num_cached_blocks`` found cached by the step's admissions,
            ``kv_cached_blocks`` the GPU blocks holding a key (used or cached free).
            ``num_wasted_tokens``: decode slots of requests already finished (async).
            ``num_spec_tokens``: draft tokens verified by decodes (speculative decoding;
            step tokens = prefill + decode + spec tokens). With LoRA also
            ``LORA_COLUMNS``.
        tick_steps: for each decode tick, the index of the step that ran it.
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
    steps: dict[str, np.ndarray]
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
        steps, ticks = len(self.steps["time_s"]), len(self.tick_steps)
        n = sum(s < steps for s in r.prefill_token_steps)
        n += sum(max(min(b, ticks) - a, 0) for a, b in r.decode_segments)
        if r.join_tick >= 0:  # still in the decode batch when the run stopped
            n += max(ticks - r.join_tick, 0)
        return n + sum(a for s, _, a in r.spec_steps if s < steps)
