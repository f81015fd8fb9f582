"""The typed config (lab/config.py), its YAML loader (traces/readers.py) and path rule
(lab/config/paths.py), and how run_experiment uses them: defaults, resolved paths, checks before
the first replay, the trace read once and identified by its sha256."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import yaml

import run_experiment
from sched_lab.config import ExperimentConfig, load_config, paths, validate
from sched_lab.core.errors import ConfigError, short_repr
from sched_lab.run.experiment import resolve_limits
from sched_lab.traces.readers import parse_yaml

SYNTHETIC = (
    "{format: synthetic, num_requests: 4, arrival: {process: poisson, rate: 2}, "
    "prompt_len: 8, output_len: 3}"
)
AZURE_ROWS = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:00,5,2\n"
    "2023-11-16 18:17:01,5,3\n2023-11-16 18:17:02,6,2\n"
)


def write(folder, text: str, name: str = "exp.yaml"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


# ---------------------------------------------------------------------------- YAML
@pytest.mark.parametrize(
    "text, value",
    [
        ("1e9", 1e9),
        ("1.0e9", 1e9),
        ("5e-1", 0.5),
        (".5", 0.5),
        ("-7", -7),
        ("0", 0),
        ("0x1f", 31),
        ("0o17", 15),
        (".inf", float("inf")),
        ("true", True),
        ("False", False),
        ("yes", "yes"),
        ("no", "no"),
        ("on", "on"),
        ("~", None),
        ("null", None),
        ("2024-01-01", "2024-01-01"),
        ("1_000", "1_000"),
        ("'0100'", "0100"),
        ('"1:30"', "1:30"),
    ],
)
def test_scalars_read_as_yaml_1_2(text, value):
    assert parse_yaml(f"a: {text}") == {"a": value}
    assert type(parse_yaml(f"a: {text}")["a"]) is type(value)


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("a: 1\nb: {c: 0100}\n", 2, "b.c: '0100' is an octal number in YAML 1.1"),
        ("a: [1, 1:30]\n", 1, "a[1]: '1:30' is a base-60 number in YAML 1.1"),
        ("a: &x 1\nb: *x\n", 1, "a: anchors and aliases (&, *) are not accepted"),
        ("a: 1\nb:\n  c: 1\n  c: 2\n", 4, "b.c: key 'c' appears twice in one mapping"),
    ],
)
def test_yaml_1_1_surprises_are_refused(text, line, message):
    with pytest.raises(yaml.YAMLError) as e:
        parse_yaml(text)
    assert e.value.problem_mark.line + 1 == line and e.value.problem.startswith(message)


def test_alias_bomb_is_refused_at_once(tmp_path):
    bomb = (
        "seed:\n  - &a ["
        + ",".join(["lol"] * 10)
        + "]\n"
        + "".join(
            f"  - &{n} [" + ",".join([f"*{p}"] * 10) + "]\n" for p, n in zip("abcdefgh", "bcdefghi")
        )
    )
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"trace: {SYNTHETIC}\n" + bomb))
    assert time.perf_counter() - t0 < 1.0
    assert str(e.value) == (
        f"{tmp_path / 'exp.yaml'}: line 3 is not valid YAML (seed[0]: "
        "anchors and aliases (&, *) are not accepted; write the value out)"
    )


def test_values_in_messages_are_cut():
    assert short_repr("x" * 10**7) == "'" + "x" * 37 + "..." + "x" * 38 + "'"
    assert len(short_repr(list(range(10**6)))) <= 80
    assert short_repr([[[[1]]]]) == "[[[...]]]"


def test_long_value_message_is_one_short_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"trace: {SYNTHETIC}\nseed: {'9' * 100_000}x\n"))
    assert len(str(e.value)) < 200 and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- typed config
def test_defaults_come_from_the_dataclasses(tmp_path):
    cfg = load_config(write(tmp_path, f"trace: {SYNTHETIC}\n"))
    assert cfg.name == "exp" and cfg.backend == "sim" and cfg.seed == 0
    assert (cfg.kv_cache.block_size, cfg.kv_cache.swap_space_bytes) == (16, 4 << 30)
    assert cfg.scheduler.max_num_seqs == 256 and cfg.scheduler.max_num_batched_tokens is None
    assert [p.label for p in cfg.policies] == ["fcfs", "swap", "chunked_prefill"]
    assert (cfg.engine.cuda_graphs, cfg.engine.mixed_graphs, cfg.engine.kn_weights) == (
        None,
        True,
        False,
    )
    assert cfg.rate_scales == (1.0,) and cfg.profile_num_batched_tokens == 2048
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1


def test_to_dict_is_the_config_yaml_layout_and_round_trips(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            f"trace: {SYNTHETIC[:-1]}, rate_scale: [1, 2]}}\n"
            "policies: [{name: chunked_prefill, label: c512, "
            "max_num_batched_tokens: 512}]\nslo: {ttft_s: 2}\n",
        )
    )
    d = cfg.to_dict()
    assert list(d) == [
        "name",
        "backend",
        "seed",
        "trace",
        "model",
        "hardware",
        "cost_model",
        "kv_cache",
        "scheduler",
        "policies",
        "slo",
        "engine",
        "check_invariants",
        "report",
    ]
    assert d["policies"] == [
        {"label": "c512", "name": "chunked_prefill", "max_num_batched_tokens": 512}
    ]
    assert d["slo"] == {"ttft_s": 2, "tpot_s": None, "e2e_s": None}
    assert list(d["engine"])[-7:] == [
        "cuda_graphs",
        "mixed_graphs",
        "kn_weights",
        "num_threads",
        "tensor_parallel_size",
        "prefill_attention",
        "triton_prefill_kernel",
    ]
    assert d["engine"]["triton_prefill_kernel"] == "base"
    assert cfg.run_label(cfg.policies[0], 2.0) == "c512@x2"
    assert validate(yaml.safe_load(yaml.safe_dump(d))) == cfg


def test_with_trace_validates():
    cfg = validate({"trace": yaml.safe_load(SYNTHETIC)})
    assert cfg.with_trace(limit=2).trace.spec["limit"] == 2
    with pytest.raises(ConfigError, match=r"trace.rate_scale: expected a finite number > 0"):
        cfg.with_trace(rate_scale=0)


def test_profile_tokens_resolved_once():
    sim = validate({"trace": yaml.safe_load(SYNTHETIC)})
    engine = dataclasses.replace(sim, backend="engine")
    fixed = validate(
        {"trace": yaml.safe_load(SYNTHETIC), "scheduler": {"max_num_batched_tokens": 4096}}
    )
    assert (
        sim.profile_num_batched_tokens,
        engine.profile_num_batched_tokens,
        fixed.profile_num_batched_tokens,
    ) == (2048, 8192, 4096)


@pytest.mark.parametrize(
    "policy, chunked, capacity, expected",
    [
        # vLLM's rules: max_model_len = the context clamped to the KV capacity; the budget is
        # 2048 with chunked prefill, else max(max_model_len, 2048).
        ({"name": "chunked_prefill"}, True, 100_000, (256, 2048, 100_000)),
        ({"name": "fcfs"}, False, 1000, (256, 2048, 1000)),
        ({"name": "fcfs"}, False, 10**6, (256, 131072, 131072)),
        ({"name": "fcfs", "max_model_len": 4096, "max_num_seqs": 4}, False, 10**6, (4, 4096, 4096)),
    ],
)
def test_resolve_limits_keeps_vllm_defaults(policy, chunked, capacity, expected):
    cfg = validate({"trace": yaml.safe_load(SYNTHETIC), "policies": [policy]})
    limits = resolve_limits(cfg, cfg.policies[0], capacity, 131072, chunked)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len) == expected


# ---------------------------------------------------------------------------- paths
def test_yaml_next_to_its_own_trace_runs_from_anywhere(tmp_path, monkeypatch):
    write(
        tmp_path / "x",
        "trace: {format: azure2023, path: mytrace.csv}\n"
        "policies: [fcfs]\nkv_cache: {num_gpu_blocks: 64}\n",
    )
    (tmp_path / "x" / "mytrace.csv").write_text(AZURE_ROWS)
    monkeypatch.chdir(tmp_path)  # not the YAML's folder, not the checkout
    assert load_config("x/exp.yaml").trace.path == tmp_path / "x" / "mytrace.csv"
    assert run_experiment.main(["x/exp.yaml", "--out", "out", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["fcfs"]["trace"] == {
        "path": "mytrace.csv",  # relative to the YAML's folder, as written there
        "sha256": hashlib.sha256(AZURE_ROWS.encode()).hexdigest(),
        "rows": 3,
    }
    # config.yaml is read again from the results folder: the path must resolve from there
    written = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    absolute = str(tmp_path / "x" / "mytrace.csv")
    assert written["trace"]["path"] == absolute
    assert written["trace_file"] == {**summary["fcfs"]["trace"], "path": absolute}
    assert written["engine"]["kn_weights"] is False


def test_bundled_trace_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "t.csv").write_text(AZURE_ROWS)
    bundled = load_config(
        write(tmp_path, "trace: {format: azure2023, path: traces/data/azure2023_conv.csv}\n")
    )
    assert bundled.trace.path == paths.DATA_ROOT / "traces/data/azure2023_conv.csv"
    home = load_config(write(tmp_path, "trace: {format: azure2023, path: ~/t.csv}\n"))
    assert home.trace.path == tmp_path / "home" / "t.csv"


def test_reports_name_a_path_as_the_yaml_could_write_it(tmp_path):
    bundled = paths.DATA_ROOT / "traces/data/azure2023_conv.csv"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.csv").write_text(AZURE_ROWS)
    elsewhere = tmp_path.parent / "t.csv"  # not under the YAML's folder tmp_path / "exp"
    # bundled data: relative to the data root, from a YAML anywhere
    assert paths.shown(bundled, tmp_path) == "traces/data/azure2023_conv.csv"
    assert paths.portable(bundled, tmp_path) == "traces/data/azure2023_conv.csv"
    # beside the YAML: reports relative to it; config.yaml (read from the results folder) absolute
    assert paths.shown(tmp_path / "sub" / "t.csv", tmp_path) == "sub/t.csv"
    assert paths.portable(tmp_path / "sub" / "t.csv", tmp_path) == str(tmp_path / "sub" / "t.csv")
    assert paths.shown(elsewhere, tmp_path / "exp") == str(elsewhere)
    # a YAML folder holding a file of the bundled data's name: that name would find it instead
    (tmp_path / "traces" / "data").mkdir(parents=True)
    (tmp_path / "traces" / "data" / "azure2023_conv.csv").write_text(AZURE_ROWS)
    assert paths.portable(bundled, tmp_path) == str(bundled)


def test_missing_path_names_the_key_and_the_value_as_written(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "trace: {format: azure2023, path: nowhere.csv}\n"))
    assert str(e.value) == (
        f"{tmp_path / 'exp.yaml'}: trace.path: 'nowhere.csv': no such file (looked for "
        f"{tmp_path / 'nowhere.csv'} or {paths.DATA_ROOT / 'nowhere.csv'})"
    )
    with pytest.raises(ConfigError, match=r"cost_model.profile: 'p.csv': no such file"):
        load_config(write(tmp_path, f"trace: {SYNTHETIC}\ncost_model: {{profile: p.csv}}\n"))


# ---------------------------------------------------------------------------- the run
def test_a_later_policy_fails_before_the_first_replay(tmp_path, monkeypatch):
    import sched_lab.run.experiment

    monkeypatch.setattr(sched_lab.run.experiment, "replay", None)  # a replay would raise TypeError
    cfg = load_config(
        write(
            tmp_path,
            f"trace: {SYNTHETIC}\nkv_cache: {{num_gpu_blocks: 64}}\n"
            "policies: [fcfs, {name: chunked_prefill, label: tiny, "
            "max_num_batched_tokens: 16}]\n",
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"policies\[tiny\]: max_num_batched_tokens 16 must "
        r"be >= max_num_seqs 256",
    ):
        sched_lab.run.experiment.run_experiment(cfg, progress=False)


def test_the_trace_is_read_once_for_a_sweep(tmp_path, monkeypatch):
    from sched_lab import traces

    calls = []
    real = traces.load_table
    monkeypatch.setattr(traces, "load_table", lambda *a: calls.append(a) or real(*a))
    cfg = load_config(
        write(
            tmp_path,
            f"trace: {SYNTHETIC[:-1]}, rate_scale: [1, 2, 3]}}\n"
            "policies: [fcfs, swap]\nkv_cache: {num_gpu_blocks: 64}\n",
        )
    )
    from sched_lab.run.experiment import run_experiment as run

    runs = run(cfg, progress=False)
    assert len(calls) == 1 and len(runs) == 6
    assert runs[5].summary["trace"] == {"path": None, "sha256": None, "rows": 4}


def test_a_trace_file_changed_while_read_is_refused(tmp_path, monkeypatch):
    from sched_lab import traces
    from sched_lab.core.errors import TraceError
    from sched_lab.run.experiment import run_experiment as run

    real = traces.load_table

    def load_then_change(*args):
        out = real(*args)
        (tmp_path / "t.csv").write_text(AZURE_ROWS + "2023-11-16 18:17:03,6,2\n")
        return out

    monkeypatch.setattr(traces, "load_table", load_then_change)
    (tmp_path / "t.csv").write_text(AZURE_ROWS)
    cfg = load_config(write(tmp_path, "trace: {format: azure2023, path: t.csv}\n"))
    with pytest.raises(TraceError, match=r"^trace.path: .*t.csv changed while it was read"):
        run(cfg, progress=False)


def test_replaying_a_config_yaml_checks_its_trace_file(tmp_path, capsys):
    exp = write(
        tmp_path,
        "trace: {format: azure2023, path: t.csv}\npolicies: [fcfs]\n"
        "kv_cache: {num_gpu_blocks: 64}\n",
    )
    (tmp_path / "t.csv").write_text(AZURE_ROWS)
    assert run_experiment.main([str(exp), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    again = str(tmp_path / "a" / "config.yaml")
    assert run_experiment.main([again, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    (tmp_path / "t.csv").write_text(AZURE_ROWS.replace(",5,3", ",5,4"))
    capsys.readouterr()
    assert run_experiment.main([again, "--out", str(tmp_path / "c"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {again}: trace_file.sha256: the trace has sha256 ")
    assert err.endswith("this config was written with (the file changed)") and "\n" not in err


def test_engine_without_torch_is_one_line(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    (tmp_path / "model").mkdir()
    exp = write(tmp_path, f"backend: engine\ntrace: {SYNTHETIC}\nengine: {{model_path: model}}\n")
    assert run_experiment.main([str(exp), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {exp}: backend: engine needs torch, which is not installed: "
        f'pip install -e ".[engine]"'
    )


def test_engine_keys_reach_the_model_runner(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import sched_lab.backend.runner
    import sched_lab.setup.engine

    seen = {}

    class Stop(Exception):
        pass

    def fake_runner(model_dir, **kwargs):
        seen.update(kwargs, model_dir=model_dir)
        raise Stop

    monkeypatch.setattr(sched_lab.backend.runner, "ModelRunner", fake_runner)
    (tmp_path / "model").mkdir()
    cfg = load_config(
        write(
            tmp_path,
            f"backend: engine\ntrace: {SYNTHETIC}\n"
            "engine: {model_path: model, device: cuda, cuda_graphs: false, "
            "mixed_graphs: false, kn_weights: true}\n",
        )
    )
    with pytest.raises(Stop):
        sched_lab.setup.engine.engine_parts(cfg)
    assert seen["model_dir"] == tmp_path / "model"
    assert (seen["cuda_graphs"], seen["mixed_graphs"], seen["kn_weights"]) == (False, False, True)
    assert (seen["max_num_batched_tokens"], seen["max_num_seqs"]) == (8192, 256)
    assert isinstance(cfg, ExperimentConfig)


ENGINE_REFUSED = [
    (
        {"cost_model": {"host_overhead_s": 0.0005}},
        "x.yaml: cost_model.host_overhead_s: sets the simulator's host time per step; the "
        "engine's host time is its own (measured, not set): remove it or set backend: sim",
    ),
    (
        {"cost_model": {"host_per_seq_s": 1e-5}},
        "x.yaml: cost_model.host_per_seq_s: sets the simulator's host time per step; the "
        "engine's host time is its own (measured, not set): remove it or set backend: sim",
    ),
    (
        {"cost_model": {"durations_from": "steps.csv"}},
        "x.yaml: cost_model.durations_from: replays an engine run's step times in the "
        "simulator; the engine measures its own: remove it or set backend: sim",
    ),
    (
        {"cost_model": {"tensor_parallel_size": 2}},
        "x.yaml: cost_model.tensor_parallel_size: 2 GPUs per simulated replica; the engine's "
        "tensor parallelism is engine.tensor_parallel_size (1): set that one",
    ),
    (
        {"speculative": {"method": "synthetic", "num_speculative_tokens": 2,
                         "acceptance_from": "results/x/fcfs"}},
        "x.yaml: speculative.acceptance_from: the simulator's acceptance, taken from an engine "
        "run; the engine verifies its own drafts: remove it or set backend: sim",
    ),
    (
        {"policies": ["fcfs", {"name": "fcfs", "label": "b", "speculative": {
            "method": "ngram", "num_speculative_tokens": 2, "acceptance_from": "r"}}]},
        "x.yaml: policies[1].speculative.acceptance_from: the simulator's acceptance, taken "
        "from an engine run; the engine verifies its own drafts: remove it or set backend: sim",
    ),
]  # fmt: skip


@pytest.mark.parametrize("keys, message", ENGINE_REFUSED)
def test_engine_refuses_simulator_only_keys_that_mislead(tmp_path, keys, message):
    (tmp_path / "model").mkdir()
    raw = {"backend": "engine", "trace": parse_yaml(SYNTHETIC), "engine": {"model_path": "model"}}
    with pytest.raises(ConfigError) as e:
        validate({**raw, **keys}, "x.yaml", tmp_path)
    assert str(e.value) == message


def test_engine_warns_once_about_the_simulator_side_of_a_file(tmp_path, caplog):
    """cost_model.profile (a file that serves both backends, as sim_vs_real.yaml) and
    acceptance_rates of an ngram block are the simulator's: one warning line, once; the
    engine's own TP size repeated in cost_model is taken silently."""
    import logging

    (tmp_path / "model").mkdir()
    raw = {
        "backend": "engine",
        "trace": parse_yaml(SYNTHETIC),
        "engine": {"model_path": "model", "tensor_parallel_size": 2},
        "cost_model": {"profile": "p.csv", "step_overhead_s": 0.001, "tensor_parallel_size": 2},
        "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                        "acceptance_rates": [0.5, 0.5]},
    }  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="sched_lab.config"):
        validate(raw, "warn-once.yaml", tmp_path)
        validate(raw, "warn-once.yaml", tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        "warn-once.yaml: backend engine measures its step times and acceptance, so it ignores "
        "the simulator-only cost_model.step_overhead_s, cost_model.profile, "
        "speculative.acceptance_rates (method ngram)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sched_lab.config"):
        validate({**raw, "cost_model": {}, "speculative": None}, "quiet.yaml", tmp_path)
    assert caplog.records == []


