"""Fidelity machinery: profile fingerprints (stale profiles flagged), and replayed durations
(``cost_model.durations_from``): fed a real engine run's step durations, the simulator makes
the engine's plan on every step.

The engine test runs a tiny random Llama on the CPU (torch attention, float32) with arrivals
spaced about one step apart, so that arrivals fall between steps, and a KV cache small
enough that every policy preempts (recompute and swap).
"""

from __future__ import annotations

import importlib.util
import json
import linecache
import re
import shutil
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import yaml

from sched_lab.backend.sources import (
    OPTION_SOURCES,
    backend_sources_hash,
    checkout_engine,
    sources_fingerprint,
)
from sched_lab.config import validate
from sched_lab.core.fingerprint import HEADER_PREFIX, differences
from sched_lab.results.names import upgrade_summary
from sched_lab.run.experiment import run_experiment
from sched_lab.sim.calibrated import CalibratedCostModel, read_fingerprint, staleness

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiles" / "h200_qwen3-0.6b.csv"
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 1024,
}


def with_fingerprint(tmp_path: Path, fingerprint: dict) -> Path:
    """The shipped profile with a fingerprint line added to its header."""
    lines = PROFILE.read_text().splitlines(keepends=True)
    path = tmp_path / "profile.csv"
    path.write_text(lines[0] + HEADER_PREFIX + json.dumps(fingerprint) + "\n" + "".join(lines[1:]))
    return path


def sim_config(raw_cost_model: dict, **extra) -> dict:
    return {
        "name": "fid",
        "trace": {
            "format": "synthetic",
            "num_requests": 20,
            "arrival": {"process": "poisson", "rate": 5.0},
            "prompt_len": {"uniform": [64, 512]},
            "output_len": {"uniform": [4, 64]},
        },
        "model": "qwen3-0.6b",
        "cost_model": raw_cost_model,
        "kv_cache": {"block_size": 16, "num_gpu_blocks": 256},
        "policies": ["fcfs"],
        **extra,
    }


# The Qwen3-0.6B profile shipped until 2026-12-04: made before fingerprints.
OLD_PROFILE = Path(__file__).parent / "data" / "profiles" / "h200_qwen3-0.6b_2026-11-30.csv"


def test_profile_without_fingerprint_loads_with_a_note() -> None:
    assert read_fingerprint(OLD_PROFILE) is None
    model = CalibratedCostModel(OLD_PROFILE)
    assert model.fingerprint is None
    stale, why = staleness(model.fingerprint, {})
    assert stale and "no engine fingerprint" in why
    run = run_experiment(validate(sim_config({"profile": str(OLD_PROFILE)})), progress=False)[0]
    cm = run.summary["cost_model"]
    assert cm["kind"] == "calibrated" and cm["stale"] is True and cm["fingerprint"] is None


def test_a_byte_order_mark_does_not_hide_the_header(tmp_path) -> None:
    """A profile saved with a UTF-8 byte-order mark (as some editors save a CSV) keeps its
    fingerprint and block size (was: "no engine fingerprint", from the first line's BOM)."""
    from sched_lab.sim.calibrated import profile_block_size

    other = {"backend_sources": "0" * 64, "gpu": "NVIDIA H100", "torch": "2.11.0"}
    path = with_fingerprint(tmp_path, other)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_fingerprint(bom) == other
    assert profile_block_size(bom) == profile_block_size(path) == 16
    assert CalibratedCostModel(bom).fingerprint == other


def test_stale_profile_is_flagged(tmp_path) -> None:
    other = {"backend_sources": "0" * 64, "gpu": "NVIDIA H100", "torch": "2.11.0"}
    path = with_fingerprint(tmp_path, other)
    assert read_fingerprint(path) == other
    cfg = validate(sim_config({"profile": str(path)}))
    run = run_experiment(cfg, progress=False)[0]
    cm = run.summary["cost_model"]
    assert cm["kind"] == "calibrated" and cm["fingerprint"] == other
    assert cm["stale"] is True and "backend sources 000000000000 vs" in cm["why"]
    # against a named engine: every differing key is listed, keys it does not name are not
    engine = {"gpu": "NVIDIA H200", "torch": "2.11.0"}
    assert differences(other, engine) == ["gpu 'NVIDIA H100' vs 'NVIDIA H200'"]
    assert staleness(other, {"gpu": "NVIDIA H100"}) == (False, "")


def test_fresh_profile_is_not_stale(tmp_path) -> None:
    path = with_fingerprint(tmp_path, {"backend_sources": backend_sources_hash(), "gpu": "x"})
    run = run_experiment(validate(sim_config({"profile": str(path)})), progress=False)[0]
    assert run.summary["cost_model"]["stale"] is False
    assert run.summary["cost_model"]["why"] == ""


def test_backend_sources_hash_covers_the_engine_not_its_tools(tmp_path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "engine.py").write_text("a = 1\n")
    (tmp_path / "tools" / "quantize.py").write_text("b = 1\n")
    (tmp_path / "quant_kernels.py").write_text("c = 1\n")
    before = backend_sources_hash(tmp_path)
    quant = backend_sources_hash(tmp_path, "quantization")
    (tmp_path / "tools" / "quantize.py").write_text("b = 2\n")  # an offline tool
    assert backend_sources_hash(tmp_path) == before
    assert backend_sources_hash(tmp_path, "quantization") == quant
    (tmp_path / "quant_kernels.py").write_text("c = 2\n")  # an option's file: its key only
    assert backend_sources_hash(tmp_path) == before
    assert backend_sources_hash(tmp_path, "quantization") != quant
    (tmp_path / "engine.py").write_text("a = 2\n")  # the engine itself
    assert backend_sources_hash(tmp_path) != before
    assert set(sources_fingerprint(["lora"], tmp_path)) == {
        "backend_sources",
        "backend_sources_lora",
    }
    assert sources_fingerprint([], tmp_path / "absent") == {}


