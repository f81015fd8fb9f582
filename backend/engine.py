"""The engine executor: runs each step's plan on a real model (backend/runner.py).

The replay loop, the policies and the block manager are the simulator's own; only the
executor differs. A step's duration is its measured wall time: the executor times input
preparation, swaps, the forward pass and sampling up to the device sync, and the replay
loop adds the wall time the policy took to plan the step (``Executor.wall_clock``).
"""

from __future__ import annotations

import time

import numpy as np

from backend.runner import ModelRunner, SeqInput
from lab.core.plan import SchedulerOutput, StepResult
from lab.core.request import Request


class EngineExecutor:
    """Executes plans on a :class:`ModelRunner`; reads nothing but the plan and never makes
    a scheduling decision.

    Args:
        runner: the model, its paged KV cache and swap space: a :class:`ModelRunner`, or a
            :class:`backend.tp_engine.TensorParallelRunner` (same interface) for N ranks.
        temperature: 0 = greedy.
    """

    wall_clock = True  # durations are measured, so the replay adds planning time

    def __init__(self, runner: ModelRunner, temperature: float = 0.0):
        self.runner, self.temperature = runner, temperature

    def execute(self, plan: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        if plan.swap_out:
            self.runner.swap_out(plan.swap_out)
        if plan.swap_in:
            self.runner.swap_in(plan.swap_in)
        owners = [*plan.prefills, *plan.decodes]
        sampled = self.runner.execute(self.step_inputs(plan))  # returns after the device is done
        tokens = {r: t for r, t in zip(owners, sampled) if t is not None}
        return StepResult(time.perf_counter() - t0, tokens)

    def step_inputs(self, plan: SchedulerOutput) -> list[SeqInput]:
        """One SeqInput per scheduled sequence, in the order of ``plan.seqs()``:
        prefill chunks, then decodes, each feeding its latest sampled token (built directly
        from ``plan.decode_positions()``: a decode batch of hundreds is the common step)."""
        temp = self.temperature
        seqs = [
            SeqInput(s.token_ids(), s.start_pos, s.block_table, s.sample, temp)
            for s in plan.prefill_seqs()
        ]
        seqs += [
            SeqInput([r.output_token_ids[-1]], pos, r.block_table, True, temp)
            for r, pos in zip(plan.decodes, plan.decode_positions())
        ]
        return seqs


def assign_prompt_tokens(requests: list[Request], vocab_size: int, seed: int) -> None:
    """Give trace requests (lengths only) random prompt token ids, reproducibly per request.

    Trace files carry lengths, not text; the engine needs ids. With ``ignore_eos`` semantics
    (output lengths honoured exactly) the ids only set the work, not the schedule.
    """
    for r in requests:
        if r.prompt_token_ids is None:
            rng = np.random.default_rng([seed, int.from_bytes(r.request_id.encode()[:8], "little")])
            r.prompt_token_ids = rng.integers(0, vocab_size, r.prompt_len).tolist()
