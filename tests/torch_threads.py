"""Torch threads of the engine tests: ``OMP_NUM_THREADS`` if set, else 1.

Small CPU steps gain little from more threads and lose much when the machine is loaded (the
tests' CPU steps are tiny), so the tests run one intra-op thread unless told otherwise.
Setting ``OMP_NUM_THREADS`` here also makes every ModelRunner leave the setting alone
(backend/runner.py) and reaches subprocesses. Import before building a runner.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    THREADS = max(1, int(os.environ["OMP_NUM_THREADS"]))
except ValueError:
    THREADS = 1
torch.set_num_threads(THREADS)
