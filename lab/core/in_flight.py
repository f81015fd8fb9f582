"""Asynchronous scheduling's in-flight state (rules: docs/ARCHITECTURE.md, "Scheduler rules")."""

from __future__ import annotations

from collections.abc import Mapping

from sched_lab.core.plan import SchedulerOutput
from sched_lab.core.request import Request


class InFlight:
    """What the scheduler knows of the launched step whose results have not arrived.

    Attributes:
        plan: the last launched plan without results, or None (always in sync runs).
        finishing: ordered set of requests whose last token a launched step samples and
            whose end the scheduler could not foresee (``finish_reason`` "stop"): they stay
            running, decode once more (wasted) and are never victims.
        ended: ordered set of requests whose foreseen end (by length) a launched step
            samples: they left ``running`` and freed their blocks at its launch and finish
            when its results arrive.
        parked: ordered set of running decodes (ends by length) that sit out the plans
            made while their drafts are in flight, as those drafts may reach their end (vLLM
            schedules no token past max_tokens); never victims; they rejoin the decode set
            when the results arrive.
        held: recompute victims whose token of ``plan`` is unknown; not re-admitted until
            it is (wait reason ``token_in_flight``).
    """

    def __init__(self) -> None:
        self.plan: SchedulerOutput | None = None
        self.finishing: dict[Request, None] = {}
        self.ended: dict[Request, None] = {}
        self.parked: dict[Request, None] = {}
        self.held: set[Request] = set()
        self._decodes: set[Request] | None = None  # plan.decodes as a set, made on demand

    @property
    def pinned(self) -> Mapping[Request, None]:
        """Running requests that are never victims: ``finishing`` and ``parked`` (do not
        mutate)."""
        return {**self.finishing, **self.parked} if self.parked else self.finishing

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
        self.ended = {}
        self.parked = {}
        self.held.clear()
