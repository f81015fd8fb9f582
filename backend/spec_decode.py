"""Speculative decoding on the engine: proposers, the verify step, and the drafts' KV.

A decoding request with ``d'`` drafts is one row of ``1 + d'`` query tokens (vLLM V1's
rule, lab/core/scheduler.py); verification is backend/verify.py. Proposers (``method``):
``ngram`` (vLLM's prompt lookup), ``draft`` (a smaller model of the same vocabulary) and
``synthetic`` (random drafts with seeded acceptance: a timing device for random-weight
models, never a quality claim; it writes the target's tokens into
``r.spec_token_ids[:accepted]``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.engine import EngineExecutor
from sched_lab.backend.errors import KVCacheCapacityError
from sched_lab.backend.inputs import SeqInput
from sched_lab.backend.sampler import sample
from sched_lab.backend.verify import rejection_sample, verify_greedy
from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import PreemptionMode, SchedulerOutput, StepResult
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.spec import draft_vocab_error

METHODS = ("ngram", "draft", "synthetic")
_DONE = (
    RequestStatus.FINISHED,
    RequestStatus.ABORTED,
    RequestStatus.REJECTED,
    RequestStatus.UNFINISHED,
)


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``tokens`` (n from ``n_max`` down to ``n_min``)."""
    size = len(tokens)
    if size < 2:
        return []
    # candidate ends i <= size - 2 of an earlier match: tokens[i] equals the last token
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        hits = ends[ends >= n - 1]
        for t in range(1, n):  # the window tokens[i - n + 1 .. i] equals the suffix
            hits = hits[tokens[hits - t] == tokens[size - 1 - t]]
        if hits.size:
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


class TokenHistory:
    """Each request's tokens (prompt + output) as a growing int64 array."""

    def __init__(self) -> None:
        self.buf: dict[Request, np.ndarray] = {}
        self.size: dict[Request, int] = {}

    def tokens(self, r: Request) -> np.ndarray:
        """The request's tokens as of the plan (rebuilt if the request changed elsewhere)."""
        n = r.prompt_len + len(r.output_token_ids)
        if self.size.get(r) != n:
            toks = np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int64)
            self.buf[r] = np.concatenate([toks, np.zeros(max(64, n), dtype=np.int64)])
            self.size[r] = n
        return self.buf[r][:n]

    def extend(self, r: Request, new: Sequence[int]) -> np.ndarray:
        """Append ``new`` (after :meth:`tokens`); returns all tokens."""
        n, buf = self.size[r], self.buf[r]
        if n + len(new) > len(buf):
            buf = self.buf[r] = np.concatenate([buf, np.zeros(len(buf), dtype=np.int64)])
        buf[n : n + len(new)] = new
        self.size[r] = n + len(new)
        return buf[: n + len(new)]

    def drop(self, r: Request) -> None:
        self.buf.pop(r, None)
        self.size.pop(r, None)


@dataclass
class Advance:
    """One request's tokens after a step: ``num_known`` of ``tokens`` are known, and how
    many drafts to propose (0 for an unfinished prefill chunk)."""

    request: Request
    tokens: np.ndarray
    num_known: int
    num_propose: int


class NgramProposer:
    method = "ngram"

    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.n_min, self.n_max = k, prompt_lookup_min, prompt_lookup_max
        self.draft_probs = None

    def begin_step(self, plan: SchedulerOutput) -> None:
        pass

    def forget(self, r: Request) -> None:
        pass

    def propose(self, items: list[Advance]) -> dict[Request, list[int]]:
        return {
            a.request: ngram_propose(a.tokens, a.num_propose, self.n_min, self.n_max)
            for a in items
            if a.num_propose
        }


