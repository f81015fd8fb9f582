"""A request of a trace and its runtime state.

Token counts follow vLLM: ``num_tokens`` = prompt + output tokens generated so far, and
``num_computed_tokens`` = tokens whose KV is in the cache. A step that feeds the last
uncomputed token samples one new output token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Why a request ends at its ``output_len`` (vLLM's finish reasons): "length" (max_tokens: the
#: scheduler knows it) or "stop" (an EOS token or a stop string: it learns it from the output).
FINISH_REASONS = ("length", "stop")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the engine samples one request's tokens (vLLM's names); the simulator ignores it.

    Args:
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature); None = the
            engine's configured ``engine.temperature``.
        top_p: nucleus sampling: only the most likely tokens whose probabilities sum to
            ``top_p`` can be drawn (the most likely one always can); 1.0 = off.
        seed: None = the engine's generator (draws depend on the batch); an int gives the
            request its own reproducible stream: the same seed and prompt give the same
            tokens whatever runs beside them.
    """

    temperature: float | None = None
    top_p: float = 1.0
    seed: int | None = None


class EmptyList(list):
    """The one shared empty list (:data:`EMPTY`) a :class:`Request`'s list fields start
    as, and go back to when emptied for good: a million requests would otherwise hold seven
    empty lists each (~0.5 GB). It reads as ``[]``; ``r.x += items`` gives ``r.x`` a new
    list; mutating it in place raises TypeError, so a writer first gives the request a list
    of its own (``if r.x is EMPTY: r.x = [...]``)."""

    __slots__ = ()
    __hash__ = object.__hash__  # one instance, compared by identity: a dataclass default

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError("Request: the shared EMPTY list is read-only; assign a list instead")

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __imul__ = _refuse  # type: ignore[assignment]

    def __iadd__(self, items):  # type: ignore[override, misc]
        return list(items)

    def __reduce__(self) -> str:
        # pickle, copy.copy and copy.deepcopy give EMPTY itself (the module's global), not
        # another read-only instance that ``r.x is EMPTY`` would not recognize
        return "EMPTY"


#: The shared empty list of every :class:`Request` list field that has no items yet.
EMPTY = EmptyList()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"  # ended by the scheduler before its end (e.g. it can no longer fit)
    UNFINISHED = "unfinished"  # not ended when the run stopped (a failed step, a deadlock)
    DROPPED = "dropped"  # a trace row that is not replayed (see traces/table.py), with a reason


