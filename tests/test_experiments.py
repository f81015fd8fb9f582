"""Every example YAML runs (small limit); configs and the CLI fail with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

import run_experiment
from sched_lab.config import load_config
from sched_lab.core.errors import ConfigError
from sched_lab.report.folder import MANIFEST
from sched_lab.sweeps.sweep import is_sweep

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "experiments").glob("*.yaml"))


def sim_examples():
    """The simulator examples that are one experiment (sweeps: tests/test_sweep.py)."""
    out = []
    for p in EXAMPLES:
        raw = yaml.safe_load(p.read_text())
        if raw.get("backend", "sim") == "sim" and not is_sweep(raw):
            out.append(p)
    return out


def replays_durations(path: Path) -> bool:
    """An example fed an engine run's step durations: it must replay that run's whole window
    (a smaller --limit is refused), so it runs without one."""
    return "durations_from" in (yaml.safe_load(path.read_text()).get("cost_model") or {})


@pytest.mark.parametrize("path", sim_examples(), ids=lambda p: p.stem)
def test_example_runs(path, tmp_path):
    out = tmp_path / "run"
    limit = None if replays_durations(path) else 60
    args = [str(path), "--out", str(out), "--no-progress"]
    assert run_experiment.main(args + (["--limit", str(limit)] if limit else [])) == 0
    cfg = load_config(path)
    policies = [p.label for p in cfg.policies]
    num_runs = len(policies) * len(cfg.rate_scales)
    req = pd.read_csv(out / "requests.csv")
    for col in (
        "policy",
        "request_id",
        "status",
        "arrival_s",
        "prompt_tokens",
        "output_tokens",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "queue_s",
        "num_preemptions",
    ):
        assert col in req.columns
    # Nothing lost: every trace request once per run, ended with a reason if not finished;
    # --limit counts replayed requests (dropped trace rows among them are listed too).
    n = (req.status != "dropped").sum()
    assert len(req) % num_runs == 0 and (limit is None or n <= limit * num_runs)
    assert set(req["status"]) <= {"finished", "rejected", "aborted", "dropped"}
    assert req.loc[req.status != "finished", "reason"].notna().all()
    steps = pd.read_csv(out / "steps.csv")
    for col in (
        "policy",
        "time_s",
        "duration_s",
        "num_prefill_tokens",
        "num_decode_tokens",
        "num_seqs",
        "kv_used_blocks",
        "num_waiting",
        "num_swapped",
    ):
        assert col in steps.columns
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary) == num_runs
    first = next(iter(summary.values()))
    stats = {"mean", "median", "std", "p50", "p90", "p99", "max"}
    assert {f"{s}_ttft_ms" for s in stats} <= set(first) and "ttft_s" not in first
    report = (out / "report.md").read_text()
    assert "latency_cdf.png" in report and (out / "latency_cdf.png").stat().st_size > 10_000
    assert (out / "over_time.png").exists() and (out / "config.yaml").exists()
    if num_runs > len(policies):
        assert (out / "latency_vs_load.png").exists()


def lab_wrote(folder: Path, name: str, text: str = "from an older run") -> None:
    """A file in ``folder`` as if an earlier sched-lab had written it (named in the manifest)."""
    (folder / name).write_text(text)
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "files": manifest["files"] + [name]}))


def test_rerun_replaces_results_whole(tmp_path):
    out = tmp_path / "run"
    args = [
        str(ROOT / "experiments/quickstart.yaml"),
        "--limit",
        "20",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert run_experiment.main(args) == 0
    files = json.loads((out / MANIFEST).read_text())["files"]
    vllm = [f for f in files if f.endswith("qps-llama-3.1-8b.json")]  # one per run
    assert [f.split("-")[0] for f in vllm] == ["chunked_prefill", "fcfs", "swap"]
    assert [f for f in files if f not in vllm] == [
        "config.yaml",
        "events.csv",
        "latency_cdf.png",
        "over_time.png",
        "report.html",
        "report.md",
        "requests.csv",
        "steps.csv",
        "summary.json",
        "timeline_chunked_prefill.png",
        "timeline_fcfs.png",
        "timeline_swap.png",
        "timing.json",
    ]
    lab_wrote(out, "stale.txt")
    assert run_experiment.main(args) == 0
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temp folders left


def test_rerun_never_deletes_a_file_the_lab_did_not_write(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        str(ROOT / "experiments/quickstart.yaml"),
        "--limit",
        "5",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert run_experiment.main(args) == 0
    capsys.readouterr()
    (out / "my_trace.csv").write_text("kept by hand")
    assert run_experiment.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {args[0]}: --out {out}: holds my_trace.csv, not written by "
        f"sched-lab (not in {MANIFEST}); refusing to replace it (move it out, or "
        "choose another --out)"
    ]
    assert (out / "my_trace.csv").read_text() == "kept by hand"
    # A folder of the lab's files without a manifest (an older version's, or docs/azure_gpu
    # with its hand-written RUN.md) is refused too, with what to do.
    (out / "my_trace.csv").unlink()
    (out / MANIFEST).unlink()
    assert run_experiment.main(args) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"--out {out}: a results folder without {MANIFEST} (from before manifests, or made by "
            "hand); refusing to replace it: delete it yourself, or choose another --out"
        )
    )
    assert (
        run_experiment.main([*args[:-3], "--out", str(ROOT / "docs/azure_gpu"), "--no-progress"])
        == 2
    )
    assert (ROOT / "docs/azure_gpu/RUN.md").is_file()


def test_rate_scale_list_replays_each_load(tmp_path):
    # Each load is the one loaded trace at its own scale (a bug once replayed the first
    # load's requests at every later load: identical rows for x1, x2, x3).
    cfg = write(
        tmp_path,
        "trace: {format: synthetic, num_requests: 6, arrival: {process: "
        "poisson, rate: 2}, prompt_len: 8, output_len: 3, "
        "rate_scale: [1, 2, 4]}\npolicies: [fcfs]\n"
        "kv_cache: {num_gpu_blocks: 64}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(cfg), "--out", str(out), "--no-progress"]) == 0
    req = pd.read_csv(out / "requests.csv")
    by_scale = {
        s: g.sort_values("request_id").arrival_s.to_numpy() for s, g in req.groupby("rate_scale")
    }
    assert sorted(by_scale) == [1.0, 2.0, 4.0] and by_scale[1.0][-1] > 0
    assert by_scale[2.0] == pytest.approx(by_scale[1.0] / 2)
    assert by_scale[4.0] == pytest.approx(by_scale[1.0] / 4)
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary) == ["fcfs@x1", "fcfs@x2", "fcfs@x4"]
    assert summary["fcfs@x4"]["duration"] < summary["fcfs@x1"]["duration"]


def test_dropped_trace_rows_are_in_the_results_and_in_no_metric(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:00,5,0\n"
        "2023-11-16 18:17:01,5,3\n2023-11-16 18:17:02,6,2\n"
    )
    cfg = write(
        tmp_path,
        f"trace: {{format: azure2023, path: {trace}}}\npolicies: [fcfs]\n"
        "kv_cache: {num_gpu_blocks: 64}\nslo: {ttft_s: 10}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(cfg), "--out", str(out), "--no-progress"]) == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req.request_id) == [0, 1, 2] and list(req.status) == [
        "dropped",
        "finished",
        "finished",
    ]
    assert req.reason[0] == (
        "not replayed: 'GeneratedTokens' == 0 in t.csv (a request needs >= 1 output token)"
    )
    assert req.loc[0, ["arrival_s", "finish_s", "ttft_s", "e2e_s"]].isna().all()
    s = json.loads((out / "summary.json").read_text())["fcfs"]
    assert (s["num_prompts"], s["completed"], s["dropped"]) == (2, 2, 0 + 1)
    assert s["slo_attainment"] == 1.0  # over the 2 replayed requests
    assert (
        "Trace rows not replayed: 1 (status `dropped` in requests.csv): 'GeneratedTokens'"
        in (out / "report.md").read_text()
    )


def test_out_in_the_way_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    import sched_lab.run.experiment

    monkeypatch.setattr(sched_lab.run.experiment, "iter_runs", None)  # a run would raise TypeError
    cfg = str(ROOT / "experiments/quickstart.yaml")
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    cases = [
        (tmp_path / "file", "exists and is not a folder"),
        (tmp_path / "file" / "sub", f"{tmp_path / 'file'} is a file, not a folder"),
        (tmp_path / "other", "the folder exists and is not a results folder"),
    ]
    for out, message in cases:
        assert run_experiment.main([cfg, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def test_out_through_links_and_dots_replaces_the_results_folder(tmp_path, monkeypatch):
    args = [str(ROOT / "experiments/quickstart.yaml"), "--limit", "5", "--no-progress"]
    real = tmp_path / "res"
    assert run_experiment.main([*args, "--out", str(real)]) == 0
    lab_wrote(real, "stale.txt")
    (tmp_path / "link").symlink_to(real)  # a link to a results folder updates that folder
    assert run_experiment.main([*args, "--out", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and not (real / "stale.txt").exists()
    monkeypatch.chdir(real)  # "." and "x/.." name the folder itself
    lab_wrote(real, "stale.txt", "again")
    assert run_experiment.main([*args, "--out", "."]) == 0
    assert not (real / "stale.txt").exists() and (real / "summary.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "res"]  # nothing left over


def test_out_in_the_way_of_a_project_folder(tmp_path, capsys, monkeypatch):
    import sched_lab.run.experiment

    monkeypatch.setattr(sched_lab.run.experiment, "iter_runs", None)  # a run would raise TypeError
    cfg = str(ROOT / "experiments/quickstart.yaml")
    project = tmp_path / "proj"
    (project / "src").mkdir(parents=True)
    for name in ("summary.json", "report.md"):
        (project / name).write_text("{}")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing" / "x" / "y")
    cases = [
        (
            project,
            "the folder exists and is not a results folder (no "
            ".sched-lab-manifest.json); refusing to replace it",
        ),
        (Path("/proc/lab-out"), "cannot make a folder in /proc"),
        ("", "--out: expected a folder, got an empty string"),
    ]
    for out, message in cases:
        assert run_experiment.main([cfg, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert (project / "src").is_dir()
    # A dangling link is followed to where it points; nothing is made before the run.
    from sched_lab.report.folder import check_out_dir

    assert check_out_dir(tmp_path / "dangling") == tmp_path / "missing" / "x" / "y"
    assert not (tmp_path / "missing").exists()


def test_command_line_mistakes_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_experiment.main(["--limit", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: argument --limit: invalid int value: 'abc' (see --help)"]
    fifo = tmp_path / "exp.fifo"
    os.mkfifo(fifo)  # reading it would block forever
    assert run_experiment.main([str(fifo), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {fifo}: not a regular file, expected an experiment YAML file"
    )


def test_config_path_that_is_a_folder(tmp_path, capsys):
    assert run_experiment.main([str(tmp_path), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path}: is a directory, expected an experiment YAML file"
    )


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


BASE = "trace: {format: synthetic, num_requests: 5, arrival: {process: poisson, rate: 1}, prompt_len: 10, output_len: 5}\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            BASE + "polices: [fcfs]\n",
            "unknown key polices (did you mean policies?); allowed: name, backend",
        ),
        (
            BASE + "policies: [no_such_policy]\n",
            # Only the start: other test modules register policies of their own (e.g.
            # tests/test_core_contract.py), so the full list depends on which ran first.
            "unknown policy 'no_such_policy'; known policies: chunked_prefill, ",
        ),
        (
            BASE + "kv_cache: {block_size: sixteen}\n",
            "kv_cache.block_size: expected an integer >= 1, got 'sixteen'",
        ),
        (BASE + "kv_cache: {blocksize: 16}\n", "unknown key kv_cache.blocksize"),
        (
            BASE + "model: llama-4\n",
            "model: expected one of llama-2-7b, llama-3.1-8b, llama-3.2-1b, mistral-7b-v0.3, qwen2.5-7b, qwen3-0.6b, qwen3-8b, smollm2-135m, got 'llama-4'",
        ),
        (
            BASE + "kv_cache: {gpu_memory_utilization: 1.5}\n",
            "kv_cache.gpu_memory_utilization: expected a number in (0.0, 1.0], got 1.5",
        ),
        (
            BASE + "policies: [{name: fcfs, max_num_seqs: 0}]\n",
            "policies[0].max_num_seqs: expected an integer in [1, 1,099,511,627,776] or null, got 0",
        ),
        (BASE + "policies: [fcfs, fcfs]\n", "labels must be unique"),
        ("trace: [1, 2]\n", "trace[0]: expected a workload class: a mapping"),
        (BASE + "trace_x: 1\n", "unknown key trace_x"),
        (BASE + "slo: {ttft_s: -1}\n", "slo.ttft_s: expected a finite number > 0 or null, got -1"),
        ("a: [1, 2\n", "is not valid YAML"),
    ],
)
def test_bad_config_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path / "exp.yaml") in str(e.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "policies: [{name: fcfs, max_num_batched_tokens: 100}]\nscheduler: {max_num_seqs: 8, max_model_len: 512}\n",
            "max_num_batched_tokens 100 is below max_model_len 512",
        ),
        (
            "policies: [{name: chunked_prefill, max_num_batched_tokens: 16}]\n",
            "max_num_batched_tokens 16 must be >= max_num_seqs 256",
        ),
        ("kv_cache: {gpu_memory_utilization: 0.05}\n", "leaves no room for KV"),
    ],
)
def test_impossible_limits_are_user_errors(tmp_path, capsys, extra, message):
    assert (
        run_experiment.main(
            [str(write(tmp_path, BASE + extra)), "--out", str(tmp_path / "o"), "--no-progress"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_cli_prints_one_line_and_no_traceback(tmp_path):
    bad = write(tmp_path, "trace: {format: azure2023, path: nowhere.csv}\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run_experiment.py"), str(bad), "--no-progress"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("INFO")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nowhere.csv" in lines[0]
