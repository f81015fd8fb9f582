"""Errors the lab reports to a user as one line (no traceback): a :class:`UserError`
subclass whose message names the file, row or key path and what was expected."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

MAX_SHOWN_CHARS = 80  # a value quoted in an error message is cut to this

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 2, 4, 6, 6
_REPR.maxstring = _REPR.maxother = MAX_SHOWN_CHARS


def short_repr(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, without building a huge repr."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class UserError(Exception):
    """A mistake in the user's input; the message is shown as one line."""


class ConfigError(UserError):
    """An experiment YAML (or a key in it) is invalid."""


class TraceError(UserError):
    """A trace file is missing, empty or malformed."""


class SchedulerStuckError(RuntimeError):
    """The replay cannot go on: no progress, a request thrashing, or a hook breaking a rule."""


class DeadlockError(SchedulerStuckError):
    """Work remains and nothing can advance it: a plan that feeds no token with no step in
    flight to free anything, or no event left while requests are unfinished."""


def did_you_mean(name: object, choices: Iterable[str], quote: bool = False) -> str:
    """`` (did you mean X?)`` for the closest choice (difflib ratio >= 0.75), else ``""``."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quote else f" (did you mean {close[0]}?)"
