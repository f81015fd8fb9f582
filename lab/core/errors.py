"""Errors the lab reports to a user as one line (no traceback).

Every user mistake (bad YAML, malformed trace, unknown policy, impossible limits) raises a
subclass of :class:`UserError` whose message names the file, row or key path and what was
expected. ``run_experiment.py`` prints ``error: <message>`` and exits with status 2.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the message is shown as one line."""


class ConfigError(UserError):
    """An experiment YAML (or a key in it) is invalid."""


class TraceError(UserError):
    """A trace file is missing, empty or malformed."""


class SchedulerStuckError(RuntimeError):
    """The replay cannot go on: no progress while work was pending, a request thrashing, or
    a policy hook breaking a rule (a bug in a policy, never silent)."""
