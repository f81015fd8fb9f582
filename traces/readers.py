"""Read trace files into pandas frames (every parse failure one TraceError line), and the
lab's one YAML reader (:func:`load_yaml_file`, :func:`parse_yaml`; rules above ``_Loader``).
Cells stay as found (CSV text, JSON values) so errors quote them; ``validate.py`` converts."""

from __future__ import annotations

import codecs
import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from sched_lab.core.errors import MAX_SHOWN_CHARS, ConfigError, TraceError, UserError, short_repr


def read_csv(path: Path, required: Sequence[str]) -> pd.DataFrame:
    """All columns as stripped-header strings (empty or absent cell -> ``""``).

    Raises:
        TraceError: not a text file, empty, unparsable CSV, or a ``required`` column missing.
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
    """One JSON object per line (blank lines skipped, other keys ignored).

    Returns:
        A frame with one object column per required and optional key (None where absent)
        and each row's 1-based file line.

    Raises:
        TraceError: not a text file, empty, a line that is not a JSON object or lacks a
            ``required`` key.
    """
    check_text(path, "JSONL")
    keys = [*required, *optional]
    records: list[dict] = []
    line_numbers: list[int] = []
    name = path.name
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                record = _parse_json_line(line, name, number)
                for key in required:
                    if key not in record:
                        raise TraceError(
                            f"{name}: line {number}: missing key {key!r}; "
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
    """TraceError ``<file>: not a text <kind> file (...)`` unless the first 64 KiB are UTF-8."""
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


class _LongInt(ValueError):
    """A JSON integer of more than :data:`MAX_INT_DIGITS` digits (its literal is the arg)."""


def _json_int(text: str) -> int:
    if _int_digits(text) > MAX_INT_DIGITS:
        raise _LongInt(text)
    return int(text)


def _parse_json_line(line: str, file: str, number: int) -> dict:
    try:
        # Only a line with a run of more than MAX_INT_DIGITS digits can hold a too-long
        # integer; the others skip the per-integer check (and the decoder made per call).
        if _DIGIT_RUN.search(line) is None:
            record = json.loads(line)
        else:
            record = json.loads(line, parse_int=_json_int)
    except _LongInt as exc:
        raise TraceError(f"{file}: line {number}: {_too_long(exc.args[0])}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{file}: line {number}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # deeper than the interpreter's stack allows: over MAX_DEPTH too
        raise TraceError(f"{file}: line {number}: {_TOO_DEEP}") from None
    if not isinstance(record, dict):
        raise TraceError(f"{file}: line {number}: expected a JSON object, got {line.strip()[:40]}")
    # Only a line with more than MAX_DEPTH opening brackets (and as many closing) can nest
    # deeper than MAX_DEPTH.
    if (
        len(line) > 2 * MAX_DEPTH
        and line.count("[") + line.count("{") > MAX_DEPTH
        and _nests_deeper(record, MAX_DEPTH)
    ):
        raise TraceError(f"{file}: line {number}: {_TOO_DEEP}")
    return record


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether the parsed JSON ``value`` holds objects or arrays more than ``limit`` levels
    deep (the value itself is level 1)."""
    level = [value]
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)
                 if isinstance(c, (dict, list))]  # fmt: skip
        if not level:
            return False
    return True


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------- YAML
# Plain ``yaml.safe_load`` reads YAML 1.1, whose implicit types surprise: ``0100`` is 64,
# ``1:30`` is 90, ``no`` is False, ``2024-01-01`` is a date, ``1e9`` is a string, and an
# alias bomb (anchors referring to anchors) expands to gigabytes from a few hundred bytes.
# This loader reads plain scalars as YAML 1.2's core schema does, and refuses what would be
# read differently by the two versions:
#
# - ``true``/``false`` (any case style) are booleans; ``yes``, ``no``, ``on``, ``off`` are
#   plain strings (a key that wants a boolean then says "expected true or false");
# - integers: ``123``, ``-5``, ``0x1f``, ``0o17``; a decimal with a leading zero (``0100``:
#   octal 64 in YAML 1.1) is refused;
# - floats: ``1.5``, ``.5``, ``1e9``, ``1.0e-9``, ``.inf``, ``-.inf``, ``.nan``;
# - base-60 numbers (``1:30``, 90 in YAML 1.1) are refused;
# - ``null``, ``~`` and an empty value are None; dates stay strings;
# - anchors (``&a``) and aliases (``*a``) are refused (so ``<<`` merges nothing); so are a key given twice
#   in one mapping (plain YAML keeps the last silently), a key that is a list or mapping,
#   and nesting deeper than :data:`MAX_DEPTH`;
# - Python tags (``!!python/...``) are refused, as by ``yaml.SafeLoader``.
#
# Quote a value (``'0100'``, ``"1:30"``) to keep it a string. Every refusal is one line
# naming the file, the line, the key path and what was expected; values shown in messages
# are cut by :func:`sched_lab.core.errors.short_repr`.
MAX_DEPTH = 64  # levels of nesting; an experiment YAML needs 4
MAX_INT_DIGITS = 100  # digits of an integer in a YAML or JSON trace file; a seed needs 20
_DIGIT_RUN = re.compile(rf"[0-9]{{{MAX_INT_DIGITS + 1}}}")  # a run longer than that
_TOO_DEEP = f"JSON nested more than {MAX_DEPTH} levels deep"

