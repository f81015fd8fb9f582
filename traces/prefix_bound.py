"""The infinite-cache upper bound of the prefix hit rate, from hash ids alone.

No block manager is involved: this module reads only ``Request.hash_ids``,
``hash_block_size``, the prompt and output lengths, so that the cache's hit rate can be
checked against it. With a cache that never evicts, a request's prompt can reuse every KV
block an earlier request computed with the same content; that is the most any cache
policy can reach on the trace.

Rules (vLLM V1's automatic prefix caching, with unlimited blocks):

- Content. A KV block of ``block_size`` B tokens lies inside one hash block of H tokens
  (H a multiple of B); KV block k of a request is identified by the chain of its hash ids
  up to hash block j = k*B // H (the ids before it matter: equal ids after different
  prefixes are different content) and its place inside that hash block.
- Lookup. Requests are taken in the given order (``load_trace``'s: by arrival). A
  request's cached tokens are B times the number of leading KV blocks of its prompt
  already seen, counting only full blocks within its first ``prompt_len - 1`` tokens: at
  least one prompt token is always computed, so that the step samples; a prompt of exactly
  m blocks therefore reuses at most m - 1 (vLLM's rule, which never writes into a cached
  block).
- Insertion. After its lookup, a request adds the full KV blocks of the tokens it writes:
  its prompt and output but the last output token (sampled, never fed back), i.e.
  prompt_len + output_len - 1 tokens, as far as its hash ids describe them: the prompt
  only when there are exactly ceil(prompt_len / hash_block_size) ids (Mooncake: the last
  id names a partial prompt block, not the tokens generated after it), else every token the
  ids cover, as the block manager keys them. Ids that cover the output
  (:mod:`traces.prefix` makes them) let a later turn reuse the reply. Order only:
  a request counts as seen by every later one, even one that arrives while it still runs.
- Hit rate = cached tokens / prompt tokens of the requests counted (vLLM's prefix cache hit
  rate). Dropped rows are skipped; so are requests with prompt + output above
  ``max_model_len`` when it is given (the replay rejects them); requests without hash ids
  count their prompt tokens and reuse nothing. Sharing between requests only: a request
  that is preempted and re-finds its own blocks (self-reuse) is not in the bound.

Cost: one dict look-up per hash id of every request, O(total hash ids).

Command: ``sched-lab prefix-bound EXPERIMENT.yaml [--limit N] [--max-model-len N]``
(:func:`lab.cli.prefix_bound`) prints the bound for an experiment's trace at its
``kv_cache.block_size`` (and its ``scheduler.max_model_len`` unless ``--max-model-len`` is
given).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lab.core.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefixBound:
    """Args: request_ids: the requests counted, in the given order; prompt_tokens: their
    prompt tokens in all; cached_tokens: per counted request; num_with_hash_ids: counted
    requests that have hash ids."""

    block_size: int
    request_ids: list[str]
    prompt_tokens: int
    cached_tokens: list[int]
    num_with_hash_ids: int

    @property
    def total_cached_tokens(self) -> int:
        return sum(self.cached_tokens)

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens (0.0 for no request)."""
        return self.total_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_hit_bound(
    requests: Iterable[Request], block_size: int, max_model_len: int | None = None
) -> PrefixBound:
    """The cached prompt tokens of each request with an unlimited prefix cache (module
    docstring for the rules). Reads the requests, never changes them.

    Raises:
        ValueError: ``block_size`` < 1, or a request whose ``hash_block_size`` is not a
            multiple of it.
    """
    if block_size < 1:
        raise ValueError(f"block_size: expected an integer >= 1, got {block_size}")
    B = block_size
    chain: dict[tuple[int, int], int] = {}  # (parent chain key or -1, hash id) -> chain key
    filled: list[int] = []  # per chain key: leading full KV blocks of that hash block seen
    ids_out, cached_out, prompt_tokens, with_ids = [], [], 0, 0
    for r in requests:
        if r.status is RequestStatus.DROPPED:
            continue
        P, out = r.prompt_len, r.output_len
        if max_model_len is not None and P + out > max_model_len:
            continue
        ids_out.append(r.request_id)
        prompt_tokens += P
        if not r.hash_ids:
            cached_out.append(0)
            continue
        with_ids += 1
        H = r.hash_block_size
        if H % B:
            raise ValueError(
                f"request {r.request_id}: hash_block_size {H} is not a multiple of block_size {B}"
            )
        per = H // B  # KV blocks per hash block
        # The ids describe the prompt only when there are ceil(P / H) of them (Mooncake: the
        # last names a partial prompt block), else every token they cover (the block
        # manager's rule, lab/core/kv.py).
        described = P if len(r.hash_ids) == -(-P // H) else len(r.hash_ids) * H
        written = min(P + out - 1, described) // B  # full KV blocks it writes, keyed
        cached_out.append(B * _walk(chain, filled, r.hash_ids, per, (P - 1) // B, written))
    return PrefixBound(B, ids_out, prompt_tokens, cached_out, with_ids)


def _walk(
    chain: dict, filled: list[int], ids: list[int], per: int, limit: int, written: int
) -> int:
    """One pass along a request's id chain: count the leading KV blocks already seen (at
    most ``limit``), and mark its first ``written`` KV blocks as seen. Each chain key is
    met once per request, so the count reads what earlier requests left."""
    hits, matching, parent = 0, True, -1
    for j, h in enumerate(ids):
        here = min(per, written - j * per)  # blocks of this hash block the request writes
        if not matching and here <= 0:
            break
        key = chain.get((parent, h))
        if key is None:
            matching = False
            if here <= 0:
                break
            key = chain[(parent, h)] = len(filled)
            filled.append(0)
        elif matching:
            got = min(filled[key], per, limit - hits)
            hits += got
            matching = filled[key] == per and hits < limit
        if here > filled[key]:
            filled[key] = here
        parent = key
    return hits
