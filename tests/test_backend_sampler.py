"""Greedy and temperature sampling."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

from sched_lab.backend.sampler import sample


def logits_rows() -> torch.Tensor:
    return torch.randn(4, 50, generator=torch.Generator().manual_seed(0))


def test_greedy_is_argmax():
    logits = logits_rows()
    assert sample(logits, [0.0] * 4, torch.Generator()).tolist() == logits.argmax(-1).tolist()


def test_temperature_rows_are_seeded_and_greedy_rows_stay_argmax():
    logits = logits_rows()
    temps = [1.0, 0.0, 1.0, 0.0]

    def draw(seed: int) -> list[int]:
        return sample(logits, temps, torch.Generator().manual_seed(seed)).tolist()

    assert draw(1) == draw(1)  # reproducible
    draws = [draw(seed) for seed in range(20)]
    assert all(d[1] == logits[1].argmax() and d[3] == logits[3].argmax() for d in draws)
    assert len({d[0] for d in draws}) > 1  # temperature 1 over 50 tokens does vary


def test_low_temperature_concentrates_on_argmax():
    logits = logits_rows()
    tokens = sample(logits, [1e-3] * 4, torch.Generator().manual_seed(0))
    assert tokens.tolist() == logits.argmax(-1).tolist()
