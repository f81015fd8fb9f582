"""Stopping a sweep on the process pool (lab/sweeps/executors.py): SIGTERM, SIGINT or SIGHUP
to the driver, or SIGKILL, ends every worker process and leaves no temporary folder. The
test waits for states (workers running, a point writing its folder), never for a time;
the bounds are generous for a loaded machine. Linux only (reads /proc)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sched_lab.report.staging import remove_stale

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 120.0  # how long a stopped sweep and its workers may take to end (loaded CI)

# 400 small points: many more than two workers finish while the test waits.
SWEEP = """\
trace: {format: synthetic, num_requests: 30, arrival: {process: poisson, rate: 4},
        prompt_len: 64, output_len: 16}
kv_cache: {num_gpu_blocks: 256}
policies: [fcfs]
sweep:
  grid:
    seed: SEEDS
    trace.rate_scale: [1, 2, 3, 4]
""".replace("SEEDS", str(list(range(100))))

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, else None (gone or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = text.rsplit(")", 1)[1].split()[:2]
    return None if state in ("Z", "X") else (state, int(ppid))


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = st[1]
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def wait_for(what, bound_s: float = BOUND_S, every_s: float = 0.02):
    """Poll ``what()`` until it is truthy; its value, or fail after ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"not reached within {bound_s:.0f} s: {what.__doc__ or what}")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL"])
def test_a_stopped_pool_sweep_ends_its_workers_and_leaves_no_temp_folder(tmp_path, request, sig):
    path = tmp_path / "sw.yaml"
    path.write_text(SWEEP)
    # A short $TMPDIR, so that the pool's own marked folder holds the forkserver's socket
    # whatever pytest's folder is called (test_a_pool_sweep_runs_under_a_long_tmpdir has
    # the long one).
    tmp = Path(tempfile.mkdtemp(prefix="sst", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    out = tmp_path / "results" / "sw"
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "run_experiment.py"), str(path), "--jobs", "2",
           "--no-progress", "-q", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:

        def writing() -> bool:
            """two workers running and a point writing its folder in $TMPDIR"""
            return any(tmp.glob("sched-lab-point.*")) and len(descendants(proc.pid)) >= 3

        wait_for(writing, every_s=0.005)
        below = descendants(proc.pid)
        proc.send_signal(getattr(signal, sig))
        proc.wait(BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()

    def ended() -> bool:
        """every process below the driver gone"""
        return not [p for p in below if _stat(p) is not None]

    wait_for(ended)
    if sig == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 128 + getattr(signal, sig), stderr
        assert "Traceback" not in stderr, stderr
        assert stderr.strip().splitlines()[-1] == (
            f"error: interrupted by {sig} during the sweep; nothing written"
        )
    # The workers unwound their points: no temporary folder of ours in $TMPDIR or beside --out.
    wait_for(lambda: not list(tmp.glob("sched-lab-point.*")))
    assert not out.exists()
    assert not out.parent.exists() or not list(out.parent.iterdir())
    # multiprocessing's folder is sched-lab's, marked: left only by SIGKILL, and then the next
    # sweep removes it (a pymp-* folder would stay for good).
    assert not list(tmp.glob("pymp-*"))
    pool = list(tmp.glob("sched-lab-pool.*"))
    assert len(pool) == (sig == "SIGKILL"), pool
    assert remove_stale(tmp, "sched-lab-pool.") == pool and not list(tmp.glob("sched-lab-pool.*"))


def test_a_pool_sweep_runs_under_a_long_tmpdir(tmp_path):
    # The forkserver's socket lives in multiprocessing's temporary folder, and a socket path
    # holds at most 107 bytes: with $TMPDIR of 75 bytes, FOLDER/sched-lab-pool.XXXXXXXX/
    # listener-XXXXXXXX would need 117 ("OSError: AF_UNIX path too long" before), so the
    # pool keeps multiprocessing's own pymp-* folder (99 bytes) and the sweep runs.
    tmp = tmp_path / ("t" * max(75 - len(str(tmp_path)) - 1, 1))
    tmp.mkdir()
    path = tmp_path / "sw.yaml"
    path.write_text(SWEEP.replace(str(list(range(100))), "[1, 2]"))
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "results" / "sw"
    cmd = [sys.executable, str(ROOT / "run_experiment.py"), str(path), "--jobs", "2",
           "--no-progress", "-q", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert len(list((out / "points").glob("p00*"))) == 8  # 2 seeds x 4 rate scales
    assert not list(tmp.iterdir())  # nothing left in $TMPDIR
