"""The package installs (``pip install .`` and ``pip install -e .``) and ``sched-lab run`` works
from a folder outside the checkout, with the bundled experiment, trace and results under the cwd.

Installed into a temporary venv that sees this environment's packages (no dependencies
installed, no build isolation: no index is needed), so that the test checks the package
itself: its module list, its data files and its console script.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"


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


WHERE = (
    "import sched_lab, sched_lab.policies, sched_lab.backend.tools, sched_lab.traces\n"
    "from sched_lab.config.paths import DATA_ROOT\n"
    "print(sched_lab.__file__, sched_lab.policies.__file__, sched_lab.backend.tools.__file__,"
    " sched_lab.traces.__file__, DATA_ROOT)"
)


def wheel_of_this_checkout(folder: Path, env: dict[str, str]) -> Path:
    """The wheel ``pip install .`` would install, built into ``folder``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(folder), str(ROOT)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = folder.glob("sched_lab-*.whl")
    return wheel


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
    if editable:
        target = ["-e", str(ROOT)]
    else:  # one import name in site-packages: sched_lab/ and its dist-info, nothing else
        wheel = wheel_of_this_checkout(tmp_path / "wheel", env)
        with zipfile.ZipFile(wheel) as zf:
            top = {name.split("/")[0] for name in zf.namelist()}
            scripts = zf.read(f"sched_lab-{VERSION}.dist-info/entry_points.txt").decode()
        assert top == {"sched_lab", f"sched_lab-{VERSION}.dist-info"}, top
        assert "sched-lab = sched_lab.cli:console_main" in scripts
        target = [str(wheel)]
    proc = subprocess.run([*pip, *target], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run(
        [bin_dir / "python", "-c", WHERE],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    lab, policies, tools, traces, data_root = map(Path, where.stdout.split())
    if editable:  # each subpackage from its own top-level folder of the checkout
        assert (lab, policies, tools, traces) == (
            ROOT / "lab" / "__init__.py",
            ROOT / "policies" / "__init__.py",
            ROOT / "backend" / "tools" / "__init__.py",
            ROOT / "traces" / "__init__.py",
        )
        assert data_root == ROOT
    else:
        package = lab.parent
        assert package.name == "sched_lab" and package.is_relative_to(tmp_path / "venv")
        assert (policies, tools, traces) == (
            package / "policies" / "__init__.py",
            package / "backend" / "tools" / "__init__.py",
            package / "traces" / "__init__.py",
        )
        assert data_root == package
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
            "core/scheduler.py",
            "sim/replay.py",
        ):
            assert (package / name).is_file(), name
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
    assert version.stdout.strip() == f"sched-lab {VERSION}"


def test_every_package_folder_is_listed():
    """pyproject.toml lists every folder with an __init__.py under its sched_lab name (a new
    room or subpackage left out would be missing from the wheel), each in its own folder."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tables = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tables["package-dir"]
    assert dirs == {
        "sched_lab": "lab",
        "sched_lab.policies": "policies",
        "sched_lab.backend": "backend",
        "sched_lab.traces": "traces",
        "sched_lab.experiments": "experiments",
        "sched_lab.profiles": "profiles",
    }
    found = {
        ".".join((name, *init.parent.relative_to(ROOT / folder).parts))
        for name, folder in dirs.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert sorted(tables["packages"]) == sorted(found)


def test_the_folders_import_only_as_sched_lab():
    """The repository root is on sys.path here, yet a folder imported by its own name is
    refused (tests/conftest.py): a missed rename would work here and fail in a wheel."""
    old_name = "policies"  # by its folder name, as before the lab was one package
    with pytest.raises(ImportError, match="sched_lab"):
        importlib.import_module(old_name)
    import sched_lab.policies

    assert Path(sched_lab.policies.__file__) == ROOT / "policies" / "__init__.py"


def test_run_experiment_without_the_package_is_one_line(tmp_path):
    """From a checkout that is not installed (here: python -S, no site-packages) the old entry
    point says what to do in one line."""
    proc = subprocess.run(
        [sys.executable, "-S", str(ROOT / "run_experiment.py"), "experiments/quickstart.yaml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        "run_experiment.py: sched_lab is not installed: pip install -e . in the checkout\n"
    )
