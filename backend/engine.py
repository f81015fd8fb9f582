"""The engine executor: runs each step's plan on a real model (backend/runner.py).

The replay loop, the policies and the block manager are the simulator's own; only the
executor differs. A step's duration is its measured wall time: the executor times input
preparation, swaps, the forward pass and sampling up to the device sync, and the replay
loop adds the wall time the policy took to plan the step (``Executor.wall_clock``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from backend.errors import CheckpointError
from backend.runner import ModelRunner, SeqInput
from lab.core.plan import ScheduledSeq, SchedulerOutput, StepResult
from lab.core.request import Request

GIB = 1 << 30


class EngineExecutor:
    """Executes plans on a :class:`ModelRunner`; reads nothing but the plan and never makes
    a scheduling decision.

    Args:
        runner: the model, its paged KV cache and swap space.
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
        seqs = plan.seqs()
        sampled = self.runner.execute(self.step_inputs(seqs))  # returns after the device is done
        tokens = {s.request: t for s, t in zip(seqs, sampled) if t is not None}
        return StepResult(time.perf_counter() - t0, tokens)

    def step_inputs(self, seqs: list[ScheduledSeq]) -> list[SeqInput]:
        """One SeqInput per scheduled sequence of the plan, in the plan's order."""
        return [SeqInput(s.token_ids(), s.start_pos, s.block_table, s.sample, self.temperature)
                for s in seqs]


def assign_prompt_tokens(requests: list[Request], vocab_size: int, seed: int) -> None:
    """Give trace requests (lengths only) random prompt token ids, reproducibly per request.

    Trace files carry lengths, not text; the engine needs ids. With ``ignore_eos`` semantics
    (output lengths honoured exactly) the ids only set the work, not the schedule.
    """
    for r in requests:
        if r.prompt_token_ids is None:
            rng = np.random.default_rng([seed, int.from_bytes(r.request_id.encode()[:8], "little")])
            r.prompt_token_ids = rng.integers(0, vocab_size, r.prompt_len).tolist()


def engine_parts(cfg: dict[str, Any], base_dir: Path):
    """Load the model once for all runs of an experiment.

    Returns:
        (make_executor() -> EngineExecutor, num_gpu_blocks, num_cpu_blocks,
        max_position_embeddings, vocab_size, tokenizer dir or None).

    Raises:
        CheckpointError, DeviceError, KVCacheCapacityError: one line each (user errors).
    """
    eng, kv = cfg["engine"], cfg["kv_cache"]
    model_dir = Path(eng["model_path"]).expanduser()
    if not model_dir.is_absolute():
        model_dir = base_dir / model_dir
    if not model_dir.is_dir():
        raise CheckpointError(
            f"engine.model_path: {model_dir} is not a directory (make one with "
            f"`python -m backend.tools convert-smollm2` or `make-random-checkpoint`)")
    runner = ModelRunner(
        model_dir, device=eng["device"], dtype=eng["dtype"],
        attention_backend=eng["attention_backend"], block_size=kv["block_size"],
        num_gpu_blocks=kv["num_gpu_blocks"], gpu_memory_utilization=kv["gpu_memory_utilization"],
        swap_space_bytes=int(kv["swap_space_gib"] * GIB), seed=cfg["seed"],
        max_model_len=cfg["scheduler"]["max_model_len"],
        max_num_batched_tokens=cfg["scheduler"]["max_num_batched_tokens"] or 8192,
        max_num_seqs=cfg["scheduler"].get("max_num_seqs") or 256,
        cuda_graphs=eng.get("cuda_graphs"),  # None: on with CUDA + triton (LAB_CUDA_GRAPHS=0: off)
    )

    def make_executor() -> EngineExecutor:
        runner.generator.manual_seed(cfg["seed"])  # each run samples the same way
        return EngineExecutor(runner, eng["temperature"])

    return (make_executor, runner.num_gpu_blocks, runner.num_cpu_blocks,
            runner.max_model_len, runner.config.vocab_size)


def text_decoder(cfg: dict[str, Any], base_dir: Path):
    """A token-ids -> text function from the model directory's tokenizer, or None if the
    directory has no tokenizer files (random-weight checkpoints)."""
    model_dir = Path(cfg["engine"]["model_path"]).expanduser()
    if not model_dir.is_absolute():
        model_dir = base_dir / model_dir
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
