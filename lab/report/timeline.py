"""A request's life from the events the scheduler recorded during the replay: ``events.csv``,
the Gantt picture of chosen requests, and the text of ``sched-lab explain``.

events.csv has one row per event (columns :data:`EVENT_COLUMNS`; ``step`` counts the run's
rows of steps.csv from 0):

* ``waited``: a streak of steps (``step`` to ``last_step``, ``steps`` of them) in which the
  request was blocked for ``reason`` (request id ``*``: the whole queue);
* ``admitted`` (``blocks``), ``prefill`` (a chunk of ``tokens``), ``decode`` (a span of
  steps, ``tokens`` generated, accepted drafts included), ``preempted`` (``reason``: the
  mode), ``swapped_in`` (``blocks``), ``finished``, ``aborted``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import pandas as pd

from sched_lab.core.events import EVENT_NAMES, PREEMPT_MODES, PREEMPTED, WAIT_REASONS
from sched_lab.core.request import RequestStatus

EVENT_COLUMNS = [
    "policy", "rate_scale", "request_id", "event", "step", "last_step", "steps", "tokens",
    "blocks", "reason", "detail",
]  # fmt: skip
QUEUE = "*"  # request id of waits that hold the whole queue

# Lane colours of the pictures (colour-blind safe: Okabe-Ito).
LANES = {
    "waiting": "#bbbbbb",
    "prefill": "#0072b2",
    "decode": "#009e73",
    "decode stalled": "#a6dcc8",
    "preempted (recompute)": "#d55e00",
    "swapped out": "#e69f00",
}


def events_frame(run) -> pd.DataFrame:
    """The events of one :class:`sched_lab.results.run.Run` as events.csv rows, in step order
    (within a step: waits, admission, chunk, decode, end; then in the order recorded)."""
    cols, order, texts = _event_columns(run)
    return _frame(run, cols, order, texts)


def events_frames(run, rows: int) -> Iterable[pd.DataFrame]:
    """:func:`events_frame`'s rows, ``rows`` at a time (the last part shorter; one empty part
    for a run without events), each frame indexed from 0."""
    cols, order, texts = _event_columns(run)
    for lo in range(0, max(len(order), 1), rows):
        yield _frame(run, cols, order[lo : lo + rows], texts)


@dataclass
class _Texts:
    """The text the events' integer columns stand for: ``request_id`` indexes ``ids`` (-1:
    the queue, :data:`QUEUE`), ``reason`` indexes :data:`_REASON_TEXTS`, and ``detail``
    indexes ``details`` (0: ""), or below 0 is wait ``-1 - code`` of ``waits`` (the event
    log's), its text made only when its rows are (:func:`_wait_text`)."""

    ids: np.ndarray  # object: each request's id, then QUEUE
    details: list[str] = field(default_factory=lambda: [""])
    waits: list = field(default_factory=list)
    _array: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=object))

    def add(self, texts: list[str]) -> int:
        """Append ``texts`` to ``details``; returns the code of the first."""
        first = len(self.details)
        self.details += texts
        return first

    def detail(self, codes: np.ndarray) -> np.ndarray:
        """The ``detail`` texts of ``codes`` (object)."""
        if len(self._array) != len(self.details):  # details added since the last call
            self._array = np.fromiter(self.details, dtype=object, count=len(self.details))
        out = self._array[np.maximum(codes, 0)]
        (at,) = np.nonzero(codes < 0)
        if len(at):
            waits = self.waits
            out[at] = [_wait_text(waits[-1 - c]) for c in codes[at].tolist()]
        return out


def _event_columns(run) -> tuple[dict[str, np.ndarray], np.ndarray, _Texts]:
    """The events' columns (EVENT_COLUMNS[2:]) in the order recorded, the rows' order, and
    the text their codes stand for. Kept small (:func:`_frame` makes a part's rows as
    events.csv has them): ``event`` as its index in :data:`_EVENT_TEXTS` (int8), the text
    columns as codes (:class:`_Texts`), the numbers in the narrowest integer type that holds
    each part's."""
    res = run.result
    n_steps = res.num_steps
    ids = [r.request_id for r in res.requests]
    texts = _Texts(np.fromiter([*ids, QUEUE], dtype=object, count=len(ids) + 1))
    del ids
    parts = []  # column dicts (EVENT_COLUMNS[2:]) in the order recorded
    if res.events is not None:
        parts += [
            _log_rows(res.events, res.requests, texts),
            _wait_rows(res.events, res.requests, texts),
        ]
    parts += _request_rows(res, texts)
    # column by column, each part's column let go once joined: one copy of the rows at a time
    cols = {c: np.concatenate([p.pop(c) for p in parts]) for c in EVENT_COLUMNS[2:]}
    keep = cols["step"] < max(n_steps, 1)
    if not keep.all():
        for c in cols:
            cols[c] = cols[c][keep]
    del keep
    rank = _EVENT_RANKS[cols["event"]]
    order = np.lexsort((rank, cols["step"]))  # stable: the order recorded breaks ties
    del rank
    if len(order) < 2**31:
        order = order.astype(np.int32)
    return cols, order, texts


def _frame(run, cols: dict[str, np.ndarray], order: np.ndarray, texts: _Texts) -> pd.DataFrame:
    """The rows ``order`` of ``cols`` (indexed from 0) with the run's policy and scale."""
    df = pd.DataFrame({"policy": run.policy, "rate_scale": run.rate_scale}, index=range(len(order)))
    for c, v in cols.items():
        v = v[order]
        if c == "event":
            v = _EVENT_TEXTS[v]
        elif c == "request_id":
            v = texts.ids[v]
        elif c == "reason":
            v = _REASON_TEXTS[v]
        elif c == "detail":
            v = texts.detail(v)
        else:
            v = v.astype(np.int64, copy=False)
        df[c] = _column(v)
    return df


