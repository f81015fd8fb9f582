"""The sched-lab command (lab/cli.py): help and exit codes, bundled configs from any folder,
results under the cwd, interrupts keep completed runs, results folders that cannot be
replaced or named, and a simulator run that never imports torch."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import sched_lab.report.folder
from sched_lab import __version__
from sched_lab.cli import main
from sched_lab.config.paths import DATA_ROOT as ROOT
from sched_lab.report.folder import MANIFEST

QUICK = ["experiments/quickstart.yaml", "--no-progress"]
SYNTHETIC = (
    "trace: {format: synthetic, num_requests: 8, arrival: {process: poisson, rate: 4}, "
    "prompt_len: 16, output_len: 4}\npolicies: [fcfs, swap, chunked_prefill]\n"
    "kv_cache: {num_gpu_blocks: 64}\n"
)
HAS_TORCH = importlib.util.find_spec("torch") is not None


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["run", "--help"],
        ["fit", "--help"],
        ["tools", "--help"],
        ["profile", "--help"],
        ["serve", "--help"],
    ],  # fmt: skip
)
def test_every_help_shows_an_example_and_the_exit_codes(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and "exit status" in out and "bad input" in out
    if argv[0] in ("--help", "run"):
        assert "130" in out and "143" in out and "1    a run stopped early" in out
        # a stopped sweep keeps its finished points (tests/test_sweep_stop.py)
        assert "a sweep keeps the points, or searches, that had finished" in " ".join(out.split())


WITHOUT_TORCH = """
import sys
from importlib.abc import MetaPathFinder


class NoEngine(MetaPathFinder):  # as if the engine extra were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "safetensors", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NoEngine())
from sched_lab.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["profile", "tools"])
def test_engine_commands_help_without_torch_and_say_what_to_install(command, tmp_path):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-c", WITHOUT_TORCH, command, *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )

    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"usage: sched-lab {command}" in proc.stdout and "exit status" in proc.stdout
    run = ["--model-dir", "m", "--out", "p.csv"] if command == "profile" else [
        "make-random-checkpoint", "--preset", "qwen3-0.6b", "--out", "m"]  # fmt: skip
    proc = cli(*run)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"error: sched-lab {command} needs the engine's packages (no module torch): "
        "pip install -e '.[engine]' in the lab's folder, with torch's CPU index "
        "(docs/install.md)"
    )
    if command == "tools":  # presets are plain data
        proc = cli("list-presets")
        assert proc.returncode == 0 and "qwen3-0.6b" in proc.stdout.split()


def test_version_and_missing_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sched-lab {__version__}"
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert one_error_line(capsys) == (
        "error: the following arguments are required: COMMAND (see --help)"
    )


