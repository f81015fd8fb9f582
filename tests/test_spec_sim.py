"""Speculative decoding in the simulator: acceptance draws, verify and draft pricing, the
metrics (lab/sim/spec_executor.py, lab/results/spec_metrics.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sched_lab.core.errors import ConfigError
from sched_lab.core.kv import make_block_manager
from sched_lab.core.plan import SchedulerOutput, StepFeatures, StepResult
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.core.spec import SpeculativeConfig
from sched_lab.policies import get_policy
from sched_lab.results import metrics, spec_metrics
from sched_lab.sim import spec_executor as se
from sched_lab.sim.calibrated import PROFILE_COLUMNS, CalibratedCostModel
from sched_lab.sim.replay import replay

STEP_S = 0.01


class ConstantCost:
    """A cost model whose every step takes ``STEP_S`` (verify tokens cost nothing extra)."""

    def step_time(self, f: StepFeatures, block_size: int) -> float:
        return STEP_S


class ConstantExecutor:
    wall_clock = False

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return StepResult(STEP_S)


def spec_replay(rates, k, requests, policy="fcfs", seed=0, budget=4096):
    spec = SpeculativeConfig("synthetic", k, acceptance_rates=tuple(rates), seed=seed)
    cls = get_policy(policy)
    bm = make_block_manager(64, 0, 16, 0.0, False)
    scheduler = cls(SchedulerLimits(8, budget, 4096), bm, speculative=spec)
    executor = se.SpecExecutor(ConstantExecutor(), ConstantCost(), 16, k, rates, seed)
    reqs = [Request(*t) for t in requests]
    result = replay(reqs, scheduler, executor, check_invariants=True)
    assert result.failure is None, result.failure
    return result, spec


# ---------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize(
    "rates, d, expected",
    [
        ((1.0, 0.0), 2, 1),  # the first always, the second never
        ((1.0, 0.0), 1, 1),
        ((1.0, 1.0, 1.0), 3, 3),
        ((1.0, 1.0, 1.0), 2, 2),  # never more than the drafts verified
        ((0.0, 1.0), 2, 0),  # a rejection ends the prefix: the second is never reached
        ((1.0, 1.0, 0.0, 1.0), 4, 2),
    ],
)
def test_acceptance_with_certain_rates(rates, d, expected):
    for step in range(20):
        assert se.num_accepted(rates, d, 7, se.request_key("r1"), step) == expected


def test_draws_are_deterministic_and_keyed():
    key = se.request_key("req-42")
    a = [se.uniform(3, key, s, i) for s in range(50) for i in range(4)]
    assert a == [se.uniform(3, key, s, i) for s in range(50) for i in range(4)]
    assert a != [se.uniform(4, key, s, i) for s in range(50) for i in range(4)]  # the seed
    assert a != [se.uniform(3, se.request_key("req-43"), s, i) for s in range(50) for i in range(4)]
    assert all(0.0 <= u < 1.0 for u in a)
    assert se.request_key("req-42") == key  # stable (no per-process hash salt)


def test_draws_follow_the_rates():
    # p1 = 0.8, p2 = 0.5 with d = 2: P(a=0) = 0.2, P(a=1) = 0.8 * 0.5, P(a=2) = 0.4
    rates, n = (0.8, 0.5), 20000
    got = np.bincount([se.num_accepted(rates, 2, 1, se.request_key(str(i)), 0) for i in range(n)])
    assert np.allclose(got / n, [0.2, 0.4, 0.4], atol=0.015)  # 4+ standard deviations
    assert se.expected_tokens(rates, 2) == pytest.approx(1 + 0.8 + 0.4)


def test_executor_runs_are_deterministic():
    reqs = [(f"r{i}", 0.0, 20, 30) for i in range(4)]
    a, _ = spec_replay((0.7, 0.6, 0.5), 3, reqs, seed=5)
    b, _ = spec_replay((0.7, 0.6, 0.5), 3, reqs, seed=5)
    c, _ = spec_replay((0.7, 0.6, 0.5), 3, reqs, seed=6)
    steps = lambda res: [r.spec_steps for r in res.requests]  # noqa: E731
    assert steps(a) == steps(b)
    assert steps(a) != steps(c)


# ---------------------------------------------------------------------------- a tiny run
def test_tiny_run_tokens_metrics_and_itl():
    # k = 2, rates [1, 0]: every verify accepts exactly one draft, so a decode step yields 2
    # tokens. Output 7: the prefill (step 0) samples token 1; steps 1, 2 verify 2 drafts
    # each (+2 tokens: 3, 5), step 3 only 1 (7 - 5 - 1 left), accepted: 7 tokens.
    result, spec = spec_replay((1.0, 0.0), 2, [("a", 0.0, 16, 7)])
    (r,) = result.requests
    assert r.status.value == "finished" and r.num_output_tokens == 7
    assert [(d, a) for _, d, a in r.spec_steps] == [(2, 1), (2, 1), (1, 1)]
    assert len(result.steps["time_s"]) == 4
    assert np.allclose(result.token_times(r), [0.01, 0.02, 0.02, 0.03, 0.03, 0.04, 0.04])
    df, itl = metrics.request_table(result, "fcfs", 1.0, split_itl=True)
    assert np.allclose(itl, [0.005] * 6)  # each 10 ms step brings 2 tokens
    assert df["tpot_s"].iloc[0] == pytest.approx(0.03 / 6)
    _, unsplit = metrics.request_table(result, "fcfs", 1.0)
    assert np.allclose(sorted(unsplit), [0, 0, 0, 0.01, 0.01, 0.01])
    s = spec_metrics.run_summary(result.requests, spec)
    assert s["num_drafts"] == 3 and s["num_draft_tokens"] == 5 and s["num_accepted_tokens"] == 3
    assert s["mean_acceptance_length"] == 2.0
    assert s["draft_acceptance_rate"] == pytest.approx(0.6)
    assert s["acceptance_rate_per_position"] == [1.0, 0.0]
    assert s["num_reached_per_pos"] == [3, 2]  # step 3 fed no second draft
    assert s["conditional_acceptance_rates"] == [1.0, 0.0]  # the rates given, measured
    df = spec_metrics.add_request_columns(df, result.requests, 2)
    row = df.iloc[0]
    assert (row["num_drafts"], row["num_draft_tokens"], row["num_accepted_tokens"]) == (3, 5, 3)
    assert row["acceptance_rate_per_position"] == "1;0"
    assert spec_metrics.step_columns(result, 4)["num_accepted_tokens"].tolist() == [0, 1, 1, 1]


def test_split_gaps_by_hand():
    assert np.allclose(spec_metrics.split_gaps(np.array([0.0, 0.3, 0.3, 0.3])), [0.1] * 3)
    assert np.allclose(
        spec_metrics.split_gaps(np.array([1.0, 1.1, 1.4, 1.4, 2.0])), [0.1, 0.15, 0.15, 0.6]
    )
    assert spec_metrics.split_gaps(np.array([5.0])).size == 0
    t = np.array([0.0, 0.2, 0.5, 0.5, 0.5, 0.9])
    assert spec_metrics.split_gaps(t).sum() == pytest.approx(0.9)  # sums to last - first


def test_counts_and_rates_by_hand():
    # (step, d', a): accepted [2, 1]; reached: all 3 reach position 1, 2 reach position 2
    c = spec_metrics.counts([(0, 2, 2), (1, 2, 0), (2, 2, 1)], 2)
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (3, 6, 3)
    assert c["num_accepted_tokens_per_pos"] == [2, 1] and c["num_reached_per_pos"] == [3, 2]
    x = spec_metrics.rates(c)
    assert x["mean_acceptance_length"] == 2.0
    assert x["acceptance_rate_per_position"] == pytest.approx([2 / 3, 1 / 3])
    assert x["draft_acceptance_rate"] == 0.5
    assert x["conditional_acceptance_rates"] == pytest.approx([2 / 3, 1 / 2])


def test_acceptance_from_reads_an_engine_runs_counts(tmp_path):
    summary = {
        "fcfs": {
            "speculative": {"num_accepted_tokens_per_pos": [6, 3], "num_reached_per_pos": [10, 6]}
        },
        "swap": {
            "speculative": {"num_accepted_tokens_per_pos": [2, 1], "num_reached_per_pos": [10, 2]}
        },
        "other": {"policy": "x"},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert se.measured_rates(tmp_path, 2) == pytest.approx((8 / 20, 4 / 8))  # pooled
    spec = SpeculativeConfig("ngram", 2, 1, 3, acceptance_from=str(tmp_path))
    assert se.acceptance_rates(spec) == pytest.approx((0.4, 0.5))
    with pytest.raises(ConfigError, match="measured 2 draft positions.*is 3"):
        se.measured_rates(tmp_path, 3)


# ---------------------------------------------------------------------------- pricing
# A linear "profile": durations exactly linear in the calibrated model's features with these
# coefficients, so the fit recovers them (the hinge and swap columns stay 0: unused).
COEF = {
    "decode_step": 2e-3, "prefill_step": 3e-3, "seq": 1e-5, "tok": 1e-6,
    "mean_ctx": 1e-7, "dctx": 2e-8, "pctx": 5e-7, "pairs": 1e-9,
}  # fmt: skip


def linear_profile(path):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        prefills = int(rng.integers(0, 3)) if i % 2 else 0
        decodes = int(rng.integers(1, 40)) if i % 3 or not prefills else 0
        ptok = int(rng.integers(1, 400)) * prefills
        pctx = int(rng.integers(0, 300)) * prefills
        pairs = float(rng.integers(0, 50000)) * prefills
        dctx = int(rng.integers(1, 500)) * decodes
        c = COEF
        t = (c["prefill_step"] if prefills else c["decode_step"]) + c["seq"] * (prefills + decodes)
        t += c["tok"] * (ptok + decodes) + c["dctx"] * dctx + c["pctx"] * pctx
        t += c["pairs"] * pairs + (c["mean_ctx"] * dctx / decodes if decodes else 0)
        rows.append(("x", ptok, prefills, pctx, pairs, decodes, dctx, 0, t))
    pd.DataFrame(rows, columns=["kind", *PROFILE_COLUMNS]).to_csv(path, index=False)
    return CalibratedCostModel(path)


def spec_plan(prompt=90, outputs=10, d=2) -> tuple[SchedulerOutput, Request]:
    """One decode of a request holding prompt + outputs tokens, verifying d drafts."""
    r = Request("v", 0.0, prompt, 100)
    r.join_tick, r.join_num_output = 0, outputs
    plan = SchedulerOutput(decodes=[r], decode_context_tokens=prompt + outputs, decode_tick=0)
    plan.spec_decodes[r] = d
    return plan, r


def test_verify_step_priced_as_a_prefill_chunk(tmp_path):
    cm = linear_profile(tmp_path / "p.csv")
    plan, _ = spec_plan()
    # the latest token sits at position 99: a chunk of 3 tokens over 99 cached ones
    assert se.spec_positions(plan) == [(99, 2)]
    c = COEF
    hand = c["prefill_step"] + c["seq"] + 3 * c["tok"] + 99 * c["pctx"] + (3 * 99 + 6) * c["pairs"]
    assert se.verify_time(cm, plan, 16, "prefill") == pytest.approx(hand, rel=1e-6)


def test_verify_step_priced_as_decode_rows(tmp_path):
    cm = linear_profile(tmp_path / "p.csv")
    plan, _ = spec_plan()
    f = plan.features()
    assert (f.num_spec_tokens, f.spec_context_tokens) == (2, 2 * 100 + 3)
    c = COEF
    decode = c["decode_step"] + c["seq"] + c["tok"] + 100 * (c["dctx"] + c["mean_ctx"])
    hand = decode + 2 * c["tok"] + 203 * c["pairs"]
    assert se.verify_time(cm, plan, 16, "decode") == pytest.approx(hand, rel=1e-6)


def test_draft_steps_priced_by_the_draft_profile(tmp_path):
    cm = linear_profile(tmp_path / "p.csv")
    c = COEF
    # 2 sequences, 200 tokens, k = 2: decode steps over 200 then 202 context tokens

    def step(ctx):
        return c["decode_step"] + 2 * (c["seq"] + c["tok"]) + (c["dctx"] + c["mean_ctx"] / 2) * ctx

    assert se.draft_time(cm, 2, 200, 2) == pytest.approx(step(200) + step(202), rel=1e-6)
    assert se.draft_time(cm, 0, 0, 4) == 0.0


def test_executor_adds_verify_minus_base_time(tmp_path):
    cm = linear_profile(tmp_path / "p.csv")
    plan, r = spec_plan()
    base = cm.step_time(plan.features(), 16)

    class Inner:
        def execute(self, plan):
            return StepResult(base)

    ex = se.SpecExecutor(Inner(), cm, 16, 2, (1.0, 0.0), verify_pricing="decode")
    res = ex.execute(plan)
    assert res.num_accepted == {r: 1}
    assert res.draft_token_ids == {r: [se.PLACEHOLDER_TOKEN] * 2}
    assert res.duration_s == pytest.approx(se.verify_time(cm, plan, 16, "decode"))
    # With a draft model: k = 2 draft decode steps over the request's 100 + 1 + 1 tokens
    plan, r = spec_plan()
    ex = se.SpecExecutor(Inner(), cm, 16, 2, (1.0, 0.0), draft_model=cm, verify_pricing="decode")
    res = ex.execute(plan)
    hand = se.verify_time(cm, plan, 16, "decode") + se.draft_time(cm, 1, 102, 2)
    assert res.duration_s == pytest.approx(hand)


# ---------------------------------------------------------------------------- bad inputs
def test_bad_rates_and_missing_rates_are_one_line(tmp_path):
    with pytest.raises(
        ConfigError, match=r"acceptance_rates\[1\]: expected a probability in \[0, 1\], got 1.5"
    ):
        se.check_rates([0.5, 1.5], 2, "acceptance_rates")
    with pytest.raises(ConfigError, match=r"got nan"):
        se.check_rates([float("nan")], 1, "acceptance_rates")
    with pytest.raises(ConfigError, match="expected 2 per-position"):
        se.check_rates([0.5], 2, "acceptance_rates")
    spec = SpeculativeConfig("ngram", 3, 1, 4)
    with pytest.raises(ConfigError) as e:
        se.acceptance_rates(spec)
    assert "\n" not in str(e.value) and "needs acceptance_rates" in str(e.value)
    with pytest.raises(ConfigError, match="no summary.json"):
        se.measured_rates(tmp_path / "nowhere", 2)
    (tmp_path / "summary.json").write_text(json.dumps({"fcfs": {"policy": "fcfs"}}))
    with pytest.raises(ConfigError, match="no run with speculative"):
        se.measured_rates(tmp_path, 2)
    draft = SpeculativeConfig("draft", 2, model="no-such-model", acceptance_rates=(0.5, 0.5))
    with pytest.raises(ConfigError, match="speculative.model: for the simulator expected"):
        se.draft_cost_model(draft, None, tmp_path)


# ---------------------------------------------------------------------------- end to end
SPEC_YAML = """
name: spec_e2e
trace: {format: synthetic, num_requests: 12, arrival: {process: poisson, rate: 50.0},
        prompt_len: 64, output_len: {uniform: [8, 40]}, seed: 1}
