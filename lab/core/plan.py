"""The plan of one engine step (``SchedulerOutput``, a plain dataclass as in vLLM V1) and the
executor's answer (``StepResult``). An executor reads only the plan: the cost model its
aggregates (:meth:`SchedulerOutput.features`), a real model its per-sequence inputs
(:meth:`SchedulerOutput.seqs`, built on demand).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sched_lab.core.kv import num_swap_runs
from sched_lab.core.request import Request


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(slots=True)
class StepFeatures:
    """What a step computes, as a cost model needs it (counts in tokens unless named).

    Attributes:
        prefill_context_tokens: sum over chunks of the cached prefix each attends to.
        prefill_attention_pairs: sum over chunks of n * c + n * (n + 1) / 2 (n tokens over c
            cached ones, causal within the chunk).
        decode_context_tokens: sum over decodes of the positions each attends to.
        num_samples: tokens sampled (decodes, prompt-finishing chunks, draft positions).
        num_swap_blocks: blocks copied host <-> device (out + in).
        num_spec_tokens: draft tokens fed for verification (also in ``num_tokens``).
        num_spec_decodes: decodes verifying drafts (also in ``num_decodes``).
        spec_context_tokens: sum over draft tokens of the KV positions each attends to.
        num_swap_runs: host <-> device transfers of the swaps: runs of consecutive CPU block
            ids in the swap-out map plus those in the swap-in map, as the engine copies them
            (:func:`sched_lab.core.kv.num_swap_runs`); 0 without swaps.
        num_loras: distinct LoRA adapters among the step's sequences (0 without LoRA).
        num_lora_tokens: tokens fed by sequences that run an adapter.
        num_lora_loads: adapters loaded host -> GPU before the step (lab/core/lora.py).
    """

    num_prefill_tokens: int
    num_prefills: int
    prefill_context_tokens: int
    prefill_attention_pairs: float
    num_decodes: int
    decode_context_tokens: int
    num_samples: int
    num_swap_blocks: int
    num_spec_tokens: int = 0
    num_spec_decodes: int = 0
    spec_context_tokens: int = 0
    num_swap_runs: int = 0
    num_loras: int = 0
    num_lora_tokens: int = 0
    num_lora_loads: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes + self.num_spec_tokens

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence of a step, for an executor that runs a model.

    Attributes:
        request: read-only for executors.
        start_pos: tokens with KV cached; the step feeds positions
            ``[start_pos, start_pos + num_new_tokens)``.
        num_new_tokens: a prompt chunk, or 1 + d for a decode verifying d drafts.
        block_table: GPU block ids; position p lives in slot
            ``block_table[p // block_size] * block_size + p % block_size``.
        sample: whether a token is sampled after the last fed one.
        num_draft_tokens: d, the last d fed tokens are drafts (sampled after each; the
            accepted prefix plus one is kept).
    """

    request: Request
    start_pos: int
    num_new_tokens: int
    block_table: list[int]
    sample: bool
    num_draft_tokens: int = 0

    def token_ids(self) -> list[int]:
        """The token ids fed (needs ``prompt_token_ids``)."""
        r, lo = self.request, self.start_pos
        hi = lo + self.num_new_tokens
        if lo >= r.prompt_len:  # a decode, or a chunk of generated tokens only
            ids = r.output_token_ids[lo - r.prompt_len : hi - r.prompt_len]
            if self.num_draft_tokens:
                ids += r.spec_token_ids[: self.num_draft_tokens]
            return ids
        return (r.prompt_token_ids + r.output_token_ids)[lo:hi]


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes.

    Attributes:
        prefills: request -> tokens fed from ``r.num_computed_tokens`` (as of the plan); a
            token is sampled when the chunk reaches ``r.num_tokens``.
        decodes: requests that each feed their latest token and sample one more.
        decode_context_tokens: sum of the decodes' token counts (KV positions read).
        preempted: (request, mode) pairs preempted while planning.
        swap_out, swap_in: (from_block, to_block) copies to do before the step.
        aborted: requests dropped while planning (reason set on the request).
        decode_tick: the decode set's tick when planned (see
            :func:`sched_lab.core.decode_set.num_tokens_at`).
        num_cached_tokens, num_cached_blocks: prefix-cache hits of this step's admissions
            (not fed; the chunk starts after them).
        spec_decodes: decode -> d' >= 1 drafts verified (the first d' of
            ``r.spec_token_ids``); others feed one token.
        num_wasted_tokens: async decodes past a request's last token (0 in sync runs).
        sampled_prefills, finished: prompt-finishing chunks, and requests whose last token
            this step samples. These last three are set at ``Scheduler.launched``.
        lora: the scheduler runs LoRA adapters (then :meth:`features` counts them).
        num_lora_loads: adapters loaded into a GPU slot by this step's admissions.
    """

    prefills: dict[Request, int] = field(default_factory=dict)
    decodes: list[Request] = field(default_factory=list)
    decode_context_tokens: int = 0
    preempted: list[tuple[Request, PreemptionMode]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)
    decode_tick: int = 0
    num_cached_tokens: int = 0
    num_cached_blocks: int = 0
    spec_decodes: dict[Request, int] = field(default_factory=dict)
    num_wasted_tokens: int = 0
    sampled_prefills: Sequence[Request] = ()  # a list once set (an empty tuple is free)
    finished: Sequence[Request] = ()
    lora: bool = False
    num_lora_loads: int = 0

    _features: StepFeatures | None = None

    def features(self) -> StepFeatures:
        """The step's :class:`StepFeatures`, cached; first call before the step is applied
        (async: launched), as it reads ``num_computed_tokens``."""
        if self._features is None:
            tokens = context = samples = 0
            pairs = 0.0
            for r, n in self.prefills.items():
                c = r.num_computed_tokens
                tokens += n
                context += c
                pairs += n * c + n * (n + 1) / 2
                samples += c + n == r.num_tokens
            self._features = StepFeatures(
                tokens,
                len(self.prefills),
                context,
                pairs,
                len(self.decodes),
                self.decode_context_tokens,
                samples + len(self.decodes),
                len(self.swap_in) + len(self.swap_out),
            )
            if self.swap_out or self.swap_in:
                self._features.num_swap_runs = num_swap_runs(self.swap_out, self.swap_in)
            if self.spec_decodes:
                self._add_spec_features(self._features)
            if self.lora:
                self._add_lora_features(self._features)
        return self._features

    def _add_lora_features(self, f: StepFeatures) -> None:
        names, tokens, spec = set(), 0, self.spec_decodes
        for r, n in self.prefills.items():
            if r.lora_name:
                names.add(r.lora_name)
                tokens += n
        for r in self.decodes:
            if r.lora_name:
                names.add(r.lora_name)
                tokens += 1 + spec.get(r, 0)
        f.num_loras, f.num_lora_tokens, f.num_lora_loads = len(names), tokens, self.num_lora_loads

    def _add_spec_features(self, f: StepFeatures) -> None:
        tick = self.decode_tick - 1
        drafts = context = 0
        for r, d in self.spec_decodes.items():
            pos = r.prompt_len + r.join_num_output + tick - r.join_tick  # the latest token's
            drafts += d
            context += d * (pos + 1) + d * (d + 1) // 2
        f.num_spec_tokens, f.num_spec_decodes = drafts, len(self.spec_decodes)
        f.spec_context_tokens = context
        f.num_samples += drafts

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens of the plan so far (sum of ``spec_decodes``)."""
        return sum(self.spec_decodes.values()) if self.spec_decodes else 0

    def seqs(self) -> list[ScheduledSeq]:
        """Per-sequence inputs: prefill chunks in plan order, then decodes. Valid until
        ``Scheduler.update`` (async: ``Scheduler.launched``). Async: a decode whose token the
        step in flight samples has ``token_ids() == []`` (the engine feeds it on device)."""
        out = self.prefill_seqs()
        spec = self.spec_decodes
        out += [
            ScheduledSeq(r, pos, 1 + spec.get(r, 0), r.block_table, True, spec.get(r, 0))
            for r, pos in zip(self.decodes, self.decode_positions())
        ]
        return out

    def prefill_seqs(self) -> list[ScheduledSeq]:
        """The prefill chunks of :meth:`seqs` alone."""
        return [
            ScheduledSeq(
                r,
                r.num_computed_tokens,
                n,
                r.block_table,
                r.num_computed_tokens + n == r.num_tokens,
            )
            for r, n in self.prefills.items()
        ]

    def decode_positions(self) -> list[int]:
        """The position each decode feeds (its latest token), in ``decodes`` order."""
        tick = self.decode_tick - 1  # num_tokens_at(r, tick) - 1, inlined: hundreds a step
        return [r.prompt_len + r.join_num_output + tick - r.join_tick for r in self.decodes]

    @property
    def feeds_tokens(self) -> bool:
        """True if some request advances: a decode, or a prefill chunk of >= 1 token."""
        if self.decodes:
            return True
        prefills = self.prefills
        return bool(prefills) and max(prefills.values()) > 0

    @property
    def is_empty(self) -> bool:
        """True if the step would compute and move nothing."""
        return not (self.prefills or self.decodes or self.swap_out or self.swap_in)


