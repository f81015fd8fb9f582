"""Longest cached prefix first, with an aging bound; otherwise as fcfs.

SGLang's "lpm" policy (Zheng et al., "SGLang: Efficient Execution of Structured Language
Model Programs", NeurIPS'24, §3): waiting requests ordered by prompt tokens found in the
prefix cache, longest first. Requests that waited ``max_wait_s`` go first (FCFS); only the
first ``max_sort`` waiting requests are sorted, the rest follow in FCFS order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sched_lab.core.request import Request
from sched_lab.core.scheduler import register_policy
from sched_lab.policies.fcfs import FCFS


@register_policy("prefix_aware")
class PrefixAware(FCFS):
    options = {"max_wait_s": 10.0, "max_sort": 128}
    max_wait_s: float
    max_sort: int

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        wait, n = options.get("max_wait_s", 0.0), options.get("max_sort", 1)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            return f"max_wait_s: expected seconds >= 0, got {wait!r:.40}"
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"max_sort: expected an integer >= 1, got {n!r:.40}"
        return None

    def admission_order(self) -> Iterable[Request]:
        bm, waiting = self.block_manager, self.waiting
        if not bm.enable_prefix_caching or len(waiting) < 2:
            return waiting
        head = [r for _, r in zip(range(self.max_sort), waiting)]
        aged = [r for r in head if self.now_s - r.arrival_s >= self.max_wait_s]
        fresh = [r for r in head if self.now_s - r.arrival_s < self.max_wait_s]
        # Longest match first; a stable sort keeps FCFS order among equal matches.
        fresh.sort(key=lambda r: -len(bm.lookup(r)))
        return [*aged, *fresh, *list(waiting)[len(head) :]]
