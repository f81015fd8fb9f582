"""Errors the lab reports to a user as one line (no traceback): a :class:`UserError`
subclass whose message names the file, row or key path and what was expected."""

from __future__ import annotations

import argparse
import difflib
import reprlib
import sys
from collections.abc import Iterable
from typing import Any

MAX_SHOWN_CHARS = 80  # a value quoted in an error message is cut to this
MAX_MESSAGE_CHARS = 1000  # a whole error message is cut to this (it is one line of stderr)
_MAX_INT_BITS = 1024  # an integer above 2**1024 is shown by its size, not its digits

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 2, 4, 6, 6
_REPR.maxstring = _REPR.maxother = MAX_SHOWN_CHARS


def short_repr(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, without building a huge repr (an
    integer too large to print in full is shown by its number of digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > _MAX_INT_BITS:
            return f"<an integer of {int(value.bit_length() * 0.30103) + 1:,} digits>"
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` on one line (line breaks become spaces), cut to ``limit`` characters."""
    text = " ".join(message.splitlines())
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40:,} characters cut)"


class UserError(Exception):
    """A mistake in the user's input; the message (``str()``) is one line of at most
    :data:`MAX_MESSAGE_CHARS` characters, however long the text it was made with."""

    def __str__(self) -> str:
        return one_line(super().__str__())


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


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose command-line mistakes are one line too, ``error: ... (see
    --help)`` and exit status 2 (argparse prints its usage first)."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)
