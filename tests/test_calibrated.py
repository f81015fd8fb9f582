"""The calibrated cost model recovers known coefficients and predicts like its formula."""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import pandas as pd
import pytest

from sched_lab.core.plan import StepFeatures
from sched_lab.sim.calibrated import (
    EAGER_KNOT,
    FEATURES,
    CalibratedCostModel,
    cross_validated_errors,
    design,
    find_profile,
    fit,
)

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


def fit_with_paged_surcharge(df: pd.DataFrame) -> dict[str, float]:
    """``df`` priced noise-free by TRUE with a paged surcharge (c12) of 0.2 ns a pair (its
    ``duration_s`` and ``kind`` set in place), then fitted: name -> coefficient."""
    true = np.array([TRUE[f] for f in FEATURES])
    true[FEATURES.index("paged_prefill_pairs")] = 2e-10
    df["duration_s"] = design(df) @ true
    df["kind"] = "x"
    return dict(zip(FEATURES, fit(df)))


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


def eager_frame(eager_per_token: float, big: tuple[int, ...]) -> pd.DataFrame:
    """profile_frame plus prefill rows of several prompts above EAGER_KNOT tokens (8, 12 or
    16 prompts of 1024), priced with TRUE plus ``eager_per_token`` above the knot."""
    rows = [
        dict(num_prefill_tokens=k * 1024, num_prefills=k, prefill_context_tokens=0,
             prefill_attention_pairs=k * 1024 * 1025 / 2, num_decodes=0,
             decode_context_tokens=0, num_swap_blocks=0)
        for k in big
    ]  # fmt: skip
    df = pd.concat([profile_frame(), pd.DataFrame(rows)], ignore_index=True)
    true = np.array([TRUE[f] for f in FEATURES])
    true[FEATURES.index(f"tokens_over_{EAGER_KNOT}")] = eager_per_token
    df["duration_s"] = design(df) @ true
    return df


def test_eager_slope_is_fitted_with_either_sign_from_three_rows_above_the_knot():
    """Three rows above 8192 tokens (12k, 14k, 16k) carry an eager slope of -1.5 us/token:
    the fit recovers it and the other coefficients exactly (noise-free data)."""
    coef = dict(zip(FEATURES, fit(eager_frame(-1.5e-6, (12, 14, 16)))))
    assert coef["tokens_over_8192"] == pytest.approx(-1.5e-6, rel=1e-6)
    for name, value in TRUE.items():
        if name != "tokens_over_8192":
            assert coef[name] == pytest.approx(value, rel=1e-6, abs=1e-15), name


def test_eager_slope_needs_three_rows_and_keeps_the_slope_non_negative(tmp_path):
    # Two rows above the knot: the slope is left out (0), and the other ten coefficients
    # are the fit without its column, as before the column existed (non-negative least
    # squares on relative error), to the last bit.
    from sched_lab.sim.calibrated import nnls

    two = eager_frame(-1.5e-6, (12, 16))
    coef = fit(two)
    assert coef[FEATURES.index("tokens_over_8192")] == 0.0
    x, y = design(two)[:, :-1], two.duration_s.to_numpy()
    scale = np.where(x.max(axis=0) == 0, 1.0, x.max(axis=0))
    assert coef[:-1].tolist() == (nnls(x / scale / y[:, None], np.ones(len(y))) / scale).tolist()
    # Three rows above the knot, but replay steps (kind "replay"): left out too.
    replayed = eager_frame(-1.5e-6, (12, 14, 16))
    replayed.loc[replayed.num_prefill_tokens > EAGER_KNOT, "kind"] = "replay"
    assert fit(replayed)[FEATURES.index("tokens_over_8192")] == 0.0
    # An eager slope below -(tokens + hinge) = -2 us/token would make a longer step
    # cheaper: it is raised to -2 us, so the slope above 8192 tokens is 0.
    coef = dict(zip(FEATURES, fit(eager_frame(-3e-6, (12, 14, 16)))))
    assert coef["tokens_over_8192"] == pytest.approx(
        -(coef["num_tokens"] + coef["tokens_over_2048"])
    )
    # The model prices the eager slope: 16 prompts of 1024 (16,384 tokens) with -1.5 us per
    # token above 8192, i.e. 8192 * 1.5 us = 12.288 ms less than without it.
    path = tmp_path / "p.csv"
    path.write_text("# header\n" + eager_frame(-1.5e-6, (12, 14, 16)).to_csv(index=False))
    model = CalibratedCostModel(path)
    f = StepFeatures(16384, 16, 0, 16 * 1024 * 1025 / 2, 0, 0, 16, 0)
    expected = (5e-3 + 16 * 2e-5 + (16384 - 2048) * 2e-6 - 8192 * 1.5e-6
                + 16 * 1024 * 1025 / 2 * 5e-10)  # fmt: skip
    assert model.step_time(f, 16) == pytest.approx(expected, rel=1e-6)


