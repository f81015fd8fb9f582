"""The package installs (``pip install .`` and ``pip install -e .``) and ``sched-lab run`` works
from a folder outside the checkout, with the bundled experiment, trace and results under the cwd.

Installed into a temporary venv that sees this environment's packages (no dependencies
installed, no build isolation: no index is needed), so that the test checks the package
itself: its module list, its data files and its console script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def venv_seeing_this_environment(path: Path) -> Path:
    """A venv whose python sees this interpreter's packages (also when it is a venv itself);
    returns its bin folder."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)],
        check=True,
    )
    py = path / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    outer = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "_outer_env.pth").write_text("".join(f"{p}\n" for p in outer))
    return path / "bin"


@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_install_and_run_from_another_folder(tmp_path, editable):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = venv_seeing_this_environment(tmp_path / "venv")
    pip = [
        bin_dir / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
    ]
    proc = subprocess.run(
        [*pip, *(["-e"] if editable else []), str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run(
        [bin_dir / "python", "-c", "import sched_lab; print(sched_lab.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    installed = Path(where.stdout.strip()).resolve()
    if editable:
        assert installed == ROOT / "lab" / "__init__.py"
    else:
        assert installed.is_relative_to(tmp_path / "venv")
        data = installed.parent.parent
        for name in (
            "experiments/quickstart.yaml",
            "experiments/data/smollm2_prompts.yaml",
            "traces/data/azure2023_conv.csv",
            "traces/data/ATTRIBUTION.md",
            "profiles/h200_qwen3-0.6b.csv",
            "profiles/h200_qwen3-0.6b.fit.json",
            "policies/fcfs.py",
            "backend/attention/triton_kernels.py",
            "backend/tools/__main__.py",
            "lab/core/scheduler.py",
            "lab/sim/replay.py",
        ):
            assert (data / name).is_file(), name
    run = [
        bin_dir / "sched-lab",
        "run",
        "experiments/quickstart.yaml",
        "--limit",
        "50",
        "--no-progress",
    ]
    proc = subprocess.run(run, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((work / "results" / "quickstart" / "summary.json").read_text())
    assert sorted(summary) == ["chunked_prefill", "fcfs", "swap"]
    assert all(s["num_prompts"] == 50 and s["completed"] == 50 for s in summary.values())
    out = tmp_path / "out"
    proc = subprocess.run(
        [*run, "--out", str(out)], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "summary.json").read_bytes() == (
        work / "results" / "quickstart" / "summary.json"
    ).read_bytes()
    version = subprocess.run(
        [bin_dir / "sched-lab", "--version"], cwd=work, env=env, capture_output=True, text=True
    )
    assert version.stdout.strip() == "sched-lab 0.1.0"
