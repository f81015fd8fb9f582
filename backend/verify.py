"""Verification of speculative drafts, batched over a step's sequences.

Row j of a verify row's logits predicts the token after draft j; tensors are padded to K
drafts, ``num_draft[i]`` real. Greedy accepts while the argmax matches (output equals greedy
decoding); sampling uses Leviathan et al. 2023 / Chen et al. 2023 rejection sampling, with a
point-mass proposal when there are no draft probabilities. Both return ``(num_accepted
(S,), next_token (S,))`` int64.
"""

from __future__ import annotations

import torch


def verify_greedy(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        target_ids: (S, K + 1) int64 target argmax per row.
        draft_ids: (S, K) int64 drafts (entries at j >= num_draft[i] are ignored).
        num_draft: (S,) int64 real drafts per sequence.
    """
    k = draft_ids.shape[1]
    valid = torch.arange(k, device=draft_ids.device)[None, :] < num_draft[:, None]
    match = (target_ids[:, :k] == draft_ids) & valid
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_ids.gather(1, accepted[:, None]).squeeze(1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling.

    Args:
        target_probs: (S, K + 1, V) float32 target softmax(logits / temperature).
        draft_ids: (S, K) int64 drafts; num_draft: (S,) int64.
        draft_probs: (S, K, V) float32 proposal distributions; None for point masses.
        generator: seeded, on the tensors' device.
    """
    s, k = draft_ids.shape
    dev = target_probs.device
    rows = torch.arange(s, device=dev)
    if k == 0:
        return torch.zeros(s, dtype=torch.long, device=dev), _draw(target_probs[:, 0], generator)
    p_d = target_probs[:, :k].gather(2, draft_ids[..., None]).squeeze(2)  # (S, K)
    q_d = 1.0 if draft_probs is None else draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
    u = torch.rand((s, k), generator=generator, device=dev)
    valid = torch.arange(k, device=dev)[None, :] < num_draft[:, None]
    accept = (u * q_d < p_d) & valid  # u < p / q, i.e. probability min(1, p / q)
    accepted = accept.long().cumprod(dim=1).sum(dim=1)
    p_a = target_probs[rows, accepted]  # (S, V): the row after the accepted prefix
    at = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_a = torch.zeros_like(p_a).scatter_(1, draft_ids[rows, at][:, None], 1.0)
    else:
        q_a = draft_probs[rows, at]
    residual = (p_a - q_a).clamp(min=0)
    # A zero residual needs p == q, where rejection has probability 0 (rounding only).
    rejected = (accepted < num_draft)[:, None] & (residual.sum(dim=1, keepdim=True) > 0)
    return accepted, _draw(torch.where(rejected, residual, p_a), generator)


def _draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row, with probability proportional to the row's weights."""
    return torch.multinomial(weights, 1, generator=generator).squeeze(1)