def test_eager_knot_is_the_engines_largest_token_graph():
    pytest.importorskip("torch", reason="backend/ needs torch: pip install -e '.[engine,test]'")
    import triton_setup  # noqa: F401  (first: later Triton tests in this process interpret)

    from sched_lab.backend.attention.flash_varlen import VARLEN_MIN_MEAN_CHUNK as ENGINE_CHUNK
    from sched_lab.backend.cuda_graphs import DEFAULT_TOKEN_SIZES
    from sched_lab.backend.profile import EAGER_MIN_ROWS
    from sched_lab.sim.calibrated import MIN_EAGER_ROWS, VARLEN_MIN_MEAN_CHUNK

    assert EAGER_KNOT == max(DEFAULT_TOKEN_SIZES)
    assert VARLEN_MIN_MEAN_CHUNK == ENGINE_CHUNK  # which eager steps run FlashAttention varlen
    assert EAGER_MIN_ROWS == MIN_EAGER_ROWS  # the profile's note and the fit agree


def test_profile_grid_has_enough_eager_rows_for_the_held_out_runner():
    """backend/profile.py's grid keeps >= MIN_EAGER_ROWS rows above the knot on the held-out
    protocol's runner (2,048 blocks of 16, max_model_len 16384: rows that do not fit are
    left out), from one prompt to many, so the eager slope is fitted."""
    pytest.importorskip("torch", reason="backend/ needs torch: pip install -e '.[engine,test]'")
    from sched_lab.backend.profile import fits_runner, shapes, step_inputs
    from sched_lab.sim.calibrated import MIN_EAGER_ROWS

    eager = []
    for _, chunks, decodes, _ in shapes():
        tokens = sum(n for _, n in chunks) + len(decodes)
        if tokens > EAGER_KNOT and fits_runner(step_inputs(chunks, decodes, 16), 2048, 16384, 256):
            eager.append(len(chunks))
    assert len(eager) >= MIN_EAGER_ROWS
    assert min(eager) == 1 and max(eager) == 16


def test_profile_grid_has_eager_rows_over_a_cached_prefix_that_fit_c12():
    """backend/profile.py's prefill_eager_prefix rows (not in --grid small) are eager (above
    EAGER_KNOT, the largest CUDA graph) and paged (their chunks read cached tokens); priced
    0.2 ns a pair above the varlen rows' rate, beside three varlen rows, they give the fit
    that surcharge back, and left_out_terms has nothing to say."""
    pytest.importorskip("torch", reason="backend/ needs torch: pip install -e '.[engine,test]'")
    from sched_lab.backend.profile import features, fits_runner, shapes, step_inputs
    from sched_lab.sim.calibrated import left_out_terms, paged_pairs

    points = [(c, d, s) for kind, c, d, s in shapes() if kind == "prefill_eager_prefix"]
    assert 4 <= len(points) <= 6
    assert "prefill_eager_prefix" not in {kind for kind, *_ in shapes(small=True)}
    rows = pd.DataFrame([asdict(features(*p)) for p in points])
    assert (rows.num_prefill_tokens > EAGER_KNOT).all() and (rows.num_decodes == 0).all()
    assert (rows.prefill_context_tokens >= 512 * rows.num_prefills).all()
    assert paged_pairs(rows.num_prefill_tokens, rows.num_prefill_tokens, rows.num_prefills,
                       rows.prefill_context_tokens).all()  # fmt: skip
    # one prompt of 12,288 tokens over 512 cached: 12288 * 512 + 12288 * 12289 / 2 pairs
    assert rows.iloc[0][["num_prefills", "prefill_context_tokens", "prefill_attention_pairs"]
                        ].tolist() == [1, 512, 81_795_072]  # fmt: skip
    # The held-out runner (2,048 blocks of 16, max_model_len 16384) leaves out the rows of
    # prompts longer than 16,384 tokens; the Mooncake protocol's (8,192, 40960) keeps all.
    seqs = [step_inputs(c, d, 16) for c, d, _ in points]
    held_out = [fits_runner(s, 2048, 16384, 256) for s in seqs]
    assert sum(held_out) == len(points) - 2 and not any(held_out[-2:])
    assert all(fits_runner(s, 8192, 40960, 256) for s in seqs)
    varlen = eager_frame(0.0, (12, 14, 16))
    df = pd.concat([varlen, rows[varlen.columns.drop(["duration_s", "kind"])]], ignore_index=True)
    coef = fit_with_paged_surcharge(df)
    assert coef["paged_prefill_pairs"] == pytest.approx(2e-10, rel=1e-6)
    assert coef["prefill_attention_pairs"] == pytest.approx(5e-10, rel=1e-6)
    assert left_out_terms(df) == []


