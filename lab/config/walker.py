"""The walker: one check per YAML value, declared next to the field it checks.

A section is a frozen dataclass of :func:`option` fields; :func:`walk` refuses unknown keys,
fills defaults and runs each check in field order. A check returns the value to store or
raises a one-line ConfigError ``{where}: {key path}: expected {what}, got {value}``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sched_lab.config import paths
from sched_lab.core.errors import ConfigError, did_you_mean, short_repr


@dataclass(frozen=True)
class Context:
    """``where`` (prefixes messages), ``base_dir`` (resolves relative paths) and ``reads``
    (what the chosen backend reads: :data:`sched_lab.config.backends.BACKENDS`)."""

    where: str
    base_dir: Path
    reads: frozenset[str] = frozenset()

    def fail(self, key: str, expected: str, value: Any) -> ConfigError:
        return fail(self.where, key, expected, value)


Check = Callable[[Context, str, Any], Any]  # (context, key path, value) -> value to store


# ---------------------------------------------------------------------------- primitives
def fail(where: str, key: str, expected: str, value: Any) -> ConfigError:
    """The one-line error of a value that is not what ``key`` expects."""
    return ConfigError(f"{where}: {key}: expected {expected}, got {short_repr(value)}")


def check_int(
    where: str, key: str, v: Any, lo: int = 1, optional: bool = False, hi: int | None = None
) -> Any:
    """An integer >= ``lo`` and, when ``hi`` is given, <= ``hi`` (not a bool), or None when
    ``optional``; returned as it is."""
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        what = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi:,}]"
        raise fail(where, key, what + (" or null" if optional else ""), v)
    return v


def check_num(
    where: str,
    key: str,
    v: Any,
    lo: float = 0.0,
    hi: float = math.inf,
    lo_open: bool = False,
    optional: bool = False,
) -> Any:
    """A finite number in the range, returned as written (an int stays an int)."""
    if v is None and optional:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        if math.isinf(hi):
            rng = f"a finite number {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"a number in {'(' if lo_open else '['}{lo}, {hi}]"
        raise fail(where, key, rng + (" or null" if optional else ""), v)
    return v


def check_choice(where: str, key: str, v: Any, choices: Collection[str]) -> str:
    """One of ``choices`` (the message lists them sorted)."""
    if not isinstance(v, str) or v not in choices:
        e = fail(where, key, "one of " + ", ".join(sorted(choices)), v)
        raise ConfigError(f"{e}{did_you_mean(v, choices, quote=True)}")
    return v


def check_bool(where: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise fail(where, key, "true or false", v)
    return v


def check_mapping(where: str, key: str, v: Any, allowed: Collection[str]) -> Mapping:
    """A mapping whose keys are all in ``allowed`` (the message lists them in order)."""
    if not isinstance(v, Mapping):
        raise fail(where, key, "a mapping", v)
    for k in v:
        if k not in allowed:
            shown = k if isinstance(k, str) and len(k) <= 80 else short_repr(k)
            raise ConfigError(
                f"{where}: unknown key {key + '.' if key else ''}{shown}"
                f"{did_you_mean(k, allowed)}; allowed: {', '.join(allowed)}"
            )
    return v


def existing(ctx: Context, key: str, value: str, kind: str, hint: str = "") -> Path:
    """``value`` resolved (:mod:`sched_lab.config.paths`); ConfigError if no ``kind`` ("file",
    "directory") exists there."""
    path = paths.resolve(value, ctx.base_dir)
    if not (path.is_file() if kind == "file" else path.is_dir()):
        raise ConfigError(
            f"{ctx.where}: {key}: {short_repr(value)}: no such {kind} (looked for "
            f"{paths.looked_in(value, ctx.base_dir)}){hint}"
        )
    return path


# ---------------------------------------------------------------------------- field specs
def option(default: Any, check: Check | None = None) -> Any:
    """A section field: its default and the check of its YAML value (None: taken as is)."""
    return field(default=default, metadata={"check": check})


def is_int(lo: int = 1, optional: bool = False, hi: int | None = None) -> Check:
    return lambda ctx, key, v: check_int(ctx.where, key, v, lo, optional, hi)


def is_num(
    lo: float = 0.0, hi: float = math.inf, lo_open: bool = False, optional: bool = False
) -> Check:
    return lambda ctx, key, v: check_num(ctx.where, key, v, lo, hi, lo_open, optional)


def is_choice(choices: Collection[str], optional: bool = False) -> Check:
    def check(ctx: Context, key: str, v: Any) -> Any:
        return v if v is None and optional else check_choice(ctx.where, key, v, choices)

    return check


def is_bool(ctx: Context, key: str, v: Any) -> bool:
    return check_bool(ctx.where, key, v)


# ---------------------------------------------------------------------------- the walk
def fill(where: str, key: str, raw: Any, cls: type) -> dict[str, Any]:
    """A section's mapping checked for unknown keys, over the dataclass's defaults."""
    fields = dataclasses.fields(cls)
    check_mapping(where, key, raw, tuple(f.name for f in fields))
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    return {**defaults, **raw}


def walk(
    ctx: Context,
    key: str,
    raw: Any,
    cls: type,
    defaults: Mapping[str, Any] | None = None,
    checked: bool = True,
) -> dict[str, Any]:
    """The values of section ``cls`` at ``key``: ``raw`` over ``defaults`` (else the
    fields' own), each checked in field order unless ``checked`` is false.

    Raises:
        ConfigError: an unknown key, or the first value its check refuses.
    """
    values = fill(ctx.where, key, raw, cls)
    values.update({k: v for k, v in (defaults or {}).items() if k not in raw})
    if checked:
        for f in dataclasses.fields(cls):
            check = f.metadata.get("check")
            if check is not None:
                values[f.name] = check(ctx, f"{key}.{f.name}", values[f.name])
    return values
