"""Stopping a sweep on the process pool (lab/sweeps/executors.py): SIGTERM, SIGINT or SIGHUP
to the driver, or SIGKILL, ends every worker process and leaves no temporary folder; the
points that had finished are written as partial results (lab/sweeps/run.py). The
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

import pandas as pd
import pytest

import run_experiment
import sched_lab.run.experiment
import sched_lab.sweeps.executors
import sched_lab.sweeps.report
from sched_lab.cli import Interrupted
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


def _default_signals() -> None:
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


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
    # the signals at their defaults: under nohup an ignored SIGHUP is inherited, and the CLI
    # keeps an ignored signal ignored (lab/cli.py), so the sweep would never stop
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_signals)  # fmt: skip
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
    # The workers unwound their points: no temporary folder of ours in $TMPDIR or beside --out.
    wait_for(lambda: not list(tmp.glob("sched-lab-point.*")))
    if sig == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
        assert not out.exists()
    else:
        assert proc.returncode == 128 + getattr(signal, sig), stderr
        assert "Traceback" not in stderr, stderr
        last = stderr.strip().splitlines()[-1]
        if last == f"error: interrupted by {sig} before any point finished; nothing written":
            assert not out.exists()
        else:  # the points that finished, as partial results
            head = f"error: interrupted by {sig} after "
            assert last.startswith(head) and last.endswith(
                f" of 400 points; wrote them to {out}/ as partial results"
            ), last
            done = int(last.removeprefix(head).split()[0])
            table = pd.read_csv(out / "sweep.csv")
            assert (table["status"] == "ok").sum() == done
            assert (table["status"] == "interrupted").sum() == 400 - done
            assert len([p for p in (out / "points").iterdir() if p.is_dir()]) == done
    assert [p.name for p in out.parent.glob("*")] in ([], ["sw"])  # no .sw.* folder beside it
    # multiprocessing's folder is sched-lab's, marked: left only by SIGKILL, and then the next
    # sweep removes it (a pymp-* folder would stay for good).
    assert not list(tmp.glob("pymp-*"))
    pool = list(tmp.glob("sched-lab-pool.*"))
    assert len(pool) == (sig == "SIGKILL"), pool
    assert remove_stale(tmp, "sched-lab-pool.") == pool and not list(tmp.glob("sched-lab-pool.*"))


@pytest.fixture
def worker_sigterm(monkeypatch):
    """This process handles SIGTERM as a pool worker inside a task does."""
    ex = sched_lab.sweeps.executors
    monkeypatch.setattr(ex, "_busy", True)
    monkeypatch.setattr(ex, "_deferred", 0)
    monkeypatch.setattr(ex, "_pending", False)
    monkeypatch.setattr(ex, "_stopping", False)
    old = signal.signal(signal.SIGTERM, ex._on_sigterm)
    yield ex
    signal.signal(signal.SIGTERM, old)


def test_a_sigterm_held_back_lands_where_the_folder_is_used_and_its_removal_finishes(
    worker_sigterm,
):
    ex, done = worker_sigterm, []
    with pytest.raises(ex._Stop):
        with ex.stop_deferred():
            signal.raise_signal(signal.SIGTERM)  # while the folder is made: held back
            done.append("made")
            try:
                with ex.stop_allowed():  # it lands here, on entry
                    done.append("used")
            finally:
                signal.raise_signal(signal.SIGTERM)  # a second one during the removal: held
                done.append("removed")
    assert done == ["made", "removed"]
    assert (ex._deferred, ex._pending, ex._stopping) == (0, False, True)


def test_a_sigterm_inside_the_allowed_block_stops_the_task_at_once(worker_sigterm):
    ex, done = worker_sigterm, []
    with pytest.raises(ex._Stop):
        with ex.stop_deferred():
            try:
                with ex.stop_allowed():
                    signal.raise_signal(signal.SIGTERM)
                    done.append("after the signal")
            finally:
                done.append("removed")
    assert done == ["removed"]
    signal.raise_signal(signal.SIGTERM)  # once stopping, a further SIGTERM is dropped
    ex._stopping = False  # outside any block, a stop lands at once too
    with pytest.raises(ex._Stop):
        signal.raise_signal(signal.SIGTERM)
        done.append("after the signal")
    assert done == ["removed"]


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
    # --no-plots: the points' folders, not their figures, are what the pool must write here
    cmd = [sys.executable, str(ROOT / "run_experiment.py"), str(path), "--jobs", "2",
           "--no-progress", "--no-plots", "-q", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert len(list((out / "points").glob("p00*"))) == 8  # 2 seeds x 4 rate scales
    assert not list(tmp.iterdir())  # nothing left in $TMPDIR


# 4 points of 2 runs each, run serially by a stand-in pool that a signal stops after two.
SMALL = """\
trace: {format: synthetic, num_requests: 6, arrival: {process: poisson, rate: 4},
        prompt_len: 32, output_len: 4}
