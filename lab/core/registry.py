"""A typed, string-keyed registry: policies, routers, trace formats, attention backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from sched_lab.core.errors import ConfigError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> ``T``.

    Args:
        kind: what is registered, for messages (``"policy"``: "unknown policy 'x'").
        known: the label of the known names in the lookup error (``"known policies"``).
        error: the exception class a lookup of an unknown name raises.
        where: a key path put before the lookup error (``"trace.format"``), or empty.
        sort: list names sorted (True) or in registration order.
    """

    def __init__(
        self,
        kind: str,
        known: str,
        *,
        error: type[Exception] = ConfigError,
        where: str = "",
        sort: bool = True,
    ) -> None:
        self.kind, self.known, self.error, self.where, self.sort = kind, known, error, where, sort
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        """Register ``item`` as ``name`` and return it; ValueError if already registered."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered by {self._items[name]}")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""
        return lambda item: self.add(name, item)

    def get(self, name: object) -> T:
        """The item registered as ``name``; raises ``error`` listing the known names if none."""
        if isinstance(name, str) and name in self._items:
            return self._items[name]
        where = f"{self.where}: " if self.where else ""
        raise self.error(
            f"{where}unknown {self.kind} {name!r}{did_you_mean(name, self._items, quote=True)}; "
            f"{self.known}: "
            f"{', '.join(self.names()) or '(none registered)'}"
        )

    def names(self) -> list[str]:
        return sorted(self._items) if self.sort else list(self._items)

    def pop(self, name: str, default: T | None = None) -> T | None:
        """Unregister ``name`` and return it (for tests)."""
        return self._items.pop(name, default)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
