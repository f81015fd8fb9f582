"""Asynchronous scheduling's in-flight state: what a launched step will do before its
results arrive (rules: docs/ARCHITECTURE.md, "Scheduler rules").

The scheduler plans step N+1 while step N runs. :class:`InFlight` is what it knows of N
meanwhile: the plan, the requests whose last token N samples (``finishing``) and the
recompute victims whose token of N is not known yet (``held``).
"""

from __future__ import annotations

from collections.abc import Mapping

from lab.core.plan import SchedulerOutput
from lab.core.request import Request


class InFlight:
    """The launched plan whose results have not arrived, and what it means for the next plan.

    Attributes:
        plan: the plan launched last whose results have not arrived, or None (always None
            in a sync run).
        finishing: requests whose last token a launched step samples, until its results
            arrive; they decode once more in a wasted slot and are never preemption victims.
            A dict used as an insertion-ordered set.
        held: recompute victims whose token of ``plan`` is not known yet; not re-admitted
            until it is (wait reason ``token_in_flight``).
    """

    def __init__(self) -> None:
        self.plan: SchedulerOutput | None = None
        self.finishing: dict[Request, None] = {}
        self.held: set[Request] = set()
        self._decodes: set[Request] | None = None  # plan.decodes as a set, made on demand

    def launch(self, plan: SchedulerOutput) -> None:
        """``plan`` was handed to the executor; it is the one in flight now."""
        self.plan, self._decodes = plan, None

    def arrived(self, plan: SchedulerOutput) -> SchedulerOutput | None:
        """``plan``'s results arrived: the tokens of ``held`` are known now. Returns the plan
        still in flight after it (None when ``plan`` was the last launched)."""
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
        """Forget everything (the run stopped)."""
        self.plan, self._decodes = None, None
        self.finishing = {}
        self.held.clear()