def test_an_options_sources_make_stale_only_the_profiles_that_ran_it() -> None:
    engine = checkout_engine()
    assert set(engine) == {"backend_sources"} | {f"backend_sources_{o}" for o in OPTION_SOURCES}
    plain = {"backend_sources": engine["backend_sources"], "gpu": "x"}
    assert staleness(plain, engine) == (False, "")  # never ran the quantized kernels
    quantized = {**plain, "backend_sources_quantization": "0" * 64}
    stale, why = staleness(quantized, engine)
    assert stale and why == (
        "the profile describes another engine: quantization sources 000000000000 vs "
        f"{engine['backend_sources_quantization'][:12]} (the engine's quantization code "
        "changed since the profile)"
    )
    quantized["backend_sources_quantization"] = engine["backend_sources_quantization"]
    assert staleness(quantized, engine) == (False, "")


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _cuda(), reason="GPU"))]
)
def test_a_plain_engine_run_calls_no_function_of_an_options_files(tmp_path, device) -> None:
    """What makes an option's files safe to leave out of a plain profile's hash: an engine
    run without the option (recompute, swap, chunked prefill, async scheduling; on a GPU
    the Triton kernels and CUDA graphs) enters none of their functions (their module and
    class bodies run at import)."""
    from sched_lab.backend.sources import BACKEND_DIR
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    ckpt = tmp_path / "ckpt"
    write_random_checkpoint(TINY, ckpt, dtype="float32")
    raw = {
        "name": "plain",
        "backend": "engine",
        "trace": {
            "format": "synthetic",
            "num_requests": 12,
            "arrival": {"process": "poisson", "rate": float("inf")},
            "prompt_len": {"uniform": [8, 40]},
            "output_len": {"uniform": [4, 12]},
        },
        "engine": {
            "model_path": str(ckpt),
            "device": device,
            "dtype": "float32" if device == "cpu" else "bfloat16",
        },
        "kv_cache": {"block_size": 8, "num_gpu_blocks": 24, "swap_space_gib": 0.001},
        "scheduler": {"max_num_seqs": 8, "max_model_len": 256},
        "policies": [
            "fcfs",
            "swap",
            {"name": "chunked_prefill", "max_num_batched_tokens": 16},
            {"name": "fcfs", "label": "fcfs-async", "async_scheduling": True},
        ],
    }
    files = {str(BACKEND_DIR / n): n for names in OPTION_SOURCES.values() for n in names}
    entered: set[str] = set()

    def calls(frame, event, arg) -> None:
        name = files.get(frame.f_code.co_filename)
        if event == "call" and name is not None:
            # a module body (import) or a class body (its first line past any decorators
            # is "class ...")
            code, n = frame.f_code, frame.f_code.co_firstlineno
            while linecache.getline(code.co_filename, n).lstrip().startswith("@"):
                n += 1
            line = linecache.getline(code.co_filename, n).lstrip()
            if code.co_name != "<module>" and not line.startswith("class "):
                entered.add(f"{name}:{code.co_name}")

    sys.setprofile(calls)
    try:
        runs = run_experiment(validate(raw), progress=False)
    finally:
        sys.setprofile(None)
    assert [(r.summary["num_prompts"], r.summary["unfinished"]) for r in runs] == [(12, 0)] * 4
    assert sum(r.summary["num_preemptions"] for r in runs) > 0  # the tight cache's paths too
    assert entered == set()
    fp = runs[0].summary["cost_model"]["fingerprint"]
    assert fp["backend_sources"] == backend_sources_hash()
    assert not any(k.startswith("backend_sources_") for k in fp)


def test_analytic_model_says_so() -> None:
    run = run_experiment(validate(sim_config({})), progress=False)[0]
    assert run.summary["cost_model"]["kind"] == "analytic"
    assert "analytic roofline ran" in run.summary["cost_model"]["why"]


def test_durations_from_and_profile_are_exclusive() -> None:
    from sched_lab.core.errors import ConfigError

    with pytest.raises(ConfigError, match="durations_from replaces the cost model"):
        validate(sim_config({"profile": str(PROFILE), "durations_from": str(PROFILE)}))


def test_durations_from_refuses_a_tensor_parallel_size() -> None:
    # The replayed steps are the engine run's, at its own TP: a TP here would only be
    # recorded in config.yaml. TP 1 (the default) is taken.
    from sched_lab.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cost_model.tensor_parallel_size: 8 with cost_model"):
        validate(sim_config({"durations_from": str(PROFILE), "tensor_parallel_size": 8}))
    cfg = validate(sim_config({"durations_from": str(PROFILE), "tensor_parallel_size": 1}))
    assert cfg.cost_model.tensor_parallel_size == 1


def _steps_csv(tmp_path: Path, rows: list[dict]) -> Path:
    cols = {
        "policy": "fcfs",
        "rate_scale": 1.0,
        "num_prefill_tokens": 0,
        "num_decode_tokens": 0,
        "num_seqs": 0,
        "num_prefills": 0,
        "prefill_context_tokens": 0,
        "prefill_attention_pairs": 0,
        "decode_context_tokens": 0,
        "num_preempted": 0,
        "num_swap_out_blocks": 0,
        "num_swap_in_blocks": 0,
    }
    path = tmp_path / "steps.csv"
    pd.DataFrame([{**cols, **r} for r in rows]).to_csv(path, index=False)
    return path


