"""The engine executor: runs each step's plan on a real model (backend/runner.py).

A step's duration is its measured wall time (inputs, swaps, forward, sampling, device sync).
``launch``/``wait`` implement asynchronous scheduling (vLLM V1's AsyncScheduler; contract in
lab/core/scheduler.py): a placeholder token (position ``p`` with ``p - prompt_len >=
len(output_token_ids)``) is fed from the previous step's sampled ids on the device. An async
step's ``duration_s`` runs from the later of its launch and the previous result to its own
result.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

import numpy as np

from sched_lab.backend.runner import DeviceFeed, ModelRunner, PendingStep, SeqInput
from sched_lab.core.plan import SchedulerOutput, StepResult
from sched_lab.core.request import Request


@dataclass(slots=True)
class LaunchedStep:
    """The handle of a launched step.

    Attributes:
        owners: the request of each sequence, in SeqInput order.
        pending: the runner's in-flight step (None: ``tokens`` already holds the result).
        start_s: ``time.perf_counter()`` when launch began.
        host_s: seconds of host work in launch.
    """

    owners: list[Request]
    pending: PendingStep | None
    tokens: list[int | None] | None
    start_s: float
    host_s: float


class EngineExecutor:
    """Executes plans on a :class:`ModelRunner` or a
    :class:`sched_lab.backend.tp_engine.TensorParallelRunner`; makes no scheduling decision.
    ``temperature``: 0 = greedy; a request's ``sampling_params`` override it (and add top_p
    and a seed) for that request."""

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
        """One SeqInput per scheduled sequence, in ``plan.seqs()`` order."""
        how = self.sampling
        seqs = [
            SeqInput(
                s.token_ids(),
                s.start_pos,
                s.block_table,
                s.sample,
                *how(s.request),
                s.request.lora_name,
            )
            for s in plan.prefill_seqs()
        ]
        seqs += [
            SeqInput([r.output_token_ids[-1]], pos, r.block_table, True, *how(r), r.lora_name)
            for r, pos in zip(plan.decodes, plan.decode_positions())
        ]
        return seqs

    def sampling(self, r: Request) -> tuple[float, float, int | None]:
        """(temperature, top_p, seed) of ``r``'s tokens: its ``sampling_params``, the
        executor's temperature where they leave it unset."""
        p = r.sampling_params
        if p is None:
            return self.temperature, 1.0, None
        temp = self.temperature if p.temperature is None else p.temperature
        return temp, p.top_p, p.seed

    # -- asynchronous steps ------------------------------------------------------------------

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Enqueue the plan's swaps and step and return its handle before the device is done."""
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
        """The step's SeqInputs with token 0 at placeholders, the placeholders' flat rows
        (ascending) and each one's row in the previous step's sampled ids. ValueError if
        that step did not sample it."""
        how, row_of = self.sampling, self._source_row
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
            seqs.append(
                SeqInput(
                    ids, s.start_pos, s.block_table, s.sample, *how(s.request), s.request.lora_name
                )
            )
            row += n
        decodes, positions = plan.decodes, plan.decode_positions()
        # ahead[i] = position - tokens known: < 0 known (the token is output_token_ids[ahead]),
        # 0 sampled by the step in flight. Comprehensions: a decode batch of hundreds.
        ahead = [p - r.prompt_len - len(r.output_token_ids) for r, p in zip(decodes, positions)]
        seqs += [
            SeqInput(
                [r.output_token_ids[a] if a < 0 else 0],
                p,
                r.block_table,
                True,
                *how(r),
                r.lora_name,
            )
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
    """Give trace requests random prompt token ids, reproducibly per request (mutates them)."""
    for r in requests:
        if r.prompt_token_ids is None:
            rng = np.random.default_rng([seed, int.from_bytes(r.request_id.encode()[:8], "little")])
            r.prompt_token_ids = rng.integers(0, vocab_size, r.prompt_len).tolist()
