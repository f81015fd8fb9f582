"""The trace formats: each loader reads one source into a :class:`TraceTable`.

Times are seconds since the first data row of the file (kept or dropped). Dropped rows
(logged at INFO, kept in the table with their reason, status ``dropped`` in the results):
0 output tokens (every format); ``burstgpt`` rows with 0 request or response tokens.
``lengths`` removes 0-output rows from its pool. A 0-token prompt elsewhere, and negative,
fractional or non-numeric counts, are errors.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.core.errors import TraceError
from sched_lab.traces.arrivals import parse_arrival
from sched_lab.traces.distributions import parse_length
from sched_lab.traces.readers import read_csv, read_jsonl
from sched_lab.traces.registry import register_format
from sched_lab.traces.spec import WHERE, get_choice, get_int, get_str_list, require, resolve_path
from sched_lab.traces.table import CACHE_KEYS, TraceTable, check_clock
from sched_lab.traces.validate import (
    Source,
    check_sorted,
    datetime_times,
    hash_id_lists,
    numeric_times,
    optional_names,
    token_counts,
)

logger = logging.getLogger(__name__)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
MOONCAKE_HASH_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces (ATTRIBUTION.md)
LENGTHS_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
SAMPLE_ORDERS = ("sequential", "shuffle")
# A replay holds its requests in memory (the trace, plus one copy per policy run): 10M is
# already ~10 GB per policy; more would fail late, after minutes of generation.
MAX_SYNTHETIC_REQUESTS = 10_000_000


@register_format("azure2023", keys=("path",))
def load_azure2023(spec: Mapping[str, Any], base_dir: Path, seed: int) -> TraceTable:
    """Azure LLM inference trace 2023 (Splitwise): ``TIMESTAMP,ContextTokens,GeneratedTokens``.
    TIMESTAMP is text with 100-ns ticks, with or without a UTC offset (2024 trace); rows must
    be sorted by time."""
    path = resolve_path(spec, base_dir, WHERE)
    frame = read_csv(path, AZURE_COLUMNS)
    src = Source(path.name)
    stamps = frame["TIMESTAMP"]
    arrival_s = datetime_times(stamps, src, "TIMESTAMP")
    check_sorted(arrival_s, stamps, src, "TIMESTAMP")
    table = TraceTable(
        row=np.arange(len(frame)),
        arrival_s=arrival_s,
        prompt_len=token_counts(frame["ContextTokens"], src, "ContextTokens", minimum=1),
        output_len=token_counts(frame["GeneratedTokens"], src, "GeneratedTokens", minimum=0),
    )
    return _drop(table, table.output_len == 0, src.file, "'GeneratedTokens' == 0", _NO_OUTPUT)


@register_format("burstgpt", keys=("path", "models", "log_types"))
def load_burstgpt(spec: Mapping[str, Any], base_dir: Path, seed: int) -> TraceTable:
    """BurstGPT CSV, both layouts (``BurstGPT_1``; ``_3``). ``Timestamp`` in seconds; optional
    ``models`` / ``log_types`` keep rows whose ``Model`` / ``Log Type`` is listed."""
    filters = {
        "Model": get_str_list(spec, "models", WHERE),
        "Log Type": get_str_list(spec, "log_types", WHERE),
    }
    path = resolve_path(spec, base_dir, WHERE)
    frame = read_csv(path, (*BURSTGPT_COLUMNS, *(c for c, v in filters.items() if v)))
    src = Source(path.name)
    stamps = frame["Timestamp"]
    times_s = numeric_times(stamps, src, "Timestamp", ticks_per_s=1)
    check_sorted(times_s, stamps, src, "Timestamp")
    table = TraceTable(
        row=np.arange(len(frame)),
        arrival_s=times_s - times_s[0],
        prompt_len=token_counts(frame["Request tokens"], src, "Request tokens", minimum=0),
        output_len=token_counts(frame["Response tokens"], src, "Response tokens", minimum=0),
    )
    table = _drop(table, table.output_len == 0, src.file, "'Response tokens' == 0", _FAILED)
    table = _drop(table, table.prompt_len == 0, src.file, "'Request tokens' == 0", _NO_PROMPT)
    for column, wanted in filters.items():
        if wanted:
            table = _filter(table, frame[column], wanted, src.file, column)
    return table


@register_format("mooncake", keys=("path", "hash_block_size"))
def load_mooncake(spec: Mapping[str, Any], base_dir: Path, seed: int) -> TraceTable:
    """Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``;
    ``hash_block_size`` defaults to 512 (:func:`sched_lab.traces.validate.hash_id_lists`).
    Optional per line: ``lora_name`` and ``cache_salt`` (strings; the prefix cache's key)."""
    block = get_int(spec, "hash_block_size", WHERE, default=MOONCAKE_HASH_BLOCK_SIZE, minimum=1)
    path = resolve_path(spec, base_dir, WHERE)
    frame, line_numbers = read_jsonl(path, MOONCAKE_KEYS, optional=("hash_ids", *CACHE_KEYS))
    src = Source(path.name, line_numbers)
    stamps = frame["timestamp"]
    times_s = numeric_times(stamps, src, "timestamp", ticks_per_s=1000)  # ms
    check_sorted(times_s, stamps, src, "timestamp")
    prompt_len = token_counts(frame["input_length"], src, "input_length", minimum=1)
    output_len = token_counts(frame["output_length"], src, "output_length", minimum=0)
    table = TraceTable(
        row=np.arange(len(frame)),
        arrival_s=times_s - times_s[0],
        prompt_len=prompt_len,
        output_len=output_len,
        hash_ids=hash_id_lists(frame["hash_ids"], prompt_len, output_len, block, src),
        hash_block_size=block,
        **{key: optional_names(frame[key], src, key) for key in CACHE_KEYS},
    )
    return _drop(table, table.output_len == 0, src.file, "'output_length' == 0", _NO_OUTPUT)


@register_format("lengths", keys=("path", "arrival", "num_requests", "sample"))
def load_lengths(spec: Mapping[str, Any], base_dir: Path, seed: int) -> TraceTable:
    """Length-only CSV (Vidur / Sarathi-Serve ``num_prefill_tokens,num_decode_tokens``) with
    ``arrival`` times; ``num_requests`` rows in file order (``sample: sequential``) or
    shuffled by ``seed``, each at most once."""
    arrival = parse_arrival(require(spec, "arrival", WHERE), f"{WHERE}.arrival")
    order = get_choice(spec, "sample", WHERE, SAMPLE_ORDERS, default="sequential")
    num_requests = get_int(spec, "num_requests", WHERE, default=None, minimum=1)
    path = resolve_path(spec, base_dir, WHERE)
    frame = read_csv(path, LENGTHS_COLUMNS)
    src = Source(path.name)
    table = TraceTable(
        row=np.arange(len(frame)),
        arrival_s=np.zeros(len(frame)),
        prompt_len=token_counts(frame["num_prefill_tokens"], src, "num_prefill_tokens", minimum=1),
        output_len=token_counts(frame["num_decode_tokens"], src, "num_decode_tokens", minimum=0),
    )
    table = _drop(table, table.output_len == 0, src.file, "'num_decode_tokens' == 0", _NO_OUTPUT)
    table = table.take(table.replayed)  # a pool of lengths: dropped rows are not requests
    if num_requests is None:
        num_requests = len(table)
    if num_requests > len(table):
        raise TraceError(
            f"{WHERE}.num_requests: {num_requests} is more than the {len(table)} usable rows "
            f"of {src.file}"
        )
    arrival_rng, sample_rng = np.random.default_rng(seed).spawn(2)
    if order == "shuffle":
        table = table.take(sample_rng.permutation(len(table))[:num_requests])
    else:
        table = table.take(slice(0, num_requests))
    arrival_s = arrival.sample(num_requests, arrival_rng)
    check_clock(arrival_s, f"{WHERE}.arrival.rate", f"{arrival.rate:g} req/s")
    return table.with_arrivals(arrival_s)


@register_format("synthetic", keys=("num_requests", "arrival", "prompt_len", "output_len"))
def load_synthetic(spec: Mapping[str, Any], base_dir: Path, seed: int) -> TraceTable:
    """No file: ``num_requests`` requests with ``arrival`` times and lengths from
    :mod:`sched_lab.traces.distributions`, each from an independent stream of ``seed``."""
    num_requests = get_int(spec, "num_requests", WHERE, minimum=1)
    if num_requests > MAX_SYNTHETIC_REQUESTS:
        raise TraceError(
            f"{WHERE}.num_requests: expected at most {MAX_SYNTHETIC_REQUESTS:,}, got "
            f"{num_requests:,} (each request is replayed from memory, ~1 KB per policy; "
            "split the workload into several runs)"
        )
    arrival = parse_arrival(require(spec, "arrival", WHERE), f"{WHERE}.arrival")
    prompt = parse_length(require(spec, "prompt_len", WHERE), f"{WHERE}.prompt_len")
    output = parse_length(require(spec, "output_len", WHERE), f"{WHERE}.output_len")
    arrival_rng, prompt_rng, output_rng = np.random.default_rng(seed).spawn(3)
    arrival_s = arrival.sample(num_requests, arrival_rng)
    check_clock(arrival_s, f"{WHERE}.arrival.rate", f"{arrival.rate:g} req/s")
    return TraceTable(
        row=np.arange(num_requests),
        arrival_s=arrival_s,
        prompt_len=prompt.sample(num_requests, prompt_rng),
        output_len=output.sample(num_requests, output_rng),
    )


_NO_OUTPUT = "a request needs >= 1 output token"
_FAILED = "failed requests in the source"
_NO_PROMPT = "a prompt needs >= 1 token"


def _drop(table: TraceTable, drop: np.ndarray, file: str, rule: str, why: str) -> TraceTable:
    """Mark the replayed rows where ``drop`` is True as dropped (reason: ``rule``, ``why``),
    logging how many; error if no replayed row is left."""
    drop = drop & table.replayed
    count, left = int(drop.sum()), int(table.replayed.sum())
    if count == 0:
        return table
    logger.info("%s: dropped %d of %d rows with %s (%s)", file, count, left, rule, why)
    if count == left:
        raise TraceError(f"{file}: no request left after dropping rows with {rule} ({why})")
    reason = table.drop_reason
    reason = np.full(len(table), "", dtype=object) if reason is None else reason.copy()
    reason[drop] = f"not replayed: {rule} in {file} ({why})"
    return dataclasses.replace(table, drop_reason=reason)


def _filter(
    table: TraceTable, values: pd.Series, wanted: list[str], file: str, column: str
) -> TraceTable:
    """Keep rows whose ``column`` is one of ``wanted``; a wanted value absent from the file is
    an error."""
    key = "models" if column == "Model" else "log_types"
    present = set(values.unique())
    for value in wanted:
        if value not in present:
            raise TraceError(
                f"{WHERE}.{key}: {value!r} does not occur in column {column!r} of {file}; "
                f"values present: {', '.join(sorted(present))}"
            )
    match = values.isin(wanted).to_numpy()[table.row]
    logger.info(
        "%s: %s in %s keeps %d of %d rows",
        file,
        column,
        wanted,
        (match & table.replayed).sum(),
        table.replayed.sum(),
    )
    if not (match & table.replayed).any():
        raise TraceError(f"{file}: no request left after {WHERE}.{key} = {wanted}")
    return table.take(match)