def _column(v: np.ndarray):
    """An events column: integers as int64, text as Python strings (object)."""
    return pd.Series(v, dtype=object, copy=False) if v.dtype == object else v


def _rows(n: int, **cols) -> dict[str, np.ndarray]:
    """Columns of ``n`` events: the values given (arrays or one value each; the text
    columns as their codes, :class:`_Texts`), 0 else (0 is "" for ``reason`` and
    ``detail``); ``event`` as its index in :data:`_EVENT_TEXTS`, the numbers narrowed
    (:func:`_narrow`)."""
    out = {}
    for c in EVENT_COLUMNS[2:]:
        v = cols.get(c, 0)
        if c == "event":
            out[c] = _event_codes(v, n)
            continue
        if np.ndim(v) == 0:
            v = np.full(n, v, dtype=np.int64)
        out[c] = _narrow(np.asarray(v, dtype=np.int64))
    return out


def _narrow(v: np.ndarray) -> np.ndarray:
    """``v`` (int64) as int8, int16 or int32, the first that holds every value (exact: read
    back as int64)."""
    if len(v):
        lo, hi = v.min(), v.max()
        for kind in (np.int8, np.int16, np.int32):
            small = np.iinfo(kind)
            if small.min <= lo and hi <= small.max:
                return v.astype(kind)
    return v


def _event_codes(names, n: int) -> np.ndarray:
    """Each of ``n`` events' name (one for all, or an array) as its index in
    :data:`_EVENT_TEXTS` (int8)."""
    if np.ndim(names) == 0:
        return np.full(n, _EVENT_TEXTS.tolist().index(names), dtype=np.int8)
    codes = np.full(n, -1, dtype=np.int8)
    names = np.asarray(names, dtype=object)
    for code, name in enumerate(_EVENT_TEXTS):  # one comparison a name (no hashing)
        codes[names == name] = code
    if (codes < 0).any():
        raise ValueError(f"unknown event {names[np.argmax(codes < 0)]!r}")
    return codes


def _log_rows(log, requests, texts: _Texts) -> dict[str, np.ndarray]:
    """The scheduler's events, an admission followed by its first prefill chunk."""
    ev = np.frombuffer(log.data, dtype=np.int64).reshape(-1, 5)
    step, kind, who, a, b = (ev[:, i] for i in range(5))
    index = _positions(requests, who)
    names = np.array(EVENT_NAMES, dtype=object)
    event = names[kind]
    preempted, aborted = kind == PREEMPTED, event == "aborted"
    reason = np.zeros(len(kind), dtype=np.int8)
    reason[preempted] = _PREEMPT_REASONS[a[preempted]]
    detail = np.zeros(len(kind), dtype=np.int64)
    ok = preempted & (b >= 0) & (b < len(log.texts))  # the log's text b; else ""
    detail[ok] = texts.add(list(log.texts)) + b[ok]
    (at,) = np.nonzero(aborted)
    detail[at] = texts.add([requests[i].reason for i in index[at]]) + np.arange(len(at))
    tokens = np.where(event == "prefill", a, 0)
    blocks = np.where((event == "admitted") | (event == "swapped_in"), a, 0)
    admitted = np.flatnonzero(event == "admitted")
    rows = _rows(len(kind), request_id=index, event=event, step=step, last_step=step,
                 steps=1, tokens=tokens, blocks=blocks, reason=reason, detail=detail)  # fmt: skip
    del event, tokens, blocks, reason, detail
    chunks = _rows(len(admitted), request_id=index[admitted], event="prefill", step=step[admitted],
                   last_step=step[admitted], steps=1, tokens=b[admitted])  # fmt: skip
    del index
    # each admission's chunk right after it: positions 2i and 2i + 1
    at = np.concatenate([2 * np.arange(len(kind)), 2 * admitted + 1])
    place = np.argsort(at, kind="stable")
    del at
    return {c: np.concatenate([rows.pop(c), chunks.pop(c)])[place] for c in EVENT_COLUMNS[2:]}


def _positions(requests, who: np.ndarray) -> np.ndarray:
    """The index in ``requests`` of each ``id()`` in ``who``; KeyError for one not there."""
    ids = np.fromiter(map(id, requests), np.int64, len(requests))
    sorter = np.argsort(ids)
    at = np.minimum(np.searchsorted(ids, who, sorter=sorter), max(len(ids) - 1, 0))
    index = sorter[at] if len(ids) else np.zeros(len(who), dtype=np.int64)
    missing = ids[index] != who if len(ids) else np.ones(len(who), dtype=bool)
    if missing.any():
        raise KeyError(int(who[np.argmax(missing)]))
    return index


def _wait_text(wait) -> str:
    """A wait streak's ``detail`` (an entry of ``EventLog.waits``)."""
    reason, _, _, _, _, a, b = wait
    return WAIT_REASONS[reason].format(a=a, b=b)


def _wait_rows(log, requests, texts: _Texts) -> dict[str, np.ndarray]:
    """The wait streaks (request id ``*``: the whole queue), their text made later."""
    waits = log.waits
    texts.waits = waits
    n = len(waits)
    # (reason, request or None, first step, last step, steps, a, b) each
    who = np.fromiter((0 if w[1] is None else id(w[1]) for w in waits), np.int64, n)
    index = np.full(n, -1, dtype=np.int64)  # -1: QUEUE
    (of,) = np.nonzero(who)
    index[of] = _positions(requests, who[of])
    del who, of
    reason = np.fromiter((_REASON_CODES[w[0]] for w in waits), np.int8, n)
    a = np.fromiter((w[5] for w in waits), np.int64, n)
    blocks = np.where(np.isin(reason, _BLOCK_WAITS), a, 0)
    tokens = np.where(reason == _REASON_CODES["token_budget"], a, 0)
    del a
    first, last, count = (np.fromiter((w[i] for w in waits), np.int64, n) for i in (2, 3, 4))
    return _rows(n, request_id=index, event="waited", step=first, last_step=last, steps=count,
                 tokens=tokens, blocks=blocks, reason=reason, detail=-1 - np.arange(n))  # fmt: skip


