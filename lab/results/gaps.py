"""A run's inter-token gaps (ITL) without an array of them, and numpy's sums walked in runs.

The finished requests of a 1M-request run have ~230M gaps between consecutive tokens (1.8 GB
as float64, and numpy's percentiles partition a copy-sized array). :class:`TokenGaps` keeps
what the gaps are made of instead, the pieces of each request's tokens (a prefill token at a
step, a decode segment over consecutive decode ticks), and gives the statistics
``latency_stats`` takes of the array, to the last bit:

- mean and std: numpy's pairwise sum of the gaps in request order (:func:`pairwise_sum`), with
  a run of at most :data:`LEAF` gaps made at a time (up to :data:`KEEP` gaps, the mean's
  runs are kept for the std, which then makes none);
- order statistics (median, percentiles, quantiles, max): from the gaps as a multiset. Inside
  a decode segment every gap is the one between two consecutive decode ticks, so each tick
  gap is counted once per segment that spans it; the gaps between pieces are taken one by one.

tests/test_metrics.py compares every statistic with numpy's on the array.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

LEAF = 1 << 20  # gaps made (and summed by np.sum) at a time by TokenGaps' sums
ROWS = 1 << 20  # token positions whose gaps TokenGaps.of_pieces takes at a time
KEEP = 1 << 23  # up to this many gaps (64 MB), TokenGaps' std reuses its mean's runs


def pairwise_sum(n: int, leaf_sum: Callable[[int, int], float], leaf: int | None = None) -> float:
    """``np.sum`` of an n-value float64 array, to the last bit, from ``leaf_sum(lo, size)``
    (``np.sum`` of values ``lo .. lo + size - 1``) over runs of at most ``leaf`` values
    (default :data:`LEAF`).

    numpy sums a contiguous array pairwise: a run of more than 128 values is split at
    ``size // 2`` rounded down to a multiple of 8 and the halves' sums are added. This walks
    the same tree down to runs of at most ``leaf`` values (>= 128: below that numpy stops
    splitting), so every addition is the one numpy makes. Raises ValueError for a smaller
    ``leaf``."""
    return float(pairwise_sums(n, lambda lo, k: np.array([leaf_sum(lo, k)]), leaf)[0])


def pairwise_sums(
    n: int, leaf_sums: Callable[[int, int], np.ndarray], leaf: int | None = None
) -> np.ndarray:
    """:func:`pairwise_sum` of several n-value arrays at once: ``leaf_sums(lo, size)`` gives
    each one's ``np.sum`` of values ``lo .. lo + size - 1`` (a float64 array, one sum an
    array), called once for each run, in order; the runs' sums are added elementwise."""
    leaf = LEAF if leaf is None else leaf
    if leaf < 128:
        raise ValueError(f"leaf: {leaf} values; at least 128 (numpy's pairwise block)")
    return _walk(0, n, leaf, leaf_sums)


def _walk(lo: int, size: int, leaf: int, leaf_sums: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """:func:`pairwise_sums` of values ``lo .. lo + size - 1``. A module function: a nested
    one calling itself would hold itself, and ``leaf_sums`` (with a run's result in its
    closure), in a reference cycle that only the garbage collector frees."""
    if size <= leaf:
        return np.asarray(leaf_sums(lo, size), dtype=np.float64)
    half = size // 2
    half -= half % 8
    return _walk(lo, half, leaf, leaf_sums) + _walk(lo + half, size - half, leaf, leaf_sums)


def std_of_runs(n: int, run: Callable[[int, int], np.ndarray], mean: float | None = None,
                leaf: int | None = None) -> float:  # fmt: skip
    """``float(a.std())`` (population) of an n-value float64 array ``a``, to the last bit, from
    ``run(lo, size)`` = ``a[lo : lo + size]`` (a view or a fresh array) over runs of at most
    ``leaf`` values; ``mean``: ``float(a.mean())`` where already known."""
    if mean is None:
        mean = pairwise_sum(n, lambda lo, k: np.sum(run(lo, k)), leaf) / n

    def squares(lo: int, k: int) -> float:
        d = np.subtract(run(lo, k), mean)
        return np.sum(np.multiply(d, d, out=d))

    return math.sqrt(pairwise_sum(n, squares, leaf) / n)


def population_std(v: np.ndarray, leaf: int | None = None) -> float:
    """``float(v.std())`` of a contiguous float64 array, to the last bit, with temporaries of
    at most ``leaf`` values (default :data:`LEAF`) where numpy's is the size of ``v``
    (:func:`std_of_runs`; ValueError for ``leaf`` < 128). tests/test_metrics.py compares it
    with ``np.std`` bit for bit."""
    if len(v) <= (LEAF if leaf is None else leaf):
        return float(v.std())
    return std_of_runs(len(v), lambda lo, k: v[lo : lo + k], leaf=leaf)


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's linear-interpolation step of ``np.percentile`` (method "linear"), op for op."""
    diff = b - a
    return np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)