def test_swap_space_that_holds_no_block_is_refused(tmp_path, monkeypatch):
    """Llama-3.1-8B: 2 (K, V) * 32 layers * 8 KV heads * 128 * 2 bytes = 128 KiB a token, a
    block of 16 tokens 2 MiB = 0.00195 GiB; 0.0001 GiB holds none. 0 (no swap) is taken."""
    from sched_lab.setup.sim import sim_parts

    raw = {"trace": parse_yaml(SYNTHETIC), "model": "llama-3.1-8b"}
    with pytest.raises(ConfigError) as e:
        sim_parts(validate({**raw, "kv_cache": {"swap_space_gib": 0.0001}}))
    assert str(e.value) == (
        "kv_cache.swap_space_gib: 0.0001 GiB holds no KV block: one block of 16 tokens of "
        "llama-3.1-8b needs 0.00195 GiB; expected at least that, or 0 for no swap space"
    )
    assert sim_parts(validate({**raw, "kv_cache": {"swap_space_gib": 0}}))[2] == 0
    assert sim_parts(validate({**raw, "kv_cache": {"swap_space_gib": 0.002}}))[2] == 1

    pytest.importorskip("torch")
    import types

    import sched_lab.backend.runner
    import sched_lab.setup.engine

    def fake_runner(model_dir, **kwargs):  # a 1 MiB block, no room for one in swap space
        kv = types.SimpleNamespace(block_bytes=1 << 20)
        return types.SimpleNamespace(num_cpu_blocks=0, kv_cache=kv)

    monkeypatch.setattr(sched_lab.backend.runner, "ModelRunner", fake_runner)
    (tmp_path / "tiny").mkdir()
    engine = {**raw, "backend": "engine", "engine": {"model_path": "tiny"},
              "kv_cache": {"swap_space_gib": 0.0005}}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        sched_lab.setup.engine.engine_parts(validate(engine, "x.yaml", tmp_path))
    assert str(e.value) == (
        "kv_cache.swap_space_gib: 0.0005 GiB holds no KV block: one block of 16 tokens of "
        "tiny needs 0.000977 GiB; expected at least that, or 0 for no swap space"
    )


