"""Bands: the stochastic simulator (``seeds``, lab/sim/noise.py), the bands over seeded
replicas (lab/results/bands.py), their coverage in the fidelity protocol
(lab/fidelity/compare.py) and the warnings about what priced the steps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from sched_lab.config import validate, with_seeds
from sched_lab.config.paths import DATA_ROOT
from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import StepFeatures
from sched_lab.fidelity.compare import coverage, run_row
from sched_lab.fidelity.markdown import coverage_section
from sched_lab.report.terminal import summary_text, warnings_text
from sched_lab.results.bands import band_fields
from sched_lab.run.experiment import run_experiment
from sched_lab.sim.calibrated import NO_HOST_NOTE, CalibratedCostModel, replay_run_ids
from sched_lab.sim.noise import (
    LEVELS,
    NoisyCostModel,
    Spells,
    StepNoise,
    draw_mean,
    fit_noise,
    fit_spells,
    merge_short,
)

QWEN = str(DATA_ROOT / "profiles" / "h200_qwen3-0.6b.csv")
# The Qwen3-0.6B profile shipped until 2026-12-04: no fingerprint, no host_s column.
OLD_QWEN = str(Path(__file__).parent / "data" / "profiles" / "h200_qwen3-0.6b_2026-11-30.csv")


def level(q: float) -> int:
    """The index of quantile level ``q`` in LEVELS."""
    return LEVELS.index(pytest.approx(q))


def test_noise_quantiles_fallbacks_and_stalls_of_a_hand_made_profile():
    # 8 small decode rows: ratios 0.8 .. 1.2, median 1.0; 8 large prefill rows: 0.9 x4, 1.1 x4
    # (median 1.0); one prefill row at 3x its prediction: a stall of 20 ms.
    decode = [0.8, 0.9, 0.95, 1.0, 1.0, 1.05, 1.1, 1.2]
    prefill = [0.9] * 4 + [1.1] * 4
    kinds = ["decode"] * 8 + ["prefill"] * 9
    sizes = ["small"] * 8 + ["large"] * 9
    predicted = [0.01] * 17
    measured = [0.01 * r for r in decode + prefill] + [0.03]
    noise = fit_noise(kinds, sizes, measured, predicted)

    q = noise.quantiles["decode/small"]  # divided by the mean of the draws (next test)
    assert draw_mean(q) == pytest.approx(1.0)
    assert q[level(1.0)] / q[level(0.0)] == pytest.approx(1.2 / 0.8)
    # 25%: position 0.25 * 7 = 1.75 between 0.9 and 0.95 -> 0.9375
    assert q[level(0.25)] / q[level(0.0)] == pytest.approx(0.9375 / 0.8)
    assert noise.rows["decode/small"] == 8
    # a bucket without rows takes its kind's rows; a kind without rows takes every row
    assert noise.quantiles["decode/large"] == noise.quantiles["decode/small"]
    assert noise.rows["mixed/medium"] == 16  # the stall is not a residual
    mixed = noise.quantiles["mixed/medium"]
    assert mixed[level(1.0)] / mixed[level(0.0)] == pytest.approx(1.2 / 0.8)
    # symmetric about 1.0: its mean is 1.0, so the quantiles are the residuals themselves
    p = noise.quantiles["prefill/large"]
    assert p[level(0.0)] == pytest.approx(0.9) and p[level(1.0)] == pytest.approx(1.1)
    # 1 stall in 17 rows, 30 ms measured for 10 predicted: 20 ms excess
    assert noise.stall_probability == pytest.approx(1 / 17)
    assert noise.stall_s == pytest.approx(0.02)


def test_a_models_own_misses_are_left_out_and_never_drawn_as_stalls():
    # the rows of the test above with stalls=False: the 3x row is still no residual, and no
    # stall is drawn (the analytic roofline's >= 2x rows are its own misses, not host stalls)
    decode = [0.8, 0.9, 0.95, 1.0, 1.0, 1.05, 1.1, 1.2]
    prefill = [0.9] * 4 + [1.1] * 4
    kinds, sizes = ["decode"] * 8 + ["prefill"] * 9, ["small"] * 8 + ["large"] * 9
    measured = [0.01 * r for r in decode + prefill] + [0.03]
    with_stalls = fit_noise(kinds, sizes, measured, [0.01] * 17)
    noise = fit_noise(kinds, sizes, measured, [0.01] * 17, stalls=False)
    assert noise.stall_probability == 0.0 and noise.stall_s == 0.0
    assert noise.rows["mixed/medium"] == 16 and noise.rows["prefill/large"] == 8
    assert noise.quantiles == with_stalls.quantiles


def test_noise_is_centred_on_the_prediction():
    # a bucket measured 10% over its prediction everywhere: the shift is recorded, not drawn
    noise = fit_noise(["decode"] * 8, ["small"] * 8, [0.011] * 8, [0.01] * 8)
    assert noise.bias["decode/small"] == pytest.approx(1.1)
    assert noise.quantiles["decode/small"] == pytest.approx([1.0] * len(LEVELS))
    # skewed: 6 rows at 1.0, 2 at 1.6 (median 1.0). Positions u * 7 at the levels k / 20:
    # 1.0 up to k = 14, then 1.15, 1.36, 1.57 (k = 15..17), 1.6 from k = 18; the mean of the
    # draws (trapezoids) is (0.5 + 14 + 1.15 + 1.36 + 1.57 + 1.6 + 1.6 + 0.8) / 20 = 1.129
    noise = fit_noise(["decode"] * 8, ["small"] * 8, [0.01] * 6 + [0.016] * 2, [0.01] * 8)
    q = noise.quantiles["decode/small"]
    assert noise.bias["decode/small"] == pytest.approx(1.129)
    assert q[level(0.0)] == pytest.approx(1 / 1.129)
    assert q[level(0.8)] == pytest.approx(1.36 / 1.129)
    assert draw_mean(q) == pytest.approx(1.0)


def test_run_sigma_is_the_rms_of_held_out_log_errors():
    # 8 decode rows held out at exp(+-0.05) of their measurement: sigma 0.05; 8 prefill rows
    # at exp(0.1) and exp(-0.2) x4 each: sqrt((0.01 + 0.04) / 2); no mixed rows: every row's
    kinds, sizes = ["decode"] * 8 + ["prefill"] * 8, ["small"] * 16
    measured = [0.01] * 16
    log_err = [0.05, -0.05] * 4 + [0.1] * 4 + [-0.2] * 4
    held_out = [m / math.exp(e) for m, e in zip(measured, log_err)]
    noise = fit_noise(kinds, sizes, measured, measured, held_out)
    assert noise.run_sigma["decode"] == pytest.approx(0.05)
    assert noise.run_sigma["prefill"] == pytest.approx(math.sqrt(0.025))
    everything = math.sqrt((8 * 0.05**2 + 4 * 0.01 + 4 * 0.04) / 16)
    assert noise.run_sigma["mixed"] == pytest.approx(everything)
    assert fit_noise(kinds, sizes, measured, measured).run_sigma == {}  # no held-out: none


def test_run_factor_is_one_draw_per_replica_and_kind_with_mean_one():
    # no step noise (every quantile 1.0), decode sigma 0.1, prefill sigma 0: each replica's
    # decode steps all take t * f, f = exp(0.1 z - 0.005); over 4,000 replicas the mean of f
    # is 1 and the standard deviation of log f is 0.1 (both to ~1.5 standard errors)
    ones = tuple([1.0] * len(LEVELS))
    keys = [
        f"{k}/{z}" for k in ("decode", "prefill", "mixed") for z in ("small", "medium", "large")
    ]
    noise = StepNoise({k: ones for k in keys}, {}, {}, 0.0, 0.0, {"decode": 0.1, "prefill": 0.0})

    class Flat:
        def step_time(self, f, block_size):
            return 0.01

    decode = StepFeatures(0, 0, 0, 0.0, 4, 400, 4, 0)
    prefill = StepFeatures(100, 1, 0, 5050.0, 0, 0, 1, 0)
    factors = []
    for seed in range(4000):
        r = NoisyCostModel(Flat(), noise, (seed,))
        d = [r.step_time(decode, 16) for _ in range(3)]
        assert d[0] == d[1] == d[2]  # one factor for the whole replica
        assert r.step_time(prefill, 16) == 0.01  # sigma 0: no factor
        factors.append(d[0] / 0.01)
    logs = np.log(factors)
    assert np.mean(factors) == pytest.approx(1.0, abs=0.0025)
    assert np.std(logs) == pytest.approx(0.1, rel=0.02)


ONES = tuple([1.0] * len(LEVELS))
NOISE_KEYS = [
    f"{k}/{z}" for k in ("decode", "prefill", "mixed") for z in ("small", "medium", "large")
]


class Flat:
    """A cost model pricing every step 10 ms."""

    def step_time(self, f, block_size):
        return 0.01


DECODE = StepFeatures(0, 0, 0, 0.0, 4, 400, 4, 0)


def test_spells_share_of_time_and_offsets_follow_the_dwell_means():
    # slow 1 ms more than fast, mean dwells 0.3 s fast and 0.1 s slow: slow a quarter of the
    # time; a fast step adds -0.25 ms, a slow one +0.75 ms (mean 0). 20,000 flat 10 ms steps
    # = ~200 busy seconds = ~500 fast/slow cycles: the slow share 0.25 +- 0.012 (one standard
    # error, sqrt(2 p (1 - p) tau / T) with tau = 0.075 s), and ~1,000 changes of state
    spells = Spells(0.001, 0.3, 0.1)
    assert spells.slow_share == pytest.approx(0.25)
    noise = StepNoise({k: ONES for k in NOISE_KEYS}, {}, {}, 0.0, 0.0, {}, spells)
    r = NoisyCostModel(Flat(), noise, (7,))
    d = np.array([r.step_time(DECODE, 16) for _ in range(20_000)])
    slow = d > 0.01
    assert set(np.round(d * 1e3, 6)) == {9.75, 10.75}
    assert slow.mean() == pytest.approx(0.25, abs=0.05)
    assert np.count_nonzero(np.diff(slow)) == pytest.approx(1000, rel=0.25)
    assert d.mean() == pytest.approx(0.01, rel=0.002)  # centred: as much work as plain
    again = NoisyCostModel(Flat(), noise, (7,))
    assert [again.step_time(DECODE, 16) for _ in range(500)] == d[:500].tolist()
    other = NoisyCostModel(Flat(), noise, (8,))
    assert [other.step_time(DECODE, 16) for _ in range(20_000)] != d.tolist()


def test_spells_draw_from_a_stream_of_their_own():
    # with spells, every step is the draw without them plus one of the two offsets: the
    # residuals and the run factor are those of the same seed without spells
    q = tuple(np.linspace(0.9, 1.1, len(LEVELS)).tolist())
    plain = StepNoise({k: q for k in NOISE_KEYS}, {}, {}, 0.0, 0.0, {"decode": 0.1})
    spelled = StepNoise(
        plain.quantiles, {}, {}, 0.0, 0.0, {"decode": 0.1}, Spells(0.001, 0.05, 0.05)
    )
    a, b = NoisyCostModel(Flat(), plain, (3, 1, 0)), NoisyCostModel(Flat(), spelled, (3, 1, 0))
    diff = np.array([b.step_time(DECODE, 16) - a.step_time(DECODE, 16) for _ in range(300)])
    assert np.allclose(np.abs(diff), 0.0005)  # -0.5 ms fast, +0.5 ms slow (share 0.5)
    assert (diff > 0).any() and (diff < 0).any()


def test_spells_are_fitted_from_a_replay_with_known_spells():
    # 2 ms predicted decode steps, measured 1.9 ms (fast) or 2.4 ms (slow) in spells of 300
    # fast and 100 slow steps, five times over; a prompt step every 50 steps measured 5 ms
    # over its prediction (not a decode: no part in the levels); and a 10-step slow blip
    # (shorter than MIN_SPELL_STEPS: noise, merged into its fast spell). Fast 1,500 steps x
    # 1.9 ms over 5 exits = 0.57 s mean dwell; slow 500 x 2.4 ms (+ prompt steps) over 4
    # exits (the run ends slow: censored) = 0.3 s; the levels' gap 0.5 ms.
    slow = np.tile(np.r_[np.zeros(300, bool), np.ones(100, bool)], 5)
    blip = slow.copy()
    blip[100:110] = True
    predicted = np.full(len(slow), 0.002)
    measured = np.where(blip, 0.0024, 0.0019)
    decode = np.ones(len(slow), bool)
    decode[25::50] = False
    measured[~decode] += 0.005
    spells = fit_spells([(measured, predicted, decode)])
    assert spells.slow_s == pytest.approx(0.0005, rel=0.02)
    assert spells.fast_level_s == pytest.approx(-0.0001, abs=2e-5)
    assert spells.transitions == 9
    fast_s = measured[~slow].sum()
    assert spells.fast_dwell_s == pytest.approx(fast_s / 5, rel=0.02)
    assert spells.slow_dwell_s == pytest.approx(measured[slow].sum() / 4, rel=0.02)
    assert (spells.states(measured, predicted, decode) == slow).mean() > 0.99
    # no change of state anywhere, or no decode step: no spells
    assert fit_spells([(np.full(400, 0.0019), np.full(400, 0.002), np.ones(400, bool))]) is None
    assert fit_spells([(measured, predicted, np.zeros(len(slow), bool))]) is None


def test_calibrated_model_fits_spells_from_its_replay_steps_only(tmp_path):
    # two engine runs (policies) of 800 steady decode steps of 8 sequences, each priced by the
    # profile's fit + 0.1 ms (fast) or + 0.6 ms (slow), spells of 300 fast then 100 slow
    # steps: the replays' spells come back (gap 0.5 ms, 2 runs, 3 changes each)
    grid = CalibratedCostModel(QWEN)
    f = StepFeatures(0, 0, 0, 0.0, 8, 8 * 500, 8, 0)
    t = grid.step_time(f, 16)
    slow = np.tile(np.r_[np.zeros(300, bool), np.ones(100, bool)], 2)
    rows = []
    for policy in ("fcfs", "sjf"):
        clock = 0.0
        for s_ in slow:
            d = t + (0.0006 if s_ else 0.0001)
            rows.append(f"{policy},1,{clock},{d},0,8,0,0,4000,0,0")
            clock += d
    path = tmp_path / "steps.csv"
    path.write_text(
        "policy,rate_scale,time_s,duration_s,num_prefill_tokens,num_decode_tokens,"
        "num_prefills,prefill_context_tokens,decode_context_tokens,num_swap_out_blocks,"
        "num_swap_in_blocks,prefill_attention_pairs\n" + "\n".join(r + ",0" for r in rows) + "\n"
    )
    spells = CalibratedCostModel(QWEN, (path,)).noise.spells
    assert spells.slow_s == pytest.approx(0.0005, rel=0.05)
    assert (spells.runs, spells.transitions) == (2, 6)
    # fast: 4 spells of 300 steps, all left; slow: 2 of 100 per run, the second censored
    assert spells.fast_dwell_s == pytest.approx(1200 * (t + 0.0001) / 4, rel=0.02)
    assert spells.slow_dwell_s == pytest.approx(400 * (t + 0.0006) / 2, rel=0.02)


def test_short_runs_of_a_state_merge_into_the_one_before():
    states = np.r_[np.zeros(30, bool), np.ones(5, bool), np.zeros(30, bool), np.ones(40, bool)]
    merged = merge_short(states, 25)
    assert not merged[:65].any() and merged[65:].all()
    assert merge_short(np.ones(3, bool), 25).all()  # the first run keeps its state


def test_replay_runs_split_where_the_policy_changes_or_time_goes_back(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text("policy,rate_scale,time_s\nfcfs,1,0\nfcfs,1,0.1\nsjf,1,0\nsjf,1,0.2\nsjf,1,0\n")
    assert replay_run_ids(path).tolist() == [0, 0, 1, 1, 2]


def test_shipped_profile_noise_and_seeded_draws():
    model = CalibratedCostModel(QWEN)
    noise = model.noise
    assert noise.spells is None  # a profile alone: no sequence of steps, no spells
    for q in noise.quantiles.values():
        assert draw_mean(q) == pytest.approx(1.0)
        assert list(q) == sorted(q)
    # medians of passes: no row is twice its prediction
    assert noise.stall_probability == 0.0
    f = StepFeatures(0, 0, 0, 0.0, 32, 32 * 1024, 32, 0)
    t = model.step_time(f, 16)
    replicas = [NoisyCostModel(model, noise, (0, k, 0)) for k in range(5)]
    draws = [r.step_time(f, 16) for r in replicas]
    q = noise.quantiles["decode/small"]
    for r, d in zip(replicas, draws):
        run = r.run_factor["decode"]  # this replica's, the same for all its decode steps
        assert t * run * q[0] <= d <= t * run * q[-1]
    assert len(set(draws)) == 5  # each seed its own draw
    again = [NoisyCostModel(model, noise, (0, k, 0)).step_time(f, 16) for k in range(5)]
    assert again == draws  # the same seed, the same draw
    assert NoisyCostModel(model, noise, (0, 0, 0)).host_time(f, 16) == model.host_time(f, 16)


EXPERIMENT = {
    "name": "bands",
    "trace": {
        "format": "synthetic",
        "num_requests": 60,
        "arrival": {"process": "poisson", "rate": 40},
        "prompt_len": {"uniform": [64, 512]},
        "output_len": {"uniform": [16, 64]},
    },
    "model": "qwen3-0.6b",
    "hardware": "h200-sxm",
    "cost_model": {"profile": QWEN},
    "kv_cache": {"block_size": 16, "num_gpu_blocks": 256},
    "policies": ["fcfs", "chunked_prefill"],
    "slo": {"ttft_s": 0.05},
}


def test_seeded_replicas_give_bands_replica_zero_and_the_same_results_again():
    cfg = validate(EXPERIMENT)
    plain = run_experiment(cfg, progress=False)
    three = run_experiment(with_seeds(cfg, 3), progress=False)
    one = run_experiment(with_seeds(cfg, 1), progress=False)
    again = run_experiment(with_seeds(cfg, 3), progress=False)
    for p, r3, r1, ra in zip(plain, three, one, again, strict=True):
        s = r3.summary
        assert s["seeds"] == 3 and s["band_percentiles"] == [5.0, 95.0]
        # the replicas differ: the band of E2E p50 has a width
        lo, hi = s["p50_e2el_ms_band"]
        assert lo < hi
        for key in ("p50_ttft_ms", "p50_e2el_ms", "p99_itl_ms", "duration"):
            lo, hi = s[f"{key}_band"]
            assert lo <= s[f"{key}_seed_median"] <= hi
        # replica 0 is the draw of seed 0, whatever the number of replicas ...
        assert r1.summary["p50_e2el_ms"] == s["p50_e2el_ms"]
        assert r1.requests.equals(r3.requests)
        # ... not the deterministic run, whose summary has no band keys
        assert s["p50_e2el_ms"] != p.summary["p50_e2el_ms"]
        assert not any(k.endswith(("_band", "_seed_median")) for k in p.summary)
        assert "seeds" not in p.summary and "noise" not in p.summary["cost_model"]
        # the same seeds, the same results
        assert ra.summary == s
        # the vLLM-format file is replica 0's alone
        assert r3.vllm["median_e2el_ms"] == s["median_e2el_ms"]
        assert not any(k.endswith("_band") for k in r3.vllm)
    text = summary_text(three, (50, 99))
    assert "over 3 seeded replicas" in text
    assert "3 replicas are few: the band is about their range" in text  # N < 20
    lo, hi = three[0].summary["duration_band"]
    med = three[0].summary["duration_seed_median"]
    assert f"{med:.1f} [{lo:.1f}, {hi:.1f}]" in text


def test_band_fields_of_hand_made_summaries():
    summaries = [{"p50_ttft_ms": v, "policy": "fcfs", "num_steps": 9} for v in (10.0, 30.0, 20.0)]
    summaries[1]["p99_ttft_ms"] = None  # no value in one replica: left out of nothing else
    fields = band_fields(summaries)
    assert fields["seeds"] == 3
    assert fields["p50_ttft_ms_seed_median"] == pytest.approx(20.0)
    # p5 at position 0.1 between 10 and 20: 11; p95 at 1.9 between 20 and 30: 29
    assert fields["p50_ttft_ms_band"] == [pytest.approx(11.0), pytest.approx(29.0)]
    assert "num_steps_band" not in fields and "policy_band" not in fields


def test_seeds_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"^config: seeds: expected an integer in \[1, 1,000\]"):
        validate({**EXPERIMENT, "seeds": 0})
    with pytest.raises(ConfigError, match="seeds: backend engine measures its step times"):
        validate({**EXPERIMENT, "backend": "engine", "seeds": 2})
    durations = {"durations_from": str(DATA_ROOT / "experiments" / "replayed_durations.yaml")}
    with pytest.raises(ConfigError, match="seeds: cost_model.durations_from"):
        validate({**EXPERIMENT, "seeds": 2, "cost_model": durations})
    yaml_effs = {"flops_efficiency": 0.5, "bandwidth_efficiency": 0.8, "step_overhead_s": 0.002}
    cfg = validate({**EXPERIMENT, "seeds": 2, "cost_model": yaml_effs})
    with pytest.raises(ConfigError, match="no measured steps to draw noise from"):
        run_experiment(cfg, progress=False)


def test_analytic_model_draws_noise_from_its_efficiency_profiles():
    raw = {**EXPERIMENT, "cost_model": {}, "seeds": 2, "policies": ["fcfs"]}
    raw["trace"] = {**EXPERIMENT["trace"], "num_requests": 20}
    (run,) = run_experiment(validate(raw), progress=False)
    assert run.summary["cost_model"]["noise"]["rows"]["decode/small"] >= 8
    # the 8B profile's prompt rows the roofline prices 2-7x short are not host stalls: no
    # stall is drawn (each step had a 4.9% chance of 19.7 ms more before: bands above the
    # deterministic run at low load)
    assert run.summary["cost_model"]["noise"]["stall_probability"] == 0.0
    lo, hi = run.summary["p50_e2el_ms_band"]
    assert lo <= run.summary["p50_e2el_ms_seed_median"] <= hi
    assert "borrowed_from" not in run.summary["cost_model"]["noise"]
    # hardware without a profile (datasheet guesses): the shipped profiles' spread, named
    (run,) = run_experiment(validate({**raw, "hardware": "a100-80gb"}), progress=False)
    noise = run.summary["cost_model"]["noise"]
    assert noise["borrowed_from"] == [
        "profiles/h200_llama-3.1-8b.csv",
        "profiles/h200_qwen3-0.6b.csv",
    ]
    assert noise["rows"]["decode/small"] >= 8
    lo, hi = run.summary["p50_e2el_ms_band"]
    assert lo < hi


def test_async_without_host_time_and_a_stale_profile_are_warned_in_the_terminal():
    raw = {**EXPERIMENT, "policies": ["fcfs", {"name": "fcfs", "label": "fa",
                                               "async_scheduling": True}]}  # fmt: skip
    raw["trace"] = {**EXPERIMENT["trace"], "num_requests": 10}
    raw["cost_model"] = {"profile": OLD_QWEN}
    runs = run_experiment(validate(raw), progress=False)
    lines = warnings_text(runs).splitlines()
    assert lines[0] == (
        f"warning: fa: async_scheduling is on, but {NO_HOST_NOTE}; these runs are priced as "
        "synchronous ones"
    )
    # the old profile has no fingerprint: it may describe another engine
    assert lines[1].startswith("warning: stale profile ") and "no engine fingerprint" in lines[1]
    assert len(lines) == 2
    sync = [r for r in runs if r.label == "fcfs"]
    assert "async_scheduling" not in warnings_text(sync)


def test_the_warnings_reach_report_md_report_html_and_a_sweep_word_for_word(tmp_path, capsys):
    import html

    import yaml

    from sched_lab.cli import main

    raw = {**EXPERIMENT, "policies": [{"name": "fcfs", "label": "fa", "async_scheduling": True}]}
    raw["trace"] = {**EXPERIMENT["trace"], "num_requests": 6}
    raw["cost_model"] = {"profile": OLD_QWEN}
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "one"
    assert main(["run", str(path), "--out", str(out), "--no-plots", "--no-progress"]) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: ")]
    no_host = f"fa: async_scheduling is on, but {NO_HOST_NOTE}; these runs are priced as "
    assert printed[0] == f"warning: {no_host}synchronous ones"
    assert printed[1].startswith("warning: stale profile ") and len(printed) == 2
    report = (out / "report.md").read_text().splitlines()
    assert [ln for ln in report if ln.startswith("**Warning**")] == [
        f"**Warning**: {line.removeprefix('warning: ')}." for line in printed
    ]
    page = html.unescape((out / "report.html").read_text())
    assert all(line.removeprefix("warning: ") in page for line in printed)


def test_sweep_warnings_from_its_table_as_written_and_read_back(tmp_path):
    import pandas as pd

    from sched_lab.sweeps.report import sweep_warnings

    why = "the profile has no engine fingerprint"
    rows = [  # point, status, policy, async, stale, profile
        ("p000", "ok", "fa", True, True, "a.csv"),
        ("p000", "ok", "fcfs", False, True, "a.csv"),
        ("p001", "ok", "fa", True, False, "b.csv"),
        ("p002", "failed", "fa", None, None, None),  # no summary: nothing to say
    ]
    table = pd.DataFrame(
        [
            {"point": pt, "status": st, "policy": pol, "async_scheduling": asy,
             "cost_model_stale": stale, "cost_model_profile": prof,
             "cost_model_why": why if stale else "", "cost_model_host_note": NO_HOST_NOTE}
            for pt, st, pol, asy, stale, prof in rows
        ]
    )  # fmt: skip
    table.to_csv(tmp_path / "sweep.csv", index=False)
    expected = [
        (
            "warning",
            f"p000 fa, p001 fa: async_scheduling is on, but {NO_HOST_NOTE}; these runs are "
            "priced as synchronous ones",
        ),
        ("warning", f"stale profile a.csv: {why} (points p000)"),  # not p001's profile
    ]
    assert sweep_warnings(table) == expected
    assert sweep_warnings(pd.read_csv(tmp_path / "sweep.csv")) == expected
    # every point with the stale profile: no list of points
    table["cost_model_stale"], table["cost_model_why"], table["cost_model_profile"] = (
        True,
        why,
        "a.csv",
    )
    assert sweep_warnings(table)[1] == ("warning", f"stale profile a.csv: {why}")


class _Sim:
    """A simulated run's summary as run_row reads it."""

    def __init__(self, label: str, summary: dict) -> None:
        self.label, self.summary = label, summary