def test_extra_candidate_features_are_fitted_beside_the_model():
    """A candidate feature of 3 us per unit, present in the data, is recovered after the
    model's coefficients, which stay exact (noise-free data)."""
    df = profile_frame()
    extra = np.arange(len(df)) % 3  # 0, 1, 2 units per row
    df["duration_s"] += 3e-6 * extra
    coef = fit(df, extra=extra)
    assert coef[-1] == pytest.approx(3e-6, rel=1e-6)
    for name, value in zip(FEATURES, coef[:-1]):
        assert value == pytest.approx(TRUE[name], rel=1e-6, abs=1e-15), name


def test_profile_rows_feed_random_token_ids_as_a_replay_does():
    """backend/profile.py step_inputs: a prompt chunk of 64 tokens over 32 cached and two
    decodes; with a vocabulary the ids are uniform draws (seeded), else id 7 everywhere."""
    pytest.importorskip("torch", reason="backend/ needs torch: pip install -e '.[engine,test]'")
    from sched_lab.backend.profile import step_inputs

    seqs = step_inputs([(32, 64)], [100, 200], 16, vocab_size=1000, seed=3)
    assert [len(s.token_ids) for s in seqs] == [64, 1, 1]
    assert [s.start_pos for s in seqs] == [32, 99, 199]
    # blocks: ceil(97 / 16) = 7, ceil(101 / 16) = 7, ceil(201 / 16) = 13, consecutive
    assert [s.block_table[0] for s in seqs] == [0, 7, 14] and len(seqs[2].block_table) == 13
    ids = seqs[0].token_ids
    assert all(0 <= t < 1000 for t in ids) and len(set(ids)) > 50  # 64 draws of 1,000
    again = step_inputs([(32, 64)], [100, 200], 16, vocab_size=1000, seed=3)
    assert [s.token_ids for s in again] == [s.token_ids for s in seqs]
    assert step_inputs([(32, 64)], [100], 16)[0].token_ids == [7] * 64


def test_paged_pairs_follow_the_engines_prefill_kernel_choice():
    """Pairs run the paged Triton kernel in a CUDA graph (<= 8192 tokens), with any cached
    tokens, or when the chunks average < 1024 tokens; else FlashAttention varlen."""
    from sched_lab.sim.calibrated import paged_pairs

    assert paged_pairs(8192, 8192, 1, 0)  # the largest graph
    assert not paged_pairs(16384, 16384, 16, 0)  # eager, 16 chunks of 1024 from position 0
    assert paged_pairs(12288, 12288, 16, 0)  # eager, chunks of 768
    assert paged_pairs(16384, 15872, 1, 512)  # eager over a 512-token prefix-cache hit
    assert not paged_pairs(8200, 8192, 1, 0)  # + 8 decodes: eager, the prompt from 0 varlen


