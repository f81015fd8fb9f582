"""The simulator's model of asynchronous scheduling: host and device time of a step (analytic,
calibrated from a profile's host_s column, replayed), and the clock of an async replay: a
step lasts max(its device time, the next step's host time)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sched_lab.config import validate
from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import StepFeatures
from sched_lab.sim.calibrated import HOST_FEATURES, NO_HOST_NOTE, CalibratedCostModel, fit_host
from sched_lab.sim.cost_model import AnalyticCostModel, CostModelExecutor
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS
from sched_lab.sim.replayed import ReplayedDurations
from tests.test_calibrated import profile_frame

TRACE = {"format": "azure2023", "path": "traces/data/azure2023_conv.csv"}

# A made-up engine's host part: 0.3 ms per decode-only step, 0.8 ms per step with prompt
# tokens, 2 us per sequence, 50 ns per token, 1 ns per context token, 4 us per swapped block.
HOST_TRUE = {
    "decode_only_step": 3e-4,
    "prefill_step": 8e-4,
    "num_seqs": 2e-6,
    "num_tokens": 5e-8,
    "context_tokens": 1e-9,
    "num_swap_blocks": 4e-6,
}


def host_frame() -> pd.DataFrame:
    """tests/test_calibrated.py's synthetic profile, plus swap rows, with an exact host_s."""
    df = profile_frame()
    swaps = df[df.num_prefills == 0].head(4).copy()
    swaps["num_swap_blocks"] = [2, 8, 32, 128]
    swaps["duration_s"] += swaps["num_swap_blocks"] * 1e-5
    df = pd.concat([df, swaps], ignore_index=True)
    prefill = df["num_prefills"] > 0
    seqs = df["num_prefills"] + df["num_decodes"]
    tokens = df["num_prefill_tokens"] + df["num_decodes"]
    ctx = df["prefill_context_tokens"] + df["decode_context_tokens"]
    df["host_s"] = (
        np.where(prefill, 8e-4, 3e-4)
        + 2e-6 * seqs
        + 5e-8 * tokens
        + 1e-9 * ctx
        + 4e-6 * df["num_swap_blocks"]
    )
    assert (df["host_s"] < df["duration_s"]).all()
    return df


def test_host_fit_recovers_known_coefficients():
    coef = dict(zip(HOST_FEATURES, fit_host(host_frame()).tolist()))
    for name, value in HOST_TRUE.items():
        assert coef[name] == pytest.approx(value, rel=1e-6, abs=1e-15), name


