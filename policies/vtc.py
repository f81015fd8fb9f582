"""Virtual Token Counter: fair sharing between tenants (Sheng et al., "Fairness in Serving
Large Language Models", OSDI'24, §4); fcfs's step, prefill first.

A tenant's counter grows by ``input_weight`` per prompt token when a request of it is
admitted and ``output_weight`` per token it generates (accepted drafts included), divided by
its ``tenant_weights`` entry (default 1); the defaults are the paper's evaluation weights,
w_p = 1 and w_q = 2. Admission takes the earliest request of the backlogged tenant with the
smallest counter, charged at once; equal counters go to the tenant whose request waits
earliest in the queue, so tenant names never change a schedule. A tenant arriving with
nothing waiting is lifted to the smallest backlogged counter (none: the last tenant to
leave's); a rejected request lifts nothing. A recomputed request's prompt is charged once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

from sched_lab.core.plan import SchedulerOutput, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import bad_number, register_policy
from sched_lab.policies.fcfs import FCFS


@register_policy("vtc")
class VTC(FCFS):
    options = {"input_weight": 1.0, "output_weight": 2.0, "tenant_weights": {}}

    @classmethod
    def check_options(cls, options: Mapping[str, Any], tenants: frozenset[str]) -> str | None:
        w = options.get("tenant_weights", {})
        if not isinstance(w, Mapping):
            return f"tenant_weights: expected a mapping of tenant -> weight, got {w!r}"
        for t, v in w.items():
            if t not in tenants:
                known = ", ".join(sorted(tenants)) or "none (no trace class names a tenant)"
                return f"tenant_weights: unknown tenant {t!r}; the trace's tenants: {known}"
            if bad_number(w, t) or v == 0:
                return f"tenant_weights.{t}: expected a number > 0, got {v!r}"
        return bad_number(options, "input_weight") or bad_number(options, "output_weight")

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.counters: defaultdict[str, float] = defaultdict(float)
        self._queued: Counter[str] = Counter()  # waiting requests per tenant
        self._last_left = 0.0  # counter of the last tenant whose queue emptied

    def cost(self, r: Request, tokens: int, weight: float) -> float:
        return tokens * weight / self.tenant_weights.get(r.tenant, 1.0)

    def add(self, request: Request, now_s: float) -> bool:
        t = request.tenant
        joins = not self._queued[t]
        if joins:  # the counter lift, read before the request joins
            backlogged = [self.counters[u] for u, n in self._queued.items() if n]
            lift = min(backlogged) if backlogged else self._last_left
        if not super().add(request, now_s):
            return False
        if joins:
            self.counters[t] = max(self.counters[t], lift)
        self._queued[t] += 1
        return True

    def admission_order(self) -> Iterator[Request]:
        waiting = list(self.waiting)  # each tenant's requests in queue order, read lazily

        def of(t: str) -> Iterator[tuple[int, Request]]:
            return ((i, r) for i, r in enumerate(waiting) if r.tenant == t)

        queues = {t: of(t) for t, n in self._queued.items() if n}
        heads = {t: ir for t, q in queues.items() if (ir := next(q, None)) is not None}
        c = dict(self.counters)
        while heads:  # smallest counter; ties: the head waiting earliest (its queue position)
            t = min(heads, key=lambda u: (c.get(u, 0.0), heads[u][0]))
            r = heads[t][1]
            if r.num_preemptions == 0:
                c[t] = c.get(t, 0.0) + self.cost(r, r.prompt_len, self.input_weight)
            yield r
            nxt = next(queues[t], None)
            if nxt is None:
                del heads[t]
            else:
                heads[t] = nxt

    def schedule(self) -> SchedulerOutput:
        plan = super().schedule()
        before = self._queued.copy()
        for r in plan.prefills:  # whole prompts, all admitted in this plan, in order
            self._queued[r.tenant] -= 1
            if r.num_preemptions == 0:
                self.counters[r.tenant] += self.cost(r, r.prompt_len, self.input_weight)
            if before[r.tenant] and not self._queued[r.tenant]:  # the last to leave wins
                self._last_left = self.counters[r.tenant]
        for r, _ in plan.preempted:  # recompute victims are back in the queue
            self._queued[r.tenant] += r.status is RequestStatus.WAITING
        if plan.aborted:  # some left the queue for good: count again
            self._queued = Counter(r.tenant for r in self.waiting)
        return plan

    def update(self, plan: SchedulerOutput, result: StepResult, now_s: float) -> None:
        super().update(plan, result, now_s)
        for r in (*plan.sampled_prefills, *plan.decodes):  # every request sampled in the step
            self.counters[r.tenant] += self.cost(r, 1, self.output_weight)
        for r in plan.spec_decodes:  # speculative decoding: accepted drafts are output too
            self.counters[r.tenant] += self.cost(
                r, result.num_accepted.get(r, 0), self.output_weight
            )