def one_request(tmp_path: Path) -> dict:
    """A 10-token prompt, 3 output tokens: a prefill step then two decode steps."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 3}\n')
    return {"format": "mooncake", "path": str(trace)}


def test_replayed_durations_count_mismatches_and_refuse_extra_steps(tmp_path) -> None:
    prefill = {"num_prefill_tokens": 10, "num_seqs": 1, "num_prefills": 1}
    prefill["prefill_attention_pairs"] = 55  # 10 * 11 / 2
    decode = {"num_decode_tokens": 1, "num_seqs": 1}
    rows = [
        {**prefill, "duration_s": 0.5},
        # a decode's context counts its own token: 11, then 12
        {**decode, "decode_context_tokens": 11, "duration_s": 0.25},
        {**decode, "decode_context_tokens": 99, "duration_s": 0.125},  # not the plan's 12
    ]
    raw = sim_config(
        {"durations_from": str(_steps_csv(tmp_path, rows))}, trace=one_request(tmp_path)
    )
    run = run_experiment(validate(raw), progress=False)[0]
    assert run.summary["plan_match"] == {
        "steps_recorded": 3,
        "steps_simulated": 3,
        "steps_matched": 2,
        "fraction_identical": 2 / 3,
        "first_mismatch": "step 2: decode_context_tokens 12 (engine 99)",
    }
    assert run.summary["cost_model"]["kind"] == "replayed"
    assert run.summary["p50_e2el_ms"] == pytest.approx(875.0)  # 0.5 + 0.25 + 0.125 s
    short = _steps_csv(tmp_path, rows[:2])
    raw = sim_config({"durations_from": str(short)}, trace=one_request(tmp_path))
    run = run_experiment(validate(raw), progress=False)[0]
    assert "asks for step 3; the engine run recorded 2" in run.summary["failure"]


def test_replayed_durations_over_an_hour_are_refused(tmp_path) -> None:
    """A recorded step of 1e30 s (or 2 h) is a broken file: one line naming it and the row
    (it ran, and reported a 1e30 s run with a RuntimeWarning)."""
    from sched_lab.core.errors import ConfigError

    decode = {"num_decode_tokens": 1, "num_seqs": 1, "decode_context_tokens": 11}
    for bad in (1e30, 7200.0):
        path = _steps_csv(tmp_path, [{"duration_s": 0.5}, {**decode, "duration_s": bad}])
        raw = sim_config({"durations_from": str(path)}, trace=one_request(tmp_path))
        with pytest.raises(ConfigError) as e:
            run_experiment(validate(raw), progress=False)
        assert str(e.value) == (
            f"cost_model.durations_from: {path}: row 2, duration_s: expected a number > 0 "
            f"and <= 3600 (seconds), got {str(bad)!r}"
        )


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_engine_plans_are_made_again_from_their_durations(tmp_path) -> None:
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.report.folder import write_results

    ckpt = tmp_path / "ckpt"
    write_random_checkpoint(TINY, ckpt, dtype="float32")
    raw = {
        "name": "tiny",
        "backend": "engine",
        "trace": {
            "format": "synthetic",
            "num_requests": 40,
            "arrival": {"process": "poisson", "rate": 200.0},  # ~ one CPU step apart
            "prompt_len": {"uniform": [8, 64]},
            "output_len": {"uniform": [4, 24]},
            "seed": 1,
        },
        "engine": {"model_path": str(ckpt), "device": "cpu", "dtype": "float32"},
        "kv_cache": {"block_size": 4, "num_gpu_blocks": 64, "swap_space_gib": 0.001},
        "scheduler": {"max_num_seqs": 8, "max_model_len": 256},
        "policies": ["fcfs", "swap", {"name": "chunked_prefill", "max_num_batched_tokens": 32}],
    }
    engine = run_experiment(validate(raw), progress=False)
    # the folder feeds steps.csv to the simulator: its figures are not needed
    write_results(tmp_path / "engine", validate(raw), engine, plots=False)
    for r in engine:  # the cache is small enough that every policy preempts
        assert r.summary["num_preemptions"] > 0
        assert r.summary["cost_model"]["kind"] == "measured"
        assert r.summary["cost_model"]["fingerprint"]["backend_sources"] == backend_sources_hash()
    assert engine[1].summary["num_preemptions_swap"] > 0
    sim_raw = {
        **raw,
        "backend": "sim",
        "model": "llama-3.2-1b",  # any preset: capacity and durations come from the run
        "cost_model": {"durations_from": str(tmp_path / "engine" / "steps.csv")},
    }
    sims = run_experiment(validate(sim_raw), progress=False)
    for real, sim in zip(engine, sims, strict=True):
        match = sim.summary["plan_match"]
        assert match["first_mismatch"] is None, (real.label, match)
        assert match["steps_matched"] == match["steps_recorded"] == real.summary["num_steps"]
        for key in ("num_preemptions_recompute", "num_preemptions_swap", "num_preempted_requests"):
            assert sim.summary[key] == real.summary[key], key
        a, b = real.requests, sim.requests
        assert list(a.request_id) == list(b.request_id)
        # the engine's clock runs on the durations steps.csv holds: the same times, exactly
        for col in ("arrival_s", "first_token_s", "ttft_s", "e2e_s"):
            assert a[col].equals(b[col]), (real.label, col)


def test_h200_engine_run_is_planned_again_step_by_step(tmp_path) -> None:
    """experiments/replayed_durations.yaml: the H200 run of docs/azure_gpu/ (Qwen3-0.6B shape,
    2,048 blocks, 456 requests, every policy preempting 34-38 times), replayed from its own
    step durations: every one of its 5,223 + 5,329 + 5,051 steps planned as on the engine."""
    import run_experiment as cli

    out = tmp_path / "out"
    # --no-plots: the summary is compared (tests/test_experiments.py draws this example's plots)
    assert cli.main([str(ROOT / "experiments/replayed_durations.yaml"), "--out", str(out),
                     "--no-progress", "--no-plots"]) == 0  # fmt: skip
    sim = json.loads((out / "summary.json").read_text())
    recorded = json.loads((ROOT / "docs/azure_gpu/summary.json").read_text())
    real = {k: upgrade_summary(v) for k, v in recorded.items()}  # recorded under older names
    for label, steps in (("fcfs", 5223), ("swap", 5329), ("chunked_prefill", 5051)):
        assert sim[label]["plan_match"]["steps_matched"] == steps == real[label]["num_steps"]
        assert sim[label]["plan_match"]["first_mismatch"] is None
        for key in ("num_preemptions_recompute", "num_preemptions_swap", "num_preempted_requests"):
            assert sim[label][key] == real[label][key], key
        for key in ("p99_ttft_ms", "p99_e2el_ms"):
            assert sim[label][key] == pytest.approx(real[label][key], abs=1e-3)


def test_rankings_count_pairs_beyond_the_engines_spread() -> None:
    """Two policies, one ranked metric shown (the others equal, so never counted): the pair
    counts when |a - b| exceeds |a - a'| + |b - b'| and the repeat orders it the same way."""
    from sched_lab.fidelity import RANKED, rank_agreement
    from sched_lab.fidelity.compare import column

    def row(policy, real, again, sim):
        r = {"slice": "conv", "load": 0.5, "policy": policy}
        for m, p in RANKED:
            x = column(m, p)
            r[f"real_{x}"] = r[f"again_{x}"] = r[f"sim_{x}"] = 1.0
        r.update(real_p50_ttft_ms=real, again_p50_ttft_ms=again, sim_p50_ttft_ms=sim)
        return r

    # engine: a - b = -1.0, spread 0.1 + 0.1; the simulator orders them the other way
    table = pd.DataFrame([row("a", 1.0, 1.1, 1.5), row("b", 2.0, 2.1, 1.2)])
    [pair] = rank_agreement(table)
    assert (pair["metric"], pair["pair"], pair["agree"]) == ("p50_ttft_ms", "a vs b", False)
    assert pair["engine"] == pytest.approx(-1.0) and pair["noise"] == pytest.approx(0.2)
    # the same difference inside the engine's spread (0.6 + 0.6): not counted
    table = pd.DataFrame([row("a", 1.0, 1.6, 1.5), row("b", 2.0, 1.4, 1.2)])
    assert rank_agreement(table) == []
    # a pair that plans alike under the same step durations is left out
    table = pd.DataFrame([row("a", 1.0, 1.1, 1.5), row("b", 2.0, 2.1, 1.2)])
    assert rank_agreement(table, frozenset({("conv", 0.5, "a", "b")})) == []


def test_analytic_efficiencies_fitted_to_a_profile_are_recovered(tmp_path) -> None:
    """Profile rows timed by the analytic model itself (efficiencies 0.5 and 0.8, 1 ms a
    step): the fit finds them back, within the grid's 8% steps."""
    from sched_lab.sim.calibrated import fit_analytic, profile_shape, read_profile
    from sched_lab.sim.cost_model import AnalyticCostModel
    from sched_lab.sim.hardware import HARDWARE
    from sched_lab.sim.models import MODELS
    from sched_lab.sim.noise import profile_features

    assert profile_shape(PROFILE) == ("qwen3-0.6b", "h200-sxm")
    df = read_profile(PROFILE)
    truth = AnalyticCostModel(MODELS["qwen3-0.6b"], HARDWARE["h200-sxm"], 0.5, 0.8, 0.001)
    df["duration_s"] = [truth.step_time(f, 16) for f in profile_features(df)]
    fit = fit_analytic(df, "qwen3-0.6b", "h200-sxm")
    assert fit["flops_efficiency"] == pytest.approx(0.5, rel=0.08)
    assert fit["bandwidth_efficiency"] == pytest.approx(0.8, rel=0.08)
    assert fit["step_overhead_s"] == pytest.approx(0.001, abs=1e-4)
    assert fit["median_relative_error"] < 0.05