def test_calibrated_host_and_device_time(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("# header line\n" + host_frame().to_csv(index=False))
    model = CalibratedCostModel(path)
    assert model.host_note == ""
    # 8 decodes over 8 * 1000 context tokens: 0.3 ms + 8 * 2 us + 8 * 50 ns + 8000 * 1 ns
    f = StepFeatures(0, 0, 0, 0.0, 8, 8000, 8, 0)
    host = 3e-4 + 8 * 2e-6 + 8 * 5e-8 + 8000 * 1e-9
    assert model.host_time(f) == pytest.approx(host, rel=1e-6)
    assert model.device_time(f, 16) == pytest.approx(model.step_time(f, 16) - host, rel=1e-6)
    # a 512-token chunk over 1024 cached tokens: 0.8 ms + 2 us + 512 * 50 ns + 1024 * 1 ns
    f = StepFeatures(512, 1, 1024, 512 * 1024 + 512 * 513 / 2, 0, 0, 1, 0)
    assert model.host_time(f) == pytest.approx(8e-4 + 2e-6 + 512 * 5e-8 + 1024e-9, rel=1e-6)
    # host time never exceeds the step: clipped to step_s when given
    assert model.host_time(f, 16, step_s=1e-4) == 1e-4


def test_old_profile_has_no_host_time_and_says_so(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text(profile_frame().to_csv(index=False))  # no host_s column
    model = CalibratedCostModel(path)
    f = StepFeatures(0, 0, 0, 0.0, 8, 8000, 8, 0)
    assert model.host_time(f) == 0.0
    assert model.device_time(f, 16) == model.step_time(f, 16)
    assert model.host_note == NO_HOST_NOTE


@pytest.mark.parametrize(
    ("row", "value", "expected"),
    [
        (3, "-1e-4", "expected host seconds >= 0, got '-1e-4'"),
        (5, "nan", "expected a finite number, got 'nan'"),
        (2, "1.0", "expected at most duration_s, got '1.0'"),
    ],
)
def test_bad_host_cell_is_one_line(tmp_path, row, value, expected):
    df = host_frame().astype({"host_s": object})
    df.loc[row - 1, "host_s"] = value
    path = tmp_path / "p.csv"
    path.write_text(df.to_csv(index=False))
    with pytest.raises(ConfigError) as e:
        CalibratedCostModel(path)
    assert str(e.value) == f"cost_model.profile: {path}: row {row}, column 'host_s': {expected}"


def analytic(**kw) -> AnalyticCostModel:
    return AnalyticCostModel(MODELS["qwen3-0.6b"], HARDWARE["h200-sxm"], **kw)


def test_analytic_host_time_is_a_part_of_the_step():
    f = StepFeatures(0, 0, 0, 0.0, 32, 32 * 1024, 32, 0)
    base = analytic()
    assert base.host_time(f) == 0.0 and base.device_time(f, 16) == base.step_time(f, 16)
    m = analytic(host_overhead_s=4e-4, host_per_seq_s=2e-6)
    assert m.step_time(f, 16) == base.step_time(f, 16)  # the split leaves the step alone
    assert m.host_time(f) == pytest.approx(4e-4 + 32 * 2e-6, rel=1e-12)
    assert m.device_time(f, 16) == pytest.approx(m.step_time(f, 16) - 4.64e-4, rel=1e-12)
    # at most the whole step: a huge per-sequence host cost is clipped to it
    big = analytic(host_per_seq_s=1.0)
    assert big.host_time(f) == big.step_time(f, 16) and big.device_time(f, 16) == 0.0
    assert (m.num_capped_steps, big.num_capped_steps) == (0, 2)  # host_time, device_time


def test_capped_host_time_is_warned_about_per_run(caplog):
    """host_per_seq_s 1 s against steps of milliseconds: every async step's host part is
    capped, and the run says in how many; the sync run computes no host time: no warning."""
    import logging

    from sched_lab.run.experiment import run_experiment

    trace = {"format": "synthetic", "num_requests": 3, "prompt_len": 8, "output_len": 3,
             "arrival": {"process": "poisson", "rate": 2}}  # fmt: skip
    raw = {
        "trace": trace,
        "model": "qwen3-0.6b",
        "cost_model": {"host_per_seq_s": 1.0},
        "policies": [{"name": "fcfs", "label": "a", "async_scheduling": True}, "fcfs"],
    }
    with caplog.at_level(logging.WARNING, logger="sched_lab.run.experiment"):
        a, s = run_experiment(validate(raw, "x.yaml"), progress=False)
    n = a.summary["num_steps"]
    assert n > 0 and [r.getMessage() for r in caplog.records] == [
        f"a: in {n} of {n} steps cost_model.host_overhead_s + host_per_seq_s * sequences "
        "exceeded the step time and was capped at it (a step's host part is at most the "
        "step: lab/sim/cost_model.py)"
    ]


def test_executor_launch_and_wait_equal_execute():
    from sched_lab.core.plan import SchedulerOutput

    m = analytic(host_overhead_s=4e-4, host_per_seq_s=2e-6)
    ex = CostModelExecutor(m, 16)
    plan = SchedulerOutput()
    handle = ex.launch(plan)
    assert ex.wait(handle).duration_s == ex.execute(plan).duration_s == handle.step_s
    assert handle.host_s == pytest.approx(4e-4) and handle.device_s == handle.step_s - 4e-4


@pytest.mark.parametrize("value", [-1e-4, math.nan, "0.4ms", True, math.inf])
def test_bad_host_overhead_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        validate({"trace": TRACE, "cost_model": {"host_overhead_s": value}}, "exp.yaml")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("exp.yaml: cost_model.host_overhead_s: expected a number in [0.0, 60.0]")


def test_host_overhead_beyond_the_step_overhead_is_refused():
    raw = {"trace": TRACE, "cost_model": {"step_overhead_s": 1e-3, "host_overhead_s": 2e-3}}
    with pytest.raises(ConfigError) as e:
        validate(raw, "exp.yaml")
    assert str(e.value) == (
        "exp.yaml: cost_model.host_overhead_s: expected at most cost_model.step_overhead_s "
        "(0.001 s; the host's part of the fixed step cost), got 0.002"
    )


@pytest.mark.parametrize("value", [-1e-6, math.nan, "x"])
def test_bad_host_per_seq_is_one_line(value):
    with pytest.raises(ConfigError, match=r"^exp.yaml: cost_model.host_per_seq_s: expected"):
        validate({"trace": TRACE, "cost_model": {"host_per_seq_s": value}}, "exp.yaml")


def test_host_overhead_with_a_profile_is_refused():
    raw = {
        "trace": TRACE,
        "cost_model": {"profile": "profiles/h200_qwen3-0.6b.csv", "host_overhead_s": 1e-4},
    }
    with pytest.raises(ConfigError) as e:
        validate(raw, "exp.yaml")
    assert str(e.value) == (
        "exp.yaml: cost_model.host_overhead_s sets the analytic model's host time; the "
        "calibrated model fits it to the profile's host_s column: drop it"
    )


def steps_csv(tmp_path, summary: dict) -> ReplayedDurations:
    from sched_lab.sim.replayed import PLAN_COLUMNS

    cols = {"policy": ["fcfs"], "rate_scale": [1.0], "duration_s": [0.01]}
    cols |= {c: [0] for c in PLAN_COLUMNS}
    pd.DataFrame(cols).to_csv(tmp_path / "steps.csv", index=False)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return ReplayedDurations(tmp_path / "steps.csv")


def test_replayed_durations_need_the_same_scheduling_mode(tmp_path):
    limits = {"max_num_seqs": 8}
    sync_run = steps_csv(tmp_path, {"fcfs": {"limits": limits}})
    ex = sync_run.executor("fcfs", 1.0, limits)  # sync replay of a sync run
    from sched_lab.core.plan import SchedulerOutput

    handle = ex.launch(SchedulerOutput())
    assert (handle.step_s, handle.host_s) == (0.01, 0.0)  # the recorded duration, as it is
    with pytest.raises(ConfigError) as e:
        sync_run.executor("fcfs", 1.0, limits, async_scheduling=True)
    assert str(e.value) == (
        f"cost_model.durations_from: {tmp_path / 'steps.csv'}: run 'fcfs' was recorded with "
        "synchronous scheduling, the simulator runs asynchronous (scheduler.async_scheduling): "
        "recorded durations hold one mode's overlap"
    )
    async_run = steps_csv(tmp_path, {"fcfs": {"limits": limits, "async_scheduling": True}})
    async_run.executor("fcfs", 1.0, limits, async_scheduling=True)
    with pytest.raises(ConfigError, match="recorded with asynchronous scheduling"):
        async_run.executor("fcfs", 1.0, limits)


def test_profile_records_host_time_until_launch(tmp_path, monkeypatch):
    """backend/profile.py writes host_s in [0, duration_s] per row (tiny model, CPU, torch
    attention, a small grid); the calibrated model then fits host time to it."""
    pytest.importorskip("torch")
    import gc

    import triton_setup  # noqa: F401  (first: later Triton tests in this process interpret)

    from sched_lab.backend import profile
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from tests.test_engine_faults import TINY

    write_random_checkpoint(TINY, tmp_path / "m", dtype="float32", name="tiny")
    grid = [("decode", [], [c] * b, 0) for b in (1, 2, 4) for c in (8, 24)]
    grid += [("prefill", [(c, n)], [], 0) for n in (4, 16) for c in (0, 8)]
    grid += [("mixed", [(8, 8)], [16] * 2, 0), ("swap", [], [16] * 2, 2)]
    monkeypatch.setattr(profile, "shapes", lambda: grid)
    out = tmp_path / "p.csv"
    args = ["--model-dir", str(tmp_path / "m"), "--out", str(out), "--attention", "torch"]
    assert profile.main([*args, "--dtype", "float32", "--repeat", "1", "--passes", "1"]) == 0
    df = pd.read_csv(out, comment="#")
    assert len(df) == len(grid) and list(df.columns[-2:]) == ["duration_s", "host_s"]
    assert ((df.host_s > 0) & (df.host_s <= df.duration_s)).all()
    assert CalibratedCostModel(out).host_note == ""
    # profile.main froze the collector while it timed steps, and unfroze it: a freeze left
    # behind made every later replay in this process walk the whole heap (gc.get_freeze_count)
    assert gc.get_freeze_count() == 0


class ToyCost:
    """Step time 8 ms + 1 ms per sequence, of which the host's part is 3 ms per sequence."""

    def step_time(self, f: StepFeatures, block_size: int) -> float:
        return 0.008 + 0.001 * f.num_seqs

    def host_time(self, f: StepFeatures, block_size: int = 0, step_s: float | None = None):
        return 0.003 * f.num_seqs


def toy_replay(async_scheduling: bool, finish_reason: str = "length"):
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.sim.replay import replay

    bm = make_block_manager(8, 0, 4, 0.0, False)
    limits = SchedulerLimits(256, 1_000_000, 1_000_000)
    scheduler = get_policy("fcfs")(limits, bm, async_scheduling=async_scheduling)
    reqs = [
        Request("a", 0.0, 4, 2, finish_reason=finish_reason),
        Request("b", 0.0, 4, 4, finish_reason=finish_reason),
    ]
    result = replay(reqs, scheduler, CostModelExecutor(ToyCost(), 4), check_invariants=True)
    assert result.failure is None, result.failure
    return result, {r.request_id: r for r in result.requests}


def test_async_step_lasts_max_of_device_and_next_host():
    # Step 0 prefills a and b (2 seqs: device 10 - 6 = 4 ms); 1 decodes both (a's last
    # token: an end by length, a leaves at 1's launch); 2 and 3 decode b alone (1 seq:
    # device 9 - 3 = 6 ms), 3 being b's last. Step N lasts max(device N, host N+1):
    # max(4, 6), max(4, 3), max(6, 3), max(6, nothing). "stop" ends: 2 is a's wasted slot
    # + b, 4 is b's wasted slot: max(4, 6), max(4, 6), max(4, 3), max(6, 3), max(6, nothing).
    result, req = toy_replay(async_scheduling=True)
    assert result.steps["duration_s"].tolist() == pytest.approx([6e-3, 4e-3, 6e-3, 6e-3])
    assert result.steps["time_s"].tolist() == pytest.approx([0, 6e-3, 10e-3, 16e-3])
    assert result.steps["num_seqs"].tolist() == [2, 2, 1, 1]
    assert result.steps["num_wasted_tokens"].tolist() == [0, 0, 0, 0]
    assert req["a"].finish_s == pytest.approx(10e-3)  # step 1's end
    assert req["b"].finish_s == pytest.approx(22e-3)
    assert result.token_times(req["b"]).tolist() == pytest.approx([6e-3, 10e-3, 16e-3, 22e-3])

    result, req = toy_replay(async_scheduling=True, finish_reason="stop")
    assert result.steps["duration_s"].tolist() == pytest.approx([6e-3, 6e-3, 4e-3, 6e-3, 6e-3])
    assert result.steps["time_s"].tolist() == pytest.approx([0, 6e-3, 12e-3, 16e-3, 22e-3])
    assert result.steps["num_seqs"].tolist() == [2, 2, 2, 1, 1]
    assert result.steps["num_wasted_tokens"].tolist() == [0, 0, 1, 0, 1]
    assert req["a"].finish_s == pytest.approx(12e-3)  # step 1's end; the wasted slot not
    assert req["b"].finish_s == pytest.approx(22e-3)
    assert result.token_times(req["b"]).tolist() == pytest.approx([6e-3, 12e-3, 16e-3, 22e-3])


def test_sync_steps_take_the_whole_step_time():
    result, req = toy_replay(async_scheduling=False)
    assert result.steps["duration_s"].tolist() == pytest.approx([10e-3, 10e-3, 9e-3, 9e-3])
    assert result.steps["num_wasted_tokens"].tolist() == [0, 0, 0, 0]
    assert (req["a"].finish_s, req["b"].finish_s) == pytest.approx((20e-3, 38e-3))


EXPERIMENT = """
trace: {{format: synthetic, num_requests: 6, arrival: {{process: poisson, rate: 50}},
        prompt_len: {{uniform: [16, 64]}}, output_len: {{uniform: [2, 8]}}}}
model: qwen3-0.6b
hardware: h200-sxm
cost_model: {cost_model}
kv_cache: {{block_size: 16, num_gpu_blocks: 64}}
policies: {policies}
"""


@pytest.mark.parametrize(
    ("cost_model", "policies", "lines"),
    [
        (  # the profile shipped until 2026-12-04 has no host_s column
            "{profile: OLD_PROFILE}",
            "[fcfs, {name: fcfs, label: fa, async_scheduling: true}]",
            [
                "Scheduling: asynchronous (vLLM V1's async scheduler: step N+1 is planned "
                "while step N runs; an end by length frees its slot and blocks when its last "
                "token is scheduled, an EOS or stop end is followed by one wasted slot and "
                "frees its blocks a step late) for fa; synchronous for fcfs.",
                f"**Warning**: fa: async_scheduling is on, but {NO_HOST_NOTE}; these runs are "
                "priced as synchronous ones.",
            ],
        ),
        (  # the shipped profile has it: no warning
            "{profile: profiles/h200_qwen3-0.6b.csv}",
            "[fcfs, {name: fcfs, label: fa, async_scheduling: true}]",
            [
                "Scheduling: asynchronous (vLLM V1's async scheduler: step N+1 is planned "
                "while step N runs; an end by length frees its slot and blocks when its last "
                "token is scheduled, an EOS or stop end is followed by one wasted slot and "
                "frees its blocks a step late) for fa; synchronous for fcfs.",
            ],
        ),
        (
            "{profile: profiles/h200_qwen3-0.6b.csv}",
            "[fcfs]",
            ["Scheduling: synchronous (each step is planned after the previous one ended)."],
        ),
        (
            "{host_overhead_s: 0.0004}",
            "[{name: fcfs, async_scheduling: true}]",
            [
                "Scheduling: asynchronous (vLLM V1's async scheduler: step N+1 is planned "
                "while step N runs; an end by length frees its slot and blocks when its last "
                "token is scheduled, an EOS or stop end is followed by one wasted slot and "
                "frees its blocks a step late)."
            ],
        ),
    ],
)
def test_report_says_which_mode_ran_and_warns_without_host_time(
    tmp_path, cost_model, policies, lines
):
    import run_experiment
    from sched_lab.config.paths import DATA_ROOT

    path = tmp_path / "exp.yaml"
    text = EXPERIMENT.format(cost_model=cost_model, policies=policies)
    text = text.replace("profiles/", f"{DATA_ROOT}/profiles/")
    old = Path(__file__).parent / "data" / "profiles" / "h200_qwen3-0.6b_2026-11-30.csv"
    path.write_text(text.replace("OLD_PROFILE", str(old)))
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress"]) == 0
    report = (out / "report.md").read_text().splitlines()
    found = [ln for ln in report if ln.startswith("Scheduling:") or "async_scheduling is on" in ln]
    assert found == lines


def test_async_replay_of_a_sync_engine_run_is_refused_before_any_replay():
    from sched_lab.config.paths import DATA_ROOT
    from sched_lab.run.experiment import run_experiment
    from sched_lab.traces.readers import load_yaml_file

    path = DATA_ROOT / "experiments" / "replayed_durations.yaml"
    raw = load_yaml_file(path)
    raw["policies"] = [{"name": "fcfs", "async_scheduling": True}]
    cfg = validate(raw, str(path), path.parent)
    with pytest.raises(ConfigError, match=r"run 'fcfs' was recorded with synchronous scheduling"):
        run_experiment(cfg, progress=False)
