"""Asynchronous scheduling's in-flight state (rules: docs/ARCHITECTURE.md, "Scheduler rules")."""

from __future__ import annotations

from collections.abc import Mapping

from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.request import Request


class InFlight:
    """What the scheduler knows of the launched step whose results have not arrived.

    Attributes:
        plan: the last launched plan without results, or None (always in sync runs).
        finishing: ordered set of requests whose last token a launched step samples; they
            decode once more (wasted) and are never victims.
        held: recompute victims whose token of ``plan`` is unknown; not re-admitted until
            it is (wait reason ``token_in_flight``).
    """

    def __init__(self) -> None:
        self.plan: SchedulerOutput | None = None
        self.finishing: dict[Request, None] = {}
        self.held: set[Request] = set()
        self._decodes: set[Request] | None = None  # plan.decodes as a set, made on demand

    def launch(self, plan: SchedulerOutput) -> None:
        self.plan, self._decodes = plan, None

    def arrived(self, plan: SchedulerOutput) -> SchedulerOutput | None:
        """``plan``'s results arrived (``held`` released); returns the plan still in flight,
        or None."""
        self.held.clear()
        if self.plan is plan:
            self.plan = None
            return None
        return self.plan

    def samples(self, r: Request) -> bool:
        """Whether the plan in flight samples a token for ``r``."""
        plan = self.plan
        if plan is None:
            return False
        if self._decodes is None:
            self._decodes = set(plan.decodes)
        return r in self._decodes or r in plan.sampled_prefills

    def drafts(self) -> Mapping[Request, int]:
        """The drafts each request verifies in the plan in flight (empty if none)."""
        return self.plan.spec_decodes if self.plan is not None else {}

    def clear(self) -> None:
        self.plan, self._decodes = None, None
        self.finishing = {}
        self.held.clear()
