"""The trace-format registry: ``format:`` string -> loader, registered where it is defined."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sched_lab.core.errors import TraceError
from sched_lab.core.registry import Registry
from sched_lab.traces.spec import WHERE
from sched_lab.traces.table import TraceTable

# (spec, base_dir, seed) -> the format's requests on its own clock, before the common options.
Loader = Callable[[Mapping[str, Any], Path, int], TraceTable]


@dataclass(frozen=True)
class TraceFormat:
    """Args: keys: spec keys this format reads, beyond the common ones (``path`` included)."""

    name: str
    load: Loader
    keys: tuple[str, ...]


FORMATS: Registry[TraceFormat] = Registry(
    "format", "known formats", error=TraceError, where=f"{WHERE}.format"
)


def register_format(name: str, keys: tuple[str, ...] = ()) -> Callable[[Loader], Loader]:
    """Decorator registering a loader under ``name``; a name can be registered once."""

    def decorator(load: Loader) -> Loader:
        FORMATS.add(name, TraceFormat(name, load, keys))
        return load

    return decorator


def get_format(name: Any) -> TraceFormat:
    """The registered format ``name``, or TraceError listing the known ones."""
    return FORMATS.get(name)