@pytest.mark.parametrize(
    "argv, missing",
    [
        (["fit"], "profile"),
        (["compare", "a"], "RUN_B"),
        (["bench", "x.yaml"], "--base-url"),
        (["serve"], "config"),
        (["prefix-bound"], "config"),
        (["fidelity"], "one of the arguments --engine --sim is required"),
    ],
)
def test_side_commands_mistakes_are_one_line(argv, missing, capsys):
    """A command-line mistake in a side command is one line and status 2, as in ``run``
    (was argparse's usage lines first, then ``sched-lab fit: error: ...``)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    line = one_error_line(capsys)
    assert line.startswith("error: ") and line.endswith(" (see --help)") and missing in line


def test_bundled_config_from_any_folder_writes_results_under_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", *QUICK, "--limit", "5"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    out = tmp_path / "results" / "quickstart"
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary) == ["chunked_prefill", "fcfs", "swap"]
    assert summary["fcfs"]["num_prompts"] == 5 and "partial" not in summary["fcfs"]
    # the bundled files by the names the YAML gives them, not this checkout's or venv's path
    assert summary["fcfs"]["trace"]["path"] == "traces/data/azure2023_conv.csv"
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (
        config["trace"]["path"] == config["trace_file"]["path"] == summary["fcfs"]["trace"]["path"]
    )
    assert config["cost_model"]["profile"] == "profiles/h200_llama-3.1-8b.csv"
    assert (
        "trace `azure2023` `traces/data/azure2023_conv.csv` (limit 5"
        in (out / "report.md").read_text()
    )
    for name in ("summary.json", "config.yaml", "report.md", "report.html"):
        assert str(ROOT) not in (out / name).read_text(), name


def test_a_missing_config_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "experiments/nothing.yaml", "--no-progress"]) == 2
    assert "experiments/nothing.yaml" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_fit_refits_a_profile_and_bad_input_is_one_line(tmp_path, capsys):
    out = tmp_path / "fit.json"
    profile = ROOT / "profiles" / "h200_qwen3-0.6b.csv"
    assert main(["fit", str(profile), "--out", str(out)]) == 0
    capsys.readouterr()
    fitted = json.loads(out.read_text())
    recorded = json.loads(profile.with_suffix(".fit.json").read_text())
    # A refit agrees to about the last digit: BLAS kernels differ between CPUs.
    assert fitted["coefficients"].keys() == recorded["coefficients"].keys()
    assert fitted["coefficients"] == pytest.approx(recorded["coefficients"], rel=1e-9, abs=1e-15)
    assert fitted["rows"] == 124  # the data rows of the CSV (128 lines: 3 comments, 1 header)
    assert main(["fit", str(tmp_path / "none.csv")]) == 2
    assert "none.csv does not exist" in one_error_line(capsys)
    # its decode rows only (48: decode, decode_uneven): refused as a run with it is refused
    # (was: coefficients written with prefill_step ~0, a fit no run could use)
    lines = profile.read_text().splitlines(keepends=True)
    head = [ln for ln in lines if ln.startswith("#")]
    rows = [ln for ln in lines if not ln.startswith("#")]
    decodes = [ln for ln in rows[1:] if ln.startswith("decode")]
    assert len(decodes) == 48
    (tmp_path / "decodes.csv").write_text("".join(head + rows[:1] + decodes))
    assert main(["fit", str(tmp_path / "decodes.csv")]) == 2
    assert one_error_line(capsys) == (
        f"error: {tmp_path / 'decodes.csv'}: no steps with prompt tokens (num_prefills > 0): "
        "the fit cannot predict their time"
    )


# A signal a process sends itself may be handled only a while later (it can reach another
# thread first; under load, more work runs meanwhile). deliver() waits until the handler has
# run, so each signal lands where the script places it: the lab's handler raises there
# (Interrupted) or records the signal and returns.
def _default_signals() -> None:
    """The child starts with SIGINT and SIGTERM at their defaults, as from a terminal: one
    inherited as ignored (a background job, nohup) stays ignored in the CLI, by design."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c script *args`` from the lab's folder, signals at their defaults."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,  # a deadline, not a wait: each signal waits for its handler
        preexec_fn=_default_signals,
    )


DELIVER = """
import os, signal, sys, time
def deliver(sig):
    handler, seen = signal.getsignal(sig), []
    def counting(signum, frame):
        seen.append(signum)
        handler(signum, frame)
    signal.signal(sig, counting)
    try:
        os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 60
        while not seen:
            if time.monotonic() > deadline:
                sys.exit("%s sent but not handled within 60 s" % sig.name)
            time.sleep(0.001)
    finally:
        signal.signal(sig, handler)
"""

