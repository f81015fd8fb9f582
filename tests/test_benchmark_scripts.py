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


def test_kv_fp8_dry_run_gives_fp8_four_times_the_float32_blocks():
    """benchmarks/kv_fp8.py --dry-run: a tiny float32 model on CPU with a budget of 64
    float32 blocks; fp8 (1 byte, not 4) gets 256 and both runs generate every token."""
    pytest.importorskip("torch")
    out = run_script("kv_fp8.py", "--dry-run")
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
