"""Typed access to the ``trace:`` block: each getter raises a one-line TraceError naming the
key path (``trace.limit``) and what was expected."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sched_lab.core.errors import TraceError, did_you_mean, short_repr

# Key path of the trace block in an experiment YAML, the prefix of every spec message.
WHERE = "trace"

_MISSING = object()


def check_mapping(value: Any, where: str) -> Mapping[str, Any]:
    """Return ``value`` if it is a mapping with string keys, else raise TraceError."""
    if not isinstance(value, Mapping):
        raise TraceError(f"{where}: expected a mapping, got {_show(value)}")
    return value


def check_keys(spec: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Reject any key of ``spec`` not in ``allowed`` (typos would otherwise be ignored)."""
    allowed = sorted(set(allowed))
    for key in spec:
        if key not in allowed:
            hint = did_you_mean(key, allowed, quote=True)
            raise TraceError(
                f"{where}: unknown key {key!r}{hint}; allowed keys: {', '.join(allowed)}"
            )


def get_int(
    spec: Mapping[str, Any],
    key: str,
    where: str,
    *,
    default: Any = _MISSING,
    minimum: int,
) -> int:
    """An integer >= ``minimum`` (bools are not integers here); ``default`` if absent."""
    if key not in spec and default is not _MISSING:
        return default
    value = require(spec, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}.{key}: expected an integer >= {minimum}, got {_show(value)}")
    return value


def get_float(
    spec: Mapping[str, Any],
    key: str,
    where: str,
    *,
    default: Any = _MISSING,
    minimum: float = 0.0,
    strict: bool = False,
    allow_inf: bool = False,
) -> float:
    """A real number >= ``minimum`` (> when ``strict``); ``inf`` only if allowed; ``default``
    (unchecked) when absent."""
    if key not in spec and default is not _MISSING:
        return default
    value = require(spec, key, where)
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    if not allow_inf:
        bound += " (finite)"
    number = (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    )
    ok = number is not None and not math.isnan(number) and (allow_inf or math.isfinite(number))
    if not ok or not (number > minimum if strict else number >= minimum):
        raise TraceError(f"{where}.{key}: expected a number {bound}, got {_show(value)}")
    return number


def get_choice(
    spec: Mapping[str, Any],
    key: str,
    where: str,
    choices: Iterable[str],
    *,
    default: Any,
) -> str:
    """One of ``choices`` (a string)."""
    choices = list(choices)
    value = spec.get(key, default)
    if value not in choices:
        raise TraceError(
            f"{where}.{key}: expected one of {', '.join(choices)}; got {_show(value)}"
            f"{did_you_mean(value, choices, quote=True)}"
        )
    return value


def get_str_list(spec: Mapping[str, Any], key: str, where: str) -> list[str] | None:
    """A non-empty list of strings, or None when the key is absent."""
    if key not in spec:
        return None
    value = spec[key]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise TraceError(f"{where}.{key}: expected a non-empty list of strings, got {_show(value)}")
    return value


def resolve_path(spec: Mapping[str, Any], base_dir: Path, where: str) -> Path:
    """The trace file: ``path`` relative to ``base_dir`` unless absolute; TraceError if the
    key is missing, not a string, or no file exists there."""
    value = require(spec, "path", where)
    if not isinstance(value, str) or not value:
        raise TraceError(f"{where}.path: expected a file path (string), got {_show(value)}")
    path = Path(value)
    if not path.is_absolute():
        path = Path(base_dir) / path
    if not path.is_file():
        what = (
            "is a directory"
            if path.is_dir()
            else "is not a regular file (a FIFO or device would block or never end)"
            if path.exists()
            else "not found"
        )
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        if what == "not found":
            raise TraceError(f"trace file not found: {path} ({where}.path = {shown})")
        raise TraceError(f"trace file {path} {what}, expected a file ({where}.path = {shown})")
    return path


def require(spec: Mapping[str, Any], key: str, where: str) -> Any:
    """The value of a required key, or TraceError naming it."""
    if key not in spec:
        raise TraceError(f"{where}: missing required key {key!r}")
    return spec[key]


def _show(value: Any) -> str:
    """``'ten' (str)``: the value (cut to ~80 characters) and its YAML type."""
    return f"{short_repr(value)} ({type(value).__name__})"