def spans_of_pieces(
    source: np.ndarray,
    end: np.ndarray,
    start: np.ndarray,
    size: np.ndarray,
    piece_who: np.ndarray,
    counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, last, gaps) of some requests from their pieces (ordered by request, then
    time): piece k is ``size[k]`` tokens from ``source[start[k]:]``, whose steps end at
    ``end``; ``piece_who``: the request (0-based here), ``counts``: tokens per request."""
    index = np.repeat(start - (np.cumsum(size) - size), size) + np.arange(int(size.sum()))
    times = end[source[index]]
    del index
    bounds = np.concatenate([[0], np.cumsum(counts)])
    gaps = np.subtract(times[1:], times[:-1])  # np.diff, then less each request's last to
    gaps = np.delete(gaps, bounds[1:-1] - 1)  # the next one's first
    if (gaps < 0).any():  # pieces overlap in time: order each request's tokens by time
        who = np.repeat(piece_who, size)
        times = times[np.lexsort((times, who))]
        gaps = np.delete(np.subtract(times[1:], times[:-1]), bounds[1:-1] - 1)
    return times[bounds[:-1]], times[bounds[1:] - 1], gaps


class Joined:
    """Two 1-D integer arrays read as one, ``head`` then ``tail`` (``len``, and indexing by an
    array of non-negative positions), without the joined copy: :class:`TokenGaps`' source
    is a run's prefill tokens' steps, then its decode ticks' (the result's own array)."""

    def __init__(self, head: np.ndarray, tail: np.ndarray) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, index) -> np.ndarray:
        index = np.asarray(index)
        out = np.empty(index.shape, dtype=np.result_type(self.head, self.tail))
        low = index < len(self.head)
        out[low] = self.head[index[low]]
        low = np.logical_not(low, out=low)
        out[low] = self.tail[index[low] - len(self.head)]
        return out


def _drain(parts: list[np.ndarray], dtype=np.float64) -> np.ndarray:
    """The arrays of ``parts`` joined (one of ``dtype`` for none); ``parts`` is emptied."""
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    parts.clear()
    return out


def merge_counts(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each distinct value of ``values``, ascending; the sum of its ``weights`` (int64)):
    the same multiset, so the same order statistics (the k-th smallest of the values each
    counted ``weights`` times), in less room where values repeat (a run's tick gaps do)."""
    if not len(values):
        return values, weights.astype(np.int64)
    order = np.argsort(values, kind="stable")
    values = values[order]  # one at a time: a caller's temporaries are freed as they go
    weights = weights[order]
    del order
    first = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    return values[first], np.add.reduceat(weights.astype(np.int64, copy=False), first)


