"""Vectorized checks that turn raw trace columns into clean numpy arrays.

Each check converts a whole column at once and, on failure, reports only the first bad
cell: ``<file>: row <n>, column '<name>': <what was expected>, got <value>``. Rows are the
1-based data rows of a CSV (header not counted); JSONL files report the file line instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from lab.core.errors import TraceError

# Wall-clock timestamps as in the Azure 2023 trace: ``2023-11-16 18:17:03.9799600``.
# No time zone (the trace has none); up to 9 fractional digits (ns); the fraction is optional.
_DATETIME_PATTERN = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d{1,9})?"


@dataclass(frozen=True)
class Source:
    """Names a trace file and its rows in error messages.

    Args:
        file: the file name shown to the user.
        line_numbers: for JSONL, the file line of each record; None for CSV (row = index + 1).
    """

    file: str
    line_numbers: Sequence[int] | None = None

    def at(self, index: int, column: str) -> str:
        """``file: row 3, column 'x'`` for the record at 0-based ``index``."""
        if self.line_numbers is None:
            return f"{self.file}: row {index + 1}, column {column!r}"
        return f"{self.file}: line {self.line_numbers[index]}, key {column!r}"


def token_counts(values: pd.Series, src: Source, column: str, *, minimum: int) -> np.ndarray:
    """Integer token counts >= ``minimum``, shape (n,), int64.

    Raises:
        TraceError: a cell that is empty, not a number, not a whole number, or < ``minimum``.
    """
    numbers = _numbers(values)
    finite = np.isfinite(numbers)
    whole = np.zeros_like(finite)
    whole[finite] = numbers[finite] == np.floor(numbers[finite])
    _raise_first(~whole, values, src, column, "expected an integer token count")
    _raise_first(numbers < minimum, values, src, column, f"expected a token count >= {minimum}")
    _raise_first(numbers > MAX_TOKENS, values, src, column,
                 f"expected a token count <= {MAX_TOKENS:,}")
    return numbers.astype(np.int64)


# No model here has a context near this; it keeps int64 arithmetic far from overflow.
MAX_TOKENS = 1 << 40


def _numbers(values: pd.Series) -> np.ndarray:
    """Cells as float64; NaN where not a number. Booleans (JSON true/false) are not numbers."""
    if values.dtype == bool or values.map(lambda v: isinstance(v, bool)).any():
        values = values.map(lambda v: np.nan if isinstance(v, bool) else v)
    return pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)


def numeric_times(values: pd.Series, src: Source, column: str, *, ticks_per_s: float) -> np.ndarray:
    """Numeric timestamps converted to seconds (``value / ticks_per_s``), shape (n,), float64.

    Raises:
        TraceError: a cell that is empty, NaN, infinite or not a number.
    """
    numbers = _numbers(values)
    _raise_first(~np.isfinite(numbers), values, src, column, "expected a finite number")
    return numbers / ticks_per_s


def datetime_times(values: pd.Series, src: Source, column: str) -> np.ndarray:
    """``YYYY-MM-DD HH:MM:SS.fffffff`` strings to seconds since the first row, float64.

    Differences are taken in integer nanoseconds, so two timestamps 0.052 s apart give
    arrival times exactly 0.052 apart (up to float64 rounding of the final division).

    Raises:
        TraceError: a cell that does not match the pattern or is not a real date/time.
    """
    expected = "expected a timestamp like '2023-11-16 18:17:03.9799600'"
    matches = values.str.fullmatch(_DATETIME_PATTERN).to_numpy(dtype=bool)
    _raise_first(~matches, values, src, column, expected)
    stamps = pd.to_datetime(values, format="ISO8601", errors="coerce")
    _raise_first(stamps.isna().to_numpy(), values, src, column, expected)
    ns = stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    return (ns - ns[0]) / 1e9


def check_sorted(times_s: np.ndarray, values: pd.Series, src: Source, column: str) -> None:
    """Require non-decreasing arrival times (ties are allowed: Mooncake has many).

    Raises:
        TraceError: naming the first row whose time is earlier than the row before it.
    """
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
