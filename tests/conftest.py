"""Shared pytest setup: the repository root on sys.path, torch threads (tests/torch_threads.py)
when torch is installed, and the ``gpu`` marker."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
