"""A loaded trace as columns, and the options common to every format, applied by
:func:`sched_lab.traces.load_trace` in order: window ``[start_s, end_s)`` (then re-based to 0),
``limit`` (the first N replayed requests), ``rate_scale`` (inter-arrival times divided by
it). Dropped rows stay in the table with a ``drop_reason`` and go through window and limit
like the others."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from sched_lab.core.errors import TraceError
from sched_lab.core.request import Request, RequestStatus
from sched_lab.traces.spec import WHERE

CACHE_KEYS = ("lora_name", "cache_salt")  # optional per-request names in prefix-cache keys


@dataclass(frozen=True)
class TraceTable:
    """One entry per request, in arrival order (all arrays (n,)).

    Args:
        row: int64 0-based source row; becomes ``Request.request_id``.
        arrival_s: float64 seconds on the trace's own clock.
        prompt_len, output_len: int64 tokens (>= 1 where replayed).
        hash_ids: per-request prefix-block hashes (None where a request has none), or None.
        prompt_token_ids: real prompt tokens per request (``prompts`` format), or None.
        drop_reason: object array of str ("" = replayed), or None when all are replayed.
        hash_block_size: tokens per hash id.
        lora_name, cache_salt: object arrays of str ("" = none; ``Request.lora_name``,
            ``Request.cache_salt``), or None when no request has one.
    """

    row: np.ndarray
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    hash_ids: list[list[int]] | None = None
    prompt_token_ids: list[list[int]] | None = None
    drop_reason: np.ndarray | None = None
    hash_block_size: int = 512
    lora_name: np.ndarray | None = None
    cache_salt: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.row)

    def take(self, index: np.ndarray | slice) -> TraceTable:
        """A new table with the entries selected by a boolean mask, index array or slice."""
        positions = np.arange(len(self))[index]

        def pick(lists: list[list[int]] | None) -> list[list[int]] | None:
            return None if lists is None else [lists[i] for i in positions]

        return TraceTable(
            row=self.row[index],
            arrival_s=self.arrival_s[index],
            prompt_len=self.prompt_len[index],
            output_len=self.output_len[index],
            hash_ids=pick(self.hash_ids),
            prompt_token_ids=pick(self.prompt_token_ids),
            drop_reason=None if self.drop_reason is None else self.drop_reason[index],
            hash_block_size=self.hash_block_size,
            lora_name=None if self.lora_name is None else self.lora_name[index],
            cache_salt=None if self.cache_salt is None else self.cache_salt[index],
        )

    @property
    def replayed(self) -> np.ndarray:
        """Boolean (n,): the entries that are replayed (not dropped)."""
        if self.drop_reason is None:
            return np.ones(len(self), dtype=bool)
        return self.drop_reason == ""

    def with_arrivals(self, arrival_s: np.ndarray) -> TraceTable:
        """The same requests with new arrival times."""
        return dataclasses.replace(self, arrival_s=arrival_s)

    def to_requests(self) -> list[Request]:
        """Fresh :class:`Request` objects; dropped entries get status ``dropped``, their
        reason and a NaN arrival time."""
        hash_ids = self.hash_ids or [None] * len(self)
        token_ids = self.prompt_token_ids or [None] * len(self)
        reasons = [""] * len(self) if self.drop_reason is None else self.drop_reason.tolist()
        requests = []
        for row, arrival_s, prompt_len, output_len, ids, tokens, reason in zip(
            self.row.tolist(),
            self.arrival_s.tolist(),
            self.prompt_len.tolist(),
            self.output_len.tolist(),
            hash_ids,
            token_ids,
            reasons,
            strict=True,
        ):
            r = Request(
                request_id=str(row),
                arrival_s=math.nan if reason else arrival_s,
                prompt_len=prompt_len,
                output_len=output_len,
                hash_ids=None if ids is None else list(ids),
                prompt_token_ids=None if tokens is None else list(tokens),
                hash_block_size=self.hash_block_size,
            )
            if reason:
                r.status, r.reason = RequestStatus.DROPPED, reason
            requests.append(r)
        for column in CACHE_KEYS:
            values = getattr(self, column)
            if values is not None:
                for r, v in zip(requests, values.tolist(), strict=True):
                    setattr(r, column, v)
        return requests


def apply_window(table: TraceTable, start_s: float, end_s: float) -> TraceTable:
    """Keep requests with ``start_s <= arrival_s < end_s``, re-based to start at 0;
    TraceError if none is left."""
    kept = table.take((table.arrival_s >= start_s) & (table.arrival_s < end_s))
    if not kept.replayed.any():
        times = table.arrival_s[table.replayed]
        raise TraceError(
            f"trace window start_s={start_s:g}, end_s={end_s:g} keeps no request; the trace's "
            f"requests arrive from {times[0]:g} s to {times[-1]:g} s"
        )
    return kept.with_arrivals(kept.arrival_s - kept.arrival_s[kept.replayed][0])


def apply_periods(table: TraceTable, periods: list[list[float | None]]) -> TraceTable:
    """Lay the trace's clock onto on-periods ``[[on_s, off_s], ...]`` of the run's clock
    (sorted, disjoint, on_s < off_s; the last ``off_s`` may be None: open). The trace's time
    runs only while a period is on: trace time ``tau`` lands in the period where the on-time
    before it sums past ``tau``, at ``on_s + (tau - on-time of the periods before)``.
    Requests past the periods' total on-time are cut, dropped rows after them too (as a
    window cuts); a loaded trace starts at 0, so its first request is always kept."""
    on = np.array([p[0] for p in periods], dtype=np.float64)
    off = np.array([np.inf if p[1] is None else p[1] for p in periods], dtype=np.float64)
    before = np.concatenate(([0.0], np.cumsum(off - on)))  # on-time before each period
    past = np.flatnonzero(table.replayed & (table.arrival_s >= before[-1]))
    kept = table.take(slice(0, past[0])) if len(past) else table
    tau = kept.arrival_s
    k = np.clip(np.searchsorted(before, tau, side="right") - 1, 0, len(on) - 1)
    return kept.with_arrivals(on[k] + (tau - before[k]))  # NaN (dropped rows) stays NaN


def apply_limit(table: TraceTable, limit: int) -> TraceTable:
    """The first ``limit`` replayed requests, with the dropped entries among them."""
    replayed = np.flatnonzero(table.replayed)
    if len(replayed) <= limit:
        return table
    return table.take(slice(0, replayed[limit - 1] + 1))


def apply_rate_scale(table: TraceTable, rate_scale: float) -> TraceTable:
    """Divide every inter-arrival time by ``rate_scale``.

    Raises:
        TraceError: two distinct arrivals would coincide (a gap below float64's smallest
            normal) or the last lies beyond MAX_CLOCK_S. Overflow to inf is left to
            ``load_trace``.
    """
    if rate_scale == 1.0:
        return table
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        scaled = table.arrival_s / rate_scale
        kept = table.replayed & np.isfinite(table.arrival_s)
        before, after = np.diff(table.arrival_s[kept]), np.diff(scaled[kept])
    where = f"{WHERE}.rate_scale"
    lost = np.flatnonzero((before > 0) & ~(after >= np.finfo(np.float64).tiny))
    if len(lost) and np.isfinite(after[lost[0]]):
        rows = table.row[kept]
        i = int(lost[0])
        raise TraceError(
            f"{where}: {rate_scale:g} shrinks the {before[i]:.3g} s gap between requests "
            f"{rows[i]} and {rows[i + 1]} to {after[i]:.3g} s, below float64's smallest "
            "normal number: the arrival times cannot be kept"
        )
    check_clock(scaled, where, f"{rate_scale:g}")
    return table.with_arrivals(scaled)


# Arrival times stay below 2**32 s (136 years), where float64 seconds still resolve a
# microsecond (spacing 2**-20 s): beyond, the replay clock would round away step durations.
MAX_CLOCK_S = float(2**32)


def check_clock(arrival_s: np.ndarray, where: str, value: str) -> None:
    """TraceError naming ``where`` = ``value`` if arrivals go beyond MAX_CLOCK_S (non-finite
    ones are left to ``load_trace``)."""
    finite = arrival_s[np.isfinite(arrival_s)]
    last = float(finite.max(initial=0.0))
    if last > MAX_CLOCK_S:
        raise TraceError(
            f"{where}: {value} puts the last arrival at {last:.3g} s; expected arrivals "
            f"within {MAX_CLOCK_S:.3g} s, where float64 seconds still resolve 1 us (at "
            f"{last:.3g} s the spacing is {np.spacing(last):.2g} s, longer than a step)"
        )
