"""The engine's replay (the same loop as the simulator's, lab/sim/replay.py) at equal times:
a request rejected at its arrival moves no other request's steps or tokens. The tiny random
Qwen3 on the CPU computes real tokens; step durations are fixed at 1 s (the engine's wall
clock replaced) so that an arrival falls exactly on a step's end."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says more)
from triton_setup import QWEN3_TINY  # noqa: E402

from sched_lab.backend.engine import EngineExecutor  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.core.kv import make_block_manager  # noqa: E402
from sched_lab.core.request import Request  # noqa: E402
from sched_lab.core.scheduler import SchedulerLimits  # noqa: E402
from sched_lab.policies import get_policy  # noqa: E402
from sched_lab.sim.replay import replay  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


class OneSecondSteps(EngineExecutor):
    """The engine's steps and tokens, each step lasting 1 s of replay time."""

    wall_clock = False

    def execute(self, plan):
        result = super().execute(plan)
        result.duration_s = 1.0
        return result


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tiny_order")
    write_random_checkpoint(QWEN3_TINY, path, dtype="float32", std=0.2)
    return ModelRunner(path, device="cpu", dtype="float32", attention_backend="torch",
                       block_size=4, num_gpu_blocks=16, swap_space_bytes=0, max_num_seqs=8,
                       max_num_batched_tokens=64, cuda_graphs=False)  # fmt: skip


def run(runner, rows):
    reqs = [Request(i, t, p, o, [(7 * k + len(i)) % 200 for k in range(p)]) for i, t, p, o in rows]
    bm = make_block_manager(16, 0, 4, 0.0, False)
    scheduler = get_policy("fcfs")(SchedulerLimits(8, 64, 60), bm)
    result = replay(reqs, scheduler, OneSecondSteps(runner))
    assert result.failure is None, result.failure
    return {r.request_id: (r.first_scheduled_s, r.finish_s, r.output_token_ids) for r in reqs}


def test_a_rejected_arrival_moves_no_other_request_on_the_engine(runner):
    # A at 0 (prompt 5, 3 tokens); B at 1.0, when A's prefill step ends: the plan at 1.0
    # prefills B (prefill-first), [2,3) decodes A and B (B ends at 3), [3,4) A (ends at 4).
    a, b = ("A", 0.0, 5, 3), ("B", 1.0, 6, 2)
    alone = run(runner, [a, b])
    assert {i: v[:2] for i, v in alone.items()} == {"A": (0.0, 4.0), "B": (1.0, 3.0)}
    assert [len(v[2]) for v in alone.values()] == [3, 2]
    with_r = run(runner, [a, ("R", 0.5, 70, 2), b])  # 72 tokens > max_model_len 60
    assert with_r.pop("R")[1] == 0.5  # rejected at its arrival
    assert with_r == alone  # same times and the same greedy tokens
