"""Prompt token ids made from hash ids, so that the engine really shares prefixes: each hash
id stands for a fixed block of ``hash_block_size`` ids drawn uniformly from the vocabulary
by a stream seeded by (seed, hash id) alone; a prompt is its ids' blocks cut to
``prompt_len``."""

from __future__ import annotations

import numpy as np

from sched_lab.core.request import Request

_SALT = 0x746F6B73  # "toks": this module's streams, apart from any other seeded draw


def token_block(hash_id: int, hash_block_size: int, vocab_size: int, seed: int) -> np.ndarray:
    """The ``hash_block_size`` token ids (int64, each in 0..vocab_size-1) of one hash id."""
    rng = np.random.default_rng([_SALT, seed, hash_id])
    return rng.integers(0, vocab_size, size=hash_block_size, dtype=np.int64)


def prompt_tokens_from_hash_ids(
    hash_ids: list[int],
    prompt_len: int,
    hash_block_size: int,
    vocab_size: int,
    seed: int,
    blocks: dict[int, np.ndarray] | None = None,
) -> list[int]:
    """The first ``prompt_len`` tokens of the concatenated blocks of ``hash_ids``.
    ``blocks``: a memo by hash id, shared across calls with the same block size, vocabulary
    and seed. ValueError if there are fewer ids than ceil(prompt_len / hash_block_size)."""
    need = -(-prompt_len // hash_block_size)
    if len(hash_ids) < need:
        raise ValueError(
            f"{len(hash_ids)} hash ids of {hash_block_size} tokens cannot make a prompt of "
            f"{prompt_len} tokens"
        )
    blocks = {} if blocks is None else blocks
    parts = []
    for h in hash_ids[:need]:
        if h not in blocks:
            blocks[h] = token_block(h, hash_block_size, vocab_size, seed)
        parts.append(blocks[h])
    return np.concatenate(parts)[:prompt_len].tolist()


def assign_hash_prompt_tokens(requests: list[Request], vocab_size: int, seed: int) -> None:
    """Give every request with hash ids and no token ids its prompt from them (mutates)."""
    memo: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # hash_block_size -> blocks
    for r in requests:
        if r.prompt_token_ids is None and r.hash_ids:
            blocks = memo.setdefault((r.hash_block_size, vocab_size), {})
            r.prompt_token_ids = prompt_tokens_from_hash_ids(
                r.hash_ids, r.prompt_len, r.hash_block_size, vocab_size, seed, blocks
            )