def test_analytic_fit_leaves_out_eager_chunks_over_a_cached_prefix() -> None:
    """The roofline has no paged-kernel term, so the 6 prefill_eager_prefix rows of the
    shipped Qwen3 profile (124 rows) are not fitted: 118 rows priced, and timing those 6
    rows 10x slower leaves the fit as it was."""
    from sched_lab.sim.calibrated import analytic_terms, fit_analytic, read_profile

    df = read_profile(PROFILE)
    assert len(df) == 124 and int((df["kind"] == "prefill_eager_prefix").sum()) == 6
    compute_s, memory_s, swap_s, y = analytic_terms(df, "qwen3-0.6b", "h200-sxm")
    assert len(compute_s) == len(memory_s) == len(swap_s) == len(y) == 118
    slow = df.copy()
    slow.loc[slow["kind"] == "prefill_eager_prefix", "duration_s"] *= 10
    assert fit_analytic(slow, "qwen3-0.6b", "h200-sxm") == fit_analytic(
        df, "qwen3-0.6b", "h200-sxm"
    )


def test_step_noise_is_the_distance_from_the_median_of_the_same_shape() -> None:
    """Six 2-decode steps of one shape (mean context 1000, in one 512-token bucket), one of
    them twice as long: median 1 ms, so that step is 100% off and the others 0%; two prompt
    steps of one shape are fewer than 5, so theirs is unknown (NaN)."""
    from sched_lab.fidelity import step_noise

    n = 8
    st = pd.DataFrame(
        {
            "num_prefills": [0] * 6 + [1, 1],
            "num_prefill_tokens": [0] * 6 + [300, 310],
            "num_decode_tokens": [2] * 6 + [0, 0],
            "decode_context_tokens": [2000, 2002, 2004, 2006, 2008, 2010, 0, 0],
            "prefill_context_tokens": [0] * n,
            "num_swap_out_blocks": [0] * n,
            "num_swap_in_blocks": [0] * n,
            "duration_s": [1e-3, 1e-3, 1e-3, 1e-3, 2e-3, 1e-3, 3e-3, 4e-3],
        }
    )
    noise = step_noise(st)
    assert noise[:6].tolist() == pytest.approx([0, 0, 0, 0, 1.0, 0])
    assert pd.isna(noise[6]) and pd.isna(noise[7])


def test_protocol_calibration_replays_only_synthetic_traces(tmp_path) -> None:
    """A calibration workload that reads a trace file is refused in one line: calibration
    must never fit rows of the traces the protocol evaluates."""
    from sched_lab.fidelity import PROTOCOL, load_protocol

    p = yaml.safe_load(PROTOCOL.read_text())
    assert set(load_protocol(PROTOCOL)["calibration"]["workloads"]) == {
        "chat", "long_prompts", "offline"
    }  # fmt: skip
    p["calibration"]["workloads"]["chat"] = dict(p["slices"]["conv"])
    bad = tmp_path / "protocol.yaml"
    bad.write_text(yaml.safe_dump(p))
    with pytest.raises(SystemExit, match=r"calibration\.workloads\.chat: expected a synthetic"):
        load_protocol(bad)


@pytest.mark.parametrize("rate, alike", [(0.2, True), (float("inf"), False)])
def test_policies_plan_alike_only_where_they_decide_alike(tmp_path, rate, alike) -> None:
    """A simulated run stands in for the engine's: sjf fed fcfs's step durations plans as
    fcfs did when requests arrive 5 s apart (never a queue to order), and not when all 12
    arrive at once (sjf admits the shortest outputs first)."""
    from sched_lab.fidelity import plans_alike
    from sched_lab.report.folder import write_results

    raw = {
        "name": "alike",
        "backend": "sim",
        "trace": {"format": "synthetic", "num_requests": 12, "seed": 3,
                  "arrival": {"process": "poisson", "rate": rate},
                  "prompt_len": {"uniform": [100, 400]}, "output_len": {"uniform": [5, 200]}},
        "kv_cache": {"num_gpu_blocks": 4096},
        "scheduler": {"max_num_seqs": 4},
        "policies": ["fcfs", {"name": "sjf", "predictor": "oracle"}],
    }  # fmt: skip
    cfg = validate(raw)
    write_results(tmp_path / "run", cfg, run_experiment(cfg, progress=False), plots=False)
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert plans_alike(written, steps, "fcfs", "sjf") is alike