model: qwen3-0.6b
hardware: h200-sxm
cost_model: {profile: PROFILE}
kv_cache: {block_size: 16, num_gpu_blocks: 512}
scheduler: {max_num_seqs: 4, max_model_len: 1024}
speculative: SPEC
policies: [{name: fcfs, label: off, speculative: null}, {name: fcfs, label: on}]
"""


def write_config(tmp_path, spec: str, name: str = "c.yaml"):
    profile = Path(__file__).resolve().parent.parent / "profiles" / "h200_qwen3-0.6b.csv"
    path = tmp_path / name
    path.write_text(SPEC_YAML.replace("PROFILE", str(profile)).replace("SPEC", spec))
    return path


def test_experiment_writes_spec_metrics_and_acceptance_from_reads_them(tmp_path):
    import run_experiment

    cfg = write_config(
        tmp_path, "{method: synthetic, num_speculative_tokens: 2, acceptance_rates: [0.9, 0.5]}"
    )
    assert run_experiment.main([str(cfg), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert "speculative" not in summary["off"]
    s = summary["on"]["speculative"]
    req = pd.read_csv(tmp_path / "a" / "requests.csv")
    on = req[req["policy"] == "on"]
    assert on["num_accepted_tokens"].sum() == s["num_accepted_tokens"]
    assert on["num_draft_tokens"].sum() == s["num_draft_tokens"]
    assert req[req["policy"] == "off"]["num_drafts"].isna().all()
    text = pd.read_csv(tmp_path / "a" / "requests.csv", dtype=str, keep_default_na=False)
    for col in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):  # 12, not 12.0
        assert text.loc[text["policy"] == "on", col].str.fullmatch(r"[0-9]+").all(), col
        assert (text.loc[text["policy"] == "off", col] == "").all(), col
    steps = pd.read_csv(tmp_path / "a" / "steps.csv")
    assert (
        steps.loc[steps["policy"] == "on", "num_accepted_tokens"].sum() == s["num_accepted_tokens"]
    )
    assert steps.loc[steps["policy"] == "on", "num_spec_tokens"].sum() == s["num_draft_tokens"]
    assert (steps.loc[steps["policy"] == "off", "num_accepted_tokens"] == 0).all()
    assert "Speculative decoding" in (tmp_path / "a" / "report.md").read_text()
    # The finished requests' output tokens: each verify step gave 1 + accepted.
    assert (on["num_generated_tokens"] == on["output_tokens"]).all()
    # A simulated ngram run takes the measured rates of that run.
    cfg2 = write_config(
        tmp_path,
        f"{{method: ngram, num_speculative_tokens: 2, acceptance_from: {tmp_path / 'a'}}}",
        "d.yaml",
    )
    args = [str(cfg2), "--out", str(tmp_path / "b"), "--no-progress", "--no-plots"]
    assert run_experiment.main(args) == 0  # its summary is checked, not its figures
    assert (
        json.loads((tmp_path / "b" / "summary.json").read_text())["on"]["speculative"]["method"]
        == "ngram"
    )


def test_sim_ngram_without_rates_is_one_line(tmp_path, capsys):
    import run_experiment

    cfg = write_config(tmp_path, "{method: ngram, num_speculative_tokens: 3}")
    assert run_experiment.main([str(cfg), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "policies[on]: speculative: method 'ngram' in the simulator needs" in err[0]
    )
    assert not (tmp_path / "x").exists()
    cfg = write_config(
        tmp_path, "{method: synthetic, num_speculative_tokens: 2, acceptance_rates: [0.5, 1.2]}"
    )
    assert run_experiment.main([str(cfg), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "acceptance_rates[1]: expected a probability in [0, 1], got 1.2" in err[0]
    )


def test_speculation_with_async_scheduling_runs(tmp_path):
    import run_experiment

    cfg = write_config(
        tmp_path, "{method: synthetic, num_speculative_tokens: 2, acceptance_rates: [0.9, 0.5]}"
    )
    text = cfg.read_text().replace(
        "max_model_len: 1024}", "max_model_len: 1024, async_scheduling: true}"
    )
    cfg.write_text(text)
    args = [str(cfg), "--out", str(tmp_path / "a"), "--no-progress", "--no-plots"]
    assert run_experiment.main(args) == 0  # the tables are checked, not the figures
    on = json.loads((tmp_path / "a" / "summary.json").read_text())["on"]
    assert on["async_scheduling"] and on["completed"] == 12
    assert on["num_wasted_tokens"] == 0  # ends by length: foreseen, with drafts too
    req = pd.read_csv(tmp_path / "a" / "requests.csv")
    assert (
        req.loc[req["policy"] == "on", "num_accepted_tokens"].sum()
        == on["speculative"]["num_accepted_tokens"]
        > 0
    )


def test_draft_named_by_model_preset_runs_and_peak_rate_counts_accepted_drafts(tmp_path):
    """A draft named by a model preset (not turned into a path); the vLLM-format file's peak
    output rate counts accepted drafts (it counted one token per decode)."""
    import run_experiment

    cfg = write_config(
        tmp_path,
        "{method: draft, num_speculative_tokens: 2, model: qwen3-0.6b, acceptance_rates: [1.0, 1.0]}",
    )
    args = [str(cfg), "--out", str(tmp_path / "d"), "--no-progress", "--no-plots"]
    assert run_experiment.main(args) == 0  # the vLLM-format file is checked, not the figures
    on = json.loads(next((tmp_path / "d").glob("on-*.json")).read_text())
    # The run lasts under a second, so its busiest whole second holds every output token.
    assert on["duration"] < 1.0
    assert on["max_output_tokens_per_s"] == on["total_output_tokens"]