INTERRUPT = (
    DELIVER
    + """
import sched_lab.run.experiment as ex
real, at = ex.iter_runs, int(sys.argv[1])
def iter_runs(*a, **k):
    if at == 0:
        deliver(signal.{sig})
    for i, run in enumerate(real(*a, **k), 1):
        yield run
        if i == at:
            deliver(signal.{sig})  # raised here, as from a user's kill or Ctrl-C
ex.iter_runs = iter_runs
from sched_lab.cli import main
sys.exit(main(sys.argv[2:]))
"""
)


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupt_keeps_the_completed_runs_as_partial_results(tmp_path, sig, code):
    (tmp_path / "exp.yaml").write_text(SYNTHETIC)
    out = tmp_path / "out"
    proc = _run_script(
        INTERRUPT.format(sig=sig), "1", "run", str(tmp_path / "exp.yaml"), "--out", str(out),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if not ln.startswith("INFO")]
    assert err == [
        f"error: interrupted by {sig} after 1 of 3 runs; wrote them to {out}/ as partial results"
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["fcfs"] and summary["fcfs"]["completed"] == 8
    assert summary["fcfs"]["partial"] == f"interrupted by {sig} after 1 of 3 runs"
    report = (out / "report.md").read_text().splitlines()
    assert report[2] == f"**Partial results**: interrupted by {sig} after 1 of 3 runs."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml", "out"]  # no temp folder


def test_a_run_refused_after_others_keeps_them_as_partial_results(tmp_path, monkeypatch, capsys):
    """A user error raised by the second of three runs (e.g. a policy the engine refuses
    only when its run starts) writes the first run as partial results and exits 2 with one
    line (was: exit 2, nothing written)."""
    import sched_lab.run.experiment as ex
    from sched_lab.core.errors import ConfigError

    real = ex.iter_runs

    def iter_runs(*a, **k):
        for run in real(*a, **k):
            yield run
            raise ConfigError("policies[1] (swap): refused at its run")

    monkeypatch.setattr(ex, "iter_runs", iter_runs)
    (tmp_path / "exp.yaml").write_text(SYNTHETIC)
    out = tmp_path / "out"
    code = main(["run", str(tmp_path / "exp.yaml"), "--out", str(out), "--no-progress", "-q",
                 "--no-plots"])  # fmt: skip
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("INFO")]
    assert err == [
        f"error: {tmp_path / 'exp.yaml'}: policies[1] (swap): refused at its run; the run "
        f"before it is in {out}/ as partial results"
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["fcfs"] and summary["fcfs"]["completed"] == 8
    assert summary["fcfs"]["partial"] == "stopped by an error after 1 of 3 runs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml", "out"]  # no temp folder


def test_interrupt_before_any_run_writes_nothing(tmp_path):
    (tmp_path / "exp.yaml").write_text(SYNTHETIC)
    proc = _run_script(
        INTERRUPT.format(sig="SIGTERM"), "0", "run", str(tmp_path / "exp.yaml"), "--out",
        str(tmp_path / "out"), "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 143
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: interrupted by SIGTERM before any run finished; nothing written"
    )
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


