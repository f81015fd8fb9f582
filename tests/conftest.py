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
