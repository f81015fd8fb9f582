"""Scheduling policies, one module each, registered by name; importing the package imports
them all (:func:`discover`)."""

from __future__ import annotations

import importlib
import pkgutil

from sched_lab.core.scheduler import get_policy, policy_names, register_policy

__all__ = ["BROKEN", "discover", "get_policy", "policy_names", "register_policy"]

#: module file -> why it could not be imported (one line), e.g. a syntax error in a new
#: policy file; the config refuses to run while any is listed (lab/config.py).
BROKEN: dict[str, str] = {}


def discover() -> list[str]:
    """Import every module here in name order; one that fails is recorded in :data:`BROKEN`
    and the others go on. Returns the module names."""
    found = sorted((m.name, m.module_finder.path) for m in pkgutil.iter_modules(__path__))
    for name, folder in found:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported as a user error
            BROKEN[f"{folder}/{name}.py"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return [name for name, _ in found]


discover()
