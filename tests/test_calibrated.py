"""The calibrated cost model recovers known coefficients and predicts like its formula."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from lab.core.plan import StepFeatures
from lab.sim.calibrated import FEATURES, CalibratedCostModel, cross_validated_errors, design, fit

# A made-up engine: 1 ms per decode-only step, 5 ms per step with prompt tokens, 20 us per
# sequence, 2 us per token above 2048 tokens, 1 us per token of mean decode context, 1 ns
# per decode context token, 0.5 ns per (query, key) pair of prefill attention.
TRUE = dict.fromkeys(FEATURES, 0.0) | {
    "decode_only_step": 1e-3,
    "prefill_step": 5e-3,
    "num_seqs": 2e-5,
    "tokens_over_2048": 2e-6,
    "mean_decode_context": 1e-6,
    "decode_context_tokens": 1e-9,
    "prefill_attention_pairs": 5e-10,
}


def profile_frame() -> pd.DataFrame:
    rows = []
    for b in (1, 4, 16, 64, 256):
        for ctx in (128, 1024, 4096):
            rows.append(
                dict(
                    num_prefill_tokens=0,
                    num_prefills=0,
                    prefill_context_tokens=0,
                    prefill_attention_pairs=0.0,
                    num_decodes=b,
                    decode_context_tokens=b * ctx,
                    num_swap_blocks=0,
                )
            )
    for n in (16, 128, 512, 1024, 4096, 8192):
        for c in (0, 2048):
            rows.append(
                dict(
                    num_prefill_tokens=n,
                    num_prefills=1,
                    prefill_context_tokens=c,
                    prefill_attention_pairs=n * c + n * (n + 1) / 2,
                    num_decodes=0,
                    decode_context_tokens=0,
                    num_swap_blocks=0,
                )
            )
    df = pd.DataFrame(rows)
    df["duration_s"] = design(df) @ np.array([TRUE[f] for f in FEATURES])
    df["kind"] = "x"
    return df


def test_fit_recovers_coefficients_of_noise_free_data():
    coef = dict(zip(FEATURES, fit(profile_frame())))
    for name, value in TRUE.items():
        assert coef[name] == pytest.approx(value, rel=1e-6, abs=1e-15), name
    assert cross_validated_errors(profile_frame()).max() < 1e-6


def test_step_time_matches_formula(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("# header line\n" + profile_frame().to_csv(index=False))
    model = CalibratedCostModel(path)
    # 32 decodes over 32 * 1000 context tokens plus a 3000-token chunk over 0 cached:
    f = StepFeatures(3000, 1, 0, 3000 * 3001 / 2, 32, 32_000, 33, 0)
    expected = (
        5e-3 + 33 * 2e-5 + (3032 - 2048) * 2e-6 + 1000 * 1e-6 + 32_000 * 1e-9 + 4_501_500 * 5e-10
    )
    assert model.step_time(f, 16) == pytest.approx(expected, rel=1e-6)
    f = StepFeatures(0, 0, 0, 0.0, 4, 4 * 500, 4, 0)  # decode-only: the graph intercept
    expected = 1e-3 + 4 * 2e-5 + 500 * 1e-6 + 2000 * 1e-9
    assert model.step_time(f, 16) == pytest.approx(expected, rel=1e-6)