def test_sim_side_names_a_missing_archive(tmp_path) -> None:
    from sched_lab.fidelity import unpack

    with pytest.raises(SystemExit, match=r"nope\.tar\.gz: no such archive"):
        unpack(tmp_path / "nope.tar.gz")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p.update(calibraton=p.pop("calibration")), r"calibraton: expected a protocol key"),
        (lambda p: p["calibration"].update(polices=["fcfs"]), r"calibration: expected a mapping"),
        (lambda p: p["time_limits_s"].update(profile="120"), r"time_limits_s.profile: expected seconds > 0"),
        (lambda p: p["time_limits_s"].pop("calibration"), r"time_limits_s: expected a mapping with keys calibration, profile, total"),
        (lambda p: p.update(loads=[0.5, 0]), r"loads: expected a list of distinct numbers > 0"),
        (lambda p: p.update(loads=[0.5, 0.5]), r"loads: expected a list of distinct numbers > 0"),
        (lambda p: p.update(rate_scales=[4, -1]), r"rate_scales: expected a list of distinct numbers > 0 \(multiples"),
        (lambda p: p["slices"]["conv"].update(rate_scales="x4"), r"slices.conv.rate_scales: expected a list of distinct numbers > 0 \(.*\), got 'x4'"),
        (lambda p: p.pop("loads"), r"slices.burstgpt: expected loads or rate_scales \(this window or the protocol's\)$"),
        (lambda p: p.update(slices={}), r"slices: expected a mapping of window names"),
        (lambda p: p["experiment"].update(backend="sim"), r"experiment: expected an experiment config with backend: engine"),
        (lambda p: p["experiment"].update(scheduler=[1]), r"experiment.scheduler: expected a mapping, got \[1\]"),
        (lambda p: p["checkpoint"].pop("dir"), r"checkpoint: expected a mapping with dir: a folder path"),
        (lambda p: p.update(checkpoint="x"), r"checkpoint: expected a mapping with dir"),
        (lambda p: p["checkpoint"].update(preset="nope"), r"checkpoint.preset: expected one of .*qwen3-0.6b.*, got 'nope'"),
        (lambda p: p["checkpoint"].update(dir="README.md"), r"checkpoint.dir: expected a folder \(it names a file\)"),
    ],
)  # fmt: skip
def test_protocol_shape_is_checked_in_one_line(tmp_path, edit, message) -> None:
    """Mistakes in a protocol stop it before any GPU work, in one line naming the key."""
    from sched_lab.fidelity import PROTOCOL, load_protocol

    p = yaml.safe_load(PROTOCOL.read_text())
    edit(p)
    bad = tmp_path / "protocol.yaml"
    bad.write_text(yaml.safe_dump(p))
    with pytest.raises(SystemExit, match=message) as e:
        load_protocol(bad)
    assert "\n" not in str(e.value)


def test_protocol_workload_typo_is_named_before_the_profile(tmp_path) -> None:
    """A calibration workload with an unknown trace key fails check_runs (run before the
    profile), naming the workload."""
    from sched_lab.fidelity import check_runs, load_protocol

    p = yaml.safe_load((ROOT / "benchmarks" / "fidelity_tiny.yaml").read_text())
    p["calibration"]["workloads"]["chat"]["num_request"] = 3
    p["experiment"]["engine"]["model_path"] = str(tmp_path)  # any folder: not loaded here
    bad = tmp_path / "protocol.yaml"
    bad.write_text(yaml.safe_dump(p))
    with pytest.raises(
        SystemExit, match=r"calibration\.workloads\.chat: trace: unknown key 'num_request'"
    ):
        check_runs(load_protocol(bad), bad)


def test_profile_takes_the_engine_runs_shape() -> None:
    """The protocol's runner shape becomes sched_lab.backend.profile's arguments."""
    from sched_lab.fidelity import PROTOCOL, load_protocol, profile_geometry

    exp = load_protocol(PROTOCOL)["experiment"]
    assert profile_geometry(exp) == ["--max-model-len", "16384", "--max-num-seqs", "256",
                                     "--num-gpu-blocks", "2048"]  # fmt: skip


def test_profile_shape_arguments_must_be_at_least_one(capsys) -> None:
    """sched_lab.backend.profile's shape arguments are whole numbers >= 1; --passes 0 or
    --repeat 0 is refused by the parser, before any model is loaded ("m" does not exist)."""
    import argparse

    pytest.importorskip("torch", reason="backend/ needs torch: pip install -e '.[engine,test]'")
    from sched_lab.backend.profile import main, positive_int

    assert positive_int("7") == 7
    for bad in ("0", "-3", "1e3"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number >= 1"):
            positive_int(bad)
    for arg in ("--passes", "--repeat"):
        with pytest.raises(SystemExit) as e:
            main(["--model-dir", "m", "--out", "p.csv", arg, "0"], prog="sched-lab profile")
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"sched-lab profile: error: argument {arg}: expected a whole number >= 1, got '0'"
        )


def test_replayed_durations_of_another_window_are_refused(tmp_path) -> None:
    """A simulated run stands in for the engine's (its folder has steps.csv and summary.json):
    fed back with the same window, it plans alike; with a window of 10 requests instead of
    20, it is refused before any replay, naming both counts."""
    from sched_lab.core.errors import ConfigError
    from sched_lab.report.folder import write_results

    trace = {"format": "azure2023", "path": str(ROOT / "traces/data/azure2023_conv.csv"),
             "limit": 20}  # fmt: skip
    raw = {"name": "w", "backend": "sim", "trace": trace, "policies": ["fcfs"]}
    cfg = validate(raw)
    write_results(tmp_path / "run", cfg, run_experiment(cfg, progress=False), plots=False)
    again = {**raw, "cost_model": {"durations_from": str(tmp_path / "run" / "steps.csv")}}
    run = run_experiment(validate(again), progress=False)[0]
    assert run.summary["plan_match"]["fraction_identical"] == 1.0
    other = {**again, "trace": {**trace, "limit": 10}}
    with pytest.raises(
        ConfigError, match=r"run 'fcfs' replayed 20 requests, this trace window has 10"
    ):
        run_experiment(validate(other), progress=False)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the engine side needs torch")
