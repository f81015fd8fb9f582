"""The engine executor: runs each step's plan on a real model (backend/runner.py).

The replay loop, the policies and the block manager are the simulator's own; only the
executor differs. A step's duration is its measured wall time: the executor times input
preparation, swaps, the forward pass and sampling up to the device sync, and the replay
loop adds the wall time the policy took to plan the step (``Executor.wall_clock``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from backend.errors import CheckpointError
from backend.runner import ModelRunner, SeqInput
from lab.core.plan import SchedulerOutput, StepResult
from lab.core.request import Request
from lab.core.scheduler import Scheduler

if TYPE_CHECKING:
    from lab.config import ExperimentConfig

GIB = 1 << 30


class EngineExecutor:
    """Executes plans on a :class:`ModelRunner`; never makes a scheduling decision.

    Args:
        runner: the model, its paged KV cache and swap space.
        scheduler: read-only here: the decode batch's live token counts.
        temperature: 0 = greedy.
    """

    wall_clock = True  # durations are measured, so the replay adds planning time

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, temperature: float = 0.0):
        self.runner, self.scheduler, self.temperature = runner, scheduler, temperature

    def execute(self, plan: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        if plan.swap_out:
            self.runner.swap_out(plan.swap_out)
        if plan.swap_in:
            self.runner.swap_in(plan.swap_in)
        seqs, owners = self.step_inputs(plan)
        sampled = self.runner.execute(seqs)  # returns after the device is done
        tokens = {r: t for r, t in zip(owners, sampled) if t is not None}
        return StepResult(time.perf_counter() - t0, tokens)

    def step_inputs(self, plan: SchedulerOutput) -> tuple[list[SeqInput], list[Request]]:
        """One SeqInput per scheduled request: prefill chunks first, then decodes."""
        seqs, owners = [], []
        for r, n in plan.prefills.items():
            ids = all_token_ids(r)
            c = r.num_computed_tokens
            seqs.append(SeqInput(ids[c:c + n], c, r.block_table, c + n == r.num_tokens,
                                 self.temperature))
            owners.append(r)
        ds = self.scheduler.decode_set
        for r in plan.decodes:
            # The latest sampled token is fed at position num_tokens - 1.
            seqs.append(SeqInput([r.output_token_ids[-1]], ds.num_tokens(r) - 1, r.block_table,
                                 True, self.temperature))
            owners.append(r)
        return seqs, owners


def all_token_ids(r: Request) -> list[int]:
    """Prompt + generated token ids (the sequence a recompute re-prefills)."""
    return r.prompt_token_ids + r.output_token_ids


def assign_prompt_tokens(requests: list[Request], vocab_size: int, seed: int) -> None:
    """Give trace requests (lengths only) random prompt token ids, reproducibly per request.

    Trace files carry lengths, not text; the engine needs ids. With ``ignore_eos`` semantics
    (output lengths honoured exactly) the ids only set the work, not the schedule.
    """
    for r in requests:
        if r.prompt_token_ids is None:
            rng = np.random.default_rng([seed, int.from_bytes(r.request_id.encode()[:8], "little")])
            r.prompt_token_ids = rng.integers(0, vocab_size, r.prompt_len).tolist()


def engine_parts(cfg: ExperimentConfig):
    """Load the model once for all runs of an experiment.

    Returns:
        (make_executor(scheduler) -> EngineExecutor, num_gpu_blocks, num_cpu_blocks,
        max_model_len, vocab_size).

    Raises:
        CheckpointError, DeviceError, KVCacheCapacityError: one line each (user errors).
    """
    eng, kv = cfg.engine, cfg.kv_cache
    if eng.model_path is None or not eng.model_path.is_dir():
        raise CheckpointError(
            f"engine.model_path: {eng.model_path} is not a directory (make one with "
            f"`python -m backend.tools convert-smollm2` or `make-random-checkpoint`)")
    runner = ModelRunner(
        eng.model_path, device=eng.device, dtype=eng.dtype,
        attention_backend=eng.attention_backend, block_size=kv.block_size,
        num_gpu_blocks=kv.num_gpu_blocks, gpu_memory_utilization=kv.gpu_memory_utilization,
        swap_space_bytes=kv.swap_space_bytes, seed=cfg.seed,
        max_model_len=cfg.scheduler.max_model_len,
        max_num_batched_tokens=cfg.profile_num_batched_tokens,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        cuda_graphs=eng.cuda_graphs, mixed_graphs=eng.mixed_graphs, kn_weights=eng.kn_weights,
    )

    def make_executor(scheduler: Scheduler) -> EngineExecutor:
        runner.generator.manual_seed(cfg.seed)  # each run samples the same way
        return EngineExecutor(runner, scheduler, eng.temperature)

    return (make_executor, runner.num_gpu_blocks, runner.num_cpu_blocks,
            runner.max_model_len, runner.config.vocab_size)


def text_decoder(cfg: ExperimentConfig):
    """A token-ids -> text function from the model directory's tokenizer, or None if the
    directory has no tokenizer files (random-weight checkpoints)."""
    model_dir = cfg.engine.model_path
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