def _request_rows(res, texts: _Texts) -> list[dict[str, np.ndarray]]:
    """Each request's end (finished) and decode spans, in request order."""
    ticks, end = res.tick_steps, res.step_end_s
    requests = res.requests
    # no steps (a served run): no step to place an end at
    done = [i for i, r in enumerate(requests) if r.status is RequestStatus.FINISHED]
    done = done if len(end) else []
    fin_step = np.searchsorted(end, np.array([requests[i].finish_s for i in done], dtype=float))
    fin = _rows(len(done), request_id=done, event="finished", step=fin_step, last_step=fin_step,
                steps=1)  # fmt: skip
    del done, fin_step
    # per decode span: its request, first tick, end tick (flat: a, b, a, b, ...)
    spans = np.fromiter(map(len, (r.decode_segments for r in requests)), np.int64, len(requests))
    rid = np.repeat(np.arange(len(requests)), spans)
    ab = np.fromiter(chain.from_iterable(chain.from_iterable(r.decode_segments for r in requests)),
                     np.int64, 2 * len(rid))  # fmt: skip
    a, b = ab[0::2], ab[1::2]
    drafts = np.zeros(len(rid), dtype=np.int64)  # accepted drafts among each span's tokens
    starts = np.cumsum(spans) - spans  # each request's first span
    del ab, spans
    for i, r in enumerate(requests):
        if not (r.spec_steps and r.decode_segments):
            continue
        spec = np.asarray(r.spec_steps, dtype=np.int64).reshape(-1, 3)  # (step, d', a)
        accepted = np.concatenate([[0], np.cumsum(spec[:, 2])])  # before each verify step
        for k, (lo, hi) in enumerate(r.decode_segments, start=int(starts[i])):
            if lo < len(ticks) and hi > lo:
                first, last = int(ticks[lo]), int(ticks[min(hi, len(ticks)) - 1])
                s0, s1 = np.searchsorted(spec[:, 0], (first, last + 1))  # its verify steps
                drafts[k] = accepted[s1] - accepted[s0]  # their tokens come with the ticks'
    ok = (a < len(ticks)) & (b > a)
    a, b, drafts, rid = a[ok], b[ok], drafts[ok], rid[ok]
    first, last = ticks[a], ticks[np.minimum(b, len(ticks)) - 1]
    detail = np.zeros(len(a), dtype=np.int64)
    (said,) = np.nonzero(drafts)
    why = [f"{d:,} of them accepted drafts" for d in drafts[said].tolist()]
    detail[said] = texts.add(why) + np.arange(len(said))
    dec = _rows(len(a), request_id=rid, event="decode", step=first, last_step=last,
                steps=last - first + 1, tokens=b - a + drafts, detail=detail)  # fmt: skip
    # the original order: per request, its end then its spans (ties only within a kind)
    return [fin, dec]


# An event's rank within a step: waits, admission, chunk, decode, preemption, end.
_EVENT_RANK = {"waited": 0, "admitted": 1, "swapped_in": 1, "prefill": 2, "decode": 3,
               "preempted": 4, "finished": 5, "aborted": 5}  # fmt: skip
# Every event's name (events.csv's ``event``), indexed by the code the columns keep, and
# each one's rank (0 for a name without one).
_EVENT_TEXTS = np.array(list(dict.fromkeys([*_EVENT_RANK, *EVENT_NAMES])), dtype=object)
_EVENT_RANKS = np.array([_EVENT_RANK.get(t, 0) for t in _EVENT_TEXTS], dtype=np.int8)
# Every ``reason`` (none, a preemption's mode, a wait's reason), indexed by the code the
# columns keep; each preemption mode's and wait reason's code.
_REASON_TEXTS = np.array(list(dict.fromkeys(["", *PREEMPT_MODES, *WAIT_REASONS])), dtype=object)
_REASON_CODES = {t: i for i, t in enumerate(_REASON_TEXTS.tolist())}
_PREEMPT_REASONS = np.array([_REASON_CODES[m] for m in PREEMPT_MODES], dtype=np.int8)
_BLOCK_WAITS = [_REASON_CODES[w] for w in ("kv_blocks", "swap_in_blocks")]