def test_report_keys(tmp_path):
    base = f"trace: {SYNTHETIC}\n"
    cfg = load_config(write(tmp_path, base))
    assert cfg.report.metric_percentiles == (50.0, 90.0, 99.0, 99.9)
    cfg = load_config(
        write(
            tmp_path,
            base + "report: {metric_percentiles: [50, 99.9], timeline_window_s: [10, 20.5], "
            "timeline_ids: [7, '8']}\n",
        )
    )
    assert cfg.report.metric_percentiles == (50.0, 99.9)
    assert cfg.report.timeline_window_s == (10.0, 20.5)
    assert cfg.report.timeline_ids == ("7", "8")
    cfg = load_config(write(tmp_path, base + "report: {timeline_ids: [8, 7, '8', 8]}\n"))
    assert cfg.report.timeline_ids == ("8", "7")  # each drawn once (it was drawn three times)
    for bad, msg in (
        (
            "{metric_percentiles: [0]}",
            "report.metric_percentiles[0]: expected a number in (0.0, 100.0]",
        ),
        ("{metric_percentiles: []}", "report.metric_percentiles: expected a list of numbers"),
        ("{timeline_by: tpot}", "report.timeline_by: expected one of e2e, ttft, got 'tpot'"),
        (
            "{timeline_window_s: [5, 1]}",
            "report.timeline_window_s: expected [start, end] with end > start",
        ),
        ("{timeline_slowest: 0}", "report.timeline_slowest: expected an integer >= 1, got 0"),
    ):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            load_config(write(tmp_path, base + f"report: {bad}\n"))


