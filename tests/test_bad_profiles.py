"""Bad engine profiles and replay_steps files (tests/data/bad_profiles/): each is refused with
one line naming the file, row and column and what was expected, before any replay; a fit
that would predict a step shorter than MIN_STEP_S is refused too."""

from __future__ import annotations

from pathlib import Path

import pytest

import run_experiment
from sched_lab.core.errors import ConfigError
from sched_lab.sim.calibrated import CalibratedCostModel

CORPUS = Path(__file__).resolve().parent / "data" / "bad_profiles"
P = "cost_model.profile: {path}"
COLUMNS = (
    "num_prefill_tokens, num_prefills, prefill_context_tokens, prefill_attention_pairs, "
    "num_decodes, decode_context_tokens, num_swap_blocks, duration_s"
)

PROFILES = {
    "duration_nan.csv": P + ": row 3, column 'duration_s': expected a finite number, got 'NaN'",
    "duration_empty.csv": P
    + ": row 2, column 'duration_s': expected a finite number, got '' (empty)",
    "duration_inf.csv": P + ": row 7, column 'duration_s': expected a finite number, got 'inf'",
    "duration_zero.csv": P
    + ": row 4, column 'duration_s': expected a step duration >= 1e-06 s, got '0'",
    "duration_negative.csv": P
    + ": row 5, column 'duration_s': expected a step duration >= 1e-06 s, got '-0.002'",
    "duration_tiny.csv": P
    + ": row 6, column 'duration_s': expected a step duration >= 1e-06 s, got '3e-09'",
    "decodes_text.csv": P + ": row 2, column 'num_decodes': expected a finite number, got 'many'",
    "decodes_negative.csv": P
    + ": row 3, column 'num_decodes': expected a whole count >= 0, got '-4'",
    "decodes_fraction.csv": P
    + ": row 4, column 'num_decodes': expected a whole count >= 0, got '1.5'",
    "pairs_negative.csv": P
    + ": row 15, column 'prefill_attention_pairs': expected a number >= 0, got '-1.0'",
    "missing_duration.csv": P
    + f": missing column duration_s; expected columns: {COLUMNS} (found: kind, "
    "num_prefill_tokens, num_prefills, prefill_context_tokens, prefill_attention_pairs, "
    "num_decodes, decode_context_...)",
    "few_rows.csv": P + ": expected at least 10 rows (one per fitted coefficient), got 5",
    "header_only.csv": P + ": expected at least 10 rows (one per fitted coefficient), got 0",
    "empty.csv": "cost_model.profile: {path} is not a readable CSV (No columns to parse from file)",
    "binary.csv": "cost_model.profile: {path} is not a text CSV (not UTF-8: byte 0)",
    "prefill_only.csv": P + ": no decode-only steps (num_prefills 0, num_decodes > 0): the fit "
    "cannot predict their time",
    # LoRA columns against the step's own: a sequence runs one adapter, which feeds >= 1 token.
    "lora_loras_huge.csv": P + ": row 9, column 'num_loras': expected at most num_prefills + "
    "num_decodes (64: one adapter per sequence), got '1e30'",
    "lora_tokens_zero.csv": P + ": row 5, column 'num_lora_tokens': expected at least num_loras "
    "(3: each adapter feeds a token), got '0'",
    "lora_tokens_beyond.csv": P + ": row 14, column 'num_lora_tokens': expected at most the "
    "step's tokens (64: num_prefill_tokens + num_decodes + num_spec_tokens), got '65'",
    # Decodes cost 1 ns per context token and nothing else: a 1-token decode would take ~1 ns
    # (the fit gives 22.7 ns, its hinge and mean-context terms included).
    "decode_without_fixed_cost.csv": P
    + ": the fitted model predicts 2.27e-08 s for a 1-token decode, expected >= 1e-06 s",
    # Prefills cost 10 ps per (query, key) pair and nothing else: 1 token = 1 pair = 1e-11 s.
    "prefill_without_fixed_cost.csv": P
    + ": the fitted model predicts 1e-11 s for a 1-token prefill, expected >= 1e-06 s",
}
R = "cost_model.replay_steps: {path}"
STEPS = {
    "steps_duration_zero.csv": R
    + ": row 3, column 'duration_s': expected a step duration >= 1e-06 s, got '0'",
    "steps_duration_huge.csv": R
    + ": row 2, column 'duration_s': expected a step duration <= 3600 s, got '5.94848176e+27'",
    "steps_header_only.csv": R + ": no steps (a header without rows)",
    "steps_missing_swap_in.csv": R
    + ": not a steps.csv of a run: missing column num_swap_in_blocks; expected columns: "
    "num_prefill_tokens, num_prefills, prefill_context_tokens, prefill_attention_pairs, "
    "num_decode_tokens, decode_context_tokens, num_swap_out_blocks, num_swap_in_blocks, "
    "duration_s (found: policy, rate_scale, time_s, duration_s, num_prefill_tokens, "
    "num_decode_tokens, num_seqs, kv_used_blocks, cpu_used_blo...)",
}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_bad_profile_is_one_line(name: str) -> None:
    path = CORPUS / name
    with pytest.raises(ConfigError) as info:
        CalibratedCostModel(path)
    assert str(info.value) == PROFILES[name].format(path=path)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_bad_replay_steps_is_one_line(name: str) -> None:
    path = CORPUS / name
    with pytest.raises(ConfigError) as info:
        CalibratedCostModel(CORPUS / "good.csv", (path,))
    assert str(info.value) == STEPS[name].format(path=path)


def test_fit_of_a_zero_cost_profile_is_refused_with_its_replay_steps_named() -> None:
    steps = CORPUS / "steps_good.csv"
    with pytest.raises(ConfigError) as info:
        CalibratedCostModel(CORPUS / "prefill_without_fixed_cost.csv", (steps,))
    assert str(info.value).startswith(
        f"cost_model.profile: {CORPUS / 'prefill_without_fixed_cost.csv'} (with replay_steps "
        f"{steps}): the fitted model predicts "
    )


def test_good_files_load_and_predict_positive_times() -> None:
    model = CalibratedCostModel(CORPUS / "good.csv", (CORPUS / "steps_good.csv",))
    assert model.coef.min() >= 0 and model._decode_step > 1e-3  # rows of 2.2-2.4 ms decodes


def test_corpus_is_covered() -> None:
    files = {p.name for p in CORPUS.iterdir()}
    assert files == set(PROFILES) | set(STEPS) | {"good.csv", "steps_good.csv"}


def test_bad_profile_in_an_experiment_is_one_error_line(tmp_path, capsys) -> None:
    yaml_path = tmp_path / "calibrated.yaml"
    yaml_path.write_text(
        "trace: {format: synthetic, num_requests: 2, arrival: {rate: 1.0}, prompt_len: 4, "
        f"output_len: 2}}\nmodel: qwen3-0.6b\ncost_model: {{profile: {CORPUS / 'duration_zero.csv'}}}\n"
    )
    rc = run_experiment.main([str(yaml_path), "--out", str(tmp_path / "out"), "--no-progress"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("INFO ")]
    assert rc == 2 and err == [
        f"error: {yaml_path}: cost_model.profile: {CORPUS / 'duration_zero.csv'}: row 4, "
        "column 'duration_s': expected a step duration >= 1e-06 s, got '0'"
    ]
    assert not (tmp_path / "out").exists()
