"""Synthetic prefix identity for any trace: shared system prompts and multi-turn sessions.

The ``prefix:`` block of a trace spec gives every request hash ids (``Request.hash_ids``),
one per ``hash_block_size`` tokens, equal where requests share tokens, so that a prefix
cache can find the sharing. It works on the rows of any format that carries no prefix
identity of its own (not ``mooncake``, whose rows have hash ids, nor ``prompts``, whose
real token ids are theirs). The names follow vLLM's benchmark datasets (``prefix_len`` and
``num_prefixes`` of ``prefix_repetition``; ``num_turns`` of ``benchmarks/multi_turn``)::

    trace:
      format: synthetic              # or azure2023, burstgpt, lengths
      ...
      hash_block_size: 16            # tokens per hash id (default 16 here, 512 for Mooncake);
                                     # a multiple of kv_cache.block_size
      prefix:
        prefix_len: 1024             # tokens of a shared system prompt (default 0: none)
        num_prefixes: 4              # distinct system prompts (default 1)
        assign: random               # which one a session gets: random | round_robin
        num_turns: {uniform: [2, 6]} # turns per session (default 1: single requests)
        think_time_s: {exponential: 30.0}   # a turn's arrival to the next turn's
        user_len: 200                # tokens of each follow-up user message
        output_len: 300              # output tokens of each follow-up turn

Rules (every random draw comes from ``seed``, in streams of its own, so the same spec and
seed give identical requests, and the format's own draws are unchanged):

- **Sessions.** Every replayed row of the format starts a session: its first turn arrives
  at the row's time, its user message has the row's ``prompt_len`` tokens and its reply
  the row's ``output_len``. Rows the format drops (:mod:`traces.loaders`) stay dropped and
  start nothing.
- **System prompts.** With ``prefix_len`` S > 0, session i gets system prompt g (of
  ``num_prefixes`` G): uniformly at random (``assign: random``) or ``i mod G`` in row order
  (``round_robin``); every prompt of the session starts with its S tokens, so the first
  turn's prompt is S + the row's prompt_len tokens (as vLLM's datasets prepend theirs).
- **Turns.** A session has ``num_turns`` turns (an integer or ``{uniform: [lo, hi]}`` /
  ``{choice: [...]}``, at most 1000). Turn t + 1's prompt is turn t's prompt, its reply and
  a new user message of ``user_len`` tokens: P(t+1) = P(t) + O(t) + U(t+1). ``user_len``
  and ``output_len`` take the forms of :mod:`traces.distributions`; each defaults to the
  first turn's (the row's) length.
- **Arrivals are open-loop.** Turn t + 1 arrives ``think_time_s`` after turn t *arrived*
  (a number of seconds, ``{exponential: mean_s}`` or ``{uniform: [lo_s, hi_s]}``): the
  replay does not wait for replies, so the think time includes the previous turn's
  latency; a turn that arrives before its previous turn has finished finds the reply not
  yet cached.
- **Hash ids.** A session is one token stream, system prompt, user message, reply, user
  message, ...; block j of the stream (tokens j*H..(j+1)*H-1, H = ``hash_block_size``) has
  one id. The first floor(S / H) blocks have their system prompt's ids (shared by every
  session with it); all other blocks have ids of their own session. A turn carries the ids
  of its prompt and its reply, ceil((P + O) / H) of them, so the next turn, which resends
  the reply, finds it under the same ids. Sharing is at hash-block granularity: a system
  prompt shares floor(S / H) blocks.
- **Order and ids.** The requests are sorted by arrival (a turn after the one before it);
  the format's rows keep their row number as request id, follow-up turns are numbered
  from the largest row number + 1, in arrival order. ``start_s`` / ``end_s`` and ``limit``
  apply afterwards, to the requests with their turns (``limit: 100`` = the first 100
  requests), so a window can cut a session; ``rate_scale`` divides every inter-arrival
  time, think times included. Prompts that outgrow ``max_model_len`` are rejected by the
  replay with their reason, as any other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.core.errors import TraceError, short_repr
from traces.distributions import Choice, Fixed, LengthDistribution, Uniform, parse_length
from traces.loaders import MAX_SYNTHETIC_REQUESTS
from traces.spec import check_keys, check_mapping, get_choice, get_float, get_int
from traces.table import TraceTable
from traces.validate import MAX_TOKENS

PREFIX_KEYS = (
    "prefix_len",
    "num_prefixes",
    "assign",
    "num_turns",
    "think_time_s",
    "user_len",
    "output_len",
)
ASSIGN_RULES = ("random", "round_robin")
PREFIX_HASH_BLOCK_SIZE = 16  # tokens per generated hash id: vLLM's default KV block size
MAX_TURNS = 1000
MAX_PREFIXES = 1_000_000
# Every turn holds the ids of its whole history: a cap keeps a mistyped spec from
# filling memory (an id costs ~80 bytes with the requests made from the table: 50M, 4 GB).
MAX_HASH_IDS = 50_000_000
_SALT = 0x70726566  # "pref": this module's random streams, apart from the format's


@dataclass(frozen=True)
class ThinkTime:
    """Seconds from a turn's arrival to the next turn's: ``kind`` fixed (``a``),
    exponential (mean ``a``) or uniform (``a``..``b``)."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Shape (n,), float64, each >= 0."""
        if self.kind == "fixed":
            return np.full(n, self.a)
        if self.kind == "exponential":
            return rng.exponential(self.a, size=n)
        return rng.uniform(self.a, self.b, size=n)


