"""The infinite-cache upper bound of the prefix hit rate, from hash ids alone.

Rules (vLLM V1's automatic prefix caching with unlimited blocks), requests in the given
order:

- KV block k (B tokens, inside hash block j = k*B // H) is identified by the request's
  adapter and cache salt (``lora_name``, ``cache_salt``: the chain's root), the hash-id
  chain up to j and its place in that hash block.
- Lookup: cached tokens = B times the leading full KV blocks already seen within the first
  ``prompt_len - 1`` tokens (one prompt token is always computed).
- Insertion: the full KV blocks of prompt_len + output_len - 1 tokens, as far as the ids
  cover them (the prompt only when there are exactly ceil(prompt_len / H) ids).
- Hit rate = cached / prompt tokens. Dropped rows, and requests over ``max_model_len`` when
  given, are skipped; requests without ids reuse nothing; self-reuse is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sched_lab.core.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefixBound:
    """request_ids: the requests counted, in order; prompt_tokens: their total;
    cached_tokens: per counted request; num_with_hash_ids: counted requests with ids."""

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
    rules); does not mutate the requests.

    Raises:
        ValueError: ``block_size`` < 1, or a ``hash_block_size`` that is not a multiple of it.
    """
    if block_size < 1:
        raise ValueError(f"block_size: expected an integer >= 1, got {block_size}")
    B = block_size
    chain: dict[tuple, int] = {}  # (parent chain key or (adapter, salt), hash id) -> chain key
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
        root = (r.lora_name, r.cache_salt)
        cached_out.append(B * _walk(chain, filled, r.hash_ids, per, (P - 1) // B, written, root))
    return PrefixBound(B, ids_out, prompt_tokens, cached_out, with_ids)


def _walk(
    chain: dict,
    filled: list[int],
    ids: list[int],
    per: int,
    limit: int,
    written: int,
    root: tuple[str, str],
) -> int:
    """Count the leading KV blocks of a request's chain from ``root`` already seen (at most
    ``limit``), and mark its first ``written`` blocks as seen."""
    hits, matching, parent = 0, True, root
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
