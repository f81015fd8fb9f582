"""Read trace files into pandas frames, turning every parse failure into one TraceError line.

Cells are kept as the text found in the file (CSV) or the JSON value (JSONL), so that a
later check can quote the offending value exactly; conversion happens in ``validate.py``.
Data rows are numbered from 1 in messages, the header not counted (row 1 is the first line
after the header); JSONL messages give the line number in the file.
"""

from __future__ import annotations

import codecs
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from lab.core.errors import TraceError


def read_csv(path: Path, required: Sequence[str]) -> pd.DataFrame:
    """All columns as strings (empty or absent cell -> ``""``), ``required`` columns present.

    Header names are stripped of surrounding spaces (``Timestamp, Model`` is accepted).

    Raises:
        TraceError: not a text file, empty file, unparsable CSV (wrong field count, bad
            encoding) or a missing column.
    """
    check_text(path, "CSV")
    try:
        with warnings.catch_warnings():
            # A row with more fields than the header would silently lose data: an error here.
            warnings.simplefilter("error", pd.errors.ParserWarning)
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, index_col=False)
    except pd.errors.EmptyDataError:
        raise TraceError(f"{path.name}: empty file (no data rows)") from None
    except (
        pd.errors.ParserError,
        pd.errors.ParserWarning,
        UnicodeDecodeError,
        ValueError,
    ) as exc:
        raise TraceError(f"{path.name}: cannot parse as CSV: {_one_line(exc)}") from None
    frame = frame.fillna("")  # a row with fewer fields than the header: empty cells
    frame.columns = [str(c).strip() for c in frame.columns]
    for column in required:  # pandas renames a repeated header "X" to "X.1", "X.2", ...
        if f"{column}.1" in frame.columns:
            raise TraceError(f"{path.name}: column {column!r} appears more than once in the header")
    if len(frame) == 0:
        raise TraceError(f"{path.name}: empty file (no data rows)")
    require_columns(frame, required, path.name)
    return frame


def read_jsonl(
    path: Path, required: Sequence[str], optional: Sequence[str] = ()
) -> tuple[pd.DataFrame, list[int]]:
    """One JSON object per line; blank lines are skipped; other keys are ignored.

    Returns:
        A frame with one object-dtype column per required and optional key (an optional
        key absent from a line is None) and the 1-based file line number of each row.

    Raises:
        TraceError: not a text file, empty file, a line that is not a JSON object, or a line
            without one of the ``required`` keys.
    """
    check_text(path, "JSONL")
    keys = [*required, *optional]
    records: list[dict] = []
    line_numbers: list[int] = []
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = _parse_json_line(line, path.name, number)
                for key in required:
                    if key not in record:
                        raise TraceError(
                            f"{path.name}: line {number}: missing key {key!r}; "
                            f"expected keys: {', '.join(required)}"
                        )
                records.append(record)
                line_numbers.append(number)
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path.name}: not UTF-8 text: {_one_line(exc)}") from None
    if not records:
        raise TraceError(f"{path.name}: empty file (no data rows)")
    columns = {key: pd.Series([r.get(key) for r in records], dtype=object) for key in keys}
    return pd.DataFrame(columns), line_numbers


_MAGIC = {
    b"\x1f\x8b": "gzip-compressed: decompress it first",
    b"PK\x03\x04": "zip-compressed: decompress it first",
    b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it first",
    b"BZh": "bzip2-compressed: decompress it first",
    b"\xfd7zXZ\x00": "xz-compressed: decompress it first",
    b"PAR1": "a Parquet file",
}
_SNIFF_BYTES = 1 << 16


def check_text(path: Path, kind: str) -> None:
    """Refuse a file whose first 64 KiB are not UTF-8 text (compressed, binary, or text in
    another encoding), which pandas would otherwise read as an empty or garbled table.

    Raises:
        TraceError: ``<file>: not a text <kind> file (...)``, saying what was found.
    """
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as exc:
        raise TraceError(f"{path.name}: cannot be read ({exc.strerror})") from None
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            raise TraceError(f"{path.name}: not a text {kind} file ({what})")
    nul = head.find(b"\x00")
    if nul >= 0:
        raise TraceError(f"{path.name}: not a text {kind} file (byte {nul} is NUL: binary data)")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"{path.name}: not a text {kind} file (byte {exc.start} is not UTF-8: "
            "binary data, or text in another encoding)"
        ) from None


def require_columns(frame: pd.DataFrame, required: Sequence[str], file: str) -> None:
    """Raise TraceError naming the first of ``required`` not among the frame's columns."""
    for name in required:
        if name not in frame.columns:
            raise TraceError(
                f"{file}: missing column {name!r}; expected columns: {', '.join(required)} "
                f"(found: {', '.join(map(str, frame.columns))})"
            )


def _parse_json_line(line: str, file: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{file}: line {number}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceError(f"{file}: line {number}: JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise TraceError(f"{file}: line {number}: expected a JSON object, got {line.strip()[:40]}")
    return record


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