def test_out_through_a_symlink_loop_or_too_long_a_name(tmp_path, capsys, monkeypatch):
    import sched_lab.run.experiment

    monkeypatch.setattr(sched_lab.run.experiment, "iter_runs", None)  # a run would raise TypeError
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert main(["run", *QUICK, "--out", str(tmp_path / "a" / "x")]) == 2
    assert f"--out {tmp_path / 'a' / 'x'}: Symlink loop" in one_error_line(capsys)
    assert main(["run", *QUICK, "--out", str(tmp_path / ("r" * 256) / "x")]) == 2
    assert one_error_line(capsys).endswith("/x: File name too long")
    assert main(["run", *QUICK, "--out", str(tmp_path / ("r" * 242))]) == 2  # 242 + 14 > 255
    assert one_error_line(capsys).endswith(
        "the name is 242 bytes long; at most 241 fit (its temporary name adds 14)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_unreplaceable_results_are_refused_before_any_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "res"
    assert main(["run", *QUICK, "--limit", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    import sched_lab.run.experiment

    monkeypatch.setattr(sched_lab.run.experiment, "iter_runs", None)  # a run would raise TypeError
    real = sched_lab.report.folder.tempfile.mkdtemp

    def read_only(prefix=None, dir=None):  # what a folder without write permission gives
        if Path(dir) == out:
            raise PermissionError(13, "Permission denied")
        return real(prefix=prefix, dir=dir)

    monkeypatch.setattr(sched_lab.report.folder.tempfile, "mkdtemp", read_only)
    assert main(["run", *QUICK, "--out", str(out)]) == 2
    assert one_error_line(capsys).endswith(
        f"--out {out}: the earlier results cannot be replaced: cannot delete its files "
        "(Permission denied)"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only folder")
def test_read_only_results_folder_is_refused_before_any_run(tmp_path, capsys):
    out = tmp_path / "res"
    assert main(["run", *QUICK, "--limit", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    out.chmod(0o555)
    try:
        assert main(["run", *QUICK, "--limit", "3", "--out", str(out)]) == 2
        assert "cannot be replaced" in one_error_line(capsys)
    finally:
        out.chmod(0o755)


def test_failed_final_rename_keeps_the_results_and_says_where(tmp_path, capsys, monkeypatch):
    out = tmp_path / "res"
    assert main(["run", *QUICK, "--limit", "3", "--out", str(out)]) == 0
    before = (out / "summary.json").read_text()
    capsys.readouterr()
    real = os.rename

    def rename(src, dst):  # the earlier results move aside, the new ones cannot follow
        if Path(dst) == out and not str(src).endswith(".old"):
            raise OSError(16, "Device or resource busy")
        return real(src, dst)

    monkeypatch.setattr(sched_lab.report.folder.os, "rename", rename)
    assert main(["run", *QUICK, "--limit", "4", "--out", str(out)]) == 1
    line = one_error_line(capsys)
    kept = Path(line.rsplit("they are in ", 1)[1])
    assert line == (
        f"error: --out {out}: cannot put the results in place (Device or resource "
        f"busy); they are in {kept}"
    )
    assert kept.parent == tmp_path and kept.name.startswith("res.unplaced-")
    assert json.loads((kept / "summary.json").read_text())["fcfs"]["num_prompts"] == 4
    assert (out / "summary.json").read_text() == before  # the earlier results are untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res", kept.name]


def test_parquet_output(tmp_path, capsys):
    out = tmp_path / "res"
    args = ["run", *QUICK, "--limit", "5", "--out", str(out), "--format", "parquet"]
    if importlib.util.find_spec("pyarrow") is None:
        assert main(args) == 2
        assert one_error_line(capsys).endswith(
            "--format parquet needs pyarrow: pip install -e '.[parquet]' in the lab's folder"
        )
        assert not out.exists()
        return
    import pandas as pd

    assert main(args) == 0
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 15 and set(requests.policy) == {"fcfs", "swap", "chunked_prefill"}
    assert "duration_s" in pd.read_parquet(out / "steps.parquet").columns
    assert not (out / "requests.csv").exists()
    assert "requests.parquet" in json.loads((out / MANIFEST).read_text())["files"]


def test_a_simulator_run_never_imports_torch(tmp_path):
    code = (
        "import sys\nfrom sched_lab.cli import main\n"
        f"assert main(['run', 'experiments/quickstart.yaml', '--limit', '20', '--out', "
        f"{str(tmp_path / 'out')!r}, '--no-progress']) == 0\n"
        "engine = sorted(m for m in ('torch', 'triton', 'transformers', 'safetensors') "
        "if m in sys.modules)\nprint('engine modules:', engine)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "engine modules: []"


def test_old_entry_points_still_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run_experiment.py"),
            *QUICK,
            "--limit",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / MANIFEST).is_file()
    proc = subprocess.run(
        [sys.executable, "-m", "sched_lab.sim.calibrated", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "sched-lab fit" in proc.stdout
    if HAS_TORCH:
        proc = subprocess.run(
            [sys.executable, "-m", "sched_lab.backend.tools", "list-presets"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and "qwen3-0.6b" in proc.stdout.split()


CLEANUP = (
    DELIVER
    + """
import sched_lab.report.folder as report
import sched_lab.run.experiment as ex
real_runs, real_abort = ex.iter_runs, report.ResultsWriter.abort
def iter_runs(*a, **k):
    deliver(signal.SIGINT)  # stops the run before any finished
    yield from real_runs(*a, **k)
ex.iter_runs = iter_runs
def abort(self):
    deliver(signal.SIGINT)  # a second one while the command cleans up
    return real_abort(self)
report.ResultsWriter.abort = abort
from sched_lab.cli import main
sys.exit(main(sys.argv[1:]))
"""
)


def test_a_signal_during_the_last_cleanup_raises_nothing(tmp_path):
    (tmp_path / "exp.yaml").write_text(SYNTHETIC)
    args = ["run", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]
    proc = _run_script(CLEANUP, *args)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: interrupted by SIGINT before any run finished; nothing written"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


WHILE_WRITING = (
    DELIVER
    + """
import sched_lab.report.folder as report
real, times = report._plots, int(sys.argv[1])
def plots(*a, **k):
    for _ in range(times):
        deliver(signal.SIGINT)
    return real(*a, **k)
report._plots = plots
from sched_lab.cli import main
sys.exit(main(sys.argv[2:]))
"""
)


@pytest.mark.parametrize("times", [1, 2])
def test_interrupt_while_writing_finishes_the_writing_once(tmp_path, times):
    # All runs are done: a first signal lets the writing end (the results are complete); a
    # second one stops it, and nothing is left.
    (tmp_path / "exp.yaml").write_text(SYNTHETIC)
    out = tmp_path / "out"
    proc = _run_script(
        WHILE_WRITING, str(times), "run", str(tmp_path / "exp.yaml"), "--out", str(out),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if not ln.startswith("INFO")]
    if times == 1:
        assert err == [
            f"error: interrupted by SIGINT while writing the results; all runs had "
            f"finished and {out}/ holds them in full"
        ]
        summary = json.loads((out / "summary.json").read_text())
        assert list(summary) == ["fcfs", "swap", "chunked_prefill"]
        assert "partial" not in summary["fcfs"]
    else:
        assert err == [
            "error: interrupted by SIGINT twice while writing the results; nothing written"
        ]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


def test_quiet_logs_warnings_only(tmp_path):
    """-q drops the INFO phase lines; the summary table still prints."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(
        "trace: {format: synthetic, num_requests: 4, arrival: {rate: 10}, prompt_len: 16, "
        "output_len: 2}\nkv_cache: {num_gpu_blocks: 64}\npolicies: [fcfs]\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "sched_lab.cli", "run", str(exp), "--out", str(tmp_path / "o"),
         "--no-progress", "-q"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert "INFO" not in out.stderr and "finished / replayed" in out.stdout


def test_out_of_memory_is_one_line_and_status_1(monkeypatch, capsys):
    # A run larger than the process may allocate (e.g. under ulimit -v) ends with one line.
    from sched_lab import cli

    def too_big(args):
        raise MemoryError

    monkeypatch.setattr(cli, "_run", too_big)
    assert cli.main(["run", "experiments/quickstart.yaml"]) == 1
    assert cli.run_main(["experiments/quickstart.yaml"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith("error: out of memory: ") for e in err)


def _report_later_equals_plots(without: Path, with_plots: Path, pngs: list[str], capsys):
    """`sched-lab report` on the --no-plots folder ``without``: the PNGs of ``with_plots``,
    its report.md byte for byte, report.html with the same text and tables and a timeline
    per run (its step times read back from steps.csv: equal to 9 digits); a second report,
    or one of a folder drawn at run time, is refused in one line."""
    import base64
    import gzip
    import re

    capsys.readouterr()
    assert main(["report", str(without)]) == 0
    assert capsys.readouterr().out.startswith(f"drew 5 PNGs into {without}/ ")
    assert sorted(p.name for p in without.glob("*.png")) == pngs
    assert (without / "report.md").read_bytes() == (with_plots / "report.md").read_bytes()
    for name in ("latency_cdf.png", "over_time.png"):  # drawn from the kept series
        assert (without / name).read_bytes() == (with_plots / name).read_bytes(), name
    packed = re.compile(r"(<script type='application/octet-stream' class='timeline'>)([^<]*)")
    pages = [(d / "report.html").read_text() for d in (without, with_plots)]
    assert packed.sub(r"\1", pages[0]) == packed.sub(r"\1", pages[1])
    figures = [
        [json.loads(gzip.decompress(base64.b64decode(x))) for _, x in packed.findall(page)]
        for page in pages
    ]
    assert len(figures[0]) == len(figures[1]) == 3
    for later, drawn in zip(*figures):
        assert later["layout"] == drawn["layout"]
        for a, b in zip(later["data"], drawn["data"], strict=True):
            assert a.keys() == b.keys() and a["name"] == b["name"] and a["y"] == b["y"]
            assert a["base"] == pytest.approx(b["base"], rel=1e-8, abs=2e-6)
    manifest = json.loads((without / MANIFEST).read_text())["files"]
    assert set(pngs) <= set(manifest) and sorted(p.name for p in without.iterdir()) == sorted(
        [*manifest, MANIFEST]
    )
    assert main(["report", str(without)]) == 2
    assert one_error_line(capsys) == (
        f"error: {without}/report.md: does not say that its plots were left out (--no-plots)"
    )
    assert main(["report", str(with_plots)]) == 2
    assert one_error_line(capsys).startswith(f"error: {with_plots}: no plot_data.npz: ")


def test_no_plots_writes_every_table_and_says_so(tmp_path, capsys):
    """--no-plots: no PNG, no interactive timeline; report.md and report.html say so, the
    tables are the bytes of a run with plots; a sweep refuses the flag in one line."""
    with_plots, without = tmp_path / "plots", tmp_path / "none"
    assert main(["run", *QUICK, "--limit", "40", "--out", str(with_plots)]) == 0
    assert main(["run", *QUICK, "--limit", "40", "--out", str(without), "--no-plots"]) == 0
    pngs = sorted(p.name for p in with_plots.glob("*.png"))
    assert pngs == [
        "latency_cdf.png", "over_time.png", "timeline_chunked_prefill.png",
        "timeline_fcfs.png", "timeline_swap.png",
    ]  # fmt: skip
    assert list(without.glob("*.png")) == []
    for name in ("requests.csv", "steps.csv", "events.csv", "summary.json", "config.yaml"):
        assert (without / name).read_bytes() == (with_plots / name).read_bytes(), name
    report = (without / "report.md").read_text()
    assert "**No plots**: this run was made with `sched-lab run --no-plots`" in report
    assert "![" not in report and "![" in (with_plots / "report.md").read_text()
    page = (without / "report.html").read_text()
    assert "No plots" in page and "Request timelines (interactive)" not in page
    manifest = json.loads((without / MANIFEST).read_text())["files"]
    assert "report.html" in manifest and not any(f.endswith(".png") for f in manifest)
    assert "plot_data.npz" in manifest  # what `sched-lab report` draws from
    _report_later_equals_plots(without, with_plots, pngs, capsys)


@pytest.mark.parametrize("lose", ["header key", "array"])
def test_report_on_plot_data_missing_a_part_is_one_line(tmp_path, capsys, lose):
    """plot_data.npz of another layout under the same version (a header key or an array
    missing) is a damaged file named in one line, not a traceback."""
    import numpy as np

    out = tmp_path / "out"
    assert main(["run", *QUICK, "--limit", "10", "--out", str(out), "--no-plots", "-q"]) == 0
    path = out / "plot_data.npz"
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if lose == "array":
        del arrays["r0_itl_cdf_s"]
    else:
        meta = json.loads(str(arrays["meta"]))
        del meta["runs"]
        arrays["meta"] = np.array(json.dumps(meta))
    with path.open("wb") as f:
        np.savez(f, **arrays)
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    missing = "'r0_itl_cdf_s'" if lose == "array" else "'runs'"
    assert one_error_line(capsys) == f"error: {path}: damaged, cannot be read (no {missing})"
    assert not list(out.glob("*.png"))


def test_a_reader_that_leaves_early_ends_explain_without_a_traceback(tmp_path):
    """`sched-lab explain ... | head`: stdout's reader gone, the command ends with status 1
    and nothing on stderr (it printed a BrokenPipeError traceback)."""
    out = tmp_path / "out"
    assert main(["run", *QUICK, "--limit", "10", "--out", str(out), "--no-plots", "-q"]) == 0
    args = ["explain", str(out), "--run", "fcfs", "--request", "3"]
    code = f"import sys\nfrom sched_lab.cli import console_main\nsys.argv[1:] = {args!r}\n"
    with subprocess.Popen(
        [sys.executable, "-c", code + "sys.exit(console_main())"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as p:  # fmt: skip
        p.stdout.close()  # the reader left before the first line
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 1
    assert err == ""


def test_a_run_without_plots_imports_no_plotting_package(tmp_path):
    """matplotlib and plotly are imported where plots are drawn, so --no-plots loads neither."""
    code = (
        "import sys\nfrom sched_lab.cli import main\n"
        f"assert main(['run', *{QUICK!r}, '--limit', '20', '--no-plots', '-q', '--out', "
        f"{str(tmp_path / 'out')!r}]) == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'plotly'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