_AMBIGUOUS = "tag:sched-lab,2026:ambiguous"
_INT_TAG = "tag:yaml.org,2002:int"
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_OCTAL_LOOKING = re.compile(r"^[-+]?0[0-9_]+$")
_BASE_60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class _Loader(yaml.SafeLoader):
    """A SafeLoader with YAML 1.2 core-schema scalars and the refusals listed above."""

    yaml_implicit_resolvers: dict = {}  # filled below, instead of SafeLoader's YAML 1.1 set

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.key_path: list[str] = []

    def compose_node(self, parent, index):
        pushed = isinstance(index, (yaml.ScalarNode, int))
        if pushed:
            self.key_path.append(index.value if isinstance(index, yaml.Node) else f"[{index}]")
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise self.refusal(
                event.start_mark, "anchors and aliases (&, *) are not accepted; write the value out"
            )
        if len(self.key_path) > MAX_DEPTH:
            raise self.refusal(event.start_mark, f"nested more than {MAX_DEPTH} levels deep")
        node = super().compose_node(parent, index)
        if node.tag == _AMBIGUOUS:
            raise self.refusal(node.start_mark, _ambiguity(node.value))
        if node.tag == _INT_TAG and _int_digits(node.value) > MAX_INT_DIGITS:
            raise self.refusal(node.start_mark, _too_long(node.value))
        if isinstance(node, yaml.MappingNode):
            self.check_keys(node)
        if pushed:
            self.key_path.pop()
        return node

    def check_keys(self, node: yaml.MappingNode) -> None:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.refusal(
                    key_node.start_mark,
                    "a mapping key must be a plain value, not a list or mapping",
                )
            if key_node.value in seen:
                self.key_path.append(key_node.value)
                raise self.refusal(
                    key_node.start_mark,
                    f"key {short_repr(key_node.value)} "
                    "appears twice in one mapping (the first value would be lost)",
                )
            seen.add(key_node.value)

    def refusal(self, mark, message: str) -> yaml.MarkedYAMLError:
        where = ".".join(self.key_path).replace(".[", "[")
        if len(where) > MAX_SHOWN_CHARS:
            where = where[: MAX_SHOWN_CHARS - 3] + "..."
        return yaml.constructor.ConstructorError(
            None, None, f"{where}: {message}" if where else message, mark
        )


def _ambiguity(value: str) -> str:
    if ":" in value:
        return (
            f"{short_repr(value)} is a base-60 number in YAML 1.1 and a string in "
            "YAML 1.2; write the number in one unit, or quote the string"
        )
    return (
        f"{short_repr(value)} is an octal number in YAML 1.1 and a decimal one in "
        "YAML 1.2; write it without the leading zero, or quote it"
    )


def _int_digits(text: str) -> int:
    """The number of decimal digits of the integer literal ``text`` (0x, 0o: about as many as
    its value has), without converting it."""
    body = text.lstrip("+-")
    if body[:2] in ("0x", "0o"):
        bits_per_digit = 4 if body[1] == "x" else 3
        return int(len(body[2:].lstrip("0")) * bits_per_digit * 0.30103) + 1
    return len(body.lstrip("0")) or 1


def _too_long(text: str) -> str:
    return (
        f"an integer of {_int_digits(text):,} digits ({text[:12]}...); at most "
        f"{MAX_INT_DIGITS} are accepted"
    )


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    v = node.value
    if v.startswith("0o"):
        return int(v[2:], 8)
    return int(v, 16) if v.startswith("0x") else int(v)


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    v = node.value.lower()
    if v.endswith(".inf"):
        return float("-inf") if v.startswith("-") else float("inf")
    return float("nan") if v == ".nan" else float(v)


for _tag, _regexp, _first in (
    ("tag:yaml.org,2002:bool", _BOOL, "tTfF"),
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    (_AMBIGUOUS, _OCTAL_LOOKING, "-+0"),
    (_AMBIGUOUS, _BASE_60, "-+0123456789"),
    (_INT_TAG, _INT, "-+0123456789"),
    ("tag:yaml.org,2002:float", _FLOAT, "-+.0123456789"),
):
    _Loader.add_implicit_resolver(_tag, _regexp, list(_first))
_Loader.add_constructor(_INT_TAG, _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def parse_yaml(text: str) -> Any:
    """Parse YAML text with this module's rules.

    Raises:
        yaml.YAMLError: with a ``problem_mark`` (line) and a ``problem`` naming the key path.
    """
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_yaml_file(
    path: str | Path, what: str = "an experiment YAML", error: type[UserError] = ConfigError
) -> Any:
    """Read and parse a YAML file.

    Args:
        what: what the file should be, for messages ("a prompts file").
        error: the UserError subclass raised.

    Raises:
        ``error``: naming ``path``: not a regular file, missing, unreadable, not UTF-8, or
            not valid YAML (with line and key path).
    """
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO would block
        raise error(f"{path}: not a regular file, expected {what} file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected {what} file") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return parse_yaml(text)
    except RecursionError:
        raise error(f"{path}: nested too deeply to be {what}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = (getattr(e, "problem", None) or str(e)).splitlines()[0][:300]
        raise error(f"{path}:{line} is not valid YAML ({problem})") from None
