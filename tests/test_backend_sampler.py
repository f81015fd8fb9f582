"""Greedy and temperature sampling."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

from sched_lab.backend.sampler import sample, step_seed, top_p_filter


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


def test_top_p_keeps_the_smallest_set_reaching_it():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 before
    # the second, 0.8 >= 0.7 before the third); 0.5 keeps one; 1.0 keeps all.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 3)
    kept = top_p_filter(probs, [0.7, 0.5, 1.0])
    assert (kept > 0).tolist() == [
        [False, True, False, True],
        [False, True, False, False],
        [True, True, True, True],
    ]
    assert kept[0, 1].item() == pytest.approx(0.5)  # kept weights are not changed


def test_tiny_top_p_is_greedy_and_ties_keep_the_lower_id():
    logits = logits_rows()
    tokens = sample(logits, [1.0] * 4, torch.Generator().manual_seed(0), top_ps=[1e-6] * 4)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    tie = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample(tie, [1.0], torch.Generator(), top_ps=[0.0]).tolist() == [1]


def test_seeded_rows_ignore_the_generator_and_their_row():
    logits = logits_rows()
    row = logits[2:3]
    alone = [sample(row, [1.0], torch.Generator().manual_seed(g), seeds=[42]).item()
             for g in range(5)]  # fmt: skip
    assert len(set(alone)) == 1  # the engine's generator does not matter
    batch = sample(logits.flip(0), [1.0] * 4, torch.Generator(), seeds=[None, 42, None, 7])
    assert batch[1].item() == alone[0]  # logits[2] is row 1 of the flipped batch
    draws = {sample(row, [1.0], torch.Generator(), seeds=[s]).item() for s in range(20)}
    assert len(draws) > 1  # different seeds draw differently


def test_step_seed_differs_by_position_and_seed():
    seeds = {step_seed(s, p) for s in (0, 1, -1, 2**70 + 5) for p in range(4)}
    assert len(seeds) == 16 and all(0 <= x < 2**64 for x in seeds)
    assert step_seed(2**64 + 3, 9) == step_seed(3, 9)  # taken mod 2**64
