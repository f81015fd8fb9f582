"""What a replay records: one row per step (``STEP_COLUMNS``) and the result of a replay.

A :class:`StepRecorder` keeps the rows in a typed array (``array.array``, 8 bytes a value
while the replay runs: a list would hold a Python object each) and makes them numpy
columns once, at the end (:meth:`StepRecorder.arrays`).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Collection, Sequence
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

ENDED = (
    RequestStatus.FINISHED,
    RequestStatus.REJECTED,
    RequestStatus.ABORTED,
    RequestStatus.UNFINISHED,
)
"""The statuses a request ends a replay in."""


class StepRecorder:
    """The per-step records of one replay loop: one row per step, appended as it ends.

    The rows are kept flat in one float64 array (every count is exact there: below 2**53)
    and split into ``STEP_COLUMNS`` columns, float64 or int64, by :meth:`arrays`.

    Attributes:
        tick_steps: for each decode tick, the index of the step that ran it.
        num_steps: rows appended so far.
    """

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.columns = (*STEP_COLUMNS, *extra)  # ``extra``: e.g. LORA_COLUMNS
        self._values = array("d")  # the rows, one after the other
        self.tick_steps = array("q")
        self.num_steps = 0

    def append(self, row: Sequence[float], decodes: Collection[object]) -> None:
        """Append one step's ``row`` (``len(self.columns)`` numbers in that order);
        ``decodes``: the step's decodes (not empty: it ran a decode tick). A value that is
        not a number raises midway (``arrays`` cuts the partial row)."""
        self._values.extend(row)
        if decodes:
            self.tick_steps.append(self.num_steps)
        self.num_steps += 1

    def arrays(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The columns (contiguous copies) and decode-tick steps; a step that failed midway
        (a partial row, not counted in ``num_steps``) is cut."""
        width = len(self.columns)
        n = len(self._values) // width
        table = np.frombuffer(self._values, dtype=np.float64)[: n * width].reshape(n, width)
        steps = {
            c: table[:, i].astype(np.float64 if c in _FLOAT_COLUMNS else np.int64)
            for i, c in enumerate(self.columns)
        }
        return steps, np.frombuffer(self.tick_steps, dtype=np.int64)


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
