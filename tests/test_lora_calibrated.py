"""LoRA terms of the calibrated model, fitted from profile rows with adapters (backend/profile.py
``--lora-dir``), and the simulator's note when a profile has none."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sched_lab.config import validate
from sched_lab.core.plan import StepFeatures
from sched_lab.setup.sim import calibrated_lora_note, cost_model_info
from sched_lab.sim.calibrated import (
    FEATURES,
    LORA_FEATURES,
    NO_LORA_NOTE,
    CalibratedCostModel,
    cross_validated_errors,
    design,
    fit_with_lora,
    read_replay_steps,
)
from tests.test_calibrated import TRUE, profile_frame

# A made-up LoRA engine: 0.4 ms once a step has an adapter, 30 us per distinct adapter,
# 2 us per token of a sequence with an adapter.
LORA_TRUE = {"lora_step": 4e-4, "num_loras": 3e-5, "num_lora_tokens": 2e-6}
HEADER = "# engine profile, made up\n# lora: rank 16 (ranks 16), 32 adapters from loras\n"


def lora_row(prefill_chunks: list[tuple[int, int]], decodes: list[int], loras: int) -> dict:
    """A profile row whose every sequence runs one of ``loras`` adapters."""
    n = sum(t for _, t in prefill_chunks)
    return dict(
        num_prefill_tokens=n,
        num_prefills=len(prefill_chunks),
        prefill_context_tokens=sum(c for c, _ in prefill_chunks),
        prefill_attention_pairs=float(sum(t * c + t * (t + 1) / 2 for c, t in prefill_chunks)),
        num_decodes=len(decodes),
        decode_context_tokens=sum(decodes),
        num_swap_blocks=0,
        num_loras=loras,
        num_lora_tokens=n + len(decodes),
    )


def lora_profile(noise: float = 0.0) -> pd.DataFrame:
    """profile_frame's rows (no adapter) and rows with adapters, timed by TRUE + LORA_TRUE,
    each times 1 + U(-noise, noise)."""
    base = profile_frame().assign(num_loras=0, num_lora_tokens=0)
    rows = [
        lora_row([], [ctx] * b, k)
        for b in (8, 32, 64, 128)
        for ctx in (512, 2048)
        for k in (1, 4, 16, 32)
        if k <= b
    ]
    rows += [lora_row([(0, n)] * p, [], p) for p, n in ((1, 256), (1, 1024), (4, 256))]
    rows += [lora_row([(512, 512)], [1024] * 32, k) for k in (4, 16)]
    with_lora = pd.DataFrame(rows)
    true = np.array([TRUE[f] for f in FEATURES])
    extra = np.array([LORA_TRUE[f] for f in LORA_FEATURES])
    loras = with_lora["num_loras"].to_numpy(float)
    x = np.stack([np.ones(len(with_lora)), loras, with_lora["num_lora_tokens"]], axis=1)
    with_lora["duration_s"] = design(with_lora) @ true + x @ extra
    with_lora["kind"] = "lora_decode"
    df = pd.concat([base, with_lora], ignore_index=True)
    rng = np.random.default_rng(0)
    df["duration_s"] *= 1 + rng.uniform(-noise, noise, len(df))
    return df


def write_profile(tmp_path, df: pd.DataFrame, header: str = HEADER):
    path = tmp_path / "p.csv"
    path.write_text(header + df.to_csv(index=False))
    return path


def test_fit_recovers_lora_coefficients():
    coef, lora_coef = fit_with_lora(lora_profile())
    for name, value in zip(LORA_FEATURES, lora_coef):
        assert value == pytest.approx(LORA_TRUE[name], rel=1e-6), name
    for name, value in zip(FEATURES, coef):  # the base fit sees only the rows without
        assert value == pytest.approx(TRUE[name], rel=1e-6, abs=1e-15), name
    assert cross_validated_errors(lora_profile()).max() < 1e-6
    # 2% measurement noise on every row: each LoRA term within 25% (the per-step constant,
    # 0.4 ms beside steps of 2-10 ms, is the least determined), held-out errors ~ the noise
    _, noisy = fit_with_lora(lora_profile(noise=0.02))
    for name, value in zip(LORA_FEATURES, noisy):
        assert value == pytest.approx(LORA_TRUE[name], rel=0.25), name
    assert np.median(cross_validated_errors(lora_profile(noise=0.02))) < 0.02


def test_lora_terms_apply_only_to_steps_with_adapters(tmp_path):
    model = CalibratedCostModel(write_profile(tmp_path, lora_profile()))
    assert model.lora_rank == 16 and model.lora_note == ""
    base = StepFeatures(0, 0, 0, 0.0, 64, 64 * 1000, 64, 0)
    # the same batch with 64 tokens over 4 adapters: + 0.4 ms + 4 * 30 us + 64 * 2 us
    with_lora = StepFeatures(0, 0, 0, 0.0, 64, 64 * 1000, 64, 0, num_loras=4, num_lora_tokens=64)
    expected_base = 1e-3 + 64 * 2e-5 + 1e-6 * 1000 + 1e-9 * 64_000
    assert model.step_time(base, 16) == pytest.approx(expected_base, rel=1e-6)
    extra = model.step_time(with_lora, 16) - model.step_time(base, 16)
    assert extra == pytest.approx(4e-4 + 4 * 3e-5 + 64 * 2e-6, rel=1e-6)
    # the sequences of the base model in a LoRA step add no LoRA tokens
    half = StepFeatures(0, 0, 0, 0.0, 64, 64 * 1000, 64, 0, num_loras=4, num_lora_tokens=32)
    assert model.step_time(half, 16) - model.step_time(base, 16) == pytest.approx(
        4e-4 + 4 * 3e-5 + 32 * 2e-6, rel=1e-6
    )
    # loads stay priced from the link (set by the simulator's setup), on top
    model.lora_load_s = 0.002
    loaded = StepFeatures(
        0, 0, 0, 0.0, 64, 64 * 1000, 64, 0, num_loras=4, num_lora_tokens=64, num_lora_loads=2
    )
    assert model.step_time(loaded, 16) - model.step_time(with_lora, 16) == pytest.approx(0.004)


def test_a_profile_without_lora_rows_prices_loads_only(tmp_path):
    df = profile_frame()
    plain = CalibratedCostModel(write_profile(tmp_path, df, "# made up\n"))
    assert plain.lora_coef is None and plain.lora_note == NO_LORA_NOTE and plain.lora_rank is None
    zeros = CalibratedCostModel(
        write_profile(tmp_path, df.assign(num_loras=0, num_lora_tokens=0), "# made up\n")
    )
    assert zeros.lora_coef is None
    f = StepFeatures(0, 0, 0, 0.0, 64, 64 * 1000, 64, 0)
    f_lora = StepFeatures(0, 0, 0, 0.0, 64, 64 * 1000, 64, 0, num_loras=4, num_lora_tokens=64)
    for model in (plain, zeros):
        assert model.step_time(f_lora, 16) == model.step_time(f, 16)  # no LoRA compute
        model.lora_load_s = 0.001
        f_load = StepFeatures(
            0, 0, 0, 0.0, 64, 64 * 1000, 64, 0, num_loras=4, num_lora_tokens=64, num_lora_loads=3
        )
        assert model.step_time(f_load, 16) == pytest.approx(model.step_time(f, 16) + 0.003)
    assert zeros.step_time(f, 16) == pytest.approx(plain.step_time(f, 16), rel=1e-12)


def test_bad_lora_columns_are_one_line(tmp_path):
    from sched_lab.core.errors import ConfigError

    df = lora_profile()
    with pytest.raises(ConfigError, match="expected both LoRA columns num_loras and num_lora"):
        CalibratedCostModel(write_profile(tmp_path, df.drop(columns="num_lora_tokens")))
    df["num_loras"] = df["num_loras"].astype(float)
    df.loc[len(df) - 1, "num_loras"] = 1.5
    with pytest.raises(ConfigError, match=r"column 'num_loras': expected a whole count >= 0"):
        CalibratedCostModel(write_profile(tmp_path, df))


def test_replay_steps_with_adapters_are_left_out(tmp_path):
    from sched_lab.core.errors import ConfigError

    steps = pd.DataFrame(
        dict(num_prefill_tokens=[0, 0, 128], num_prefills=[0, 0, 1],
             prefill_context_tokens=[0, 0, 0], prefill_attention_pairs=[0.0, 0.0, 8256.0],
             num_decode_tokens=[4, 4, 0], decode_context_tokens=[400, 404, 0],
             num_swap_out_blocks=0, num_swap_in_blocks=0, duration_s=[0.01, 0.02, 0.03],
             num_loras=[0, 2, 1])
    )  # fmt: skip
    path = tmp_path / "steps.csv"
    steps.to_csv(path, index=False)
    rows = read_replay_steps(path)
    assert rows["duration_s"].tolist() == [0.01]  # the steps that ran no adapter
    steps.assign(num_loras=1).to_csv(path, index=False)
    with pytest.raises(ConfigError, match="every step ran LoRA adapters"):
        read_replay_steps(path)


def lora_config(profile, rank: int | None = 16):
    """A small simulator experiment on ``profile``; ``rank`` None: no ``lora:`` section."""
    raw = {
        "trace": {"format": "synthetic", "num_requests": 4, "prompt_len": 64, "output_len": 4,
                  "arrival": {"process": "poisson", "rate": 4}},
        "model": "llama-3.1-8b",
        "hardware": "h200-sxm",
        "cost_model": {"profile": str(profile)},
        "policies": ["fcfs"],
    }  # fmt: skip
    if rank is not None:
        raw["lora"] = {"max_loras": 2, "num_adapters": 4, "assign": "uniform",
                       "max_lora_rank": rank}  # fmt: skip
    return validate(raw)


def test_the_run_says_when_the_profile_prices_no_lora_compute(tmp_path):
    plain = write_profile(tmp_path, profile_frame(), "# made up\n")
    model = CalibratedCostModel(plain)
    assert cost_model_info(lora_config(plain), model)["lora_note"] == NO_LORA_NOTE
    # without a lora: section nothing is said (the summary keeps the keys it had)
    assert "lora_note" not in cost_model_info(lora_config(plain, rank=None), model)
    with_lora = tmp_path / "lora"
    with_lora.mkdir()
    path = write_profile(with_lora, lora_profile())
    model = CalibratedCostModel(path)
    assert "lora_note" not in cost_model_info(lora_config(path), model)
    assert "rank-16 adapters, the run's are rank 8" in calibrated_lora_note(
        lora_config(path, rank=8), model
    )


def test_a_run_with_a_profile_without_lora_rows_notes_it_once(tmp_path, capsys):
    from sched_lab.cli import main

    plain = write_profile(tmp_path, profile_frame(), "# made up\n")
    path = tmp_path / "exp.yaml"
    path.write_text(
        "trace: {format: synthetic, num_requests: 6, prompt_len: 64, output_len: 4,\n"
        "        arrival: {process: poisson, rate: 4}}\n"
        f"model: llama-3.1-8b\nhardware: h200-sxm\ncost_model: {{profile: {plain}}}\n"
        "lora: {max_loras: 2, num_adapters: 4, assign: uniform}\npolicies: [fcfs, lora_aware]\n"
    )
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-plots",
                 "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("LoRA compute is not modelled") == 1


def test_cpu_profile_with_adapters_runs_end_to_end(tmp_path, monkeypatch):
    """backend/profile.py --lora-dir on a tiny random model with 2 random adapters (CPU,
    torch attention, a tiny grid): rows with adapters carry num_loras and num_lora_tokens,
    the header their rank, and the calibrated model fits LoRA terms from them."""
    pytest.importorskip("torch")
    import triton_setup  # noqa: F401  (first: later Triton tests in this process interpret)

    from sched_lab.backend import profile
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.backend.tools.random_lora import write_random_loras
    from tests.test_engine_faults import TINY

    write_random_checkpoint(TINY, tmp_path / "m", dtype="float32", name="tiny")
    write_random_loras(tmp_path / "m", tmp_path / "loras", 2, 8, dtype="float32")
    grid = [("decode", [], [c] * b, 0) for b in (1, 2, 4) for c in (8, 24)]
    grid += [("prefill", [(c, n)], [], 0) for n in (4, 16) for c in (0, 8)]
    grid += [("mixed", [(8, 8)], [16] * 2, 0), ("swap", [], [16] * 2, 2)]
    monkeypatch.setattr(profile, "shapes", lambda: grid)
    monkeypatch.setattr(profile, "LORA_DECODE_BATCHES", (2, 4))
    monkeypatch.setattr(profile, "LORA_DECODE_CONTEXTS", (8, 24))
    monkeypatch.setattr(profile, "LORA_PREFILLS", [(1, 16), (2, 8)])
    monkeypatch.setattr(profile, "LORA_MIXED", [(2, 8, 2)])
    monkeypatch.setattr(profile, "LORA_MIXED_CONTEXT", 16)
    monkeypatch.setattr(profile, "LORA_MIXED_CACHED", 8)
    out = tmp_path / "p.csv"
    args = ["--model-dir", str(tmp_path / "m"), "--out", str(out), "--attention", "torch",
            "--dtype", "float32", "--repeat", "1", "--passes", "1",
            "--lora-dir", str(tmp_path / "loras")]  # fmt: skip
    assert profile.main(args) == 0
    header = [line for line in out.read_text().splitlines() if line.startswith("# lora:")]
    assert header and header[0].startswith("# lora: rank 8 (ranks 8), 2 adapters from loras")
    df = pd.read_csv(out, comment="#")
    lora = df[df["num_loras"] > 0]
    assert (df.loc[df["num_loras"] == 0, "num_lora_tokens"] == 0).all()
    # decode batches of 2 and 4 at 2 contexts over 1 and 2 adapters; prefills; one mixed
    assert len(lora) == 2 * 2 * 2 + 2 + 1 and len(df) == len(grid) + len(lora)
    row = lora[(lora["kind"] == "lora_mixed")].iloc[0]  # 2 decodes + an 8-token chunk
    assert (row["num_loras"], row["num_lora_tokens"]) == (2, 10)
    row = lora[(lora["kind"] == "lora_prefill") & (lora["num_prefills"] == 2)].iloc[0]
    assert (row["num_loras"], row["num_lora_tokens"]) == (2, 16)
    model = CalibratedCostModel(out)
    assert model.lora_coef is not None and model.lora_rank == 8 and (model.lora_coef >= 0).all()


def test_multi_lora_h200_script_dry_run(tmp_path, monkeypatch, capsys):
    """benchmarks/multi_lora_h200.py --dry-run on the CPU: checkpoint, adapters, a profile
    with LoRA rows, the YAML on the engine and in the simulator at max_loras 1 and 2, and
    the table (numbers of a tiny model on a shared CPU: only their presence is checked).
    Its main() runs in this process (the script's profile step starts its own child)."""
    pytest.importorskip("torch")
    import importlib.util
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    # one torch thread; not under the Triton interpreter that other test modules turn on for
    # this process (the dry run's engine takes the torch paths on a CPU; the engine reads the
    # variable when it builds a runner, and the profile's child inherits this environment)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.syspath_prepend(str(root))  # sys.path restored after: the script adds the root
    spec = importlib.util.spec_from_file_location("multi_lora_h200",
                                                  root / "benchmarks" / "multi_lora_h200.py")  # fmt: skip
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["multi_lora_h200.py", "--dry-run", "--out", str(out),
                                      "--work", str(tmp_path / "work")])  # fmt: skip
    assert script.main() == 0
    capsys.readouterr()  # the script's progress lines and table
    record = json.loads((out / "multi_lora_h200.json").read_text())
    assert [p["max_loras"] for p in record["points"]] == [1, 2] and not record["skipped"]
    for p in record["points"]:
        for side in ("engine", "sim"):
            assert set(p[side]) == {"fcfs", "lora_aware"}
            assert all(s["completed"] == 8 and s["num_lora_loads"] >= 1 for s in p[side].values())
            assert (out / side / f"max_loras_{p['max_loras']}" / "steps.csv").exists()
    assert set(record["lora_coefficients"]) == {"lora_step", "num_loras", "num_lora_tokens"}
    md = (out / "multi_lora_h200.md").read_text()
    rows = [line.split(" | ")[:2] for line in md.splitlines() if line.startswith("| 1 |")
            or line.startswith("| 2 |")]  # fmt: skip
    assert rows == [["| 1", p] for p in ("fcfs", "lora_aware")] + [
        ["| 2", p] for p in ("fcfs", "lora_aware")
    ]
