"""Scheduling policies, one module each, registered by name (``@register_policy``).

Importing this package imports every module in it (:func:`discover`), so a new file here is
a new policy with no other change; :func:`get_policy` and :func:`policy_names` then see it.
"""

from __future__ import annotations

import importlib
import pkgutil

from lab.core.scheduler import get_policy, policy_names, register_policy

__all__ = ["BROKEN", "discover", "get_policy", "policy_names", "register_policy"]

#: module file -> why it could not be imported (one line), e.g. a syntax error in a new
#: policy file; the config refuses to run while any is listed (lab/config.py).
BROKEN: dict[str, str] = {}


def discover() -> list[str]:
    """Import every module of this package (in name order; importing one twice is a no-op).
    A module that fails to import (any exception, a duplicate name included) is recorded in
    :data:`BROKEN` instead of stopping the import of the others. Returns the module names."""
    found = sorted((m.name, m.module_finder.path) for m in pkgutil.iter_modules(__path__))
    for name, folder in found:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported as a user error
            BROKEN[f"{folder}/{name}.py"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return [name for name, _ in found]


discover()
