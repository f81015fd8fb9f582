"""Scheduling policies, one file each, registered by name (see lab/core/scheduler.py)."""

from policies import chunked_prefill, fcfs, swap  # noqa: F401  (registration)