def _summary(value: float, band: tuple[float, float] | None) -> dict:
    keys = [f"p{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in (50, 90, 99)]
    s = {k: value for k in keys}
    s.update(output_throughput=value, num_preemptions=0)
    if band is not None:
        for k in [*keys, "output_throughput"]:
            s[f"{k}_band"] = list(band)
            s[f"{k}_seed_median"] = value
    return s


def test_coverage_of_hand_made_runs():
    # engine value 100 in every run; bands [90, 110] (inside), [95, 105] (inside),
    # [101, 120] (outside, above), [80, 99.9] (outside, below); medians 100, 100, 110, 90
    bands = [((90, 110), 100), ((95, 105), 100), ((101, 120), 110), ((80, 99.9), 90)]
    rows = []
    for band, median in bands:
        s = _summary(median, band)
        rows.append(run_row("w", 0.5, _Sim("fcfs", s), _summary(100.0, None), None))
    assert [r["inside_p50_ttft_ms"] for r in rows] == [True, True, False, False]
    # widths: 20/100, 10/100, 19/110, 19.9/90
    assert rows[2]["width_p50_ttft_ms"] == pytest.approx(19 / 110)
    cov, width, n = coverage(rows, "p50_ttft_ms")
    assert n == 4 and cov == pytest.approx(0.5)
    assert width == pytest.approx((19 / 110 + 0.2) / 2)  # median of 0.1, 0.173, 0.2, 0.221
    assert coverage(rows, "throughput")[0] == pytest.approx(0.5)
    # runs without bands count nothing
    plain = run_row("w", 0.5, _Sim("fcfs", _summary(100.0, None)), _summary(100.0, None), None)
    assert "inside_p50_ttft_ms" not in plain
    assert coverage([plain], "p50_ttft_ms")[2] == 0


def test_point_error_from_the_deterministic_run_band_from_the_seeded_one():
    # deterministic sim 104 vs engine 100: error 4%; seeded replicas' band [90, 103]
    # leaves 100 inside, their median 95 gives width 13/95; the repeat 110: spread 10%
    engine, repeat = _summary(100.0, None), {"fcfs": _summary(110.0, None)}
    row = run_row("w", 0.5, _Sim("fcfs", _summary(104.0, None)), engine, repeat,
                  _summary(95.0, (90, 103)))  # fmt: skip
    assert row["err_p50_ttft_ms"] == pytest.approx(0.04)
    assert row["inside_p50_ttft_ms"] is True
    assert row["width_p50_ttft_ms"] == pytest.approx(13 / 95)
    import pandas as pd

    lines = coverage_section(pd.DataFrame([row]))
    assert "| TTFT p50 | 1 | 100.0% ✗ | 13.7% | 4.0% | 10.0% |" in lines


def test_coverage_section_marks_coverage_outside_the_target():
    import pandas as pd

    rows = [
        run_row("w", 0.5, _Sim("fcfs", _summary(100.0, (90, 110))), _summary(100.0, None), None)
        for _ in range(9)
    ]
    rows.append(
        run_row("w", 0.5, _Sim("fcfs", _summary(100.0, (90, 110))), _summary(120.0, None), None)
    )
    lines = coverage_section(pd.DataFrame(rows))
    # 9 of 10 runs inside: 90%, within 85-95%; width 20%; point error median 0%
    assert "| TTFT p50 | 10 | 90.0% | 20.0% | 0.0% | - |" in lines
    assert coverage_section(pd.DataFrame([{"err_p50_ttft_ms": 0.1}])) == []
    spelled = StepNoise({}, {}, {}, 0.0, 0.0, {"decode": 0.03}, Spells(0.0004, 3.0, 1.0, 0, 6, 14))
    assert (
        "Run factor sigma 3.0%; slow spells fitted from the calibration replays: 0.40 ms more "
        "per step while slow, 25.0% of the time, mean dwells 3.00 s fast and 1.00 s slow "
        "(14 changes of state in 6 replay runs)."
    ) in coverage_section(pd.DataFrame(rows), spelled)
    # A sigma per kind (the profile rows' own, no replay sample): each named, not a bare list
    per_kind = StepNoise({}, {}, {}, 0.0, 0.0, {"decode": 0.046, "prefill": 0.216, "mixed": 0.11})
    assert (
        "Run factor sigma 4.6% decode, 21.6% prefill, 11.0% mixed; no slow spells (no "
        "calibration replays, or none that changed state)."
    ) in coverage_section(pd.DataFrame(rows), per_kind)


def test_seeds_flag_runs_replicas_and_rejects_a_bad_count(tmp_path, capsys):
    import yaml

    import run_experiment

    path = tmp_path / "bands.yaml"
    raw = {**EXPERIMENT, "policies": ["fcfs"]}
    raw["trace"] = {**EXPERIMENT["trace"], "num_requests": 10}
    path.write_text(yaml.safe_dump(raw))
    assert run_experiment.main([str(path), "--seeds", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "seeds: expected an integer in [1, 1,000]" in err
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--seeds", "2", "--out", str(out), "--no-plots"]) == 0
    assert "over 2 seeded replicas" in capsys.readouterr().out
    assert "Cells: median [p5, p95] over 2 seeded replicas" in (out / "report.md").read_text()


def test_an_interrupted_seeded_run_keeps_the_replicas_that_finished(tmp_path, monkeypatch, capsys):
    import json
    import signal

    import yaml

    import sched_lab.run.experiment as experiment
    from sched_lab.cli import Interrupted, main

    raw = {**EXPERIMENT, "seeds": 4}
    raw["trace"] = {**EXPERIMENT["trace"], "num_requests": 10}
    path = tmp_path / "bands.yaml"
    path.write_text(yaml.safe_dump(raw))
    real = experiment._run_once

    def run_once(ex, run, trace, seed, own=False):
        if run.label == "chunked_prefill" and seed == 2:  # Ctrl-C during its third replica
            raise Interrupted(signal.SIGINT)
        return real(ex, run, trace, seed, own)

    monkeypatch.setattr(experiment, "_run_once", run_once)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--no-plots", "--no-progress"]) == 130
    partial = (
        "interrupted by SIGINT after 2 of 2 runs, the last (chunked_prefill) with 2 of 4 "
        "seeded replicas"
    )
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {partial}; wrote them to {out}/ as partial results"
    )
    summary = json.loads((out / "summary.json").read_text())
    fcfs, chunked = summary["fcfs"], summary["chunked_prefill"]
    assert fcfs["seeds"] == 4 and "seeds_requested" not in fcfs
    assert chunked["seeds"] == 2 and chunked["seeds_requested"] == 4
    assert chunked["partial"] == partial
    lo, hi = chunked["p50_e2el_ms_band"]  # the band of the 2 replicas that finished
    assert lo <= chunked["p50_e2el_ms_seed_median"] <= hi
    report = (out / "report.md").read_text()
    assert f"**Partial results**: {partial}." in report
    assert "the bands); interrupted: chunked_prefill 2 of 4 replicas; 4 replicas are few" in report


def test_counts_print_as_whole_numbers_latencies_as_they_are():
    from sched_lab.report.markdown import _cell
    from sched_lab.report.terminal import banded
    from sched_lab.results.bands import band_text

    # preemptions 3, 6, 7, 9: median 6.5 (rounded half to even: 6); p5 at position 0.15
    # between 3 and 6: 3.45 (down: 3); p95 at 2.85 between 7 and 9: 8.7 (up: 9)
    summaries = [
        {"num_preemptions_recompute": n, "p50_ttft_ms": t}
        for n, t in ((3, 10.0), (6, 20.0), (7, 30.0), (9, 40.0))
    ]
    run = _Sim("fcfs", {**summaries[0], **band_fields(summaries)})
    assert run.summary["num_preemptions_recompute_seed_median"] == pytest.approx(6.5)
    assert banded(run, "num_preemptions_recompute", "g") == "6 [3, 9]"
    assert _cell(run, "num_preemptions_recompute", "d") == "6 [3, 9]"
    # a latency keeps its fractions: median 25, p5 10 + 0.15 * 10 = 11.5, p95 30 + 0.85 * 10
    assert banded(run, "p50_ttft_ms", ".1f") == "25.0 [11.5, 38.5]"
    assert _cell(run, "p50_ttft_ms", ".4f", lambda ms: ms / 1e3) == "0.0250 [0.0115, 0.0385]"
    # 7.5 rounds to 8 (half to even); ends already whole stay as they are
    assert band_text("num_preemptions_swap", (7.5, 7.0, 8.0), "g") == "8 [7, 8]"
    assert band_text("completed", (10.0, 9.05, 10.0), "d") == "10 [9, 10]"


def test_seeds_apply_to_every_bundled_experiment_or_are_refused_in_one_line():
    from pathlib import Path

    from sched_lab.config import check_seeds_flag, load_config
    from sched_lab.run.experiment import check_before_runs
    from sched_lab.sweeps.sweep import is_sweep, load_sweep, read_yaml

    examples = sorted((Path(__file__).parent.parent / "experiments").glob("*.yaml"))
    refused, ran = [], []
    for path in examples:
        _, raw = read_yaml(path)
        if raw.get("backend", "sim") != "sim":  # measured step times: refused before all else
            with pytest.raises(ConfigError) as e:
                check_seeds_flag(str(path), raw, 2)
            assert str(e.value) == (
                f"{path} (--seeds): seeds: backend {raw['backend']} measures its step times; "
                "seeded replicas with step-time noise are the simulator's (backend: sim), or "
                "remove seeds"
            )
            refused.append(path.stem)
        elif is_sweep(raw):  # every point validated and checked, its noise fitted
            load_sweep(path, raw={**raw, "seeds": 2}, check_traces=False)
        elif "durations_from" in (raw.get("cost_model") or {}):  # one engine run's own times
            with pytest.raises(ConfigError, match="seeds: cost_model.durations_from replays"):
                with_seeds(load_config(path), 2)
            refused.append(path.stem)
        else:
            cfg = with_seeds(load_config(path), 2)
            check_before_runs(cfg)  # the noise model is fitted here
            ran.append(path.stem)
    assert "quickstart" in ran and "synthetic_gamma" in ran  # a datasheet-guess hardware too
    assert "smollm2_cpu" in refused and "replayed_durations" in refused


STEPS_HEADER = (
    "num_prefill_tokens,num_prefills,prefill_context_tokens,prefill_attention_pairs,"
    "num_decode_tokens,decode_context_tokens,num_swap_out_blocks,num_swap_in_blocks,duration_s\n"
)


def _steps_csv(path, decodes: int, prefills: int):
    """An engine steps.csv of ``decodes`` decode steps of 8 sequences (context 8 x 1,000)
    at 2.1 ms and ``prefills`` 512-token prompt steps at 4 ms."""
    rows = ["0,0,0,0.0,8,8000,0,0,0.0021\n"] * decodes
    rows += [f"512,1,0,{512 * 513 / 2},0,0,0,0,0.004\n"] * prefills
    path.write_text(STEPS_HEADER + "".join(rows))
    return path


def test_replay_steps_listed_twice_is_refused_in_one_line(tmp_path):
    steps = str(_steps_csv(tmp_path / "steps.csv", 10, 10))
    raw = {**EXPERIMENT, "cost_model": {"profile": QWEN, "replay_steps": [steps, steps]}}
    with pytest.raises(ConfigError, match=r"replay_steps\[1\]: .*steps.csv is replay_steps\[0\] "
                       "again; expected each engine run once$"):  # fmt: skip
        validate(raw)


def test_replay_files_too_small_for_a_sample_keep_the_profiles_run_sigma(tmp_path):
    # 5 decode and 3 prompt steps: no kind reaches MIN_ROWS (8), so no held-out run sample;
    # the run factor falls back to the profile rows' 5-fold sigma instead of vanishing
    small = _steps_csv(tmp_path / "small.csv", 5, 3)
    alone = CalibratedCostModel(QWEN).noise.run_sigma
    with_small = CalibratedCostModel(QWEN, (small,)).noise.run_sigma
    assert set(with_small) == {"decode", "prefill", "mixed"}
    for kind, sigma in alone.items():
        assert sigma > 0.01 and with_small[kind] == pytest.approx(sigma, rel=0.25)
    # two files of 10 steps of each kind: one held-out sample per file and kind, pooled
    runs = [_steps_csv(tmp_path / f"run{i}.csv", 10, 10) for i in range(2)]
    pooled = CalibratedCostModel(QWEN, tuple(runs)).noise.run_sigma
    assert len(set(pooled.values())) == 1 and 0 < pooled["decode"] < 5
