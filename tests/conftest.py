"""Shared pytest setup: the repository root on sys.path (run_experiment.py, benchmarks/), a
guard against importing the lab's folders by their folder names, torch threads
(tests/torch_threads.py) when torch is installed, and the ``gpu`` marker."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class FolderNameGuard:
    """The lab imports as ``sched_lab`` only (``sched_lab.policies``, ...). With the root on
    sys.path ``import lab`` or ``import policies`` would load a second copy of a folder under
    its folder name: a missed rename that works here and fails in an installed copy. Refused."""

    FOLDERS = ("lab", "policies", "backend", "traces", "experiments", "profiles")

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in cls.FOLDERS:
            return None
        for finder in sys.meta_path:
            spec = None if finder is cls else finder.find_spec(name, path, target)
            if spec is not None:
                break
        places = spec.submodule_search_locations if spec is not None else None
        if places and any((Path(p).parent / "lab" / "core").is_dir() for p in places):
            raise ImportError(f"import {name}: the lab's folders import as sched_lab.*")
        return None


sys.meta_path.insert(0, FolderNameGuard)

if importlib.util.find_spec("torch") is not None:
    import torch_threads  # noqa: F401  (one torch thread unless OMP_NUM_THREADS says otherwise)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when none is available")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Refuse a test file that registers a policy when it is imported: files that parametrize
    over the registry would then collect a different set of tests in a different file order
    (tests/helpers.py bundled_policy_names; register inside a test or fixture instead)."""
    if "sched_lab.core.scheduler" not in sys.modules:
        return
    from sched_lab.core.scheduler import get_policy, policy_names

    extra = [
        n for n in policy_names() if not get_policy(n).__module__.startswith("sched_lab.policies.")
    ]
    if extra:
        raise pytest.UsageError(
            f"policies registered while the tests were collected: {', '.join(extra)} "
            "(register them inside a test or fixture, not at import)"
        )
