"""Request traces: read the ``trace:`` block of an experiment into a list of Requests.

Example (YAML)::

    trace:
      format: azure2023            # azure2023 | burstgpt | mooncake | lengths | synthetic | prompts
      path: traces/data/azure2023_conv.csv   # see lab/config/paths.py
      start_s: 0                   # window [start_s, end_s) on the trace's own clock
      end_s: 600
      limit: 1000                  # first N requests after the window
      rate_scale: 2.0              # offered-load multiplier: inter-arrival times / 2
      seed: 0                      # for generated arrivals, lengths and shuffles
      prefix: {prefix_len: 1024, num_prefixes: 4, num_turns: 3, think_time_s: 30}
                                   # shared system prompts, multi-turn sessions, hash ids
      hash_block_size: 16          # tokens per hash id (mooncake: 512; prefix: 16)

Formats and their keys are documented in :mod:`sched_lab.traces.loaders`; arrival processes in
:mod:`sched_lab.traces.arrivals`; synthetic length distributions in :mod:`sched_lab.traces.distributions`; ``prefix`` (any format
without hash ids of its own) in :mod:`sched_lab.traces.prefix`. ``hash_block_size`` applies to a
trace with hash ids: Mooncake's (default 512) or those ``prefix`` makes (default 16).
Every mistake in the spec or the file raises :class:`sched_lab.core.errors.TraceError` with one line
naming the key, or the file, row and column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import sched_lab.traces.loaders  # noqa: F401  (registers the formats)
import sched_lab.traces.prompts  # noqa: F401
from sched_lab.core.errors import TraceError
from sched_lab.core.request import Request
from sched_lab.traces.prefix import PREFIX_HASH_BLOCK_SIZE, apply_prefix, parse_prefix
from sched_lab.traces.registry import FORMATS, get_format
from sched_lab.traces.spec import WHERE, check_keys, check_mapping, get_float, get_int, require
from sched_lab.traces.table import (
    TraceTable,
    apply_limit,
    apply_rate_scale,
    apply_window,
    check_clock,
)

__all__ = ["COMMON_KEYS", "FORMATS", "load_table", "load_trace", "scale_table"]

# Spec keys every format accepts; each format adds its own (see FORMATS[name].keys).
COMMON_KEYS = ("format", "start_s", "end_s", "limit", "rate_scale", "seed", "prefix")
# Formats whose rows carry a prefix identity of their own (``prefix:`` is refused there).
OWN_PREFIX = {"mooncake": "its rows have hash_ids", "prompts": "its prompts are real token ids"}


def load_trace(spec: Mapping[str, Any], base_dir: Path) -> list[Request]:
    """Load the requests a trace spec describes, in arrival order.

    Args:
        spec: the ``trace:`` block of an experiment (a mapping, as parsed from YAML).
        base_dir: a relative ``path`` is resolved against it.

    Returns:
        New Requests, ``arrival_s`` non-decreasing from 0.0, ``request_id`` the 0-based
        source row (stable under any window or limit); rows the format does not replay come
        with status ``dropped``, their reason and a NaN ``arrival_s``. Deterministic in the
        spec and seed.

    Raises:
        TraceError: unknown format or key, a bad value, a missing, empty or malformed file,
            or a window/filter that keeps no request.
    """
    rate_scale = get_float(
        check_mapping(spec, WHERE), "rate_scale", WHERE, default=1.0, strict=True
    )
    table, _ = load_table(spec, base_dir)
    return scale_table(table, rate_scale).to_requests()


def load_table(spec: Mapping[str, Any], base_dir: Path) -> tuple[TraceTable, int]:
    """Read the trace once, with window and limit applied and no ``rate_scale`` (use
    :func:`scale_table` per load).

    Returns:
        (the table with arrivals re-based to 0, the number of entries the format produced
        before window and limit).

    Raises:
        TraceError: as :func:`load_trace`.
    """
    spec = check_mapping(spec, WHERE)
    trace_format = get_format(require(spec, "format", WHERE))
    check_keys(spec, (*COMMON_KEYS, "hash_block_size", *trace_format.keys), WHERE)
    start_s = get_float(spec, "start_s", WHERE, default=0.0)
    end_s = get_float(spec, "end_s", WHERE, default=math.inf, strict=True, allow_inf=True)
    if end_s <= start_s:
        raise TraceError(
            f"{WHERE}.end_s: must be greater than start_s ({start_s:g}), got {end_s:g}"
        )
    limit = get_int(spec, "limit", WHERE, default=None, minimum=1)
    seed = get_int(spec, "seed", WHERE, default=0, minimum=0)
    prefix = _prefix(spec, trace_format.name)

    table = trace_format.load(spec, Path(base_dir), seed)
    rows = len(table)
    if prefix is not None:
        block = get_int(spec, "hash_block_size", WHERE, default=PREFIX_HASH_BLOCK_SIZE, minimum=1)
        table = apply_prefix(table, prefix, block, seed)
    _check_finite(table, "the arrival rate is too small")
    table = apply_window(table, start_s, end_s)
    if limit is not None:
        table = apply_limit(table, limit)
    check_clock(table.arrival_s[table.replayed], WHERE, "the trace's own clock")
    return table, rows


def _prefix(spec: Mapping[str, Any], name: str):
    """The checked ``prefix:`` block, or None; ``hash_block_size`` only where there are
    hash ids (the format's own, or the block's)."""
    where = f"{WHERE}.prefix"
    if "prefix" not in spec:
        if "hash_block_size" in spec and "hash_block_size" not in FORMATS[name].keys:
            raise TraceError(
                f"{WHERE}.hash_block_size: format {name} has no hash ids (give a prefix: "
                "block to make them)"
            )
        return None
    if name in OWN_PREFIX:
        raise TraceError(
            f"{where}: not with format {name}: {OWN_PREFIX[name]}, its own prefix identity"
        )
    return parse_prefix(spec["prefix"], where)


def scale_table(table: TraceTable, rate_scale: float) -> TraceTable:
    """``table`` at ``rate_scale`` times its request rate; TraceError if an arrival time
    overflows."""
    table = apply_rate_scale(table, rate_scale)
    _check_finite(table, f"rate_scale {rate_scale:g} is too small")
    return table


def _check_finite(table, why: str) -> None:
    """TraceError naming the first request whose arrival time overflowed to inf (or NaN)."""
    finite = np.isfinite(table.arrival_s) | ~table.replayed
    if not finite.all():
        i = int(np.argmin(finite))
        raise TraceError(
            f"{WHERE}: request {table.row[i]} would arrive at {table.arrival_s[i]} s: {why}"
        )
