"""A tensor-parallel engine: one process per rank, rank 0 in the experiment's own process.

Rank 0 runs the scheduler and drives its own shard through :class:`TensorParallelRunner`
(the :class:`sched_lab.backend.runner.ModelRunner` interface), broadcasting each step's swap maps and
SeqInputs to spawned worker ranks over gloo; collectives run on NCCL with CUDA (rank r on
``cuda:r``), gloo on the CPU; only rank 0 samples. A failed worker makes the step raise
:class:`TensorParallelError` naming it, and every later step too.

Test hook: ``SCHED_LAB_TP_FAULT="RANK:STEP"`` makes that worker raise at its STEP-th step.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sched_lab.backend.inputs import SeqInput
from sched_lab.backend.runner import ModelRunner
from sched_lab.backend.tp import TPShard
from sched_lab.core.errors import ConfigError, UserError

FAULT_ENV = "SCHED_LAB_TP_FAULT"
MAX_CPU_RANKS = 8  # gloo processes on a CPU host: more is a mistake, not a study
TIMEOUT_S = 300  # a collective that waits longer than this fails (a lost rank)
ERROR_WAIT_S = 10.0  # how long rank 0 waits for a failed worker's line
_LIVE: TensorParallelRunner | None = None  # this process's group (rank 0), if any


class TensorParallelError(UserError):
    """A tensor-parallel rank failed; the message names the rank and its error (one line)."""


def check_world(size: int, device: str) -> None:
    """ConfigError unless ``size`` ranks fit the host: CUDA devices, or MAX_CPU_RANKS."""
    where = "engine.tensor_parallel_size"
    if device.startswith("cuda"):
        if device != "cuda":
            raise ConfigError(f"{where}: {size} ranks use cuda:0..{size - 1}; set device: cuda")
        have = torch.cuda.device_count()
        if size > have:
            raise ConfigError(f"{where}: {size} ranks need {size} CUDA devices, {have} visible")
    elif size > MAX_CPU_RANKS:
        raise ConfigError(f"{where}: {size} gloo processes on the CPU; at most {MAX_CPU_RANKS}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, size: int, port: int, cuda: bool) -> Any:
    """Join the default group (NCCL on CUDA, gloo otherwise); returns the gloo plan group."""
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=timedelta(seconds=TIMEOUT_S))  # fmt: skip
    return dist.new_group(backend="gloo") if cuda else dist.group.WORLD


def _worker(rank: int, size: int, port: int, model_dir: str, kwargs: dict, errors: Any) -> None:
    """Rank ``rank``'s loop: build the shard, then run each broadcast step until "stop"."""
    cuda = str(kwargs.get("device", "cpu")).startswith("cuda")
    fault = os.environ.get(FAULT_ENV, "")
    fail_rank, _, fail_step = fault.partition(":")
    step = 0
    try:
        group = _init_group(rank, size, port, cuda)
        if cuda:
            kwargs = {**kwargs, "device": f"cuda:{rank}"}
        runner = ModelRunner(model_dir, **kwargs, tensor_parallel=TPShard(rank, size))
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=group)
            kind, swap_out, swap_in, seqs = box[0]
            if kind == "stop":
                break
            step += 1
            if fail_rank == str(rank) and fail_step == str(step):
                raise RuntimeError(f"injected fault ({FAULT_ENV}) at step {step}")
            runner.swap_out(swap_out)
            runner.swap_in(swap_in)
            if seqs:
                with torch.inference_mode():
                    runner._forward(seqs, runner.kv_cache)
                runner.synchronize()
        dist.destroy_process_group()
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - one line to rank 0, then go
        # (Ctrl-C in a terminal reaches every rank: no traceback from each)
        line = (
            "interrupted (SIGINT)"
            if isinstance(e, KeyboardInterrupt)
            else f"{type(e).__name__}: {e}"
        )
        errors.put((rank, step, line.splitlines()[0]))
        errors.close()
        errors.join_thread()  # the line is in the pipe before the process goes
        os._exit(1)


class TensorParallelRunner:
    """``size`` ranks (>= 2, one process each) of the full checkpoint ``model_dir``, driven
    like a :class:`ModelRunner` from rank 0; ``kwargs`` go to every rank's ModelRunner."""

    def __init__(self, model_dir: str | Path, size: int, **kwargs: Any) -> None:
        device = str(kwargs.get("device", "cpu"))
        check_world(size, device)
        global _LIVE
        if _LIVE is not None:  # one group per process: the previous experiment's is done
            _LIVE.close()
        _LIVE = self
        cuda = device.startswith("cuda")
        self.size, self.failure = size, None
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        port = _free_port()
        model_dir = str(Path(model_dir).expanduser())
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, size, port, model_dir, kwargs, self._errors),
                daemon=True,
                name=f"tp-rank-{r}",
            )  # fmt: skip
            for r in range(1, size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(self.close)
        try:
            self._group = _init_group(0, size, port, cuda)
            local = {**kwargs, "device": "cuda:0"} if cuda else kwargs
            self.runner = ModelRunner(model_dir, **local, tensor_parallel=TPShard(0, size))
        except Exception as e:
            self._fail(e)
        self.config = self.runner.config
        self.generator = self.runner.generator
        self.max_model_len = self.runner.max_model_len
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []

    @property
    def num_gpu_blocks(self) -> int:
        return self.runner.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.runner.num_cpu_blocks

    def capacity_line(self) -> str:
        return self.runner.capacity_line()

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Swap rank 0's shard now; the other ranks swap theirs with the next step."""
        self._check_alive()
        self.runner.swap_out(mapping)
        self._swap_out += mapping

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._check_alive()
        self.runner.swap_in(mapping)
        self._swap_in += mapping

    def execute(self, seqs: list[SeqInput]) -> list[int | None]:
        """Broadcast the step and run rank 0's shard; the sampled tokens."""
        return self._step(seqs, self.runner.execute)

    def execute_logits(self, seqs: list[SeqInput]) -> list[torch.Tensor | None]:
        return self._step(seqs, self.runner.execute_logits)

    def _step(self, seqs: list[SeqInput], run: Any) -> Any:
        self._check_alive()
        if not seqs and not self._swap_out and not self._swap_in:
            return []
        plan = ("step", self._swap_out, self._swap_in, list(seqs))
        self._swap_out, self._swap_in = [], []
        try:
            dist.broadcast_object_list([plan], src=0, group=self._group)
            if not seqs:
                self.runner.synchronize()
                return []
            return run(seqs)
        except Exception as e:
            self._fail(e)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group stopped earlier: {self.failure}")

    def _fail(self, error: Exception) -> None:
        """Name the failed worker if one reported (else rank 0's own error), stop the group."""
        try:
            rank, step, line = self._errors.get(timeout=ERROR_WAIT_S)
            self.failure = f"tensor-parallel rank {rank} failed at its step {step}: {line}"
        except queue.Empty:
            self.failure = None
        self._stop_workers(graceful=False)
        if self.failure is None:
            self.failure = f"rank 0 failed: {type(error).__name__}: {error}".splitlines()[0]
            raise error
        raise TensorParallelError(self.failure) from error

    def close(self) -> None:
        """Stop the workers (a "stop" broadcast, then join) and leave the group."""
        if self.failure is None and any(p.is_alive() for p in self._procs):
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([("stop", [], [], [])], src=0, group=self._group)
            self.failure = "closed"
        self._stop_workers(graceful=True)

    def _stop_workers(self, graceful: bool) -> None:
        for p in self._procs:
            p.join(timeout=30 if graceful else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        atexit.unregister(self.close)
