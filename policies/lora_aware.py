"""LoRA-aware admission: requests whose adapter is already in use or on the GPU first, with
an aging bound; otherwise as fcfs.

Admission order (lab/core/lora.py has the slot rules): requests that waited ``max_wait_s``
first, in FCFS order; then the base model's and those of an adapter a running or swapped
request uses (no new slot, no load); then those of an adapter resident on the GPU (a slot,
no load); then the rest grouped by adapter, the largest group first (ties: the group of the
longest-waiting request), so one load serves the most requests (the idea of S-LoRA's and
Punica's adapter-grouped batching). Ties keep arrival order. Only the first ``max_sort``
waiting requests are ordered so; the rest follow in FCFS order.

Aging: while the oldest aged request's adapter finds no slot, the adapter in use by the
fewest running requests is admitted no new requests (but aged ones ahead of it), so its slot
frees for it while the others and the base model go on: an aged request waits for one
adapter's running requests to finish, never for a lull in the traffic of the popular
adapters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from itertools import islice
from typing import Any

from sched_lab.core.request import Request
from sched_lab.core.scheduler import bad_number, register_policy
from sched_lab.policies.fcfs import FCFS


@register_policy("lora_aware")
class LoRAAware(FCFS):
    options = {"max_wait_s": 10.0, "max_sort": 128}
    max_wait_s: float
    max_sort: int

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        n = options.get("max_sort", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"max_sort: expected an integer >= 1, got {n!r:.40}"
        return bad_number(options, "max_wait_s")

    def admission_order(self) -> list[Request]:
        waiting, lora = self.waiting, self.lora
        if lora is None or len(waiting) < 2:
            return list(waiting)
        running = [q.lora_name for q in (*self.running, *self.swapped) if q.lora_name]
        pinned = set(running)
        aged, in_use, resident = [], [], []
        groups: dict[str, list[Request]] = {}  # adapter -> its requests, first seen first
        oldest = self.now_s - self.max_wait_s  # arrived at or before: aged
        for r in islice(waiting, self.max_sort):
            name = r.lora_name
            if r.arrival_s <= oldest:
                aged.append(r)
            elif not name or name in pinned:
                in_use.append(r)
            elif name in lora.gpu:
                resident.append(r)
            else:
                groups.setdefault(name, []).append(r)
        # largest group first; sorted() is stable, so equal sizes keep first-seen order
        rest = [r for g in sorted(groups.values(), key=len, reverse=True) for r in g]
        order = [*aged, *in_use, *resident, *rest, *islice(waiting, self.max_sort, None)]
        blocked = next((r for r in aged if not lora.fits(r.lora_name, pinned)), None)
        if blocked is None:
            return order
        # The oldest aged request finds no slot: the adapter with the fewest running
        # requests gets no new ones, so its slot frees for it.
        counts = Counter(running)
        drain = min(pinned, key=lambda a: (counts[a], a))
        cut = order.index(blocked) + 1  # FCFS among aged: none behind it takes the slot
        return [*order[:cut], *(r for r in order[cut:] if r.lora_name != drain)]