kv_cache: {num_gpu_blocks: 64}
policies: [fcfs, sjf]
sweep: {grid: {seed: [1, 2, 3, 4]}}
"""


def _stopped_after(n: int, signum: int):
    """A stand-in for executors.run_tasks: runs the first ``n`` tasks here, then the signal
    ``signum`` arrives (as lab/cli.py raises it)."""

    def run_tasks(fn, tasks, on_error, **kw):
        for t in tasks[:n]:
            yield fn(t)
        raise Interrupted(signum)

    return run_tasks


def test_a_stopped_sweep_writes_the_points_that_finished(tmp_path, monkeypatch, capsys):
    path = tmp_path / "sw.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    monkeypatch.setattr(sched_lab.sweeps.executors, "run_tasks", _stopped_after(2, signal.SIGTERM))
    code = run_experiment.main([str(path), "--out", str(out), "--no-progress", "-q", "--jobs", "2"])
    assert code == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: interrupted by SIGTERM after 2 of 4 points; wrote them to {out}/ as partial results"
    )
    table = pd.read_csv(out / "sweep.csv")
    # one row per point and policy; the two not run carry the reason
    assert table["point"].tolist() == [
        "p000",
        "p000",
        "p001",
        "p001",
        "p002",
        "p002",
        "p003",
        "p003",
    ]
    assert table["status"].tolist() == ["ok"] * 4 + ["interrupted"] * 4
    assert table["policy"].tolist() == ["fcfs", "sjf"] * 4
    assert table["error"].iloc[4:].tolist() == ["not run: the sweep was interrupted by SIGTERM"] * 4
    assert table["error"].iloc[:4].isna().all()
    assert sorted(p.name for p in (out / "points").iterdir() if p.is_dir()) == ["p000", "p001"]
    report = (out / "report.md").read_text()
    assert "**Partial results**: interrupted by SIGTERM after 2 of 4 points;" in report
    assert "**Not run** (the sweep was stopped): p002, p003" in report


def test_a_sweep_stopped_before_any_point_finished_writes_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "sw.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    monkeypatch.setattr(sched_lab.sweeps.executors, "run_tasks", _stopped_after(0, signal.SIGINT))
    code = run_experiment.main([str(path), "--out", str(out), "--no-progress", "-q", "--jobs", "2"])
    assert code == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: interrupted by SIGINT before any point finished; nothing written"
    )
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_seeded_sweep_stopped_in_a_replica_writes_the_points_that_finished(
    tmp_path, monkeypatch, capsys
):
    """``--seeds 2``, run here (``--jobs 1``): the signal arrives inside point p001's second
    replica (lab/run/experiment.py ``_run`` catches it there and raises it again once the
    run is handed on); p000, with both replicas of both policies, is kept."""
    path = tmp_path / "sw.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    replay = sched_lab.run.experiment._run_once
    calls = []

    def run_once(ex, run, trace, seed, own=False):
        calls.append(seed)
        if len(calls) == 6:  # 4 per point (2 policies x 2 replicas): p001's fcfs, seed 1
            raise Interrupted(signal.SIGTERM)
        return replay(ex, run, trace, seed, own)

    monkeypatch.setattr(sched_lab.run.experiment, "_run_once", run_once)
    argv = [str(path), "--out", str(out), "--no-progress", "-q", "--jobs", "1", "--seeds", "2"]
    assert run_experiment.main(argv) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: interrupted by SIGTERM after 1 of 4 points; wrote them to {out}/ as partial results"
    )
    assert calls == [0, 1] * 3
    table = pd.read_csv(out / "sweep.csv")
    assert table["status"].tolist() == ["ok"] * 2 + ["interrupted"] * 6
    assert table["seeds"].iloc[:2].tolist() == [2, 2]  # every replica of the kept point
    assert [p.name for p in (out / "points").iterdir() if p.is_dir()] == ["p000"]


def test_a_signal_while_a_sweep_writes_its_folder_writes_nothing(tmp_path, monkeypatch, capsys):
    """Every point finished, then SIGINT while the results folder is written: a sweep defers
    no signal (docs/guarantees.md), so nothing is written and no temporary folder is left."""
    path = tmp_path / "sw.yaml"
    path.write_text(SMALL.replace("[fcfs, sjf]", "[fcfs]").replace("[1, 2, 3, 4]", "[1, 2]"))
    out = tmp_path / "out"

    def write(tmp, *args):
        (tmp / "sweep.csv").write_text("half")
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(sched_lab.sweeps.report, "_write", write)
    argv = [str(path), "--out", str(out), "--no-progress", "-q", "--jobs", "1"]
    assert run_experiment.main(argv) == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: interrupted by SIGINT while writing the results of all 2 points; nothing written"
    )
    assert list(tmp_path.iterdir()) == [path]


class _Proc:
    """A worker process stand-in: ``join`` raises a KeyboardInterrupt on its ``interrupt``-th
    call (a second Ctrl-C while the pool ends), and the process has ended once joined after
    a terminate or a kill."""

    def __init__(self, interrupt: int = 0):
        self.calls, self.interrupt, self.exitcode, self.signals = 0, interrupt, None, []

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")

    def join(self, timeout=None):
        self.calls += 1
        if self.calls == self.interrupt:
            raise Interrupted(signal.SIGINT)
        if self.signals:
            self.exitcode = -15 if self.signals[0] == "TERM" else -9


class _Conn:
    closed = False

    def close(self):
        self.closed = True


def test_a_signal_while_the_pool_stops_is_raised_once_every_worker_has_ended():
    ex = sched_lab.sweeps.executors
    procs = [_Proc(interrupt=1), _Proc()]
    workers = [ex._Worker(p, _Conn()) for p in procs]
    with pytest.raises(Interrupted):
        ex._stop(workers, terminate=True)
    # the first join was interrupted and ran again; each worker got one SIGTERM and ended
    # within its grace (no SIGKILL), and every pipe is closed
    assert [p.calls for p in procs] == [2, 1]
    assert [p.signals for p in procs] == [["TERM"], ["TERM"]]
    assert [p.exitcode for p in procs] == [-15, -15]
    assert all(w.conn.closed for w in workers)


class _ClosedBySignal:
    """A stand-in for executors.run_tasks' generator: yields every task's result, and its
    ``close`` (the pool's workers ending) is interrupted by ``signum``."""

    def __init__(self, fn, tasks, signum):
        self.results, self.signum = iter([fn(t) for t in tasks]), signum

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.results)

    def close(self):
        raise Interrupted(self.signum)


def test_a_signal_while_the_workers_end_stops_the_sweep_with_its_points_kept(
    tmp_path, monkeypatch, capsys
):
    path = tmp_path / "sw.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    monkeypatch.setattr(
        sched_lab.sweeps.executors,
        "run_tasks",
        lambda fn, tasks, on_error, **kw: _ClosedBySignal(fn, tasks, signal.SIGTERM),
    )
    code = run_experiment.main([str(path), "--out", str(out), "--no-progress", "-q", "--jobs", "2"])
    assert code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: interrupted by SIGTERM after 4 of 4 points; wrote them to {out}/ as partial results"
    )
    assert pd.read_csv(out / "sweep.csv")["status"].tolist() == ["ok"] * 8