class SyntheticProposer:
    """Random drafts and a seeded acceptance draw. ``acceptance_rates[i]``: probability that
    draft i + 1 is accepted given drafts 1..i were (the last rate repeats)."""

    method = "synthetic"

    def __init__(self, k: int, acceptance_rates: Sequence[float], vocab_size: int,
                 seed: int) -> None:  # fmt: skip
        rates = list(acceptance_rates) or [0.0]
        self.k, self.vocab_size = k, vocab_size
        self.rates = np.array((rates + [rates[-1]] * k)[:k], dtype=np.float64)
        self.rng = np.random.default_rng(seed)
        self.draft_probs = None

    def begin_step(self, plan: SchedulerOutput) -> None:
        pass

    def forget(self, r: Request) -> None:
        pass

    def propose(self, items: list[Advance]) -> dict[Request, list[int]]:
        items = [a for a in items if a.num_propose]
        ids = self.rng.integers(0, self.vocab_size, (len(items), self.k)).tolist()
        return {a.request: row[: a.num_propose] for a, row in zip(items, ids, strict=True)}

    def accepted(self, num_draft: np.ndarray) -> np.ndarray:
        """(S,) accepted drafts: a prefix drawn per row, at most ``num_draft[i]``."""
        k = int(num_draft.max(initial=0))
        ok = self.rng.random((len(num_draft), k)) < self.rates[:k]
        ok &= np.arange(k)[None, :] < num_draft[:, None]
        return np.cumprod(ok, axis=1).sum(axis=1)


@dataclass
class _DraftSeq:
    computed: int = 0  # positions [0, computed) hold the draft's KV of the known tokens
    blocks: list[int] = field(default_factory=list)