@pytest.mark.parametrize(
    "name",
    ["fidelity_heldout.yaml", "fidelity_heldout_long.yaml", "fidelity_heldout_mooncake.yaml",
     "fidelity_heldout_8b.yaml", "fidelity_heldout_8b_mooncake.yaml"],
)  # fmt: skip
def test_engine_side_without_a_gpu_stops_before_the_checkpoint(tmp_path, capsys, name) -> None:
    """The held-out protocols' runs all pass check_runs on a CPU box; then the engine side
    stops in one line naming experiment.engine.device, before the checkpoint (16 GB for 8B)
    is made (its empty folder, made for check_runs, is removed again)."""
    import torch

    from sched_lab.fidelity import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the engine side would run")
    p = yaml.safe_load((ROOT / "benchmarks" / name).read_text())
    ckpt = tmp_path / "ckpt"
    p["checkpoint"]["dir"] = str(ckpt)  # absolute: ROOT / it is it
    p["experiment"]["engine"]["model_path"] = str(ckpt)
    protocol = tmp_path / name
    protocol.write_text(yaml.safe_dump(p))
    assert main(["--engine", "--protocol", str(protocol), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"error: {protocol}: experiment.engine.device: cuda, but torch ")
    assert "sees no CUDA device here" in err
    assert not ckpt.exists()


def test_engine_side_names_a_bad_window_before_the_checkpoint(tmp_path, capsys) -> None:
    """A window with an unknown trace key stops the engine side in check_runs, before any
    checkpoint is written (the tiny 8B protocol, on the CPU)."""
    from sched_lab.fidelity import main

    p = yaml.safe_load((ROOT / "benchmarks" / "fidelity_8b_tiny.yaml").read_text())
    ckpt = tmp_path / "ckpt"
    p["checkpoint"]["dir"] = str(ckpt)
    p["experiment"]["engine"]["model_path"] = str(ckpt)
    p["slices"]["mooncake"]["limt"] = p["slices"]["mooncake"].pop("limit")
    protocol = tmp_path / "protocol.yaml"
    protocol.write_text(yaml.safe_dump(p))
    assert main(["--engine", "--protocol", str(protocol), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: slices.mooncake: trace: unknown key 'limt' (did you mean 'limit'?); allowed keys:"
    )
    assert "\n" not in err
    assert not ckpt.exists()


def test_sizing_follows_the_protocols_time_limits(tmp_path) -> None:
    """benchmarks/fidelity_sizing.py: the profile is cut at its limit, and a total limit that
    leaves the first pass no time skips every window (the pass is its process start alone)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fidelity_sizing import predict

    p = yaml.safe_load((ROOT / "benchmarks" / "fidelity_8b_tiny.yaml").read_text())
    p["time_limits_s"] = {"profile": 40, "calibration": 120, "total": 100}
    protocol = tmp_path / "protocol.yaml"
    protocol.write_text(yaml.safe_dump(p))
    cost_model = {"profile": str(PROFILE)}
    steps = predict(protocol, cost_model, load_s=2, process_s=5, checkpoint_s=10, profile_s=90)
    assert steps["checkpoint"] == 10 and steps["profile"] == 40
    assert steps["first"] == 5 and steps["repeat"] == 5


def test_sizing_names_a_bad_profile_in_one_line(tmp_path, capsys) -> None:
    """benchmarks/fidelity_sizing.py --profile of a missing file: one line, exit 2 (it was a
    ConfigError traceback)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fidelity_sizing import main

    protocol = ROOT / "benchmarks" / "fidelity_8b_tiny.yaml"
    missing = tmp_path / "none.csv"
    assert main(["--protocol", str(protocol), "--profile", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"error: {protocol}: cost_model.profile: '{missing}': no such "
                              f"file (looked for {missing})\n")  # fmt: skip


def test_async_protocol_calibrates_with_synchronous_steps() -> None:
    """benchmarks/fidelity_async.yaml replays its calibration workloads synchronously (their
    step times are what the calibrated model fits) and its held-out windows asynchronously,
    windows from 3000 s and workloads as the sync protocol's; the sync protocol's
    calibration config is left as written (no async_scheduling key added)."""
    from sched_lab.fidelity import PROTOCOL, calibration_config, load_protocol, slice_config

    asy = load_protocol(ROOT / "benchmarks" / "fidelity_async.yaml")
    sync = load_protocol(PROTOCOL)
    assert asy["calibration"] == sync["calibration"]
    assert {n: s["start_s"] for n, s in asy["slices"].items()} == {"conv": 3000, "code": 3000}
    for name in asy["calibration"]["workloads"]:
        assert calibration_config(asy, name)["scheduler"]["async_scheduling"] is False
        assert "async_scheduling" not in calibration_config(sync, name)["scheduler"]
    assert slice_config(asy, "conv")["scheduler"]["async_scheduling"] is True
    assert asy["experiment"]["scheduler"]["async_scheduling"] is True  # not mutated


def test_async_step_predictions_are_the_async_clock() -> None:
    """Step time S = 1 ms + 1 us/token for decode-only steps, 2 ms + 1 us/token with prompt
    tokens; host time H = 0.3 ms (decode-only), 1.5 ms (prompt). Steps: prefill of 100
    tokens (S 2.1 ms, device 0.6 ms), two decodes of 1 (S 1.001 ms, device 0.701 ms), a
    prefill of 100 chained to them, then after an idle gap a decode. Async clock
    max(S_n - H_n, H_{n+1}): 0.6, 0.701, 1.5 (the next step's host time is longer), 0.6
    (no step planned while it ran: the next starts after the gap), 0.701 ms (the last)."""
    from types import SimpleNamespace

    import numpy as np

    from sched_lab.fidelity import predicted_durations
    from sched_lab.sim.calibrated import FEATURES

    coef = np.zeros(len(FEATURES))
    coef[[0, 1, 3]] = 1e-3, 2e-3, 1e-6  # decode-only, prompt-step intercepts; per token
    host_coef = np.zeros(6)
    host_coef[[0, 1]] = 3e-4, 1.5e-3
    prompt = [100, 0, 0, 100, 0]
    st = pd.DataFrame(
        {
            "time_s": [0.0, 0.002, 0.003, 0.004, 0.5],
            "duration_s": [0.002, 0.001, 0.001, 0.002, 0.001],
            "num_prefill_tokens": prompt,
            "num_prefills": [int(p > 0) for p in prompt],
            "prefill_context_tokens": [0] * 5,
            "prefill_attention_pairs": [0.0] * 5,
            "num_decode_tokens": [int(p == 0) for p in prompt],
            "decode_context_tokens": [0, 101, 102, 0, 101],
            "num_swap_out_blocks": [0] * 5,
            "num_swap_in_blocks": [0] * 5,
        }
    )
    model = SimpleNamespace(coef=coef, host_coef=host_coef, block_size=16)
    sync = [2.1e-3, 1.001e-3, 1.001e-3, 2.1e-3, 1.001e-3]
    assert predicted_durations(model, st).tolist() == pytest.approx(sync)
    assert predicted_durations(model, st, True).tolist() == pytest.approx(
        [0.6e-3, 0.701e-3, 1.5e-3, 0.6e-3, 0.701e-3]
    )
    no_host = SimpleNamespace(coef=coef, host_coef=None, block_size=16)  # no host_s
    assert predicted_durations(no_host, st, True).tolist() == pytest.approx(sync)


def test_notes_are_those_named_after_the_archive(tmp_path) -> None:
    from sched_lab.fidelity import notes_path

    assert notes_path(tmp_path / "heldout_engine.tar.gz") == tmp_path / "heldout_engine_notes.md"
    # the first run's archive beside it does not take the second run's notes
    assert (
        notes_path(tmp_path / "heldout_run1_engine.tar.gz").name == "heldout_run1_engine_notes.md"
    )
    assert notes_path(tmp_path) == tmp_path / "notes.md"  # an unpacked archive folder


def test_a_window_of_one_request_is_refused_before_the_profile(tmp_path) -> None:
    """A window's own rate (requests over its time span) scales the loads: one request has
    none, so check_runs refuses it in one line rather than the first pass dividing by 0."""
    from sched_lab.fidelity import check_runs, load_protocol

    p = yaml.safe_load((ROOT / "benchmarks" / "fidelity_tiny.yaml").read_text())
    p["experiment"]["engine"]["model_path"] = str(tmp_path)
    name = next(iter(p["slices"]))
    p["slices"][name]["limit"] = 1
    bad = tmp_path / "protocol.yaml"
    bad.write_text(yaml.safe_dump(p))
    with pytest.raises(SystemExit, match=rf"slices\.{name}: expected a window of >= 2 requests"):
        check_runs(load_protocol(bad), bad)


def test_sim_side_refuses_a_doc_that_is_a_folder_before_any_replay(tmp_path) -> None:
    from sched_lab.fidelity import ARCHIVE, sim

    with pytest.raises(SystemExit, match=r"--doc .*: expected a markdown file path"):
        sim(ARCHIVE, tmp_path)


def test_archive_members_of_the_wrong_shape_are_one_line_errors(tmp_path) -> None:
    """A summary.json that is a JSON list, or a protocol.yaml that is a YAML list, is named
    with what was expected (no AttributeError later)."""
    from sched_lab.fidelity.sim_side import _member

    (tmp_path / "engine" / "w_1").mkdir(parents=True)
    (tmp_path / "engine" / "w_1" / "summary.json").write_text("[1, 2]")
    (tmp_path / "protocol.yaml").write_text("- a\n")
    archive = tmp_path / "A.tar.gz"
    with pytest.raises(SystemExit) as e:
        _member(archive, tmp_path, "engine/w_1/summary.json", json.loads)
    assert (
        str(e.value) == f"error: {archive}: engine/w_1/summary.json: expected a mapping, got [1, 2]"
    )
    with pytest.raises(SystemExit) as e:
        _member(archive, tmp_path, "protocol.yaml", yaml.safe_load)
    assert str(e.value) == f"error: {archive}: protocol.yaml: expected a mapping, got ['a']"


def test_a_damaged_repeat_steps_csv_is_one_line_naming_the_member(tmp_path) -> None:
    """The repeat pass's steps.csv (read for the step table's repeat rows): not a CSV, or one
    without the engine's columns, is named in one line (it was a pandas traceback)."""
    from sched_lab.fidelity.sim_side import _steps_member

    folder = tmp_path / "engine_repeat" / "w_1"
    folder.mkdir(parents=True)
    archive, name = tmp_path / "A.tar.gz", "engine_repeat/w_1/steps.csv"
    (folder / "steps.csv").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(
        SystemExit, match=rf"^error: {re.escape(str(archive))}: {name}: cannot be read \("
    ):
        _steps_member(archive, tmp_path, name)
    (folder / "steps.csv").write_text("policy,time_s,duration_s\nfcfs,0,0.01\n")
    with pytest.raises(SystemExit) as e:
        _steps_member(archive, tmp_path, name)
    assert str(e.value) == (
        f"error: {archive}: {name}: missing column(s) num_prefill_tokens, num_prefills, "
        "prefill_context_tokens, prefill_attention_pairs, num_decode_tokens, "
        "decode_context_tokens, num_swap_out_blocks, num_swap_in_blocks (expected an engine "
        "run's steps.csv)"
    )


def test_rate_scale_windows_and_two_call_archives_merge(tmp_path, request) -> None:
    """A window's own ``rate_scales`` replace the protocol's and leave its trace spec; the
    first call packs only its archive, the repeat call only the ``_repeat`` one beside it,
    and the sim side reads the two as one (the repeat's skips included)."""
    from sched_lab.fidelity import (
        load_protocol,
        pack,
        repeat_archive,
        scale_folder_name,
        slice_config,
        unpack,
        window_loads,
        window_rate_scales,
    )
    from sched_lab.fidelity.sim_side import read_record

    p = load_protocol(ROOT / "benchmarks" / "fidelity_long_tiny.yaml")
    p["slices"]["b"] = {**p["slices"]["conv"]}
    del p["slices"]["b"]["rate_scales"]
    p["rate_scales"] = [2]
    assert window_rate_scales(p, "conv") == [4, 12] and window_rate_scales(p, "b") == [2]
    assert window_loads(p, "conv") == [1.1]
    assert "rate_scales" not in slice_config(p, "conv")["trace"]
    assert scale_folder_name("conv", 4.0) == "conv_x4"

    out = tmp_path / "out"
    for side in ("engine", "engine_repeat"):
        (out / side / "conv_x4").mkdir(parents=True)
        (out / side / "conv_x4" / "steps.csv").write_text(f"{side}\n")
    (out / "profile.csv").write_text("kind\n")
    record = {"folders": ["conv_x4"], "skipped": ["conv_x12 (estimated 9 s)"],
              "rate_scales": {"conv_x4": {"rate_scale": 4, "offered_load": 0.65}}}  # fmt: skip
    (out / "engine.json").write_text(json.dumps(record))
    archive = tmp_path / "a.tar.gz"
    pack(out, archive, parts=("first",))
    assert archive.exists() and not repeat_archive(archive).exists()
    (out / "engine.json").write_text(json.dumps({**record, "skipped": [*record["skipped"],
                                                 "conv_x4 repeat (estimated 9 s)"]}))  # fmt: skip
    pack(out, archive, parts=("repeat",))
    src = unpack(archive)
    request.addfinalizer(lambda: shutil.rmtree(src))
    assert (src / "engine_repeat" / "conv_x4" / "steps.csv").read_text() == "engine_repeat\n"
    assert (src / "engine" / "conv_x4" / "steps.csv").read_text() == "engine\n"
    assert read_record(archive, src)["skipped"] == [
        "conv_x12 (estimated 9 s)",
        "conv_x4 repeat (estimated 9 s)",
    ]


def test_engine_json_listing_a_run_twice_is_refused(tmp_path) -> None:
    """A calibration run listed twice in engine.json would be fitted twice, so never held out
    from itself (the run factor's sigma); a folder listed twice would be tabled twice: each
    is one line naming the archive and the name."""
    from sched_lab.fidelity.sim_side import read_record

    for side, name in (("engine", "w_1"), ("calibration", "chat")):
        (tmp_path / side / name).mkdir(parents=True)
        (tmp_path / side / name / "steps.csv").write_text("x\n")
    (tmp_path / "profile.csv").write_text("kind\n")
    archive = tmp_path / "a.tar.gz"
    for key, names in (("calibration", ["chat", "chat"]), ("folders", ["w_1", "w_1"])):
        record = {"folders": ["w_1"], "calibration": ["chat"], key: names}
        (tmp_path / "engine.json").write_text(json.dumps(record))
        with pytest.raises(SystemExit) as e:
            read_record(archive, tmp_path)
        assert str(e.value) == (
            f"error: {archive}: engine.json: {key}: {names[0]!r} is listed twice; expected "
            "each run once"
        )


def test_split_is_refused_without_its_archive_or_the_engine_side(tmp_path, capsys) -> None:
    """``--split repeat`` needs the first call's archive; ``--split`` is the engine side's."""
    from sched_lab.fidelity import main

    missing = tmp_path / "none.tar.gz"
    argv = [
        "--engine",
        "--split",
        "repeat",
        "--out",
        str(tmp_path / "w"),
        "--archive",
        str(missing),
    ]
    assert main(argv) == 2
    assert (
        f"--split repeat: expected --archive, the first call's .tar.gz (--split first), got {missing}"
        in capsys.readouterr().err
    )
    assert main(["--sim", "--split", "first", "--archive", str(missing)]) == 2
    assert capsys.readouterr().err == "error: --split: only with --engine\n"
    assert not (tmp_path / "w").exists()


def test_seeds_of_the_sim_side_need_two_replicas_and_the_engine_side_takes_none(capsys):
    from sched_lab.fidelity import main

    assert main(["--sim", "--seeds", "1", "--archive", "none.tar.gz"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --seeds: expected an integer in [2, 1,000] (a band needs two "
                   "replicas at least), got 1")  # fmt: skip
    assert main(["--engine", "--seeds", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --seeds: only with --sim (the engine side measures its steps)"
    )


def test_an_engine_summary_without_a_number_is_named():
    from sched_lab.fidelity.compare import METRICS, PCTS, column, missing_number

    full = {column(m, p): 1.0 for m in METRICS for p in PCTS}
    full.update(output_throughput=100.0, num_preemptions=0)
    assert missing_number(full) is None
    assert missing_number({**full, "p50_tpot_ms": None}) == "p50_tpot_ms"
    assert missing_number({**full, "num_preemptions": True}) == "num_preemptions"
    del full["p99_e2el_ms"]
    assert missing_number(full) == "p99_e2el_ms"


def test_a_damaged_repeat_archive_is_the_one_named(tmp_path):
    from sched_lab.fidelity.archive import unpack

    good = tmp_path / "a.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        tar.add(__file__, arcname="engine.json")
    (tmp_path / "a_repeat.tar.gz").write_bytes(b"")  # empty: not a gzip
    with pytest.raises(SystemExit, match=r"^error: .*a_repeat\.tar\.gz: a damaged archive \("):
        unpack(good)


def test_step_table_has_the_repeat_pass_rows_and_the_figures_stay_the_first_passs():
    from sched_lab.fidelity.markdown import _by_kind, first_pass

    steps = pd.DataFrame(
        {
            "kind": ["decode", "decode", "prefill", "decode", "prefill"],
            "err": [0.1, -0.2, 0.3, 0.05, -0.05],
            "noise": [0.01] * 5,
            "saturated": False,
            "pass": ["first"] * 3 + ["repeat"] * 2,
        }
    )
    assert first_pass(steps).err.tolist() == [0.1, -0.2, 0.3]
    rows = {r.split(" | ")[0][2:]: r.split(" | ")[1:4] for r in _by_kind(steps)}
    # first pass |err| 0.1, 0.2, 0.3: median 20%; repeat 5%, 5%; both: median of 5 = 10%
    assert rows["all"] == ["3", "20.0%", "28.0%"]
    assert rows["repeat pass: all"] == ["2", "5.0%", "5.0%"]
    assert rows["repeat pass: prefill"] == ["1", "5.0%", "5.0%"]
    assert rows["both passes: all"] == ["5", "10.0%", "26.0%"]
    assert "repeat pass: all" not in "".join(_by_kind(first_pass(steps)))


@pytest.mark.parametrize("kernel", ["base", "exp2"])
def test_the_protocols_profile_runs_the_runs_prefill_kernel(tmp_path, kernel) -> None:
    from sched_lab.fidelity.engine_side import _step_commands
    from sched_lab.fidelity.protocol import load_protocol

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_tiny.yaml"
    protocol = load_protocol(path)
    protocol["experiment"]["engine"]["model_path"] = str(tmp_path)  # validated: it exists
    if kernel != "base":
        protocol["experiment"]["engine"]["triton_prefill_kernel"] = kernel
    (name, argv), *_ = _step_commands(protocol, path, tmp_path / "ckpt", tmp_path)
    assert name == "profile"
    at = argv.index("--triton-prefill-kernel")
    assert argv[at + 1] == kernel