# ---------------------------------------------------------------------------- segments
@dataclass
class Story:
    """One request's life in one run: coloured segments (lane, start_s, end_s, text) and
    the lines of its explanation."""

    request_id: str
    segments: list[tuple[str, float, float, str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    arrival_s: float = 0.0
    e2e_s: float = float("nan")

    @property
    def label(self) -> str:
        """The request's row name in the pictures: its id and E2E."""
        e2e = f"  E2E {self.e2e_s:.1f} s" if np.isfinite(self.e2e_s) else ""
        return f"{self.request_id}{e2e}"


def story(request: pd.Series, events: pd.DataFrame, steps: pd.DataFrame) -> Story:
    """The segments and explanation of ``request`` (a requests.csv row) from its run's ``events``
    and ``steps`` (time_s, duration_s, num_decode_tokens)."""
    start = steps["time_s"].to_numpy(dtype=float)
    end = start + steps["duration_s"].to_numpy(dtype=float)
    decodes = steps["num_decode_tokens"].to_numpy()
    rid = str(request["request_id"])
    mine = events[events["request_id"].astype(str) == rid]
    queue = events[events["request_id"].astype(str) == QUEUE]
    arrival = float(request["arrival_s"])
    st = Story(
        rid, [], [], request["first_token_s"], request["finish_s"], arrival, request["e2e_s"]
    )
    reason = request["reason"] if isinstance(request["reason"], str) else ""
    if request["status"] == "dropped":  # a trace row never replayed: no arrival, no events
        st.lines.append(f"request {rid}: dropped ({reason})")
        return st
    prompt = int(request["prompt_tokens"])

    def at(step: int) -> str:
        return (
            f"step {step:,} (t={start[step]:.3f} s)" if 0 <= step < len(start) else f"step {step:,}"
        )

    st.lines.append(
        f"request {rid}: prompt {prompt:,} tokens, output {int(request['output_tokens']):,} "
        f"tokens; {request['status']}" + (f" ({reason})" if reason else "")
    )
    st.lines.append(f"arrived at t={arrival:.3f} s")
    if request["status"] == "rejected":
        return st
    # A spell out of the running batch lasts from arrival (or a preemption) to the next
    # admission (or swap-in); `state` names it.
    since_s, since_step, state = arrival, int(np.searchsorted(start, arrival, "left")), "waiting"
    computed = generated = 0  # tokens with KV now; output tokens so far
    for ev in _tuples(mine[mine["event"] != "waited"]):
        s = int(ev.step)
        if ev.event in ("admitted", "swapped_in"):
            if start[s] > since_s:
                st.segments.append((state, since_s, start[s], f"{state} until {at(s)}"))
            held = queue if ev.event == "admitted" else queue.iloc[:0]  # the waiting queue's
            st.lines += _wait_lines(mine, held, since_step, s - 1, start[s] - since_s)
            if ev.event == "admitted":
                again = f" (recomputed: the prompt and {_n(generated, 'generated token')})"
                again = again if generated else ""
                st.lines.append(f"{at(s)}: admitted with {_n(int(ev.blocks), 'KV block')}{again}")
            else:
                blocks = _n(int(ev.blocks), "KV block")
                st.lines.append(f"{at(s)}: swapped in ({blocks} back on the GPU)")
            state = "running"
        elif ev.event == "prefill":
            n = int(ev.tokens)
            whole = prompt + generated
            st.segments.append(("prefill", start[s], end[s], f"prefill of {n:,} tokens, {at(s)}"))
            what = (
                f"prefill of all {n:,} tokens"
                if computed == 0 and n == whole
                else f"prefill chunk of {n:,} tokens ({computed:,}-{computed + n:,} of {whole:,})"
            )
            computed += n
            if computed >= whole:
                generated += 1
                what += f"; token {generated:,} at t={end[s]:.3f} s"
            st.lines.append(f"{at(s)}: {what}")
        elif ev.event == "decode":
            s1, n = int(ev.last_step), int(ev.tokens)
            st.segments.append(
                ("decode", start[s], end[s1], f"decoded {n:,} tokens, steps {s:,}-{s1:,}")
            )
            idle = np.flatnonzero(decodes[s : s1 + 1] == 0) + s
            for k in idle:
                st.segments.append(("decode stalled", start[k], end[k], f"no decode in step {k:,}"))
            more = f"; {_n(len(idle), 'prefill-only step')} in between, without decodes"
            more = more if len(idle) else ""
            drafts = f", {ev.detail}" if isinstance(ev.detail, str) and ev.detail else ""
            span = f"step {s:,}" if s1 == s else f"steps {s:,}-{s1:,}"
            generated += n
            st.lines.append(
                f"{span}: decoded {_n(n, 'token')}{drafts} (to {generated:,}), "
                f"t={start[s]:.3f}-{end[s1]:.3f} s{more}"
            )
        elif ev.event == "preempted":
            swap = ev.reason == "swap"
            state = "swapped out" if swap else "preempted (recompute)"
            what = (
                "swapped out to CPU swap space"
                if swap
                else f"preempted by {ev.reason}: its KV dropped"
            )
            why = f", chosen as {ev.detail}" if isinstance(ev.detail, str) and ev.detail else ""
            st.lines.append(f"{at(s)}: {what}{why}")
            since_s, since_step, computed = start[s], s + 1, computed if swap else 0
        elif ev.event == "finished":
            tpot = request["tpot_s"]
            st.lines.append(
                f"{at(s)}: finished, last token at t={end[s]:.3f} s: TTFT "
                f"{request['ttft_s']:.3f} s, E2E {request['e2e_s']:.3f} s"
                + (f", TPOT {tpot * 1e3:.1f} ms" if np.isfinite(tpot) else "")
            )
        elif ev.event == "aborted":
            st.lines.append(f"{at(s)}: aborted: {ev.detail}")
            return st
    if state != "running":  # never admitted again (the run stopped)
        last = float(request["finish_s"]) if np.isfinite(request["finish_s"]) else end[-1]
        st.segments.append((state, since_s, last, state))
        st.lines += _wait_lines(mine, queue, since_step, len(start) - 1, last - since_s)
    return st


def _wait_lines(mine, queue, s0: int, s1: int, wait_s: float) -> list[str]:
    """Why the request waited over steps [s0, s1]: its own streaks (at the head of its
    queue), the steps the whole queue was held, and the rest: behind other requests."""
    if s1 < s0:
        return []
    out, blocked = [], 0
    own = mine[(mine["event"] == "waited") & (mine["step"] >= s0) & (mine["step"] <= s1)]
    for w in _tuples(own):
        n, a, b = int(w.steps), int(w.step), int(w.last_step)
        blocked += n
        span = f"steps {a:,}-{b:,}" if b > a else f"step {a:,}"
        out.append(f"{span}: blocked {_steps(n)} at the head of the queue: {w.detail}")
    by_reason: dict[str, int] = {}
    held = queue[(queue["last_step"] >= s0) & (queue["step"] <= s1)] if len(queue) else queue
    for w in _tuples(held):
        n = min(int(w.last_step), s1) - max(int(w.step), s0) + 1
        by_reason[w.detail] = by_reason.get(w.detail, 0) + n
    for text, n in by_reason.items():
        blocked += n
        out.append(f"the whole queue was held {_steps(n)}: {text}")
    total = s1 - s0 + 1
    behind = total - blocked
    rest = f"; {_steps(behind)} behind other requests" if blocked and behind > 0 else ""
    rest = ", behind other requests" if not blocked else rest
    span = f"steps {s0:,}-{s1:,}" if s1 > s0 else f"step {s0:,}"
    return [f"{span}: waited {_steps(total)} ({wait_s:.3f} s){rest}", *out]


def _tuples(rows: pd.DataFrame) -> Iterable:
    """``rows.itertuples(index=False)``; for no rows, nothing (no tuple type made)."""
    return rows.itertuples(index=False) if len(rows) else ()


def _steps(n: int) -> str:
    return _n(n, "step")


def _n(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


# ---------------------------------------------------------------------------- choosing
def choose(requests: pd.DataFrame, report_cfg) -> list[str]:
    """Ids of the requests a run's timeline shows: ``timeline_ids``, else those in flight during
    ``timeline_window_s`` (at most 40, earliest first), else the ``timeline_slowest`` slowest
    finished by ``timeline_by``."""
    if report_cfg.timeline_ids:
        have = set(requests["request_id"].astype(str))
        return [i for i in report_cfg.timeline_ids if i in have]
    if report_cfg.timeline_window_s is not None:
        lo, hi = report_cfg.timeline_window_s
        end = requests["finish_s"].fillna(np.inf)
        inside = requests[(requests["arrival_s"] <= hi) & (end >= lo)]
        return inside.sort_values("arrival_s")["request_id"].astype(str).head(40).tolist()
    key = "e2e_s" if report_cfg.timeline_by == "e2e" else "ttft_s"
    fin = requests[requests["status"] == "finished"]
    return fin.nlargest(report_cfg.timeline_slowest, key)["request_id"].astype(str).tolist()


# ---------------------------------------------------------------------------- pictures
GANTT_DPI = 110


def step_runs(n: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) indices of the bars for ``n`` steps: one per step up to ``most``, else
    runs of ``ceil(n / most)`` consecutive steps (a picture shows no more bars than it has
    pixels, nor a page than it can draw)."""
    size = max(-(-n // max(most, 1)), 1)
    first = np.arange(0, n, size)
    return first, np.minimum(first + size, n) - 1


def steps_in_view(t: np.ndarray, d: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Indices of the steps (start ``t``, duration ``d``, seconds) that overlap (lo, hi) by
    more than the 9 significant digits the CSVs keep of a time: a step that only touches an
    edge is not in view, so a timeline drawn later from the files (``sched-lab report``)
    shows the same steps as one drawn at run time."""
    edge = 1e-8 * max(abs(lo), abs(hi), 1.0)
    return np.flatnonzero((t + d > lo + edge) & (t < hi - edge))


def gantt_png(
    path: Path,
    stories: Sequence[Story],
    steps: pd.DataFrame,
    title: str,
    window: tuple[float, float] | None = None,
) -> None:
    """The Gantt picture: one row per request (lanes by colour), step boundaries above;
    ``window`` (seconds) limits the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    n = max(len(stories), 1)
    # Fixed margins (inches): a tight bounding box would draw the picture twice.
    widest = max((len(st.label) for st in stories), default=4)  # 8-point characters
    left, right, top_in, bottom = 0.5 + 0.07 * widest, 0.3, 0.4, 0.8
    height = top_in + 0.35 + 0.05 + 0.36 * n + bottom
    fig, (top, ax) = plt.subplots(
        2, 1, figsize=(11, height), sharex=True, height_ratios=[0.35, n * 0.36],
        gridspec_kw={"hspace": 0.05 / 0.36 * 2 / (n + 1)},
    )  # fmt: skip
    fig.subplots_adjust(left=left / 11, right=1 - right / 11, top=1 - top_in / height,
                        bottom=bottom / height)  # fmt: skip
    lo = min((s[1] for st in stories for s in st.segments), default=0.0)
    hi = max((s[2] for st in stories for s in st.segments), default=1.0)
    if window is not None:
        lo, hi = window
    least = (hi - lo) * 1e-4  # a segment shorter than this is drawn this wide
    # One collection per lane and one line per marker for all rows (rows do not overlap):
    # a picture's cost grows with its artists, not with its bars.
    boxes: dict[str, list] = {lane: [] for lane in LANES}
    for i, st in enumerate(stories):
        y0, y1 = i - 0.35, i + 0.35
        for k, t0, t1, _ in st.segments:
            if k in boxes:
                x1 = t0 + max(t1 - t0, least)
                boxes[k].append(((t0, y0), (t0, y1), (x1, y1), (x1, y0)))
    for lane, colour in LANES.items():
        if boxes[lane]:
            ax.add_collection(PolyCollection(boxes[lane], color=colour, lw=0), autolim=False)
    for times, marker, ms, mew in (("first_token_s", "|", 9, 1.5), ("finish_s", "o", 3, None)):
        at = [(getattr(st, times), i) for i, st in enumerate(stories)]
        at = [(x, i) for x, i in at if np.isfinite(x)]
        if at:
            xs, ys = zip(*at)
            kw = {} if mew is None else {"mew": mew}
            ax.plot(xs, ys, marker=marker, color="black", ms=ms, ls="", **kw)
    ax.set_yticks(range(len(stories)), [st.label for st in stories], fontsize=8)
    ax.set_ylim(len(stories) - 0.5, -0.5)
    ax.set_ylabel("request id")
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    # Step boundaries: alternating shades, one band per step in view, or per run of
    # consecutive steps where there are more steps than the picture has pixels across.
    t = steps["time_s"].to_numpy(dtype=float)
    d = steps["duration_s"].to_numpy(dtype=float)
    sel = steps_in_view(t, d, lo, hi)
    first, last = step_runs(len(sel), int(fig.get_figwidth() * GANTT_DPI))
    first, last = sel[first], sel[last]
    for parity, colour in ((0, "#cccccc"), (1, "#555555")):
        a, b = first[parity::2], last[parity::2]
        top.broken_barh(list(zip(t[a], t[b] + d[b] - t[a])), (0, 1), color=colour, lw=0)
    top.set_yticks([])
    top.set_ylabel("steps", rotation=0, ha="right", va="center", fontsize=8)
    size = int(last[0] - first[0] + 1) if len(sel) else 1
    shades = "alternating shades" + (f", {size:,} steps each" if size > 1 else "")
    top.set_title(f"{title}: {len(sel):,} steps ({shades})", fontsize=10)
    ax.set_xlim(lo - (hi - lo) * 0.01, hi + (hi - lo) * 0.01)
    handles = [Patch(color=c, label=k) for k, c in LANES.items()]
    handles.append(plt.Line2D([], [], marker="|", color="black", ls="", ms=9, label="first token"))
    handles.append(plt.Line2D([], [], marker="o", color="black", ls="", ms=3, label="finished"))
    fig.legend(handles=handles, fontsize=7, ncol=8, loc="lower center", frameon=True)
    fig.savefig(path, dpi=GANTT_DPI)
    plt.close(fig)


def stories_for(
    ids: Iterable[str], requests: pd.DataFrame, events: pd.DataFrame, steps: pd.DataFrame
) -> list[Story]:
    """:func:`story` of each id (one run's requests, events and steps)."""
    wanted = requests[requests["request_id"].astype(str).isin(set(ids))]
    rows = {str(r["request_id"]): r for _, r in wanted.iterrows()}
    ev = events[events["request_id"].astype(str).isin(set(ids) | {QUEUE})]
    out = [story(rows[i], ev, steps) for i in ids if i in rows]
    return sorted(out, key=lambda st: st.arrival_s)  # a staircase reads better than a ranking


# ---------------------------------------------------------------------------- explain
# The columns explain and timeline read, by file; the numeric ones must hold numbers.
RUN_COLUMNS = {
    "requests": ("request_id", "status", "reason", "arrival_s", "prompt_tokens",
                 "output_tokens", "first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s"),
    "events": ("request_id", "event", "step", "last_step", "steps", "tokens", "blocks",
               "reason", "detail"),
    "steps": ("time_s", "duration_s", "num_decode_tokens"),
}  # fmt: skip
_TEXT_COLUMNS = {"request_id", "status", "reason", "event", "detail"}
# The columns every row has a value in (the others may be empty: a rejected request has no
# TTFT, a request no reason); an empty one means the row, or the file, was cut short.
_FILLED_COLUMNS = {
    "requests": ("policy", "rate_scale", "request_id", "status", "arrival_s", "prompt_tokens",
                 "output_tokens"),
    "events": ("policy", "rate_scale", "request_id", "event", "step", "last_step", "steps",
               "tokens", "blocks"),
    "steps": ("policy", "rate_scale", *RUN_COLUMNS["steps"]),
}  # fmt: skip
# requests.csv cells a dropped trace row leaves empty (lab/results/metrics.py: in_trace_order)
_DROPPED_MAY_LACK = ("arrival_s", "prompt_tokens", "output_tokens")


def load_run(folder: Path, run: str | None):
    """(label, requests, events, steps) of one run of a results folder (``run``: its label, or
    None for the only run). Raises UserError: a sweep's folder (its points are results
    folders), no such folder, run or file, or a file that is
    damaged (not JSON / CSV / parquet, a column missing, text where numbers belong, a row
    without a value it must have, fewer rows than summary.json counts, an event at a step
    steps.csv lacks: a file cut short)."""
    return load_runs(folder, [run])[0]


def load_runs(folder: Path, runs: list[str | None]):
    """:func:`load_run` of each of ``runs``, each file read once."""
    import json

    from sched_lab.core.errors import UserError, short_repr

    folder = Path(folder)
    points = folder / "points"
    if points.is_dir() and any((folder / f).is_file() for f in ("sweep.csv", "curve.csv")):
        first = min((p.name for p in points.iterdir() if p.is_dir()), default="p000")
        raise UserError(f"{folder}: a sweep's folder: its runs are in its points' folders, "
                        f"e.g. {points / first}")  # fmt: skip
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{folder}: not a results folder (summary.json: {e})") from None
    if not isinstance(summary, dict) or not all(
        isinstance(v, dict) and "policy" in v and "rate_scale" in v for v in summary.values()
    ):
        raise UserError(
            f"{folder}/summary.json: expected a mapping of run labels to summaries with "
            f"'policy' and 'rate_scale', got {short_repr(summary, 60)}"
        )
    labels = list(summary)
    chosen = []
    for run in runs:
        if run is None:
            if len(labels) != 1:
                raise UserError(
                    f"{folder}: {len(labels)} runs; choose one with --run: {', '.join(labels)}"
                )
            run = labels[0]
        if run not in summary:
            raise UserError(f"{folder}: no run {short_repr(run)}; runs: {', '.join(labels)}")
        chosen.append(run)
    paths: dict[str, Path] = {}

    def read(name: str, **kw) -> pd.DataFrame:
        for ext in ("csv", "parquet"):
            p = folder / f"{name}.{ext}"
            if p.is_file():
                try:  # index_col=False: a row with a field too many is an error, not an index
                    df = (
                        pd.read_csv(p, index_col=False, **kw)
                        if ext == "csv"
                        else pd.read_parquet(p)
                    )
                except (OSError, ValueError) as e:  # parser, encoding and Arrow errors
                    raise UserError(f"{p}: damaged, cannot be read ({e})") from None
                if ext == "csv" and not _ends_a_line(p):
                    raise UserError(
                        f"{p}: damaged, line {len(df) + 1:,} ends without a line break (the "
                        "lab ends every line with one); was the file cut short?"
                    )
                paths[name] = p
                return _checked(df, p, ("policy", "rate_scale", *RUN_COLUMNS[name]), name)
        raise UserError(f"{folder}: no {name}.csv (results written before request events?)")

    requests = read("requests", dtype={"request_id": str, "reason": str})
    events = read(
        "events", dtype={"request_id": str, "reason": str, "detail": str}, keep_default_na=False
    )
    steps = read("steps")[["policy", "rate_scale", *RUN_COLUMNS["steps"]]]
    out = []
    for run in chosen:
        policy, scale = summary[run]["policy"], summary[run]["rate_scale"]
        picked = [df[(df["policy"] == policy) & (df["rate_scale"] == scale)]
                  for df in (requests, events, steps)]  # fmt: skip
        _check_complete(paths, run, summary[run], *picked)
        out.append((run, picked[0], picked[1], picked[2].reset_index(drop=True)))
    return out


def _ends_a_line(path: Path) -> bool:
    """Whether the file ``path`` is empty or its last byte is a line break."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) in (b"\n", b"\r")


def _where(path: Path, index: int) -> str:
    """``line N`` of a CSV file for the row of 0-based ``index`` (line 1 is the header);
    ``row N`` of a parquet file."""
    return f"line {index + 2:,}" if path.suffix == ".csv" else f"row {index + 1:,}"


def _checked(df: pd.DataFrame, path: Path, columns: Sequence[str], name: str) -> pd.DataFrame:
    """``df`` (the whole file ``name``) if it has every one of ``columns``, numbers in the
    numeric ones and a value in each :data:`_FILLED_COLUMNS` cell; an empty numeric cell of
    a file read without NaN markers becomes NaN."""
    from sched_lab.core.errors import UserError, short_repr

    for c in columns:
        if c not in df.columns:
            raise UserError(f"{path}: damaged, no column {c!r}")
    df = df.reset_index(drop=True)
    for c in columns:
        numeric = c not in _TEXT_COLUMNS and c != "policy"
        if numeric and len(df) and not pd.api.types.is_numeric_dtype(df[c]):
            text = df[c].astype(str).str.strip()
            numbers = pd.to_numeric(df[c].where(text != ""), errors="coerce")
            bad = np.flatnonzero(numbers.isna() & df[c].notna() & (text != ""))
            if len(bad):
                raise UserError(
                    f"{path}: damaged, column {c!r} holds text where numbers belong "
                    f"({_where(path, bad[0])}: {short_repr(df[c].iloc[bad[0]])})"
                )
            df[c] = numbers  # only empty cells were not numbers
    filled = [c for c in _FILLED_COLUMNS[name] if c in columns]
    empty = df[filled].isna() | (df[filled].astype(str) == "")
    if name == "requests" and "status" in df.columns:  # a dropped row was never replayed:
        dropped = (df["status"] == "dropped").to_numpy()  # its trace values may be missing
        for c in _DROPPED_MAY_LACK:
            if c in filled:
                empty.loc[dropped, c] = False
    rows = np.flatnonzero(empty.any(axis=1).to_numpy())
    if len(rows):
        i = int(rows[0])
        column = filled[int(np.argmax(empty.iloc[i].to_numpy()))]
        raise UserError(
            f"{path}: damaged, {_where(path, i)} has no value in column {column!r} (every "
            "row has one; was the file cut short?)"
        )
    return df


def _check_complete(paths: dict[str, Path], label: str, summary: dict, requests, events, steps):
    """Raise UserError when a file holds fewer rows of the run than summary.json counts
    (``num_prompts`` + ``dropped`` requests, ``num_steps`` steps; cluster runs count steps
    per replica and are left out), or an event names a step steps.csv has no row for."""
    from sched_lab.core.errors import UserError

    def ints(*keys: str) -> int | None:
        values = [summary.get(k) for k in keys]
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        return sum(values) if ok else None

    expected = [("requests", requests, ints("num_prompts", "dropped"), "num_prompts + dropped")]
    if "replica" not in requests.columns:
        expected.append(("steps", steps, ints("num_steps"), "num_steps"))
    for name, df, count, keys in expected:
        if count is not None and len(df) != count:
            raise UserError(
                f"{paths[name]}: damaged, {len(df):,} rows of run {label}, but summary.json "
                f"counts {count:,} ({keys}); was the file cut short?"
            )
    if len(events):
        last = np.maximum(events["step"].to_numpy(), events["last_step"].to_numpy())
        i = int(np.argmax(last))
        if last[i] >= len(steps):
            raise UserError(
                f"{paths['events']}: damaged, {_where(paths['events'], int(events.index[i]))} "
                f"names step {int(last[i]):,} of run {label}, but {paths['steps'].name} has "
                f"{len(steps):,} rows of it; was a file cut short?"
            )


def file_label(label: str) -> str:
    """A run's label as part of a file name (``timeline_<label>.png``): letters, digits,
    ``.``, ``_`` and ``-``; any other character becomes ``_``."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def default_picture_name(
    label: str, ids: Sequence[str], slowest: int, by: str, window: tuple[float, float] | None
) -> str:
    """Where ``sched-lab timeline`` puts its picture without ``--out``, in the results folder:
    ``timeline_<run>_<choice>.png``, never the name of the picture the run wrote
    (``timeline_<run>.png``)."""
    if ids:
        choice = "requests"
    elif window is not None:
        choice = f"window_{window[0]:g}-{window[1]:g}s"
    else:
        choice = f"slowest{slowest}_{by}"
    return f"timeline_{file_label(label)}_{file_label(choice)}.png"


def picture(
    folder: Path,
    out: Path | None = None,
    run: str | None = None,
    ids: Sequence[str] = (),
    slowest: int = 12,
    by: str = "e2e",
    window: tuple[float, float] | None = None,
) -> str:
    """``sched-lab timeline``: the Gantt PNG of chosen requests of a results folder's run;
    returns a line saying what was drawn. ``out`` None: in the results folder
    (:func:`default_picture_name`, listed in its manifest), never the working directory.
    An id named twice is drawn once; a ``window`` that holds no step of the run is a
    UserError."""
    from types import SimpleNamespace

    from sched_lab.core.errors import UserError, short_repr
    from sched_lab.core.outputs import check_output, write_output

    if window is not None and not (all(map(math.isfinite, window)) and 0 <= window[0] < window[1]):
        raise UserError(f"--window: expected START END in seconds, 0 <= START < END, got {window}")
    if out is not None:
        out = Path(out)
        if out.suffix.lower() not in (".png", ".pdf", ".svg"):
            raise UserError(f"--out: {out}: expected a file name ending in .png, .pdf or .svg")
        if not out.parent.is_dir():
            raise UserError(f"--out: {out.parent} is not a folder")
        out = check_output(out, "--out")  # before the work: a user's file is never replaced
    ids = list(dict.fromkeys(ids))  # an id named twice is drawn once
    label, requests, events, steps = load_run(folder, run)
    if window is not None:  # a window wholly outside the run would draw an empty picture
        t = steps["time_s"].to_numpy(dtype=float)
        d = steps["duration_s"].to_numpy(dtype=float)
        if not len(steps_in_view(t, d, *window)):
            span = f"{t.min():.3f}-{(t + d).max():.3f} s" if len(t) else "no steps"
            raise UserError(
                f"--window: expected a window that holds a step of run {label} ({span}), got "
                f"{window[0]:g}-{window[1]:g} s"
            )
    if out is None:  # the results folder was read: it is one
        name = default_picture_name(label, ids, slowest, by, window)
        out = check_output(Path(folder) / name, "timeline (no --out):")
    if "replica" in requests.columns:
        raise UserError(f"{folder}: a cluster run: cluster runs record no per-request events")
    chosen = SimpleNamespace(
        timeline_ids=tuple(ids), timeline_window_s=window, timeline_slowest=slowest,
        timeline_by=by,
    )  # fmt: skip
    wanted = choose(requests, chosen)
    missing = [i for i in ids if i not in set(wanted)]
    if missing:  # an id the run lacks is a mistake, never silently left out
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        names = ", ".join(short_repr(i) for i in missing[:3])
        raise UserError(f"{folder}: run {label} has no request {names}{more}")
    if not wanted:
        raise UserError(f"{folder}: run {label} has none of the requests asked for")
    stories = stories_for(wanted, requests, events, steps)
    what = f"requests {', '.join(wanted[:6])}{'...' if len(wanted) > 6 else ''}"
    write_output(out, lambda path: gantt_png(path, stories, steps, f"{label}: {what}", window))
    return f"wrote {out}: {len(stories)} requests of run {label}"


def _cluster_line(q: pd.Series, label: str) -> str:
    """A cluster run's request in one line, from its requests.csv row alone: its status and
    reason, the replica (and prefill replica) that served it, and the times it has; a value
    the row leaves empty (a rejected request's replica and TTFT, a dropped row's arrival) is
    left out, never printed as nan."""

    def have(key: str) -> bool:
        return key in q.index and pd.notna(q[key])

    reason = f" ({q['reason']})" if isinstance(q["reason"], str) and q["reason"] else ""
    where = ""
    if have("replica"):
        where = f" on replica {int(q['replica'])}"
        if have("prefill_replica") and q["prefill_replica"] != q["replica"]:
            where += f" after prefill on replica {int(q['prefill_replica'])}"
    times = [f"arrived at t={q['arrival_s']:.3f} s"] if have("arrival_s") else []
    times += [f"{name} {q[key]:.3f} s" for name, key in (("TTFT", "ttft_s"), ("E2E", "e2e_s"))
              if have(key)]  # fmt: skip
    if q["status"] != "dropped":
        times.append(f"{int(q['num_preemptions'])} preemptions")
    return (
        f"request {q['request_id']}: {q['status']}{reason}{where} [run {label}]; "
        + "".join(f"{t}, " for t in times[:-1])
        + "".join(f"{t}. " for t in times[-1:])
        + "Cluster runs record no scheduler events per request (each replica steps on its own "
        "clock): see requests.csv"
    )


def explain(folder: Path, request_id: str, run: str | None = None) -> str:
    """The text of ``sched-lab explain``: the request's life, one event a line."""
    from sched_lab.core.errors import UserError, short_repr

    label, requests, events, steps = load_run(folder, run)
    row = requests[requests["request_id"] == str(request_id)]
    if row.empty:
        raise UserError(f"{folder}: run {label} has no request {short_repr(str(request_id))}")
    if "replica" in requests.columns:  # a cluster run: no scheduler events per request
        return _cluster_line(row.iloc[0], label)
    st = story(row.iloc[0], events[events["request_id"].isin([str(request_id), QUEUE])], steps)
    return "\n".join([f"{st.lines[0]} [run {label}]", *("  " + x for x in st.lines[1:])])
