"""Small builders shared by the tests: a fixed-cost executor and a one-call replay."""

from __future__ import annotations

from sched_lab.core.kv import make_block_manager
from sched_lab.core.plan import SchedulerOutput, StepResult
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy, policy_names
from sched_lab.sim.records import ReplayResult
from sched_lab.sim.replay import replay


def bundled_policy_names() -> list[str]:
    """The policies of the policies/ package, sorted: what tests parametrize over. The
    registry (``policy_names()``) also holds the policies tests register, so a list taken
    from it at import time would depend on the order the test files are collected in."""
    return [n for n in policy_names() if get_policy(n).__module__.startswith("sched_lab.policies.")]


STEP_S = 0.01  # every step of the toy cost model takes 10 ms


class FixedCost:
    """Toy executor: every step takes ``step_s`` seconds, whatever it computes."""

    def __init__(self, step_s: float = STEP_S) -> None:
        self.step_s = step_s
        self.plans: list[SchedulerOutput] = []

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return StepResult(self.step_s)


def run(
    policy: str,
    requests: list[tuple],
    *,
    gpu_blocks=8,
    cpu_blocks=8,
    block_size=16,
    max_model_len=1_000_000,
    budget=None,
    max_num_seqs=256,
    watermark=0.0,
    step_s=STEP_S,
    enable_prefix_caching=False,
    hash_block_size=None,
) -> ReplayResult:
    """Replay (request_id, arrival_s, prompt, output) tuples with invariants checked."""
    cls = get_policy(policy)
    if budget is None:
        budget = 64 if cls.chunked_prefill else max_model_len
    bm = make_block_manager(gpu_blocks, cpu_blocks, block_size, watermark, enable_prefix_caching)
    scheduler = cls(SchedulerLimits(max_num_seqs, budget, max_model_len), bm)
    reqs = [Request(*t) for t in requests]
    if hash_block_size is not None:
        for r in reqs:
            r.hash_block_size = hash_block_size
    result = replay(reqs, scheduler, FixedCost(step_s), check_invariants=True)
    assert result.failure is None, result.failure  # a broken invariant stops the replay
    return result


def by_id(result: ReplayResult) -> dict[str, Request]:
    return {r.request_id: r for r in result.requests}
