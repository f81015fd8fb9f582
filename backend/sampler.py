"""Next-token sampling: greedy (temperature 0) or from softmax(logits / temperature), with
per-row nucleus (top-p) filtering and per-row seeds.

A seeded row draws with its own generator, seeded from (request seed, position of the
sampled token) by :func:`step_seed`: the token depends only on the row's logits, its seed and
its position, not on the batch it ran in nor on the steps before (so a recompute after a
preemption draws the same token again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sched_lab.backend.inputs import SeqInput

MASK64 = (1 << 64) - 1


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    generator: torch.Generator,
    top_ps: list[float] | None = None,
    seeds: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: (n, vocab_size) float32.
        temperatures: n values; 0 = greedy (first index on ties), > 0 samples from
            softmax(logits / temperature).
        generator: seeded, on the logits' device; draws the rows without a seed.
        top_ps: n values in [0, 1], or None (all 1.0: no filtering); a sampled row draws
            only among its most likely tokens whose probabilities sum to top_p (its most
            likely token always stays).
        seeds: n generator seeds (None: the row draws with ``generator``), or None.
    Returns:
        (n,) int64 token ids on the logits' device.
    """
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    temps = torch.tensor(temperatures, dtype=torch.float32).to(logits.device, non_blocking=True)
    probs = (logits / temps.clamp(min=1e-6)[:, None]).softmax(dim=-1)
    if top_ps is not None and any(p < 1 for p in top_ps):
        probs = top_p_filter(probs, top_ps)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    for i, seed in enumerate(seeds or ()):
        if seed is not None and temperatures[i] > 0:
            own = torch.Generator(logits.device).manual_seed(seed)
            drawn[i] = torch.multinomial(probs[i], 1, generator=own)[0]
    return torch.where(temps > 0, drawn, greedy)


def top_p_filter(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """``probs`` (n, vocab) with each row's tokens outside its nucleus zeroed (not
    renormalized: multinomial takes weights). A token stays when the probability of the
    tokens more likely than it is below top_p; ties keep the lower id first."""
    p = torch.tensor(top_ps, dtype=probs.dtype).to(probs.device, non_blocking=True)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    ahead = ordered.cumsum(dim=-1) - ordered  # (n, vocab) mass of the tokens before each
    drop = ahead >= p[:, None]
    drop[:, 0] = False  # the most likely token always stays (top_p 0 or tiny: greedy)
    return torch.zeros_like(probs).scatter_(-1, order, ordered.masked_fill(drop, 0.0))


def sample_seqs(
    logits: torch.Tensor, seqs: list[SeqInput], generator: torch.Generator
) -> torch.Tensor:
    """:func:`sample` with each row's sampling from its sequence (one sampled SeqInput per
    row): its temperature, top_p, and seed mixed with the position of the sampled token."""
    temps = [s.temperature for s in seqs]
    if all(t == 0 for t in temps):  # the common all-greedy step: nothing else to read
        return logits.argmax(dim=-1)
    top_ps = [s.top_p for s in seqs]
    seeds = [None if s.seed is None else step_seed(s.seed, s.start_pos + len(s.token_ids))
             for s in seqs]  # fmt: skip
    return sample(
        logits,
        temps,
        generator,
        top_ps if any(p < 1 for p in top_ps) else None,
        seeds if any(x is not None for x in seeds) else None,
    )


def step_seed(seed: int, position: int) -> int:
    """The 64-bit generator seed of the token at ``position`` (0-based, prompt included) of a
    request seeded ``seed`` (any int; taken mod 2**64): splitmix64 over the seed, then over
    that and the position, so nearby seeds and positions give unrelated streams."""
    return _mix64(_mix64(seed) + position)


def _mix64(x: int) -> int:
    """splitmix64's step: a bijection of 64-bit integers that scatters nearby inputs."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)