def test_paged_pairs_surcharge_is_fitted_from_varlen_rows_and_priced(tmp_path):
    """Three eager rows from position 0 (12, 14, 16 prompts of 1024: varlen) beside the graph
    rows, and three eager rows over a 1,024-token cached prefix (paged), priced with a paged
    surcharge of 0.2 ns a pair: the fit recovers it; a step is priced with it only when paged."""
    rows = [
        dict(num_prefill_tokens=n, num_prefills=1, prefill_context_tokens=1024,
             prefill_attention_pairs=n * 1024 + n * (n + 1) / 2, num_decodes=0,
             decode_context_tokens=0, num_swap_blocks=0)
        for n in (10240, 12288, 16384)
    ]  # fmt: skip
    df = pd.concat([eager_frame(0.0, (12, 14, 16)), pd.DataFrame(rows)], ignore_index=True)
    coef = fit_with_paged_surcharge(df)
    assert coef["paged_prefill_pairs"] == pytest.approx(2e-10, rel=1e-6)
    assert coef["prefill_attention_pairs"] == pytest.approx(5e-10, rel=1e-6)
    path = tmp_path / "p.csv"
    path.write_text("# header\n" + df.to_csv(index=False))
    model = CalibratedCostModel(path)
    varlen = StepFeatures(16384, 16, 0, 16 * 1024 * 1025 / 2, 0, 0, 16, 0)
    paged = StepFeatures(16384, 16, 16 * 512, 16 * (1024 * 512 + 1024 * 1025 / 2), 0, 0, 16, 0)
    base = 5e-3 + 16 * 2e-5 + (16384 - 2048) * 2e-6
    assert model.step_time(varlen, 16) == pytest.approx(
        base + varlen.prefill_attention_pairs * 5e-10
    )
    assert model.step_time(paged, 16) == pytest.approx(
        base + paged.prefill_attention_pairs * (5e-10 + 2e-10)
    )
    # Graph rows alone (profile_frame: every pair paged): no surcharge, c8 prices every pair.
    assert fit(profile_frame())[FEATURES.index("paged_prefill_pairs")] == 0.0
    # Verify rows (1 + d queries) keep the step off FlashAttention varlen: with drafts, the
    # same prompt chunks pay the surcharge (flash_varlen.varlen_prefix), as do the drafts.
    spec = replace(varlen, num_decodes=4, decode_context_tokens=400, num_spec_tokens=12,
                   num_spec_decodes=4, spec_context_tokens=1212)  # fmt: skip
    assert model.spec_step_time(spec, 16) == pytest.approx(
        model.step_time(spec, 16)
        + 12 * 2e-6  # the drafts' tokens above 2048
        + 1212 * (5e-10 + 2e-10)  # their pairs, paged
        + varlen.prefill_attention_pairs * 2e-10  # the prompts' pairs, now paged
    )


def test_step_time_agrees_with_the_design_matrix_for_every_kind_of_step():
    """Random steps of every kind (swaps alone, decode-only, prompt, mixed, in a graph or eager, from
    position 0 or over cached tokens, with swaps and LoRA) under random coefficients (c10 < 0
    too): ``step_time`` equals ``predict`` (``design @ coef`` plus the LoRA terms)."""
    from sched_lab.sim.calibrated import paged_pairs, predict

    model = CalibratedCostModel(find_profile("h200_qwen3-0.6b"))
    rng = np.random.default_rng(0)
    coef = rng.uniform(1e-10, 1e-3, len(FEATURES)) * rng.choice([1e-6, 1e-3, 1.0], len(FEATURES))
    coef[FEATURES.index(f"tokens_over_{EAGER_KNOT}")] *= -1
    lora_coef = rng.uniform(1e-6, 1e-3, 3)
    (model._decode_step, model._prefill_step, model._seq, model._tok, model._hinge,
     model._mean_ctx, model._dctx, model._pctx, model._pairs, model._swap_token, model._eager,
     model._swap_run, model._paged_pairs) = coef  # fmt: skip
    model._lora_step, model._per_lora, model._lora_token = lora_coef
    steps = []
    for _ in range(300):
        prefills = int(rng.choice([0, 0, 1, 2, 8, 16]))
        decodes = int(rng.choice([0, 1, 7, 64, 256])) if prefills else int(rng.integers(0, 300))
        prompt = int(rng.choice([1, 700, 1024, 4000, 12000])) * prefills
        cached = int(rng.choice([0, 0, 512])) * prefills
        n = prompt / max(prefills, 1)
        pairs = prefills * (n * cached / max(prefills, 1) + n * (n + 1) / 2)
        swaps = int(rng.choice([0, 0, 3])) or int(not prefills + decodes)  # swaps alone
        loras = int(rng.integers(0, min(prefills + decodes, 3) + 1))
        steps.append(StepFeatures(
            prompt, prefills, cached, pairs, decodes, decodes * int(rng.integers(1, 5000)),
            prefills + decodes, swaps, num_swap_runs=swaps and int(rng.integers(1, swaps + 1)),
            num_loras=loras, num_lora_tokens=loras and loras + int(rng.integers(0, prompt + 1)),
        ))  # fmt: skip
    df = pd.DataFrame([asdict(s) for s in steps])
    tokens = df.num_prefill_tokens + df.num_decodes
    paged = paged_pairs(tokens, df.num_prefill_tokens, df.num_prefills, df.prefill_context_tokens)
    kinds = set(zip(df.num_prefills > 0, df.num_decodes > 0, tokens > EAGER_KNOT,
                    df.prefill_context_tokens > 0, paged))  # fmt: skip
    # every kind drawn: swaps alone; decode-only; prompt or mixed x graph (paged) or eager
    # x cached (paged) or not (chunks of 12000: varlen; of 700: paged)
    assert len(kinds) == 2 + 2 * (2 + 3)
    df["num_swap_tokens"] = df["num_swap_blocks"] * 32  # steps of blocks of 32 tokens
    got = np.array([model.step_time(s, 32) for s in steps])
    np.testing.assert_allclose(got, predict(df, coef, lora_coef), rtol=1e-12)


