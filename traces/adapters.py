"""Which LoRA adapter a request runs with, for traces that name none (``lora.assign``).

Each request without a ``lora_name`` of its own draws from ``random.Random(f"{seed}:lora:
{request_id}")``: first whether it stays on the base model (probability ``base_share``), then
its adapter among ``names``: ``uniform``, or ``zipf`` with P(names[i]) proportional to
1 / (i + 1) ** alpha (names[0] the most popular). A draw depends only on the seed and the
request's id, so it is the same at every load, for every policy, and assigning twice
changes nothing.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from sched_lab.core.request import Request

RULES = ("none", "uniform", "zipf")


def assign_adapters(
    requests: Sequence[Request],
    names: Sequence[str],
    rule: str,
    seed: int,
    zipf_alpha: float = 1.0,
    base_share: float = 0.0,
) -> None:
    """Set ``lora_name`` of the requests that have none by ``rule`` (mutates them)."""
    if rule == "none" or not names:
        return
    if rule not in RULES:
        raise ValueError(f"lora.assign: expected one of {', '.join(RULES)}, got {rule!r}")
    alpha = zipf_alpha if rule == "zipf" else 0.0
    cumulative = list(accumulate(1.0 / (i + 1) ** alpha for i in range(len(names))))
    total = cumulative[-1]
    for r in requests:
        if r.lora_name:
            continue
        rng = random.Random(f"{seed}:lora:{r.request_id}")
        if rng.random() < base_share:
            continue  # stays on the base model
        i = bisect_right(cumulative, rng.random() * total)
        r.lora_name = names[min(i, len(names) - 1)]