class TokenGaps:
    """The gaps between consecutive tokens of some requests, in request order, as the
    ``np.ndarray`` of them would give them (``len``, mean, std, max, median, percentiles,
    quantiles), without it. Made by :meth:`of_pieces`."""

    def __init__(self, source, end, start, size, piece_who, counts, values, weights) -> None:
        """``values``, ``weights``: lists of arrays, the gaps and how many times each counts
        (any order, a value any number of times: :func:`merge_counts`); emptied here, so
        their arrays are freed as they are merged."""
        self._source, self._end = source, end
        self._start, self._size, self._who, self._counts = start, size, piece_who, counts
        self._piece_at = np.searchsorted(piece_who, np.arange(len(counts) + 1))
        self._gaps_before = np.concatenate([[0], np.cumsum(counts - 1)])
        # each distinct gap, ascending, and how many gaps are at most it
        self._values, weights = merge_counts(_drain(values), _drain(weights, np.int64))
        self._cum = np.cumsum(weights, dtype=np.int64)
        self.n = int(self._gaps_before[-1])
        self._kept: dict[tuple[int, int], np.ndarray] | None = None  # runs of gaps (_mean)

    @classmethod
    def of_pieces(cls, source, end, start, size, piece_who, counts) -> TokenGaps | None:
        """The gaps of requests given as pieces (:func:`spans_of_pieces`'s arguments: a
        piece is ``size[k]`` tokens at the steps ``source[start[k]:]``, whose ends are
        ``end``; pieces ordered by request, then by their first token's time). None where a
        gap would be negative (pieces overlap in time: the tokens must be sorted).

        The gaps inside pieces are taken :data:`ROWS` source positions at a time: at
        position x, the gap to x + 1 counts once for each piece spanning both; each part's
        equal gaps are merged (:func:`merge_counts`) before the next part."""
        ends = start + size - 1  # each piece's last token, in source
        spans = size >= 2  # pieces with gaps inside: source positions start .. ends - 1
        opens, closes = np.sort(start[spans]), np.sort(ends[spans])
        same = piece_who[1:] == piece_who[:-1]  # consecutive pieces of one request
        between = end[source[start[1:][same]]] - end[source[ends[:-1][same]]]
        if (between < 0).any():
            return None
        values = [between]  # the distinct gaps of each part, with their counts
        weights = [np.ones(len(between), dtype=np.int64)]
        depth = 0  # pieces spanning the position before the part
        for lo in range(0, len(source), ROWS):
            hi = min(lo + ROWS, len(source))
            a0, a1 = np.searchsorted(opens, (lo, hi))
            c0, c1 = np.searchsorted(closes, (lo, hi))
            mult = np.bincount(opens[a0:a1] - lo, minlength=hi - lo)
            mult -= np.bincount(closes[c0:c1] - lo, minlength=hi - lo)
            mult = np.cumsum(mult, out=mult)
            mult += depth  # pieces spanning each position x: its gap to x + 1 counts as many
            depth = int(mult[-1])
            x = np.flatnonzero(mult)
            if len(x):
                times = end[source[np.arange(lo, x[-1] + lo + 2)]]  # each position's step end
                inside = np.subtract(times[1:], times[:-1])[x]
                if (inside < 0).any():
                    return None
                v, w = merge_counts(inside, mult[x])
                values.append(v)
                weights.append(w)
        return cls(source, end, start, size, piece_who, counts, values, weights)

    def __len__(self) -> int:
        return self.n

    @property
    def first(self) -> np.ndarray:
        """Each request's first token time."""
        return self._end[self._source[self._start[self._piece_at[:-1]]]]

    @property
    def last(self) -> np.ndarray:
        """Each request's last token time."""
        k = self._piece_at[1:] - 1
        return self._end[self._source[self._start[k] + self._size[k] - 1]]

    def chunk(self, lo: int, hi: int) -> np.ndarray:
        """Gaps ``lo .. hi - 1`` (a fresh array)."""
        r0 = int(np.searchsorted(self._gaps_before, lo, side="right")) - 1
        r1 = max(int(np.searchsorted(self._gaps_before, hi, side="left")), r0 + 1)
        p0, p1 = self._piece_at[r0], self._piece_at[r1]
        *_, gaps = spans_of_pieces(
            self._source, self._end, self._start[p0:p1], self._size[p0:p1],
            self._who[p0:p1] - r0, self._counts[r0:r1],
        )  # fmt: skip
        skip = lo - int(self._gaps_before[r0])
        return gaps[skip : skip + hi - lo]

    def to_array(self) -> np.ndarray:
        """Every gap (the array this stands for)."""
        return self.chunk(0, self.n) if self.n else np.zeros(0)

    def _run(self, lo: int, k: int) -> np.ndarray:
        kept = self._kept
        if kept is None:
            return self.chunk(lo, lo + k)
        if (lo, k) not in kept:
            kept[(lo, k)] = self.chunk(lo, lo + k)
        return kept[(lo, k)]

    @functools.cached_property
    def _mean(self) -> float:
        # the mean's runs of gaps are the std's: kept for it where they are few (KEEP)
        self._kept = {} if self.n <= KEEP else None
        return pairwise_sum(self.n, lambda lo, k: np.sum(self._run(lo, k))) / self.n

    def mean(self) -> float:
        """``float(a.mean())`` of the array ``a`` of the gaps (NaN for none, as numpy)."""
        return self._mean if self.n else float("nan")

    def std(self) -> float:
        """``float(a.std())`` (population; NaN for none)."""
        if not self.n:
            return float("nan")
        try:
            return std_of_runs(self.n, self._run, self._mean)
        finally:
            self._kept = None

    def max(self) -> float:
        """``float(a.max())``; ValueError for none, as numpy."""
        if not self.n:
            raise ValueError("max of no gaps")
        return float(self._values[-1])

    def kth(self, k: np.ndarray) -> np.ndarray:
        """The k-th smallest gaps (0-based)."""
        return self._values[np.searchsorted(self._cum, k, side="right")]

    def median(self) -> float:
        """``float(np.median(a))``: the middle gap, or the mean of the two middle ones (NaN
        for none)."""
        if not self.n:
            return float("nan")
        half = self.n // 2
        if self.n % 2:
            return float(self.kth(np.array([half]))[0])
        a, b = self.kth(np.array([half - 1, half]))
        return float((a + b) / 2)

    def quantile(self, qs) -> np.ndarray:
        """``np.quantile(a, qs)`` (linear; ``qs`` a float64 array in [0, 1])."""
        virtual = (self.n - 1) * np.asarray(qs, dtype=np.float64)
        prev = np.floor(virtual)
        top = virtual >= self.n - 1  # numpy takes the last value (its index -1) for both
        prev[top] = -1  # and its gamma from that index
        gamma = virtual - prev
        below = np.where(top, self.n - 1, prev).astype(np.int64)
        above = np.where(top, self.n - 1, prev + 1).astype(np.int64)
        return lerp(self.kth(below), self.kth(above), gamma)

    def percentile(self, ps) -> np.ndarray:
        """``np.percentile(a, ps)`` (``ps`` in [0, 100])."""
        return self.quantile(np.true_divide(np.asarray(ps, dtype=np.float64), 100))
