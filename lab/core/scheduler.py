"""Scheduler state and the mechanics every policy shares; the policy registry.

A policy (policies/<name>.py) subclasses :class:`Scheduler` and writes one method,
``schedule()``, from the helpers here: admit waiting requests, reserve decode blocks with
preemption, swap in. The helpers mutate the queues and the block manager and record what
they did in the step's plan, as vLLM's scheduler does.

Token and block conventions (vLLM V0's block manager):
* A request holds ``num_tokens`` = prompt + output tokens so far. A step feeds new tokens
  (a prompt chunk, or the latest sampled token of a decode), writing their KV, and samples
  a token when it feeds the last one.
* The slot of a sampled token is reserved in the step that samples it, so after every step
  a request holds ceil(num_tokens / block_size) blocks. Example (block size 4, prompt 3,
  output 6): blocks held during steps 1..6 are 1, 2, 2, 2, 2, 3.
* Admission allocates the blocks of the request's whole prompt (plus the sampled slot) at
  once, also when the prompt is computed in chunks (vLLM V0 and Sarathi-Serve do so; V1
  allocates chunk by chunk, which under KV pressure preempts half-computed prompts over
  and over). After admission only decodes need new blocks.
* Recompute preemption drops all KV; the request re-enters ``waiting`` at the front and its
  re-prefill feeds prompt + output tokens so far, sampling the next token.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from lab.core.decode_set import DecodeSet
from lab.core.errors import ConfigError, SchedulerStuckError
from lab.core.kv import BlockManager, blocks_for
from lab.core.plan import PreemptionMode, SchedulerOutput
from lab.core.request import Request, RequestStatus

log = logging.getLogger("lab.core.scheduler")


@dataclass(frozen=True)
class SchedulerLimits:
    """Limits every plan respects (vLLM's names).

    Attributes:
        max_num_seqs: requests in the running batch at once.
        max_num_batched_tokens: token budget of one step (prefill + decode tokens).
        max_model_len: prompt + output tokens of one request; longer ones are rejected.
        max_preemptions: preemptions of one request after which the run fails as
            thrashing (a livelock guard; no policy here comes near it in practice).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_preemptions: int = 1000


class Scheduler:
    """Queues, block manager and limits, plus the shared moves of every policy.

    Queues: ``waiting`` (FIFO; recompute victims return at the front), ``running`` (in
    admission order; the last one is the newest and the first preemption victim),
    ``swapped`` (FIFO). Running requests are either in ``decode_set`` or in ``prefilling``
    (a chunked prompt not yet fully computed).
    """

    name: ClassVar[str] = ""
    #: True if prompts may be split into chunks across steps.
    chunked_prefill: ClassVar[bool] = False
    #: How victims are preempted; the swap policy overrides it.
    preemption_mode: ClassVar[PreemptionMode] = PreemptionMode.RECOMPUTE
    #: Options a policy accepts in its YAML block, with defaults.
    options: ClassVar[dict[str, Any]] = {}

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, **options: Any):
        self.limits = limits
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decode_set = DecodeSet(block_manager.block_size)
        self.now_s = 0.0
        for key, value in {**self.options, **options}.items():
            setattr(self, key, value)

    # ------------------------------------------------------------------ the policy's part
    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Mutates the queues and the block manager."""
        raise NotImplementedError

    # ------------------------------------------------------------------ queries
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def rejection_reason(self, r: Request) -> str | None:
        """Why a request can never run under these limits, or None if it can."""
        total = r.prompt_len + r.output_len
        gpu = self.block_manager.num_gpu_blocks
        if total > self.limits.max_model_len:
            return (
                f"prompt {r.prompt_len} + output {r.output_len} = {total} tokens "
                f"({blocks_for(total, self.block_size)} blocks) exceeds max_model_len "
                f"{self.limits.max_model_len} tokens (KV cache: {gpu} GPU blocks of "
                f"{self.block_size} tokens)"
            )
        need = blocks_for(r.prompt_len + 1, self.block_size)
        if need > gpu:
            return f"prompt {r.prompt_len} tokens needs {need} KV blocks, the GPU cache has {gpu}"
        return None

    def blocks_to_admit(self, r: Request) -> int:
        """GPU blocks a waiting request needs: all its tokens plus the slot it samples into."""
        return blocks_for(r.num_tokens + 1, self.block_size) - len(r.block_table)

    # ------------------------------------------------------------------ shared moves
    def admit_waiting(self, plan: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in FCFS order while limits and free blocks allow.

        Whole prompts unless the policy is chunked, in which case the last admitted one
        may get a partial chunk (its blocks are allocated whole). Returns the budget left.
        """
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            r = self.waiting[0]
            num_new = r.num_tokens - r.num_computed_tokens
            if num_new > budget:
                if not self.chunked_prefill:
                    break
                num_new = budget
            need = self.blocks_to_admit(r)
            if not bm.can_allocate(need, use_watermark=bool(self.running)):
                if not self.running and need > bm.num_free_gpu_blocks and not self.swapped:
                    self.abort(plan, self.waiting.popleft(), f"needs {need} KV blocks to "
                               f"resume, the GPU cache has {bm.num_gpu_blocks}")
                    continue
                break
            self.waiting.popleft()
            bm.allocate(r, need)
            r.status = RequestStatus.RUNNING
            if r.first_scheduled_s < 0:
                r.first_scheduled_s = self.now_s
            self.running.append(r)
            if num_new < r.num_tokens - r.num_computed_tokens:
                self.prefilling.append(r)
            plan.prefills[r] = num_new
            budget -= num_new
        return budget

    def reserve_decode_blocks(self, plan: SchedulerOutput) -> None:
        """Give each decode a block if its next token starts one, preempting the newest
        running requests while blocks are short. A request that needs a block while
        holding the whole cache alone is aborted."""
        bm, ds = self.block_manager, self.decode_set
        while len(ds.needing_block()) > bm.num_free_gpu_blocks:
            victim = self.running[-1]
            if len(self.running) == 1:
                self.abort(plan, victim, f"outgrew the KV cache: needs more than the "
                           f"{bm.num_gpu_blocks} GPU blocks while running alone")
            else:
                self.preempt(plan, victim)
        for r in ds.needing_block():
            bm.allocate(r, 1)

    def preempt(self, plan: SchedulerOutput, victim: Request) -> None:
        """Preempt ``victim`` by swap if the policy swaps and CPU space allows, else by
        recompute. Mutates queues and blocks; records the preemption in ``plan``."""
        assert victim not in plan.prefills, "a request is never scheduled and preempted"
        self._leave_running(victim)
        mode = PreemptionMode.RECOMPUTE
        if self.preemption_mode is PreemptionMode.SWAP:
            if self.block_manager.can_swap_out(victim):
                mode = PreemptionMode.SWAP
            else:
                log.debug(
                    "%s: CPU swap space full (%d free blocks, %d needed): request %s is "
                    "recomputed instead", self.name, self.block_manager.num_free_cpu_blocks,
                    len(victim.block_table), victim.request_id)
        if mode is PreemptionMode.SWAP:
            plan.swap_out.extend(self.block_manager.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            victim.num_preemptions_swap += 1
            self.swapped.append(victim)
        else:
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.WAITING
            victim.num_preemptions_recompute += 1
            self.waiting.appendleft(victim)
        plan.preempted.append((victim, mode))
        if victim.num_preemptions > self.limits.max_preemptions:
            raise SchedulerStuckError(
                f"policy {self.name!r} is thrashing: request {victim.request_id} was preempted "
                f"{victim.num_preemptions} times (scheduler.max_preemptions = "
                f"{self.limits.max_preemptions}) at t={self.now_s:.6f}s")

    def swap_in_swapped(self, plan: SchedulerOutput) -> None:
        """Bring swapped requests back, oldest first, while blocks and max_num_seqs allow.
        They rejoin the decode batch in this step."""
        bm = self.block_manager
        while self.swapped and len(self.running) < self.limits.max_num_seqs:
            r = self.swapped[0]
            need = len(r.block_table) + (1 if r.num_tokens % self.block_size == 0 else 0)
            if not bm.can_allocate(need, use_watermark=bool(self.running)):
                break
            self.swapped.popleft()
            plan.swap_in.extend(bm.swap_in(r))
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            self.decode_set.add(r)
            if need > len(r.block_table):
                bm.allocate(r, 1)

    def abort(self, plan: SchedulerOutput, r: Request, reason: str) -> None:
        """Drop ``r`` for good with ``reason``; its blocks are freed."""
        if r.status is RequestStatus.RUNNING:
            self._leave_running(r)
        self.block_manager.free(r)
        r.status, r.reason, r.finish_s = RequestStatus.ABORTED, reason, self.now_s
        plan.aborted.append(r)

    def add_decodes(self, plan: SchedulerOutput) -> SchedulerOutput:
        """Put the whole decode batch in the plan (after ``reserve_decode_blocks``)."""
        if self.decode_set:
            plan.decodes = self.decode_set.requests()
            plan.decode_context_tokens = self.decode_set.context_tokens
        return plan

    # ------------------------------------------------------------------ step results
    def update_from_output(self, plan: SchedulerOutput, step_index: int, now_s: float) -> None:
        """Apply a finished step at time ``now_s``: tokens sampled, requests finished.

        Decodes advance the decode set's tick (``plan.decodes`` non-empty); prefill chunks
        that reach the end of their tokens sample a token and join the decode set.
        """
        if plan.decodes:
            for r in self.decode_set.advance():
                self._finish(r, now_s)
        for r, num_new in plan.prefills.items():
            r.num_computed_tokens += num_new
            if r.num_computed_tokens < r.num_tokens:
                continue  # a partial chunk: no token yet
            if r in self.prefilling:
                self.prefilling.remove(r)
            r.num_output_tokens += 1
            r.prefill_token_steps.append(step_index)
            if r.num_output_tokens >= r.output_len:
                r.num_computed_tokens = r.num_tokens - 1
                self.running.remove(r)
                self._finish(r, now_s)
            else:
                self.decode_set.add(r)

    def _finish(self, r: Request, now_s: float) -> None:
        if r in self.running:
            self.running.remove(r)
        self.block_manager.free(r)
        r.status, r.finish_s = RequestStatus.FINISHED, now_s

    def _leave_running(self, r: Request) -> None:
        self.running.remove(r)
        if r in self.decode_set:
            self.decode_set.remove(r)
        elif r in self.prefilling:
            self.prefilling.remove(r)



# ---------------------------------------------------------------------- registry
_POLICIES: dict[str, type[Scheduler]] = {}


def register_policy(name: str):
    """Class decorator: register a policy under ``name`` (duplicates are an error)."""

    def wrap(cls: type[Scheduler]) -> type[Scheduler]:
        if name in _POLICIES:
            raise ValueError(f"policy {name!r} is already registered by {_POLICIES[name]}")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return wrap


def policy_names() -> list[str]:
    import policies  # noqa: F401  (registers the built-in policies)

    return sorted(_POLICIES)


def get_policy(name: str) -> type[Scheduler]:
    """The policy class registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    known = policy_names()
    if name not in _POLICIES:
        raise ConfigError(f"unknown policy {name!r}; known policies: {', '.join(known)}")
    return _POLICIES[name]