def test_cross_feature_rules_are_one_named_table():
    from sched_lab.config import BACKENDS, RULES
    from sched_lab.config.sections import EngineConfig
    from sched_lab.config.walker import Context
    from sched_lab.core.attention_names import ATTENTION_BACKENDS

    names = [r.name for r in RULES]
    assert len(set(names)) == len(names) and all(r.doc for r in RULES)
    assert set(BACKENDS) == {"sim", "engine"}
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == "attention_backend")
    with pytest.raises(ConfigError, match=r"^c: engine.a: expected one of flash_attn, torch, tr"):
        field.metadata["check"](Context("c", Path(".")), "engine.a", "x")
    assert ATTENTION_BACKENDS == ("torch", "triton", "flash_attn")


def test_workload_classes_are_their_own_trace_variant(tmp_path):
    from sched_lab.config import ClassesConfig, TraceConfig

    one = validate({"trace": parse_yaml(SYNTHETIC)}, "c", tmp_path)
    assert isinstance(one.trace, TraceConfig) and one.trace.classes == ()
    two = validate({"trace": [{"name": "a", **parse_yaml(SYNTHETIC)}]}, "c", tmp_path)
    assert isinstance(two.trace, ClassesConfig) and not hasattr(two.trace, "spec")
    assert two.to_dict()["trace"][0]["name"] == "a" and two.rate_scales == (1.0,)


