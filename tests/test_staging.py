"""Temporary folders left by a killed sched-lab (lab/report/staging.py): the next run removes
those it marked whose process is gone, and nothing else; a sweep's pool keeps its
multiprocessing folder among them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import run_experiment
from sched_lab.core.outputs import MANIFEST
from sched_lab.report.staging import MARKER, make_marked, remove_stale

TINY = """name: tiny
trace: {format: synthetic, num_requests: 4, arrival: {process: poisson, rate: 1},
        prompt_len: 10, output_len: 5}
policies: [fcfs]
"""


def gone_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def marked(folder: Path, pid: int, host: str | None = None) -> Path:
    folder.mkdir()
    mark = {"pid": pid, "host": socket.gethostname() if host is None else host}
    (folder / MARKER).write_text(json.dumps(mark))
    (folder / "requests.csv").write_text("half written")
    return folder


def test_only_marked_folders_of_ended_processes_are_removed(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        dead = marked(tmp_path / ".res.dead0001", gone_pid())
        running = marked(tmp_path / ".res.alive001", alive.pid)
        mine = marked(tmp_path / ".res.mine0001", os.getpid())
        elsewhere = marked(tmp_path / ".res.other001", gone_pid(), host="another-host")
        unmarked = tmp_path / ".res.users001"
        unmarked.mkdir()
        bad_marker = tmp_path / ".res.badmark1"
        bad_marker.mkdir()
        (bad_marker / MARKER).write_text("not json")
        other_name = marked(tmp_path / ".other.dead0001", gone_pid())
        link = tmp_path / ".res.link0001"
        link.symlink_to(marked(tmp_path / "target", gone_pid()))
        assert remove_stale(tmp_path, ".res.") == [dead]
        assert not dead.exists()
        for kept in (running, mine, elsewhere, unmarked, bad_marker, other_name, link):
            assert kept.exists(), kept
        assert (tmp_path / "target" / MARKER).exists()
    finally:
        alive.communicate(b"")
    assert remove_stale(tmp_path / "missing", ".res.") == []


def test_a_run_removes_a_killed_runs_staging_folder_and_leaves_no_marker(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    stale = marked(tmp_path / ".res.k1ll3d00", gone_pid())
    args = [str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "res"), "--no-progress", "-q"]
    assert run_experiment.main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res", "tiny.yaml"]
    assert not stale.exists()
    assert not (tmp_path / "res" / MARKER).exists()
    assert MARKER not in json.loads((tmp_path / "res" / MANIFEST).read_text())["files"]


def test_a_marked_folder_names_this_process(tmp_path):
    folder = make_marked(tmp_path, ".x.")
    assert folder.name.startswith(".x.") and [p.name for p in folder.iterdir()] == [MARKER]
    mark = json.loads((folder / MARKER).read_text())
    assert mark == {"pid": os.getpid(), "host": socket.gethostname()}


def test_a_signal_while_marking_leaves_no_folder(tmp_path, monkeypatch):
    # A sweep's worker stopped by SIGTERM between making its folder and writing the marker
    # left an unmarked folder that no later sweep removes (before).
    def stopped() -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(socket, "gethostname", stopped)
    with pytest.raises(KeyboardInterrupt):
        make_marked(tmp_path, "sched-lab-point.")
    assert not list(tmp_path.iterdir())


def test_the_pools_multiprocessing_folder_is_marked_and_removed_at_exit(tmp_path):
    code = (
        "import multiprocessing.util as u\n"
        "from sched_lab.sweeps import executors\n"
        "executors._pool_tempdir()\n"
        "print(u.get_temp_dir())\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("sched-lab-pool.")
    assert not folder.exists()  # removed at exit, as multiprocessing's own pymp-* folder