def test_left_out_terms_name_the_rows_the_optional_terms_need():
    from sched_lab.sim.calibrated import left_out_terms

    notes = left_out_terms(profile_frame())  # graph rows only: no eager row, no varlen pair
    assert len(notes) == 2
    assert notes[0].startswith("c10 (the eager slope above 8192 tokens) is 0: 0 profile rows")
    assert notes[1].startswith("c12 (the paged kernel's surcharge a prefill pair) is 0")
    assert "0 profile rows whose pairs run FlashAttention varlen" in notes[1]
    assert "best fitted with both these and paged rows above 8192 tokens" in notes[1]
    two = left_out_terms(eager_frame(0.0, (12, 16)))
    assert [n[:3] for n in two] == ["c10", "c12"] and "2 profile rows above" in two[0]
    # 3 eager rows, all varlen: c12 is fitted, but no paged row above the knot pins it there
    (note,) = left_out_terms(eager_frame(0.0, (12, 14, 16)))
    assert note.startswith("c12 (the paged kernel's surcharge a prefill pair) is fitted mostly "
                           "from CUDA-graph rows: 0 profile rows above 8192 tokens")  # fmt: skip
    assert "priced by extrapolation" in note


def test_decode_step_time_prices_each_context_as_step_time_to_the_last_bit():
    """``decode_step_time(f)(ctx)`` equals ``step_time`` of ``f`` with that decode context,
    bit for bit, for steps of every kind (decodes alone, with prompts, swaps, adapters and
    loads, above both token knots) under random coefficients; a step of decodes alone gets
    the function kept for its number of decodes."""
    model = CalibratedCostModel(find_profile("h200_qwen3-0.6b"))
    rng = np.random.default_rng(1)
    coef = rng.uniform(1e-10, 1e-3, len(FEATURES)) * rng.choice([1e-6, 1e-3, 1.0], len(FEATURES))
    coef[FEATURES.index(f"tokens_over_{EAGER_KNOT}")] *= -1
    (model._decode_step, model._prefill_step, model._seq, model._tok, model._hinge,
     model._mean_ctx, model._dctx, model._pctx, model._pairs, model._swap_token, model._eager,
     model._swap_run, model._paged_pairs) = coef  # fmt: skip
    model._lora_step, model._per_lora, model._lora_token = rng.uniform(1e-6, 1e-3, 3)
    model.lora_load_s = 3e-4
    for _ in range(300):
        prefills = int(rng.choice([0, 0, 1, 8]))
        decodes = int(rng.choice([1, 7, 256, 3000, 9000]))
        prompt = int(rng.choice([1, 700, 12000])) * prefills
        cached = int(rng.choice([0, 512])) * prefills
        swaps = int(rng.choice([0, 0, 3]))
        loras = int(rng.choice([0, 0, 2]))
        f = StepFeatures(
            prompt, prefills, cached, prefills * (prompt + cached) * 0.5, decodes, 0,
            prefills + decodes, swaps, num_swap_runs=swaps and 2, num_loras=loras,
            num_lora_tokens=loras and 5, num_lora_loads=int(rng.choice([0, 0, 1])),
        )  # fmt: skip
        price = model.decode_step_time(f, 32)
        for ctx in rng.integers(decodes, decodes * 5000, 5).tolist():
            assert price(ctx) == model.step_time(replace(f, decode_context_tokens=ctx), 32)
        pure = not (prefills or swaps or loras or f.num_lora_loads)
        assert (model.decode_step_time(replace(f), 32) is price) == pure
