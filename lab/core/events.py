"""What the scheduler's shared moves did to each request, and why a request waited (O(1)
per move; read by ``sched-lab explain`` and the timeline).

* events: ``(step, kind, id(request), a, b)`` integers in one ``array.array``: admitted
  (a = blocks, b = first chunk's tokens), chunk (a = tokens fed, b = computed before),
  preempted (a = :data:`PREEMPT_MODES` index, b = index into ``texts``), swapped in
  (a = blocks), aborted. ``step``: the row in steps.csv.
* ``waits``: streaks ``[reason, request, first_step, last_step, count, a, b]``, one per
  reason and waiting spell of the request admission stopped at; ``request`` None when the
  whole queue was held.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any

# Event kinds (the ``kind`` of an event tuple).
ADMITTED, PREFILL, PREEMPTED, SWAPPED_IN, FINISHED, ABORTED = range(6)
EVENT_NAMES = ("admitted", "prefill", "preempted", "swapped_in", "finished", "aborted")
PREEMPT_MODES = ("recompute", "swap", "recompute (CPU swap space full)")

# Wait reasons: code -> what the explanation says, with a and b of the streak.
WAIT_REASONS: dict[str, str] = {
    "kv_blocks": "needs {a} KV blocks, {b} free above the watermark (at its first step)",
    "token_budget": "{a} tokens to prefill, {b} left of the step's token budget",
    "budget_spent": "the step's token budget was spent on decodes and running chunks",
    "max_num_seqs": "max_num_seqs ({a}) requests running",
    "swapped_first": "swapped requests come back first (admission not tried)",
    "preempted_step": "a request was preempted in this step (admission not tried)",
    "not_tried": "the policy did not try admission",
    "swap_in_blocks": "swap-in needs {a} KV blocks, {b} free above the watermark (at first)",
    "swap_in_max_num_seqs": "swap-in held by max_num_seqs ({a}) requests running",
    "max_loras": "its LoRA adapter finds no slot: max_loras ({a}) adapters in use",
    "token_in_flight": "preempted while its token was in flight (async scheduling): "
    "re-admitted once the token is known",
}


class EventLog:
    """Events and wait streaks of one scheduler (see the module docstring). Append-only."""

    __slots__ = ("data", "record", "texts", "_text_index", "waits", "_open", "_last")
    __slots__ += ("_last_global", "_touched", "_touched_step")

    def __init__(self) -> None:
        self.data = array("q")  # the events, five integers each
        #: ``record((step, kind, id(request), a, b))`` appends an event (``data.extend``:
        #: the moves call it on hot paths, so no Python-level wrapper).
        self.record = self.data.extend
        self.texts: list[str] = []  # the ``b`` of preemptions points here
        self._text_index: dict[str, int] = {}
        self.waits: list[list] = []
        self._open: dict[Any, dict[str, list]] = {}  # request -> reason -> its open streak
        self._last: list = [None, None, -1, -1, 0, 0, 0]  # the streak extended last
        self._last_global: list | None = None
        self._touched: list[list] = []  # the streaks counted in step ``_touched_step``
        self._touched_step = -1

    def _touch(self, row: list, step: int) -> None:
        """Note that ``row`` counted ``step`` (for :meth:`repeat`)."""
        if self._touched_step != step:
            self._touched_step, self._touched = step, [row]
        else:
            self._touched.append(row)

    def repeat(self, step: int) -> None:
        """Count ``step`` in every streak that counted ``step - 1``: the same waits again, for
        a plan that repeats the one before it (``Scheduler.repeat_decodes``)."""
        if self._touched_step != step - 1:
            return
        for row in self._touched:
            row[3] = step
            row[4] += 1
        self._touched_step = step

    def repeat_run(self, first: int, num_steps: int) -> None:
        """:meth:`repeat` for steps ``first`` .. ``first + num_steps - 1``, at once."""
        if self._touched_step != first - 1:
            return
        last = first + num_steps - 1
        for row in self._touched:
            row[3] = last
            row[4] += num_steps
        self._touched_step = last

    def text(self, value: str) -> int:
        """The index of ``value`` in ``texts`` (added once)."""
        index = self._text_index.get(value)
        if index is None:
            index = self._text_index[value] = len(self.texts)
            self.texts.append(value)
        return index

    def rows(self, requests: Iterable[Any]) -> Iterator[tuple[int, int, Any, int, Any]]:
        """The events as ``(step, kind, request, a, b)`` in order, ``request`` looked up among
        ``requests`` and a preemption's ``b`` as its text."""
        by_id = {id(r): r for r in requests}
        d = self.data
        for i in range(0, len(d), 5):
            step, kind, rid, a, b = d[i : i + 5]
            yield step, kind, by_id[rid], a, self.texts[b] if kind == PREEMPTED else b

    def __len__(self) -> int:
        return len(self.data) // 5

    def extend(self, step: int, request: Any, reason: str) -> bool:
        """Count ``step`` in the last streak if it is ``request``'s for ``reason`` and return
        True; else False (call :meth:`wait`)."""
        row = self._last
        if row[1] is request and row[0] is reason:
            if row[3] != step:
                row[3] = step
                row[4] += 1
                self._touch(row, step)
            return True
        return False

    def wait(self, step: int, request: Any, reason: str, a: int = 0, b: int = 0) -> None:
        """``request`` was blocked for ``reason`` in ``step`` (idempotent within a step);
        ``a`` and ``b`` describe the streak's first step."""
        row = self._last
        if row[1] is request and row[0] is reason:
            if row[3] != step:
                row[3] = step
                row[4] += 1
                self._touch(row, step)
            return
        spells = self._open.get(request)
        if spells is None:
            spells = self._open[request] = {}
        row = spells.get(reason)
        if row is None:
            row = spells[reason] = [reason, request, step, step, 1, a, b]
            self.waits.append(row)
            self._touch(row, step)
        elif row[3] != step:
            row[3] = step
            row[4] += 1
            self._touch(row, step)
        self._last = row

    def end_wait(self, request: Any) -> None:
        """``request`` left the queue it waited in: its next wait starts new streaks."""
        if self._open.pop(request, None) is not None and self._last[1] is request:
            self._last = [None, None, -1, -1, 0, 0, 0]

    def wait_all(self, step: int, reason: str, a: int = 0) -> None:
        """The whole queue waited in ``step`` for ``reason`` (consecutive steps: one streak)."""
        row = self._last_global
        if row is not None and row[0] == reason and row[3] >= step - 1:
            if row[3] != step:
                row[3] = step
                row[4] += 1
                self._touch(row, step)
            return
        row = self._last_global = [reason, None, step, step, 1, a, 0]
        self.waits.append(row)
        self._touch(row, step)
