"""Swap cost by block size: the runs the engine copies, the plan feature that counts them,
and the swap term of both cost models (hand-computed)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sched_lab.core.kv import contiguous_runs, num_swap_runs
from sched_lab.core.plan import SchedulerOutput, StepFeatures
from sched_lab.sim.calibrated import FEATURES, CalibratedCostModel, design, fit
from sched_lab.sim.cost_model import AnalyticCostModel
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS

# Two runs of three blocks: CPU ids 0-2 swapped out, CPU ids 10-12 swapped in.
SWAP_OUT = [(7, 1), (4, 0), (9, 2)]
SWAP_IN = [(12, 3), (10, 5), (11, 6)]


def test_runs_of_consecutive_ids():
    # ids 3,4,5 are one copy, 9 another, 11,12 a third: (first id, start index, stop index)
    assert contiguous_runs([3, 4, 5, 9, 11, 12]) == [(3, 0, 3), (9, 3, 4), (11, 4, 6)]
    assert contiguous_runs([7]) == [(7, 0, 1)]
    assert contiguous_runs([]) == []


def test_swap_runs_count_cpu_ids_of_both_maps():
    assert num_swap_runs(SWAP_OUT, SWAP_IN) == 2
    assert num_swap_runs(SWAP_OUT, []) == 1
    # out: CPU 0 | 2 | 4 (the GPU ids do not matter); in: CPU 5,6
    assert num_swap_runs([(1, 0), (2, 2), (3, 4)], [(6, 0), (5, 1)]) == 4
    assert num_swap_runs([], []) == 0


def test_plan_features_count_swap_blocks_and_runs():
    f = SchedulerOutput(swap_out=SWAP_OUT, swap_in=SWAP_IN).features()
    assert (f.num_swap_blocks, f.num_swap_runs) == (6, 2)
    assert SchedulerOutput().features().num_swap_runs == 0


def swap_features(runs: int) -> StepFeatures:
    return StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 6, num_swap_runs=runs)


@pytest.mark.parametrize(
    "block_size, swap_s",
    [
        # 2 runs * 10 us + 6 blocks * 8 tokens * 131,072 B (Llama-3.1-8B bf16) / 64 GB/s
        (8, 2 * 10e-6 + 6 * 8 * 131_072 / 64e9),  # 20 us + 98.304 us
        (64, 2 * 10e-6 + 6 * 64 * 131_072 / 64e9),  # 20 us + 786.432 us
    ],
)
def test_analytic_swap_time_is_runs_times_latency_plus_bytes(block_size, swap_s):
    cm = AnalyticCostModel(MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"])
    no_swap = StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 0)
    t = cm.step_time(swap_features(2), block_size) - cm.step_time(no_swap, block_size)
    assert t == pytest.approx(swap_s, rel=1e-9)
    assert swap_s == pytest.approx({8: 118.304e-6, 64: 806.432e-6}[block_size], rel=1e-12)


# A made-up engine's swaps: 1 ns per swapped KV token (per byte: the profiled model's) and
# 30 us per host <-> device copy, on a 2 ms decode step; the profile's blocks hold 16 tokens.
PER_TOKEN_S, PER_RUN_S, DECODE_S = 1e-9, 30e-6, 2e-3


def swap_profile(with_runs: bool) -> pd.DataFrame:
    """Decode rows, prefill rows and swap rows of 2-512 blocks in 1-64 runs each."""
    rows = [dict(num_prefill_tokens=0, num_prefills=0, num_decodes=d, decode_context_tokens=0,
                 num_swap_blocks=0, num_swap_runs=0) for d in (1, 8, 64)]  # fmt: skip
    rows += [dict(num_prefill_tokens=n, num_prefills=1, num_decodes=0, decode_context_tokens=0,
                  num_swap_blocks=0, num_swap_runs=0) for n in (16, 256, 1024)]  # fmt: skip
    rows += [dict(num_prefill_tokens=0, num_prefills=0, num_decodes=8, decode_context_tokens=0,
                  num_swap_blocks=b, num_swap_runs=min(r, b))
             for b in (2, 32, 512) for r in (2, 16, 64)]  # fmt: skip
    df = pd.DataFrame(rows).assign(prefill_context_tokens=0, prefill_attention_pairs=0.0)
    blocks, runs = df["num_swap_blocks"], df["num_swap_runs"]
    df["duration_s"] = (
        np.where(df["num_prefills"] > 0, 5e-3, DECODE_S)
        + 1e-6 * (df["num_prefill_tokens"] + df["num_decodes"])
        + PER_TOKEN_S * 16 * blocks
        + PER_RUN_S * runs
    )
    df["kind"] = "x"
    return df if with_runs else df.drop(columns="num_swap_runs")


def test_fit_separates_per_token_and_per_run_swap_costs():
    coef = dict(zip(FEATURES, fit(swap_profile(True))))
    assert coef["num_swap_tokens"] == pytest.approx(PER_TOKEN_S, rel=1e-6)
    assert coef["num_swap_runs"] == pytest.approx(PER_RUN_S, rel=1e-6)


@pytest.mark.parametrize("block_size", [8, 64])
def test_calibrated_swap_time_scales_by_bytes(tmp_path, block_size):
    path = tmp_path / "p.csv"
    path.write_text("# model m: block_size 16\n" + swap_profile(True).to_csv(index=False))
    model = CalibratedCostModel(path)
    no_swap = StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 0)
    t = model.step_time(swap_features(2), block_size) - model.step_time(no_swap, block_size)
    # 6 blocks of 8 tokens: 48 ns + 60 us = 60.048 us; of 64 tokens: 384 ns + 60 us
    expected = {8: 60.048e-6, 64: 60.384e-6}[block_size]
    assert expected == pytest.approx(6 * block_size * PER_TOKEN_S + 2 * PER_RUN_S, rel=1e-12)
    assert t == pytest.approx(expected, rel=1e-6)


def test_a_profile_without_runs_charges_swaps_per_byte(tmp_path):
    # Runs unknown: the per-run term is 0, and a swapped block costs its tokens at the rate
    # fitted from blocks of the header's size (32 here: 32 tokens per profiled block).
    df = swap_profile(False)
    path = tmp_path / "p.csv"
    path.write_text("# model m: block_size 32\n" + df.to_csv(index=False))
    model = CalibratedCostModel(path)
    coef = dict(zip(FEATURES, model.coef))
    assert coef["num_swap_runs"] == 0.0
    # the fit sees each profiled block as 32 tokens: the per-token rate is half per block
    per_block = coef["num_swap_tokens"] * 32
    no_swap = StepFeatures(0, 0, 0, 0.0, 1, 100, 1, 0)
    for bs in (8, 64):
        t = model.step_time(swap_features(2), bs) - model.step_time(no_swap, bs)
        assert t == pytest.approx(6 * per_block * bs / 32, rel=1e-9)
    assert design(df)[:, FEATURES.index("num_swap_runs")].max() == 0.0