@dataclass(frozen=True)
class PrefixOptions:
    """The ``prefix:`` block, checked (see the module docstring for each key)."""

    prefix_len: int = 0
    num_prefixes: int = 1
    assign: str = "random"
    num_turns: LengthDistribution = Fixed(1)
    think_time: ThinkTime | None = None
    user_len: LengthDistribution | None = None
    output_len: LengthDistribution | None = None


def parse_prefix(spec: Any, where: str) -> PrefixOptions:
    """Read the ``prefix:`` block.

    Raises:
        TraceError: one line naming the key: an unknown key, a value of the wrong type or
            out of range, ``num_prefixes`` or ``assign`` without a system prompt, more
            than one turn without ``think_time_s``, or follow-up keys with a single turn.
    """
    spec = check_mapping(spec, where)
    check_keys(spec, PREFIX_KEYS, where)
    prefix_len = get_int(spec, "prefix_len", where, default=0, minimum=0)
    if prefix_len > MAX_TOKENS:
        raise TraceError(f"{where}.prefix_len: expected at most {MAX_TOKENS:,}, got {prefix_len}")
    num_prefixes = get_int(spec, "num_prefixes", where, default=1, minimum=1)
    if num_prefixes > MAX_PREFIXES:
        raise TraceError(
            f"{where}.num_prefixes: expected at most {MAX_PREFIXES:,}, got {num_prefixes}"
        )
    assign = get_choice(spec, "assign", where, ASSIGN_RULES, default="random")
    if prefix_len == 0:
        for key in ("num_prefixes", "assign"):
            if key in spec:
                raise TraceError(
                    f"{where}.{key}: there is no system prompt to share (set prefix_len > 0)"
                )
    try:
        turns = parse_length(spec.get("num_turns", 1), f"{where}.num_turns")
    except TraceError:
        turns = None
    most = None if turns is None else _most(turns)
    if most is None or most > MAX_TURNS:
        raise TraceError(
            f"{where}.num_turns: expected an integer, {{uniform: [lo, hi]}} or "
            f"{{choice: [...]}} of turns in 1..{MAX_TURNS}, got {short_repr(spec['num_turns'])}"
        )
    options = PrefixOptions(prefix_len, num_prefixes, assign, turns)
    if most == 1:
        for key in ("think_time_s", "user_len", "output_len"):
            if key in spec:
                raise TraceError(
                    f"{where}.{key}: only for follow-up turns; num_turns allows 1 turn"
                )
        return options
    if "think_time_s" not in spec:
        raise TraceError(
            f"{where}: missing key 'think_time_s' (seconds from a turn's arrival to the "
            "next turn's), needed when num_turns allows more than 1 turn"
        )
    lengths = {
        key: parse_length(spec[key], f"{where}.{key}") if key in spec else None
        for key in ("user_len", "output_len")
    }
    think = _think_time(spec["think_time_s"], f"{where}.think_time_s")
    return dataclasses.replace(options, think_time=think, **lengths)


def apply_prefix(
    table: TraceTable, options: PrefixOptions, hash_block_size: int, seed: int
) -> TraceTable:
    """The table's requests with system prompts, follow-up turns and hash ids (module
    docstring), sorted by arrival; on the trace's own clock, before window and limit.

    Raises:
        TraceError: a prompt beyond MAX_TOKENS, more requests than the synthetic format
            allows, or more than MAX_HASH_IDS hash ids in all.
    """
    where = "trace.prefix"
    H, S = hash_block_size, options.prefix_len
    starts = np.flatnonzero(table.replayed)  # (n,) positions of the sessions' first turns
    n = len(starts)
    g_rng, turn_rng, think_rng, user_rng, out_rng = np.random.default_rng([_SALT, seed]).spawn(5)
    if options.assign == "random":
        groups = g_rng.integers(0, options.num_prefixes, size=n)
    else:
        groups = np.arange(n) % options.num_prefixes
    turns = options.num_turns.sample(n, turn_rng)  # (n,) >= 1
    follow = int((turns - 1).sum())
    if len(table) + follow > MAX_SYNTHETIC_REQUESTS:
        raise TraceError(
            f"{where}.num_turns: the sessions make {len(table) + follow:,} requests; "
            f"expected at most {MAX_SYNTHETIC_REQUESTS:,}"
        )
    think_s = options.think_time.sample(follow, think_rng) if follow else np.zeros(0)
    user = options.user_len.sample(follow, user_rng) if options.user_len and follow else None
    out = options.output_len.sample(follow, out_rng) if options.output_len and follow else None

    shared = S // H  # full hash blocks of a system prompt
    next_id = options.num_prefixes * shared  # ids below: system prompt g's are g*shared..
    total_ids = 0
    rows: list[tuple[float, int, int, list[int] | None, int]] = []  # arrival, P, O, ids, pos
    k = 0  # index into the follow-up draws
    for i, pos in enumerate(starts.tolist()):
        t_s = float(table.arrival_s[pos])
        u1, o1 = int(table.prompt_len[pos]), int(table.output_len[pos])
        lengths = [(t_s, S + u1, o1)]
        for _ in range(int(turns[i]) - 1):
            prev_t, prev_p, prev_o = lengths[-1]
            u = u1 if user is None else int(user[k])
            o = o1 if out is None else int(out[k])
            lengths.append((prev_t + float(think_s[k]), prev_p + prev_o + u, o))
            k += 1
        last_t, last_p, last_o = lengths[-1]
        if last_p > MAX_TOKENS:
            raise TraceError(
                f"{where}: the session of row {table.row[pos]} reaches a prompt of "
                f"{last_p:,} tokens, above {MAX_TOKENS:,}"
            )
        blocks = -(-(last_p + last_o) // H)
        g = int(groups[i])
        stream = list(range(g * shared, (g + 1) * shared))
        own = blocks - shared
        stream += range(next_id, next_id + own)
        next_id += own
        for turn, (t, p, o) in enumerate(lengths):
            count = -(-(p + o) // H)
            total_ids += count
            if total_ids > MAX_HASH_IDS:
                raise TraceError(
                    f"{where}: the sessions need more than {MAX_HASH_IDS:,} hash ids (each "
                    "turn holds its whole history); expected fewer or shorter turns, or a "
                    "larger trace.hash_block_size"
                )
            rows.append((t, p, o, stream[:count], pos if turn == 0 else -1))
    for pos in np.flatnonzero(~table.replayed).tolist():  # dropped rows, unchanged
        rows.append((float(table.arrival_s[pos]), 0, 0, None, pos))
    # Stable by arrival: a session's turns stay in order, ties keep generation order
    # (replayed rows and their turns, then dropped rows).
    order = sorted(range(len(rows)), key=lambda j: rows[j][0])
    return _table(table, [rows[j] for j in order], hash_block_size)


def _table(table: TraceTable, rows: list, hash_block_size: int) -> TraceTable:
    """A TraceTable from (arrival_s, prompt, output, ids, source position or -1) rows."""
    n = len(rows)
    row = np.empty(n, dtype=np.int64)
    prompt = np.empty(n, dtype=np.int64)
    output = np.empty(n, dtype=np.int64)
    reason = None if table.drop_reason is None else np.full(n, "", dtype=object)
    next_row = int(table.row.max()) + 1
    for j, (_, p, o, _, pos) in enumerate(rows):
        if pos < 0:  # a follow-up turn
            row[j], prompt[j], output[j], next_row = next_row, p, o, next_row + 1
            continue
        row[j] = table.row[pos]
        replayed = table.drop_reason is None or table.drop_reason[pos] == ""
        prompt[j] = p if replayed else table.prompt_len[pos]
        output[j] = o if replayed else table.output_len[pos]
        if reason is not None:
            reason[j] = table.drop_reason[pos]
    return TraceTable(
        row=row,
        arrival_s=np.asarray([r[0] for r in rows], dtype=np.float64),
        prompt_len=prompt,
        output_len=output,
        hash_ids=[r[3] for r in rows],
        drop_reason=reason,
        hash_block_size=hash_block_size,
    )


def _most(dist: LengthDistribution) -> int | None:
    """The largest value a turn-count distribution can draw (None: unbounded forms)."""
    if isinstance(dist, Fixed):
        return dist.tokens
    if isinstance(dist, Uniform):
        return dist.hi
    if isinstance(dist, Choice):
        return max(dist.values)
    return None


def _think_time(value: Any, where: str) -> ThinkTime:
    """``5.0`` | ``{exponential: mean_s}`` | ``{uniform: [lo_s, hi_s]}`` (seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        parent, _, key = where.rpartition(".")
        return ThinkTime("fixed", get_float({key: value}, key, parent))
    forms = "a number of seconds >= 0, {exponential: mean_s} or {uniform: [lo_s, hi_s]}"
    if not isinstance(value, Mapping) or len(value) != 1:
        raise TraceError(f"{where}: expected {forms}, got {short_repr(value)}")
    ((kind, params),) = value.items()
    if kind == "exponential":
        mean = get_float({"exponential": params}, "exponential", where, strict=True)
        return ThinkTime("exponential", mean)
    if kind == "uniform":
        ok = (
            isinstance(params, list)
            and len(params) == 2
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in params
            )
            and 0 <= params[0] <= params[1]
        )
        if not ok:
            raise TraceError(
                f"{where}.uniform: expected [lo_s, hi_s], finite, 0 <= lo_s <= hi_s, "
                f"got {short_repr(params)}"
            )
        return ThinkTime("uniform", float(params[0]), float(params[1]))
    raise TraceError(f"{where}: expected {forms}, got {short_repr(value)}")
