"""Vectorized checks that turn raw trace columns into clean numpy arrays; a failure names
only the first bad cell: ``<file>: row <n>, column '<name>': <expected>, got <value>`` (CSV
rows 1-based without the header; JSONL the file line)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.types import infer_dtype

from sched_lab.core.errors import TraceError

# Wall-clock timestamps as in the Azure 2023 trace, ``2023-11-16 18:17:03.9799600`` (no time
# zone), or the Azure 2024 trace, ``2024-05-10 00:00:00.011+00:00`` (an offset from UTC; ``Z``
# and ``+0000`` too); up to 9 fractional digits (ns); the fraction is optional.
_OFFSET_PATTERN = r"(?:Z|[+-]\d{2}:?\d{2})"
_DATETIME_PATTERN = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{1,9})?" + _OFFSET_PATTERN + "?"
_NS_PER = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}


@dataclass(frozen=True)
class Source:
    """Names a trace file and its rows in errors; ``line_numbers``: each JSONL record's file
    line, None for CSV."""

    file: str
    line_numbers: Sequence[int] | None = None

    def at(self, index: int, column: str) -> str:
        """``file: row 3, column 'x'`` for the record at 0-based ``index``."""
        if self.line_numbers is None:
            return f"{self.file}: row {index + 1}, column {column!r}"
        return f"{self.file}: line {self.line_numbers[index]}, key {column!r}"


def token_counts(values: pd.Series, src: Source, column: str, *, minimum: int) -> np.ndarray:
    """Integer token counts >= ``minimum``, (n,) int64; TraceError on an empty, non-numeric,
    fractional or too small cell."""
    numbers = _numbers(values)
    finite = np.isfinite(numbers)
    whole = np.zeros_like(finite)
    whole[finite] = numbers[finite] == np.floor(numbers[finite])
    _raise_first(~whole, values, src, column, "expected an integer token count")
    _raise_first(numbers < minimum, values, src, column, f"expected a token count >= {minimum}")
    _raise_first(
        numbers > MAX_TOKENS, values, src, column, f"expected a token count <= {MAX_TOKENS:,}"
    )
    return numbers.astype(np.int64)


# No model here has a context near this; it keeps int64 arithmetic far from overflow.
MAX_TOKENS = 1 << 40
# pandas' inferred kinds of a column that holds no boolean (a bool makes it "boolean" or
# "mixed..." but for "mixed-integer-float", which is ints and floats only)
_NO_BOOLS = ("integer", "floating", "mixed-integer-float", "empty")


def _numbers(values: pd.Series) -> np.ndarray:
    """Cells as float64; NaN where not a number. Booleans (JSON true/false) are not numbers."""
    numbers_only = infer_dtype(values, skipna=True) in _NO_BOOLS  # and missing cells
    if not numbers_only and (
        values.dtype == bool or values.map(lambda v: isinstance(v, bool)).any()
    ):
        values = values.map(lambda v: np.nan if isinstance(v, bool) else v)
    return pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)


def numeric_times(values: pd.Series, src: Source, column: str, *, ticks_per_s: float) -> np.ndarray:
    """Timestamps to seconds (``value / ticks_per_s``), (n,) float64; TraceError on an empty,
    NaN, infinite or non-numeric cell."""
    numbers = _numbers(values)
    _raise_first(~np.isfinite(numbers), values, src, column, "expected a finite number")
    return numbers / ticks_per_s


def datetime_times(values: pd.Series, src: Source, column: str) -> np.ndarray:
    """``YYYY-MM-DD HH:MM:SS.fffffff[+HH:MM]`` to seconds since the first row, float64.

    Offsets convert to UTC; either every row has one or none. Differences are in integer
    nanoseconds.

    Raises:
        TraceError: a cell that does not match or is not a real date/time, outside UTC
            1677-09-21..2262-04-11, with mixed offsets, or over 2**63 ns after the first row.
    """
    expected = "expected a timestamp like '2023-11-16 18:17:03.9799600'"  # or with +00:00
    matches = values.str.fullmatch(_DATETIME_PATTERN).to_numpy(dtype=bool)
    _raise_first(~matches, values, src, column, expected)
    zoned = values.str.contains(_OFFSET_PATTERN + "$").to_numpy(dtype=bool)
    what = "an offset from UTC" if zoned[0] else "no offset from UTC"
    _raise_first(zoned != zoned[0], values, src, column, f"expected {what}, as in row 1")
    stamps = pd.to_datetime(values, format="ISO8601", errors="coerce", utc=bool(zoned[0]))
    _raise_first(stamps.isna().to_numpy(), values, src, column, expected)
    unit = stamps.dt.unit  # pandas picks the unit from the digits given
    ticks = stamps.to_numpy(dtype=f"datetime64[{unit}]").astype(np.int64)  # UTC if zoned
    limit = np.iinfo(np.int64).max // _NS_PER[unit]
    _raise_first(
        np.abs(ticks) > limit,
        values,
        src,
        column,
        "expected a time from 1677-09-21 to 2262-04-11 UTC (the nanosecond clock)",
    )
    ns = ticks * _NS_PER[unit]
    with np.errstate(over="ignore"):
        since = ns - ns[0]
    _raise_first(
        (ns >= ns[0]) != (since >= 0),
        values,
        src,
        column,
        f"expected a time within 292 years (2**63 ns) of row 1 ({_show(values.iloc[0])})",
    )
    return since / 1e9


def check_sorted(times_s: np.ndarray, values: pd.Series, src: Source, column: str) -> None:
    """Require non-decreasing arrival times (ties allowed); TraceError names the first row
    out of order."""
    back = np.flatnonzero(np.diff(times_s) < 0)
    if len(back):
        i = int(back[0]) + 1
        raise TraceError(
            f"{src.at(i, column)}: time goes backwards ({_show(values.iloc[i])} after "
            f"{_show(values.iloc[i - 1])}); rows must be sorted by arrival time"
        )


def _raise_first(bad: np.ndarray, values: pd.Series, src: Source, column: str, what: str) -> None:
    hits = np.flatnonzero(bad)
    if len(hits):
        i = int(hits[0])
        raise TraceError(f"{src.at(i, column)}: {what}, got {_show(values.iloc[i])}")


def _show(value: Any) -> str:
    """A cell as text: CSV cells are strings; JSONL values print as JSON (None -> null)."""
    if isinstance(value, str):
        return "'' (empty)" if value == "" else repr(value)
    return json.dumps(value)


# Hash ids are kept as Python ints; beyond int64 they could not become array keys.
MAX_HASH_ID = (1 << 63) - 1


def hash_id_lists(
    values: pd.Series,
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    hash_block_size: int,
    src: Source,
    column: str = "hash_ids",
) -> list[list[int] | None] | None:
    """Prefix-block hash ids per row, checked against its token counts: a row with prompt P
    and output O needs between ceil(P / hash_block_size) and ceil((P + O) /
    hash_block_size) ids.

    Returns:
        One list of ints per row (None without the key); None if no row has it.

    Raises:
        TraceError: naming file and row: not a list of integers, an id outside
            0..2**63-1, or too few or too many ids.
    """
    if values.isna().all():
        return None
    out: list[list[int] | None] = []
    for i, ids in enumerate(values):
        if ids is None:
            out.append(None)
            continue
        where = src.at(i, column)
        if not (isinstance(ids, list) and all(type(h) is int for h in ids)):
            raise TraceError(f"{where}: expected a list of integers, got {_cut(ids)}")
        bad = next((j for j, h in enumerate(ids) if not 0 <= h <= MAX_HASH_ID), None)
        if bad is not None:
            raise TraceError(
                f"{where}: expected hash ids in 0..2**63-1, got {_cut(ids[bad])} at "
                f"position {bad + 1}"
            )
        p, o = int(prompt_len[i]), int(output_len[i])
        least, most = -(-p // hash_block_size), -(-(p + o) // hash_block_size)
        if len(ids) < least:
            raise TraceError(
                f"{where}: expected at least ceil(prompt {p} / hash_block_size "
                f"{hash_block_size}) = {least} hash ids (one per block of the prompt), "
                f"got {len(ids)}"
            )
        if len(ids) > most:
            raise TraceError(
                f"{where}: expected at most ceil((prompt {p} + output {o}) / hash_block_size "
                f"{hash_block_size}) = {most} hash ids (blocks of the prompt and the output), "
                f"got {len(ids)}; is trace.hash_block_size right?"
            )
        out.append(ids)
    return out


def optional_names(values: pd.Series, src: Source, column: str) -> np.ndarray | None:
    """An optional per-row name (``lora_name``, ``cache_salt``): object array of str, ""
    where absent or null; None if no row has one. TraceError naming file and row for a
    value that is not a non-empty string of UTF-8 text (NaN included: only null or an absent
    key means none)."""
    if all(v is None for v in values):
        return None
    out = np.full(len(values), "", dtype=object)
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, str) or not v:
            raise TraceError(f"{src.at(i, column)}: expected a non-empty string, got {_cut(v)}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise TraceError(
                f"{src.at(i, column)}: expected UTF-8 text, got a string with a lone "
                f"surrogate ({ascii(v)[:60]})"
            ) from None
        out[i] = v
    return out


def _cut(value: Any) -> str:
    """A JSON value, cut to ~60 characters, for one-line messages."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
