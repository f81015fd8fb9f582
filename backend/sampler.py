"""Next-token sampling: greedy (temperature 0) or from softmax(logits / temperature)."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor, temperatures: list[float], generator: torch.Generator
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: (n, vocab_size) float32.
        temperatures: n values; 0 = greedy (first index on ties), > 0 samples from
            softmax(logits / temperature).
        generator: seeded, on the logits' device.
    Returns:
        (n,) int64 token ids on the logits' device.
    """
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    temps = torch.tensor(temperatures, dtype=torch.float32).to(logits.device, non_blocking=True)
    scaled = logits / temps.clamp(min=1e-6)[:, None]
    drawn = torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(1)
    return torch.where(temps > 0, drawn, greedy)