@dataclass(eq=False, slots=True)
class Request:
    """One trace request.

    Args:
        request_id: unique within a trace.
        arrival_s: seconds from the trace start (>= 0; NaN for a dropped row, never replayed).
        prompt_len: prompt tokens (>= 1).
        output_len: output tokens (>= 1), generated exactly (as with ignore_eos).
        prompt_token_ids: real prompt tokens, engine backend only (None in traces).
        hash_ids: hash id i names tokens ``[i * hash_block_size, (i + 1) * hash_block_size)``
            of prompt + output; equal ids at equal positions mean equal content up to there
            (Mooncake traces). The prefix cache keys blocks by them.
        priority: lower runs first (vLLM's convention).
        class_name: workload class (traces/classes.py); "" for a single trace.
        tenant: "" = no tenant.
        ttft_slo_s: the class's TTFT target in seconds, or None.
        hash_block_size: tokens per hash id (Mooncake's 512); a multiple of the KV block
            size when the prefix cache is on.
        lora_name: the LoRA adapter the request runs with (vLLM's ``lora_request.lora_name``);
            "" = the base model. Part of every prefix-cache key: adapters share no block.
        cache_salt: vLLM's ``cache_salt``; "" = none. Part of the first block's prefix-cache
            key (so of every key after it): requests share cached blocks only with requests
            of the same salt, e.g. one tenant's.
        finish_reason: why the request ends at ``output_len`` (vLLM's finish reasons):
            ``"length"`` (max_tokens, a trace row's known length: the scheduler foresees
            the end) or ``"stop"`` (an EOS token or a stop string: it does not). Matters
            only under asynchronous scheduling (docs/ARCHITECTURE.md, "Scheduler rules").
        sampling_params: the engine's per-request sampling (a served request's
            ``temperature``, ``top_p``, ``seed``); None = the engine's configured sampling.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    hash_ids: list[int] | None = None
    priority: int = 0
    class_name: str = ""
    tenant: str = ""
    ttft_slo_s: float | None = None
    hash_block_size: int = 512
    lora_name: str = ""
    cache_salt: str = ""
    finish_reason: str = "length"
    sampling_params: SamplingParams | None = None

    # Runtime state, owned by the scheduler (lab/core/scheduler.py). Its lists start as the
    # shared EMPTY (read-only): a writer assigns a list of its own first.
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    block_table: list[int] = EMPTY
    reason: str = ""
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_recomputed_tokens: int = 0  # KV tokens dropped by recompute preemptions (redone)
    # When the request first entered a running batch (seconds); -1 = never.
    first_scheduled_s: float = -1.0
    finish_s: float = -1.0
    # Output token times, stored without per-token work (see lab/core/decode_set.py):
    # ``prefill_token_steps``: step indices whose end produced a token by finishing a prefill;
    # ``decode_segments``: half-open ranges [start, end) of decode ticks, one token per tick.
    prefill_token_steps: list[int] = EMPTY
    decode_segments: list[tuple[int, int]] = EMPTY
    # Decode-set bookkeeping (valid while status is RUNNING and the prefill is done).
    join_tick: int = -1
    join_num_output: int = 0
    output_token_ids: list[int] = EMPTY
    # Prefix cache (lab/core/kv.py PrefixCachingBlockManager; zero when it is off).
    # ``num_cached_tokens``: tokens found in the cache at the first admission (KV computed by
    # other requests or earlier turns: true sharing; vLLM's name). ``num_resumed_cached_tokens``:
    # tokens found at re-admissions after recompute preemptions, summed (mostly the request's
    # own blocks, kept by key when it was preempted: self-reuse, not sharing).
    num_cached_tokens: int = 0
    num_resumed_cached_tokens: int = 0
    # Chained key heads of the blocks whose content is known, computed on demand (one a hash
    # id, block j under head j // (hash_block_size // block_size); else one a block), and how
    # many leading blocks of ``block_table`` have been offered to the cache (hits, or
    # registered after being computed).
    block_hashes: list[int] = EMPTY
    num_registered_blocks: int = 0
    # Speculative decoding (lab/core/spec.py; empty when it is off). ``spec_token_ids``: the
    # draft tokens proposed for the request's next step (set by ``Scheduler.update`` from
    # ``StepResult.draft_token_ids``; placeholder ids in the simulator). ``spec_steps``: one
    # (step index, drafts scheduled d', drafts accepted a) per step that verified drafts of
    # the request; that step's end produced 1 + a tokens, the one its decode tick records
    # (``decode_segments``) and a extra ones.
    spec_token_ids: list[int] = EMPTY
    spec_steps: list[tuple[int, int, int]] = EMPTY

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"request {self.request_id}: finish_reason: expected one of "
                f"{', '.join(FINISH_REASONS)}, got {self.finish_reason!r}"
            )

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far (materialized state; see DecodeSet for live ones)."""
        return self.prompt_len + self.num_output_tokens

    @property
    def end_foreseen(self) -> bool:
        """Whether the scheduler knows the request ends at ``output_len`` before the token
        that ends it is sampled (an end by length)."""
        return self.finish_reason == "length"

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens scheduled for verification (vLLM's ``num_draft_tokens``)."""
        return sum(d for _, d, _ in self.spec_steps)

    @property
    def num_accepted_tokens(self) -> int:
        """Draft tokens accepted (vLLM's ``num_accepted_tokens``)."""
        return sum(a for _, _, a in self.spec_steps)

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap
