"""Synthetic prefix identity for any trace: shared system prompts and multi-turn sessions.

The ``prefix:`` block gives every request hash ids, one per ``hash_block_size`` tokens, for
any format without its own (not ``mooncake`` nor ``prompts``). Key names follow vLLM's
benchmark datasets (``prefix_len``, ``num_prefixes`` of ``prefix_repetition``; ``num_turns``
of ``benchmarks/multi_turn``); docs/traces.md has an example. Rules (all draws from ``seed``, in
streams of their own, so the format's own draws are unchanged):

- Every replayed row starts a session whose first turn is the row (dropped rows start none).
- With ``prefix_len`` S > 0, session i gets system prompt g of ``num_prefixes`` G (random,
  or ``i mod G`` for ``round_robin``), prepended to every prompt of the session.
- Turn t + 1's prompt is P(t) + O(t) + U(t+1) (``user_len``); ``num_turns`` at most 1000;
  ``user_len`` and ``output_len`` default to the row's lengths.
- Open loop: turn t + 1 arrives ``think_time_s`` after turn t arrived.
- A session is one token stream; block j of it has one id. The first floor(S / H) blocks
  carry the system prompt's shared ids, the rest ids of the session; a turn carries
  ceil((P + O) / H) ids.
- Requests are sorted by arrival; rows keep their row number as id, follow-up turns are
  numbered from the largest row number + 1. Window, ``limit`` and ``rate_scale`` apply
  afterwards (think times included).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sched_lab.core.errors import TraceError, short_repr
from sched_lab.traces.distributions import Choice, Fixed, LengthDistribution, Uniform, parse_length
from sched_lab.traces.loaders import MAX_SYNTHETIC_REQUESTS
from sched_lab.traces.spec import check_keys, check_mapping, get_choice, get_float, get_int
from sched_lab.traces.table import TraceTable
from sched_lab.traces.validate import MAX_TOKENS

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
    """Seconds from a turn's arrival to the next: fixed ``a``, exponential (mean ``a``) or
    uniform (``a``..``b``)."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """(n,) float64, each >= 0."""
        if self.kind == "fixed":
            return np.full(n, self.a)
        if self.kind == "exponential":
            return rng.exponential(self.a, size=n)
        return rng.uniform(self.a, self.b, size=n)


@dataclass(frozen=True)
class PrefixOptions:
    """The checked ``prefix:`` block."""

    prefix_len: int = 0
    num_prefixes: int = 1
    assign: str = "random"
    num_turns: LengthDistribution = Fixed(1)
    think_time: ThinkTime | None = None
    user_len: LengthDistribution | None = None
    output_len: LengthDistribution | None = None


def parse_prefix(spec: Any, where: str) -> PrefixOptions:
    """Read the ``prefix:`` block; TraceError (one line naming the key) on an unknown key, a
    bad type or range, ``num_prefixes``/``assign`` without a system prompt, several turns
    without ``think_time_s``, or follow-up keys with a single turn."""
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
    """The table's requests with system prompts, follow-up turns and hash ids, sorted by
    arrival, before window and limit.

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
