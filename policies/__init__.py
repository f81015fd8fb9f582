"""Scheduling policies, one module each, registered by name (``@register_policy``).

Importing this package imports every module in it (:func:`discover`), so a new file here is
a new policy with no other change; :func:`get_policy` and :func:`policy_names` then see it.
"""

from __future__ import annotations

import importlib
import pkgutil

from lab.core.scheduler import get_policy, policy_names, register_policy

__all__ = ["discover", "get_policy", "policy_names", "register_policy"]


def discover() -> list[str]:
    """Import every module of this package (in name order; importing one twice is a no-op).
    Returns the module names."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__))
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names


discover()
