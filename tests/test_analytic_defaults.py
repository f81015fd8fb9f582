"""The analytic model's default efficiencies (lab/sim/analytic_defaults.py): fitted to the
shipped profiles, reproduced by re-fitting them, applied when the YAML leaves them out, and
named in summary.json and report.md."""

from __future__ import annotations

import pytest

from sched_lab.config import validate
from sched_lab.report.markdown import _cost_model_lines
from sched_lab.run.experiment import run_experiment
from sched_lab.sim.analytic_defaults import FITTED, GUESS, defaults, refit
from sched_lab.sim.cost_model import AnalyticCostModel
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS

TRACE = {
    "format": "synthetic",
    "num_requests": 2,
    "arrival": {"process": "poisson", "rate": 2},
    "prompt_len": 8,
    "output_len": 2,
}


def cfg(**top):
    return validate({"trace": TRACE, "policies": ["fcfs"], **top})


def test_refitting_the_shipped_profiles_gives_the_stored_constants() -> None:
    """If a profile is re-made or the fit changes, FITTED must be updated (the module says
    how: python -m sched_lab.sim.analytic_defaults)."""
    assert refit() == FITTED


def test_own_profile_then_joint_fit_then_guesses() -> None:
    qwen = defaults("qwen3-0.6b", "h200-sxm")
    assert (qwen.flops_efficiency, qwen.bandwidth_efficiency, qwen.step_overhead_s) == (
        0.43,
        0.794,
        0.0014,
    )
    assert qwen.profiles == ("profiles/h200_qwen3-0.6b.csv",)
    other = defaults("qwen3-8b", "h200-sxm")  # no profile of its own: the joint fit
    assert other.profiles == ("profiles/h200_qwen3-0.6b.csv", "profiles/h200_llama-3.1-8b.csv")
    assert other is FITTED[("h200-sxm", None)]
    for hw in ("a100-80gb", "h100-sxm", "h200-sxm-measured"):  # no profile of that hardware
        assert defaults("llama-3.1-8b", hw) is GUESS
    assert GUESS.values == {
        "flops_efficiency": 0.7,
        "bandwidth_efficiency": 0.85,
        "step_overhead_s": 0.002,
    }
    # the constructor's own defaults are the guesses (its docstring says so)
    import inspect

    from sched_lab.sim.cost_model import AnalyticCostModel

    params = inspect.signature(AnalyticCostModel).parameters
    assert {k: params[k].default for k in GUESS.values} == GUESS.values


def test_fitted_llama_decode_step_matches_its_profile_row() -> None:
    """One decode of a 128-token context on Llama-3.1-8B / H200 is weight-read bound: all
    16.06 GB of weights (plus 129 tokens of KV at 128 KiB) at 0.735 * 4.8 TB/s, plus the
    fitted 0.8 ms: 5.36 ms; the profile's first row measured 5.236 ms (the fit's median
    error over the rows it prices is 6.1%)."""
    from sched_lab.core.plan import StepFeatures

    m = MODELS["llama-3.1-8b"]
    d = defaults("llama-3.1-8b", "h200-sxm")
    cm = AnalyticCostModel(m, HARDWARE["h200-sxm"], **d.values)
    t = cm.step_time(StepFeatures(0, 0, 0, 0.0, 1, 128, 1, 0), 16)
    by_hand = (m.weight_bytes + 129 * m.kv_bytes_per_token) / (0.735 * 4.8e12) + 0.0008
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, dim, bf16
    assert t == pytest.approx(by_hand, rel=1e-12)
    assert t == pytest.approx(0.005236, rel=0.05)


def test_yaml_values_win_and_the_rest_are_fitted() -> None:
    c = cfg(model="qwen3-0.6b").cost_model
    assert (c.flops_efficiency, c.bandwidth_efficiency, c.step_overhead_s) == (
        0.43,
        0.794,
        0.0014,
    )
    c = cfg(model="qwen3-0.6b", cost_model={"flops_efficiency": 0.5}).cost_model
    assert (c.flops_efficiency, c.bandwidth_efficiency, c.step_overhead_s) == (
        0.5,
        0.794,
        0.0014,
    )
    c = cfg(hardware="a100-80gb").cost_model
    assert (c.flops_efficiency, c.bandwidth_efficiency, c.step_overhead_s) == (0.7, 0.85, 0.002)


@pytest.mark.parametrize(
    ("top", "source", "shown"),
    [
        (
            {"model": "qwen3-0.6b"},
            {
                "efficiencies": "profile",
                "efficiency_profiles": ["profiles/h200_qwen3-0.6b.csv"],
                "efficiency_error": 0.0777,
                "efficiencies_from_yaml": [],
            },
            "measured: fitted to `profiles/h200_qwen3-0.6b.csv`, median step-time error "
            "7.8% on the profile rows it prices",
        ),
        (
            {"model": "qwen3-8b"},
            {
                "efficiencies": "profile",
                "efficiency_profiles": [
                    "profiles/h200_qwen3-0.6b.csv",
                    "profiles/h200_llama-3.1-8b.csv",
                ],
                "efficiency_error": 0.0885,
                "efficiencies_from_yaml": [],
            },
            "(a joint fit: this model has no profile of its own), median step-time error 8.8%",
        ),
        (
            {"hardware": "a100-80gb"},
            {
                "efficiencies": "guess",
                "efficiency_profiles": [],
                "efficiency_error": None,
                "efficiencies_from_yaml": [],
            },
            "datasheet guesses (no profile of this hardware): their error is unknown",
        ),
        (
            {"cost_model": {"step_overhead_s": 0.001}},
            {
                "efficiencies": "profile",
                "efficiency_profiles": ["profiles/h200_llama-3.1-8b.csv"],
                "efficiency_error": None,
                "efficiencies_from_yaml": ["step_overhead_s"],
            },
            "except step_overhead_s (set in the YAML: error unknown)",
        ),
        (
            {
                "cost_model": {
                    "flops_efficiency": 0.5,
                    "bandwidth_efficiency": 0.5,
                    "step_overhead_s": 0.001,
                }
            },  # fmt: skip
            {
                "efficiencies": "yaml",
                "efficiency_profiles": [],
                "efficiency_error": None,
                "efficiencies_from_yaml": [
                    "flops_efficiency",
                    "bandwidth_efficiency",
                    "step_overhead_s",
                ],
            },
            "its efficiencies were set in the YAML: their error is unknown",
        ),
    ],
)
def test_summary_and_report_say_where_the_efficiencies_came_from(top, source, shown) -> None:
    summary = run_experiment(cfg(**top), progress=False)[0].summary["cost_model"]
    assert summary["kind"] == "analytic"
    assert {k: summary[k] for k in source} == source
    fitted = source["efficiencies"] == "profile"  # else the note that they are assumptions
    assert ("with efficiencies fitted to engine profiles" in summary["why"]) == fitted
    assert ("are assumptions, not measurements" in summary["why"]) != fitted
    text = "\n".join(_cost_model_lines(summary))
    assert "**Analytic cost model**: the analytic roofline ran" in text
    assert shown in text
    v = summary["values"]  # the values the run used, shown beside their source
    assert f"(flops_efficiency {v['flops_efficiency']:g}, bandwidth_efficiency" in text