@dataclass(slots=True)
class StepResult:
    """What the executor reports back.

    Attributes:
        duration_s: step duration (predicted, or measured wall time on the engine).
        sampled_token_ids: request -> token sampled (engine only); for a spec decode the
            token after its accepted drafts.
        num_accepted: spec decode -> drafts accepted (0..d'; missing = 0).
        draft_token_ids: request -> drafts proposed for its next step (simulator: k
            placeholder ids).
    """

    duration_s: float
    sampled_token_ids: dict[Request, int] = field(default_factory=dict)
    num_accepted: dict[Request, int] = field(default_factory=dict)
    draft_token_ids: dict[Request, list[int]] = field(default_factory=dict)


class Executor(Protocol):
    """Runs a plan; never makes a scheduling decision.

    ``wall_clock``: durations are measured (the replay loop adds the planning time).
    Optional, for asynchronous scheduling, with ``execute(plan) == wait(launch(plan))``:
    ``launch(plan) -> handle`` starts the step and reads the plan's inputs before returning;
    ``wait(handle) -> StepResult`` blocks until it is done. A handle may carry ``host_s``,
    the host seconds inside ``duration_s`` (absent = 0).
    """

    wall_clock: bool

    def execute(self, plan: SchedulerOutput) -> StepResult: ...
