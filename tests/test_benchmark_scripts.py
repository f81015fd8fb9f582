"""Simulator benchmark scripts still run against today's result names (they read summaries)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str) -> str:
    """What ``benchmarks/SCRIPT`` prints with ``args`` (run from the checkout, 300 s at most;
    a failure raises)."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout


def test_cluster_pd_prints_one_row_per_layout_and_policy():
    # 60 requests of the Azure conversation trace at 4x on 2 GPUs: aggregated and 1P + 1D,
    # fcfs and chunked_prefill. At this load every request meets both SLO pairs.
    out = run_script("cluster_pd.py", "--gpus", "2", "--rates", "4", "--limit", "60")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 1P") or
            line.startswith("| 2 agg")]  # fmt: skip
    assert [(r[0], r[1]) for r in rows] == [
        ("| 2 aggregated", "fcfs"),
        ("| 2 aggregated", "chunked_prefill"),
        ("| 1P + 1D", "fcfs"),
        ("| 1P + 1D", "chunked_prefill"),
    ]
    for r in rows:
        assert r[-2].endswith("/ 100.0%") and r[-1].endswith("/ 100.0% |")


def test_output_speed_names_every_part_and_matches_pandas():
    """benchmarks/output_speed.py: one row per part of writing, and pandas' bytes equal."""
    out = run_script("output_speed.py", "--limit", "30", "--pandas")
    for name in ("requests.csv", "steps.csv", "events.csv"):
        assert f"{name}: pandas' bytes identical" in out
    parts = [line.split(" | ")[0].removeprefix("| ") for line in out.splitlines()[5:]]
    for part in ("steps.csv", "PNG plots", "timelines: Gantt PNGs", "report.html",
                 "writing, all (with plots)", "writing, --no-plots"):  # fmt: skip
        assert part in parts, part


def test_kv_fp8_dry_run_gives_fp8_four_times_the_float32_blocks(monkeypatch, capsys):
    """benchmarks/kv_fp8.py --dry-run: a tiny float32 model on CPU with a budget of 64
    float32 blocks; fp8 (1 byte, not 4) gets 256 and both runs generate every token. Its
    main() runs in this process (torch is imported here already)."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its `from common import ...`
    monkeypatch.setattr(sys, "argv", ["kv_fp8.py", "--dry-run"])
    load_script("kv_fp8").main()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("budget ")]
    assert [(r[1], int(r[2]), int(r[4])) for r in rows] == [("auto", 64, 279), ("fp8", 256, 279)]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("no_such", "no such experiment in experiments/"),
        ("sweep_quick", "a sweep (its points' files are checked by tests/test_sweep.py, not here)"),
        ("sim_vs_real", "backend: engine, not the simulator"),
        ("../experiments/quickstart", "expected an experiment's name (quickstart), not a path"),
    ],
)
def test_identical_refuses_a_name_it_does_not_check(name, why):
    """benchmarks/identical.py --only: a name it would skip is refused in one line, exit 2,
    before anything runs (it used to print nothing and exit 0)."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/identical.py", "--only", "quickstart", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"identical.py: --only {name}: {why}; expected one of: async_vs_sync, ")
    assert "quickstart" in line.split("expected one of: ")[1].split(", ")


def load_script(name: str):
    """benchmarks/NAME.py imported as a module (its main() callable in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fidelity_eager_steps_refuses_what_is_not_an_engine_archive(tmp_path, capsys):
    """benchmarks/fidelity_eager_steps.py: a missing archive, a file that is not a tar.gz,
    an archive without profile.csv and one without engine runs: each one line, exit 2 (a
    missing archive used to raise StopIteration)."""
    import tarfile

    script = load_script("fidelity_eager_steps")
    (tmp_path / "text.tar.gz").write_text("x")
    (tmp_path / "profile.csv").write_text("kind\n")
    for name, members in (("empty", []), ("no_runs", ["profile.csv"])):
        with tarfile.open(tmp_path / f"{name}.tar.gz", "w:gz") as tar:
            for m in members:
                tar.add(tmp_path / m, arcname=f"run/{m}")
    cases = {
        "missing.tar.gz": "no such archive (expected a fidelity --engine .tar.gz)",
        "text.tar.gz": "not a readable .tar.gz (ReadError)",
        "empty.tar.gz": "no profile.csv (expected a fidelity --engine archive)",
        "no_runs.tar.gz": "no engine*/*/steps.csv (no engine run to predict)",
    }
    for name, why in cases.items():
        assert script.main([str(tmp_path / name)]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"fidelity_eager_steps.py: {tmp_path / name}: {why}\n")


def test_fidelity_overview_names_a_missing_doc_or_column(tmp_path, monkeypatch, capsys):
    """benchmarks/fidelity_overview.py: a listed doc, its heldout.csv or a column it reads
    missing: one line, exit 2, nothing on stdout (a missing doc used to raise, a missing
    table to print a row of dashes)."""
    script = load_script("fidelity_overview")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "DOCS", (("docs/f.md", "m", "w"),))
    (tmp_path / "docs" / "f").mkdir(parents=True)
    table = tmp_path / "docs" / "f" / "heldout.csv"
    regen = "missing (regenerate it: the doc's header says how)"
    for make, why in (
        (lambda: None, f"docs/f.md: {regen}"),
        (lambda: (tmp_path / "docs" / "f.md").write_text("# f\n"), f"docs/f/heldout.csv: {regen}"),
        (lambda: table.write_text("run,load,err_p50_ttft_ms\nr,1.2,0.1\n"),
         "docs/f/heldout.csv: missing column(s) err_p50_tpot_ms, err_p50_e2el_ms"),
    ):  # fmt: skip
        make()
        assert script.main() == 2
        out, err = capsys.readouterr()
        assert (out, err.splitlines()) == ("", [f"fidelity_overview.py: {why}"]), why


def test_decode_breakdown_groups_kernels_by_part_and_prices_what_they_read():
    """benchmarks/decode_breakdown.py: kernel names to parts, and per-part figures from
    hand-made profiler rows (2 replays; 1 MB of weights at 1e12 B/s is 1 us)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from decode_breakdown import breakdown, part_of

    assert part_of("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT") == "gemm"
    assert part_of("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert part_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert part_of("_decode_work_kernel") == "attention"
    assert part_of("_qkv_prepare_kernel") == "qkv_prepare"
    assert part_of("_rms_norm_kernel") == "rms_norm"
    assert part_of("void at::native::index_elementwise_kernel<128, 4>") == "other"
    rows = [("nvjet_a", 8, 40.0), ("_decode_work_kernel", 2, 12.0), ("_rms_norm_kernel", 4, 6.0)]
    out = breakdown(rows, 2, {"gemm": 10_000_000, "attention": 3_000_000}, 1e12)
    assert out["gemm"] == {"kernels": 4.0, "us": 20.0, "bytes": 10_000_000, "ideal_us": 10.0,
                           "ratio": 2.0}  # fmt: skip
    assert out["attention"]["us"] == 6.0 and out["attention"]["ratio"] == 2.0
    assert out["rms_norm"] == {"kernels": 2.0, "us": 3.0, "bytes": 0, "ideal_us": 0.0,
                               "ratio": None}  # fmt: skip
    assert out["other"]["kernels"] == 0.0