def test_typos_get_a_did_you_mean():
    """An unknown key or name close to a known one (difflib ratio >= 0.75) is named in the
    one-line error; a name close to none gets the list alone."""
    trace = {"format": "synthetic", "num_requests": 2, "prompt_len": 4, "output_len": 2,
             "arrival": {"process": "poisson", "rate": 1.0}}  # fmt: skip
    cases = [
        ({"schedular": {}}, "unknown key schedular (did you mean scheduler?); allowed: name,"),
        ({"scheduler": {"max_num_seq": 3}},
         "unknown key scheduler.max_num_seq (did you mean max_num_seqs?); allowed: max_num_seqs,"),
        ({"policies": ["fcsf"]},
         "policies[0]: unknown policy 'fcsf' (did you mean 'fcfs'?); known policies: "),
        ({"zzz": 1}, "unknown key zzz; allowed: name,"),
        ({"serch": {}}, "unknown key serch (did you mean search?); allowed: name,"),
        ({"sweep": {}}, "config: sweep: a sweep, not one experiment"),
        ({"backend": "engin"}, "backend: expected one of engine, sim, got 'engin' (did you "
                               "mean 'engine'?)"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(ConfigError) as e:
            validate({"name": "x", "trace": trace, **extra})
        assert message in str(e.value), str(e.value)


def test_an_unknown_policy_says_how_to_add_one_for_this_install(tmp_path, monkeypatch):
    """In a checkout (pyproject.toml beside the bundled data) a new policy is a file in its
    policies/ folder; an installed copy (a wheel) is not the user's to add files to, so the
    hint names the route that works there: register_policy from their own script."""
    from sched_lab import policies

    trace = {"format": "synthetic", "num_requests": 2, "prompt_len": 4, "output_len": 2,
             "arrival": {"process": "poisson", "rate": 1.0}}  # fmt: skip
    folder = Path(policies.__file__).parent
    with pytest.raises(ConfigError) as e:
        validate({"name": "x", "trace": trace, "policies": ["mine"]})
    assert str(e.value).endswith(f"; a new policy is one file in {folder}/ (docs/policies.md)")
    monkeypatch.setattr(paths, "DATA_ROOT", tmp_path)  # no pyproject.toml: a wheel's layout
    with pytest.raises(ConfigError) as e:
        validate({"name": "x", "trace": trace, "policies": ["mine"]})
    message = str(e.value)
    assert "; this sched_lab is an installed copy" in message and "\n" not in message
    assert "sched_lab.policies.register_policy" in message and "pip install -e ." in message
