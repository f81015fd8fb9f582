"""The engine executor: runs each step's plan on a real model (backend/runner.py).

The replay loop, the policies and the block manager are the simulator's own; only the
executor differs. A step's duration is its measured wall time: the executor times input
preparation, swaps, the forward pass and sampling up to the device sync, and the replay
loop adds the wall time the policy took to plan the step (``Executor.wall_clock``).

Two ways to run a step:

* ``execute(plan)``: synchronous; returns once the device is done and the tokens are on
  the host. Every token a plan feeds is in its request's ``output_token_ids``.
* ``launch(plan) -> handle`` then ``wait(handle)`` (asynchronous scheduling, vLLM V1's
  AsyncScheduler; the contract in lab/core/scheduler.py): ``launch`` stages the inputs on
  the host and enqueues swaps, forward, sampling and the copy of the sampled ids to pinned
  memory on the device's stream, and returns before the device is done; ``wait`` blocks on
  that step's event only. The scheduler plans step N+1 before N's results are applied, so
  a sequence of N+1 may feed a token sampled in N and not yet in ``output_token_ids``
  (a placeholder): the token at position ``p`` is known iff ``p - prompt_len <
  len(output_token_ids)``. Such a token is fed from N's sampled-id tensor on the device
  (its row found by request), with no host round trip (:class:`backend.inputs.DeviceFeed`).
  On the CPU the same path runs to the end inside ``launch``. A runner without ``launch``
  (the tensor-parallel runner) runs each step in ``launch`` and feeds placeholders from the
  previous step's host tokens.

Async durations: a step's ``duration_s`` runs from the later of its launch and the previous
step's result to its own result (when ``wait`` returns), so consecutive steps tile the wall
clock; the planning of step N+1 falls inside N's duration.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

import numpy as np

from backend.runner import DeviceFeed, ModelRunner, PendingStep, SeqInput
from lab.core.plan import SchedulerOutput, StepResult
from lab.core.request import Request


@dataclass(slots=True)
class LaunchedStep:
    """The handle of a launched step (:meth:`EngineExecutor.launch`).

    Attributes:
        owners: the request of each sequence of the step, in SeqInput order.
        pending: the runner's in-flight step (None: the runner has no ``launch`` and the
            tokens are in ``tokens`` already).
        tokens: the sampled tokens per sequence when the step already ran.
        start_s: ``time.perf_counter()`` when launch began.
        host_s: seconds launch took (host work: swaps issued, inputs staged, kernels
            enqueued), without waiting for the device.
    """

    owners: list[Request]
    pending: PendingStep | None
    tokens: list[int | None] | None
    start_s: float
    host_s: float


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
        # The last launched step: its sampled ids (device, or host tokens) and each sampled
        # request's row in them; feeds the placeholders of the next launch.
        self._source = None
        self._source_row: dict[Request, int] = {}
        self._last_result_s = 0.0

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self._source, self._source_row = None, {}
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

    # -- asynchronous steps ------------------------------------------------------------------

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Enqueue the plan's swaps and step on the device and return its handle before the
        device is done (see the module doc); placeholders are fed from the previous launched
        step's sampled ids."""
        t0 = time.perf_counter()
        if plan.swap_out:
            self.runner.swap_out(plan.swap_out)
        if plan.swap_in:
            self.runner.swap_in(plan.swap_in)
        owners = [*plan.prefills, *plan.decodes]
        seqs, rows, src = self.async_inputs(plan)
        device_launch = getattr(self.runner, "launch", None)
        if device_launch is None:  # a runner that runs each step to the end: host feed
            ends = list(itertools.accumulate(len(s.token_ids) for s in seqs))
            for row, s in zip(rows, src):
                i = bisect.bisect_right(ends, row)  # the sequence holding flat row ``row``
                seqs[i].token_ids[row - ends[i]] = self._source[s]  # index from its end
            tokens = self.runner.execute(seqs)
            pending = None
            self._source = [t for t in tokens if t is not None]
        else:
            feed = None
            if rows:
                feed = DeviceFeed(np.asarray(rows, dtype=np.int64), self._source,
                                  np.asarray(src, dtype=np.int64))  # fmt: skip
            pending, tokens = device_launch(seqs, feed), None
            self._source = pending.sampled
        sampled = (
            [i for i, t in enumerate(tokens) if t is not None]
            if pending is None
            else pending.sampled_seqs
        )
        self._source_row = {owners[i]: k for k, i in enumerate(sampled)}
        return LaunchedStep(owners, pending, tokens, t0, time.perf_counter() - t0)

    def wait(self, handle: LaunchedStep) -> StepResult:
        """The launched step's result: its sampled tokens (on the host) and its duration."""
        tokens = handle.tokens if handle.pending is None else self.runner.wait(handle.pending)
        now = time.perf_counter()
        start = max(handle.start_s, self._last_result_s)
        self._last_result_s = now
        sampled = {r: t for r, t in zip(handle.owners, tokens) if t is not None}
        return StepResult(now - start, sampled)

    def async_inputs(self, plan: SchedulerOutput) -> tuple[list[SeqInput], list[int], list[int]]:
        """The step's SeqInputs (as :meth:`step_inputs`) with token 0 where a fed token is a
        placeholder, the flat token rows of those placeholders (ascending) and, for each, its
        row in the previous launched step's sampled ids. ValueError if a placeholder was not
        sampled by that step (only one token per request can be in flight)."""
        temp, row_of = self.temperature, self._source_row
        seqs: list[SeqInput] = []
        rows: list[int] = []
        src: list[int] = []
        row = 0
        for s in plan.prefill_seqs():
            ids = s.token_ids()
            n = s.num_new_tokens
            if len(ids) < n:  # the chunk ends in the token sampled by the previous step
                r = s.request
                missing = s.start_pos + n - r.prompt_len - len(r.output_token_ids)
                _check_in_flight(r, s.start_pos + n - 1, missing, row_of)
                src.append(row_of[s.request])
                rows.append(row + n - 1)
                ids = [*ids, 0]
            seqs.append(SeqInput(ids, s.start_pos, s.block_table, s.sample, temp))
            row += n
        decodes, positions = plan.decodes, plan.decode_positions()
        # ahead[i] = position - tokens known: < 0 known (the token is output_token_ids[ahead]),
        # 0 sampled by the step in flight. Comprehensions: a decode batch of hundreds.
        ahead = [p - r.prompt_len - len(r.output_token_ids) for r, p in zip(decodes, positions)]
        seqs += [
            SeqInput([r.output_token_ids[a] if a < 0 else 0], p, r.block_table, True, temp)
            for r, p, a in zip(decodes, positions, ahead)
        ]
        flight = [i for i, a in enumerate(ahead) if a >= 0]
        for i in flight:
            r = decodes[i]
            if ahead[i] != 0 or r not in row_of:
                _check_in_flight(r, positions[i], ahead[i] + 1, row_of)
        rows += [row + i for i in flight]
        src += [row_of[decodes[i]] for i in flight]
        return seqs, rows, src


def _check_in_flight(r: Request, pos: int, missing: int, row_of: dict[Request, int]) -> None:
    if missing != 1 or r not in row_of:
        raise ValueError(
            f"request {r.request_id}: the token at position {pos} is not known "
            f"({len(r.output_token_ids)} output tokens) and was not sampled by the step "
            "launched before (one token per request can be in flight)"
        )


def assign_prompt_tokens(requests: list[Request], vocab_size: int, seed: int) -> None:
    """Give trace requests (lengths only) random prompt token ids, reproducibly per request.

    Trace files carry lengths, not text; the engine needs ids. With ``ignore_eos`` semantics
    (output lengths honoured exactly) the ids only set the work, not the schedule.
    """
    for r in requests:
        if r.prompt_token_ids is None:
            rng = np.random.default_rng([seed, int.from_bytes(r.request_id.encode()[:8], "little")])
            r.prompt_token_ids = rng.integers(0, vocab_size, r.prompt_len).tolist()
