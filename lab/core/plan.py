"""The plan of one engine step (``SchedulerOutput``) and the executor's answer (``StepResult``).

A policy writes a plan; an executor (the cost model, or the real engine in backend/) reads
only the plan to run the step. As in vLLM V1 the plan is a plain dataclass.

Decodes are not entries of ``prefills`` but a list of their own, because the decode batch is
kept in closed form (lab/core/decode_set.py): the cost model needs only the aggregates
(:meth:`SchedulerOutput.features`), and an executor that runs a real model asks for the
per-sequence inputs (:meth:`SchedulerOutput.seqs`: tokens to feed, their positions, block
table), computed from the plan on demand so the simulator never pays for them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lab.core.request import Request


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(slots=True)
class StepFeatures:
    """What a step computes, in the terms a cost model needs (all counts are tokens unless
    named otherwise).

    Attributes:
        num_prefill_tokens: prompt tokens fed (all chunks).
        num_prefills: prefill chunks in the step.
        prefill_context_tokens: sum over chunks of the cached prefix they attend to (KV read).
        prefill_attention_pairs: sum over chunks of (query, key) pairs, causal within the
            chunk: n * c + n * (n + 1) / 2 for a chunk of n tokens over c cached ones.
        num_decodes: decodes (one token each).
        decode_context_tokens: sum over decodes of the positions they attend to.
        num_samples: tokens sampled (decodes + chunks that finish their prompt).
        num_swap_blocks: blocks copied between host and device (out + in).
        num_spec_tokens: draft tokens fed by decodes for verification (speculative
            decoding, lab/core/spec.py); each is a query token (counted in ``num_tokens``,
            the step's budget) and a sampled position (counted in ``num_samples``).
        num_spec_decodes: decodes that verify drafts (also counted in ``num_decodes``).
        spec_context_tokens: sum over draft tokens of the KV positions each attends to
            (the latest token's context plus the drafts before it and itself).
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

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes + self.num_spec_tokens

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence of a step, as an executor that runs a model needs it.

    Attributes:
        request: the request (read-only for executors).
        start_pos: tokens whose KV is cached already (num_computed_tokens); the step feeds
            positions ``[start_pos, start_pos + num_new_tokens)``.
        num_new_tokens: tokens fed this step (a prompt chunk, or 1 + d for a decode
            verifying d draft tokens).
        block_table: GPU block ids, covering at least ``start_pos + num_new_tokens``
            positions; position p lives in slot
            ``block_table[p // block_size] * block_size + p % block_size``.
        sample: whether the step samples a token after the last fed one.
        num_draft_tokens: d, the draft tokens among the fed ones (the last d; a decode with
            speculation): the step samples after each fed token and keeps the accepted
            prefix plus one.
    """

    request: Request
    start_pos: int
    num_new_tokens: int
    block_table: list[int]
    sample: bool
    num_draft_tokens: int = 0

    def token_ids(self) -> list[int]:
        """The token ids fed (prompt then generated tokens; needs ``prompt_token_ids``)."""
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
        prefills: request -> new tokens this step (a whole prompt or a chunk). The chunk
            covers tokens [r.num_computed_tokens, r.num_computed_tokens + n) as of the
            plan; the step samples a token for r when the chunk reaches r.num_tokens.
        decodes: requests that each feed their latest token and sample one more.
        decode_context_tokens: sum over ``decodes`` of their token count (prompt +
            output so far), i.e. the KV positions the decode attention reads.
        preempted: (request, mode) pairs preempted while planning this step.
        swap_out: (gpu_block, cpu_block) copies to do before the step runs.
        swap_in: (cpu_block, gpu_block) copies to do before the step runs.
        aborted: requests dropped while planning (reason set on the request).
        decode_tick: the decode set's tick when planned (the decodes' token counts follow
            from it, see :func:`lab.core.decode_set.num_tokens_at`).
        num_cached_tokens: tokens the admissions of this step found in the prefix cache
            (not fed: each such chunk starts after them and attends to them as context).
        num_cached_blocks: the blocks holding them.
        spec_decodes: decode -> d' >= 1, the draft tokens it verifies this step (the first
            d' of ``r.spec_token_ids``, fed after its latest token at the next positions);
            empty without speculative decoding. Decodes not in it feed one token.
        num_wasted_tokens: decodes of requests whose last token an earlier step already
            sampled (asynchronous scheduling: their slot is wasted; 0 in sync runs). Set
            when the plan is launched (``Scheduler.launched``).
        sampled_prefills: the chunks that finish their prompt (they sample a token), in
            plan order. Set when the plan is launched.
        finished: requests whose last output token this step samples. Set when the plan
            is launched.
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

    _features: StepFeatures | None = None

    def features(self) -> StepFeatures:
        """The step's :class:`StepFeatures`, computed once (call before the step's results
        are applied, or before it is launched under async scheduling: it reads each chunk's
        ``num_computed_tokens``)."""
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
            if self.spec_decodes:
                self._add_spec_features(self._features)
        return self._features

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
        """Per-sequence inputs of the step: prefill chunks in plan order, then decodes (each
        feeds its latest token at :meth:`decode_positions`). Valid until the step's results
        are applied (``Scheduler.update``), under async scheduling until it is launched
        (``Scheduler.launched``); O(sequences), so the simulator never calls it. Async: a
        decode's token is a placeholder (not in ``output_token_ids`` yet) when the step in
        flight samples it; ``token_ids`` then returns [] and the engine feeds it from that
        step's sampled tokens on the device."""
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
        """The position each decode feeds (its latest token), in ``decodes`` order: one
        list comprehension, for executors that build their own per-sequence inputs."""
        tick = self.decode_tick - 1  # num_tokens_at(r, tick) - 1, inlined: hundreds a step
        return [r.prompt_len + r.join_num_output + tick - r.join_tick for r in self.decodes]

    @property
    def feeds_tokens(self) -> bool:
        """True if some request advances: a decode, or a prefill chunk of >= 1 token."""
        return bool(self.decodes) or any(n > 0 for n in self.prefills.values())

    @property
    def is_empty(self) -> bool:
        """True if the step would compute and move nothing."""
        return not (self.prefills or self.decodes or self.swap_out or self.swap_in)


@dataclass(slots=True)
class StepResult:
    """What the executor reports back.

    Attributes:
        duration_s: step duration in seconds (predicted by the cost model, or measured
            wall time on the engine).
        sampled_token_ids: request -> token id sampled this step (engine only; the
            simulator leaves it empty). For a decode of ``plan.spec_decodes``: the token
            sampled after its accepted drafts (the bonus token, or the correction).
        num_accepted: spec decode -> drafts accepted (0 .. d' of ``plan.spec_decodes``; a
            missing entry counts as 0). The request gains accepted + 1 tokens.
        draft_token_ids: request -> the drafts proposed for its next step (for requests that
            sampled a token; a sampled request without an entry has none). Engine: the
            proposer's; simulator: k placeholder ids.
    """

    duration_s: float
    sampled_token_ids: dict[Request, int] = field(default_factory=dict)
    num_accepted: dict[Request, int] = field(default_factory=dict)
    draft_token_ids: dict[Request, list[int]] = field(default_factory=dict)


class Executor(Protocol):
    """Runs a plan. Never makes a scheduling decision.

    ``wall_clock``: True if durations are measured wall time; the replay loop then adds the
    wall time the policy spent planning the step, so a step costs what it cost for real.

    Asynchronous scheduling (lab/sim/replay.py) uses two optional methods, with
    ``execute(plan) == wait(launch(plan))``:

    * ``launch(plan) -> handle``: start the step and return at once (the engine enqueues it
      behind the step in flight; the plan's decodes of requests whose latest token is not
      known yet read it from the previous step's sampled tokens on the device). The plan's
      inputs are read here: the scheduler advances its token counts right after.
    * ``wait(handle) -> StepResult``: block until the step is done.

    A handle may carry ``host_s``: the seconds of host work (planning, input preparation)
    inside the step's ``duration_s`` (the simulator's cost model; absent = 0). An executor
    without ``launch``/``wait`` runs each step at launch (``execute``).
    """

    wall_clock: bool

    def execute(self, plan: SchedulerOutput) -> StepResult: ...