class DraftProposer:
    """A smaller model of the target's vocabulary proposes k tokens per request per step.

    Its runner has its own paged cache of ``target blocks + max_num_seqs * (ceil(k /
    block_size) + 1)`` blocks and block tables kept here (unknown to the scheduler), on top
    of the target's memory budget; no prefix cache. A recompute victim's draft KV is
    dropped; a swap victim's stays. When full, requests outside the step lose their draft KV
    first; a request that still does not fit gets no drafts that step.
    """

    method = "draft"

    def __init__(self, runner, k: int, temperature: float) -> None:  # a ModelRunner
        self.runner, self.k, self.temperature = runner, k, temperature
        self.bs = runner.block_size
        self.free = list(range(runner.num_gpu_blocks - 1, -1, -1))  # pop() -> lowest first
        self.seqs: dict[Request, _DraftSeq] = {}
        # (n, V) float32 distributions the last drafts were sampled from (temperature > 0)
        self.draft_probs: dict[Request, torch.Tensor] | None = {} if temperature > 0 else None

    def begin_step(self, plan: SchedulerOutput) -> None:
        for r in [r for r in self.seqs if r.status in _DONE] + list(plan.aborted):
            self.forget(r)
        for r, mode in plan.preempted:
            if mode is PreemptionMode.RECOMPUTE:
                self.forget(r)

    def forget(self, r: Request) -> None:
        s = self.seqs.pop(r, None)
        if s is not None:
            self.free.extend(reversed(s.blocks))
        if self.draft_probs is not None:
            self.draft_probs.pop(r, None)

    def _reserve(self, r: Request, positions: int, step: set[Request]) -> _DraftSeq | None:
        """The request's draft state with blocks for ``positions``; None if they do not fit
        even after dropping the draft KV of requests outside the step."""
        s = self.seqs.setdefault(r, _DraftSeq())
        need = -(-positions // self.bs) - len(s.blocks)
        if need > len(self.free):
            for other in [o for o in self.seqs if o not in step]:
                self.forget(other)
                if need <= len(self.free):
                    break
        if need > len(self.free):
            return None
        s.blocks += [self.free.pop() for _ in range(max(0, need))]
        return s

    def propose(self, items: list[Advance]) -> dict[Request, list[int]]:
        step = {a.request for a in items}
        seqs, owners, rows, row = [], [], [], 0
        for a in items:
            n_feed_end = a.num_known + max(a.num_propose, 1) - 1  # positions the draft writes
            s = self._reserve(a.request, n_feed_end, step)
            if s is None:
                continue
            s.computed = min(s.computed, a.num_known - (a.num_propose > 0))
            if s.computed >= a.num_known:
                continue  # nothing new to feed
            toks = a.tokens[s.computed : a.num_known].tolist()
            seqs.append(SeqInput(toks, s.computed, s.blocks, a.num_propose > 0))
            row += len(toks)
            s.computed = a.num_known
            if a.num_propose:
                owners.append(a)
                rows.append(row - 1)
        if not seqs:
            return {}
        logits = self.runner.logits_at(seqs, rows)
        drafts: dict[Request, list[int]] = {a.request: [] for a in owners}
        probs: dict[Request, list[torch.Tensor]] = {a.request: [] for a in owners}
        live = owners
        for j in range(self.k):
            tokens = self._sample(logits)
            for a, t, q in zip(live, tokens.tolist(), self._probs(logits), strict=True):
                drafts[a.request].append(t)
                if q is not None:
                    probs[a.request].append(q)
            live = [a for a in live if a.num_propose > j + 1]
            if not live:
                break
            step_seqs = []
            for a in live:
                s = self.seqs[a.request]
                step_seqs.append(SeqInput([drafts[a.request][-1]], s.computed, s.blocks, True))
                s.computed += 1
            logits = self.runner.logits_at(step_seqs, range(len(step_seqs)))
        if self.draft_probs is not None:
            for r, qs in probs.items():
                self.draft_probs[r] = torch.stack(qs)
        return drafts

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        temps = [self.temperature] * logits.shape[0]
        return sample(logits, temps, self.runner.generator)

    def _probs(self, logits: torch.Tensor) -> list[torch.Tensor | None]:
        if self.temperature == 0:
            return [None] * logits.shape[0]
        return list((logits / self.temperature).softmax(dim=-1))


class SpecDecoder:
    """Runs plans with speculative decoding on a target :class:`ModelRunner`."""

    def __init__(self, runner, proposer, k: int, temperature: float) -> None:
        self.runner, self.proposer, self.k, self.temperature = runner, proposer, k, temperature
        self.history = TokenHistory()

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        runner, temp = self.runner, self.temperature
        if plan.swap_out:
            runner.swap_out(plan.swap_out)
        if plan.swap_in:
            runner.swap_in(plan.swap_in)
        self.proposer.begin_step(plan)
        for r in [r for r in self.history.size if r.status in _DONE]:
            self.history.drop(r)
        seqs: list[SeqInput] = []
        owners: list[Request] = []  # sampled sequences, in order
        drafts: list[list[int]] = []  # their drafts fed this step
        rows: list[int] = []  # their logits rows: every fed position of a verify row
        chunks: list[tuple[Request, int]] = []  # prompt chunks that sample nothing
        row = 0
        for s in plan.prefill_seqs():
            seqs.append(SeqInput(s.token_ids(), s.start_pos, s.block_table, s.sample, temp))
            row += s.num_new_tokens
            if s.sample:
                owners.append(s.request)
                drafts.append([])
                rows.append(row - 1)
            else:
                chunks.append((s.request, s.start_pos + s.num_new_tokens))
        spec = plan.spec_decodes
        for r, pos in zip(plan.decodes, plan.decode_positions()):
            d = r.spec_token_ids[: spec.get(r, 0)]
            seqs.append(SeqInput([r.output_token_ids[-1], *d], pos, r.block_table, True, temp))
            rows.extend(range(row, row + 1 + len(d)))
            row += 1 + len(d)
            owners.append(r)
            drafts.append(d)
        logits = runner.logits_at(seqs, rows)
        accepted, next_tokens, forced = self._verify(owners, drafts, logits)
        result = StepResult(0.0)
        items = [Advance(r, self.history.tokens(r), n, 0) for r, n in chunks]
        for i, r in enumerate(owners):
            a, d = accepted[i], drafts[i]
            if d:
                result.num_accepted[r] = a
                if forced is not None:  # synthetic: the accepted tokens are the target's
                    r.spec_token_ids[:a] = forced[i][:a]
            result.sampled_token_ids[r] = next_tokens[i]
            self.history.tokens(r)
            toks = self.history.extend(r, [*r.spec_token_ids[:a], next_tokens[i]])
            outputs = len(r.output_token_ids) + a + 1
            n = min(self.k, r.output_len - outputs - 1, runner.max_model_len - len(toks))
            if n > 0:  # a request without drafts to come needs no draft KV either
                items.append(Advance(r, toks, len(toks), n))
        proposed = self.proposer.propose(items)
        result.draft_token_ids = {r: proposed.get(r, []) for r in owners}
        runner.synchronize()
        result.duration_s = time.perf_counter() - t0
        return result

    def _verify(self, owners: list[Request], drafts: list[list[int]],
                logits: torch.Tensor) -> tuple[list[int], list[int], list[list[int]] | None]:  # fmt: skip
        """(accepted drafts, next token) per sampled sequence, and for ``synthetic`` the
        target's tokens at each row (forced as the accepted ones)."""
        if not owners:
            return [], [], None
        dev = logits.device
        num = [len(d) for d in drafts]
        k = max(num, default=0)
        starts = np.cumsum([0] + [n + 1 for n in num[:-1]])
        index = torch.from_numpy(starts[:, None] + np.minimum(np.arange(k + 1)[None, :],
                                                              np.array(num)[:, None]))  # fmt: skip
        index = index.to(dev)  # (S, K + 1) logits rows of each sequence, last one repeated
        draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long)
        draft_ids = draft_ids.reshape(len(drafts), k).to(dev)
        num_draft = torch.tensor(num, dtype=torch.long).to(dev)
        gen = self.runner.generator
        if self.proposer.method == "synthetic":
            target = sample(logits, [self.temperature] * logits.shape[0], gen)[index].tolist()
            acc = self.proposer.accepted(np.array(num, dtype=np.int64)).tolist()
            return acc, [t[a] for t, a in zip(target, acc, strict=True)], target
        if self.temperature == 0:
            accepted, tokens = verify_greedy(logits.argmax(dim=-1)[index], draft_ids, num_draft)
        else:
            probs = (logits / self.temperature).softmax(dim=-1)[index]  # (S, K + 1, V)
            accepted, tokens = rejection_sample(probs, draft_ids, num_draft,
                                                self._draft_probs(owners, num, k, probs), gen)  # fmt: skip
        return accepted.tolist(), tokens.tolist(), None

    def _draft_probs(self, owners: list[Request], num: list[int], k: int,
                     probs: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
        """(S, K, V) the draft model's distributions of the fed drafts (zeros where none);
        None for point-mass proposals."""
        stored = self.proposer.draft_probs
        if stored is None or k == 0:
            return None
        q = probs.new_zeros(len(owners), k, probs.shape[-1])
        for i, (r, n) in enumerate(zip(owners, num, strict=True)):
            if n:
                q[i, :n] = stored[r][:n]
        return q


class SpecExecutor(EngineExecutor):
    """An :class:`EngineExecutor` whose every plan runs through a :class:`SpecDecoder`.
    Synchronous scheduling only (``launch`` refuses)."""

    def __init__(self, spec: SpecDecoder) -> None:
        super().__init__(spec.runner, spec.temperature)
        self.spec = spec

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return self.spec.execute(plan)

    def launch(self, plan: SchedulerOutput):
        raise ConfigError(ASYNC_ERROR)


ASYNC_ERROR = (
    "speculative: the engine runs speculative decoding with synchronous scheduling only; "
    "set async_scheduling: false for this policy"
)


def make_spec_decoder(
    runner,
    method: str,
    num_speculative_tokens: int,
    temperature: float = 0.0,
    *,
    prompt_lookup_min: int = 1,
    prompt_lookup_max: int = 4,
    model: str | Path | None = None,
    acceptance_rates: Sequence[float] = (),
    seed: int = 0,
    max_num_seqs: int = 256,
    draft_runner_kwargs: dict | None = None,
) -> SpecDecoder:
    """A :class:`SpecDecoder` for the target ``runner``; ``draft`` loads ``model`` into a
    second ModelRunner on the target's device, dtype, backend and block size
    (``draft_runner_kwargs`` override). Another vocabulary raises ConfigError."""
    k = num_speculative_tokens
    if method not in METHODS:
        raise ConfigError(
            f"speculative.method: expected one of {', '.join(METHODS)}, got {method!r}"
        )
    if not hasattr(runner, "logits_at"):
        raise ConfigError(
            "speculative decoding needs a single-device runner (tensor_parallel_size 1)"
        )
    if method == "ngram":
        proposer = NgramProposer(k, prompt_lookup_min, prompt_lookup_max)
    elif method == "synthetic":
        proposer = SyntheticProposer(k, acceptance_rates, runner.config.vocab_size, seed)
    else:
        proposer = DraftProposer(load_draft(runner, model, k, max_num_seqs, draft_runner_kwargs),
                                 k, temperature)  # fmt: skip
    return SpecDecoder(runner, proposer, k, temperature)


def load_draft(target, model: str | Path | None, k: int, max_num_seqs: int,
               overrides: dict | None = None):  # fmt: skip
    """The draft's ModelRunner, after checking that its vocabulary is the target's."""
    from sched_lab.backend.runner import ModelRunner

    if model is None:
        raise ConfigError("speculative.model: method draft needs the draft checkpoint's directory")
    path = Path(model).expanduser()
    error = draft_vocab_error(str(path), ModelConfig.from_dir(path).vocab_size,
                              target.config.vocab_size)  # fmt: skip
    if error:
        raise ConfigError(error)
    bs = target.block_size
    kwargs = dict(
        device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."),
        attention_backend=target.attn_backend.name,
        block_size=bs,
        num_gpu_blocks=target.num_gpu_blocks + max_num_seqs * (-(-k // bs) + 1),
        swap_space_bytes=0,
        max_model_len=target.max_model_len,
        max_num_seqs=max_num_seqs,
        cuda_graphs=target.graphs is not None,
        # the target's largest mixed graph (the draft's catch-up steps are about as large)
        max_num_batched_tokens=max(target.graphs.token_sizes, default=8192)
        if target.graphs
        else 8192,
    )
    kwargs.update(overrides or {})
    try:
        return ModelRunner(path, **kwargs)
    except torch.OutOfMemoryError:
        raise KVCacheCapacityError(
            f"speculative.model: the draft {path} and its KV cache ({kwargs['num_gpu_blocks']} "
            f"blocks) do not fit beside the target's; lower kv_cache.gpu_memory_utilization "
            f"or set kv_cache.num_gpu_blocks"
        ) from None


def spec_decoder_from(config, runner, temperature: float, seed: int, max_num_seqs: int,
                      drafts: dict | None = None) -> SpecDecoder | None:  # fmt: skip
    """A :class:`SpecDecoder` from a ``speculative:`` config block, or None. ``drafts``
    caches draft runners by checkpoint across runs."""
    if config is None:
        return None
    if getattr(runner, "lora", None) is not None:
        raise ConfigError("speculative: speculative decoding with LoRA adapters is not implemented")
    method, k = config.method, config.num_speculative_tokens
    kw = dict(
        prompt_lookup_min=getattr(config, "prompt_lookup_min", None) or 1,
        prompt_lookup_max=getattr(config, "prompt_lookup_max", None) or 4,
        acceptance_rates=list(getattr(config, "acceptance_rates", None) or ()),
        seed=seed if getattr(config, "seed", None) is None else config.seed,
    )
    if method != "draft":
        return make_spec_decoder(runner, method, k, temperature, **kw)
    model = getattr(config, "model", None)
    key = (str(model), k, max_num_seqs)
    if drafts is None or key not in drafts:
        draft = load_draft(runner, model, k, max_num_seqs)
        if drafts is not None:
            drafts.clear()
            drafts[key] = draft
    else:
        draft = drafts[key]
    draft.generator.manual_seed(kw["seed"])
    return SpecDecoder(runner, DraftProposer(draft, k, temperature), k, temperature)
