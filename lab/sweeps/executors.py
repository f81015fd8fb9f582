"""Where a sweep's tasks run: serially, on a local process pool (``forkserver``, else
``spawn``; workers ignore SIGINT, unwind their task on SIGTERM and stop when the driver
dies), or on Ray (one ``num_cpus=1`` task each).

Results come back as they complete; the caller orders them. A task must not raise; a worker
that dies, or a task that raises anyway, gives ``on_error(task, message)``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from sched_lab.core.errors import UserError
from sched_lab.report.staging import make_marked

log = logging.getLogger("sched_lab.sweeps.executors")

Task = Any
Result = Any


def run_tasks(
    fn: Callable[[Task], Result],
    tasks: Sequence[Task],
    on_error: Callable[[Task, str], Result],
    *,
    jobs: int = 1,
    ray: bool = False,
    ray_address: str | None = None,
) -> Iterator[Result]:
    """``fn(task)`` for every task, yielded as each completes (not in order).

    Args:
        jobs: processes of the pool (1: serially, here), or CPUs of a local Ray.
        ray: run on a local Ray started for the run (and stopped after it).
        ray_address: run on the Ray cluster at this address (``auto``, ``ray://host:10001``).

    Raises:
        UserError: ray is not installed, or the cluster cannot be reached.
    """
    if not tasks:
        return
    if ray or ray_address is not None:
        yield from _ray(fn, tasks, on_error, jobs, ray_address)
    elif jobs <= 1 or len(tasks) == 1:
        for t in tasks:
            try:
                yield fn(t)
            except Exception as e:  # noqa: BLE001 - reported as the task's result
                yield on_error(t, _one_line(e))
    else:
        yield from _pool(fn, tasks, on_error, jobs)


def describe(jobs: int, ray: bool, ray_address: str | None) -> str:
    """The executor in words, for timing.json."""
    if ray_address is not None:
        return f"ray at {ray_address}"
    if ray:
        return f"local ray ({jobs} CPUs)"
    return "serial" if jobs <= 1 else f"process pool ({jobs} processes)"


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, UserError) else str(e)
    return " ".join(text.split())[:500]


STOP_GRACE_S = 10.0  # how long a stopped worker may take to unwind before it is killed
POOL_PREFIX = "sched-lab-pool."  # multiprocessing's temporary folder of a sweep's driver


class _Stop(BaseException):
    """Raised in a worker's task by SIGTERM: unwinds its ``with`` blocks (temporary
    folders), then the worker exits."""


_busy = False  # whether this worker process is inside a task
_deferred = 0  # stop_deferred() depth minus stop_allowed() depth: > 0 holds a SIGTERM back
_pending = False  # a SIGTERM arrived while held back
_stopping = False  # _Stop was raised: the task unwinds, and a later SIGTERM is dropped


def _stop_task() -> None:
    global _stopping, _pending
    _stopping, _pending = True, False
    raise _Stop


def _on_sigterm(signum, frame) -> None:
    global _pending
    if not _busy:
        os._exit(128 + signum)
    if _stopping:
        return
    if _deferred > 0:
        _pending = True
        return
    _stop_task()


class _Deferral:
    """Moves :data:`_deferred` by ``step`` within the block; where it returns to 0 with a
    SIGTERM pending, the task stops there."""

    def __init__(self, step: int):
        self.step = step

    def _settle(self) -> None:
        if _deferred <= 0 and _pending:
            _stop_task()

    def __enter__(self) -> None:
        global _deferred
        _deferred += self.step
        try:
            self._settle()
        except _Stop:  # no __exit__ follows a raising __enter__: undo the step here
            _deferred -= self.step
            raise

    def __exit__(self, *exc) -> None:
        global _deferred
        _deferred -= self.step
        self._settle()


def stop_deferred() -> _Deferral:
    """A block in a task that a stopped worker finishes before it unwinds: making a
    temporary folder and its ``finally`` that removes it. Put the folder's use in a
    :func:`stop_allowed` block inside the ``try``, so that a stop lands there and the
    ``finally`` runs. A no-op outside a pool worker.

    A signal lands between two bytecodes, so without this a SIGTERM could land after the
    folder is made and before the ``try``, or inside the ``finally``'s removal, and leave
    the folder behind. Once a task stops, a further SIGTERM (the driver's watcher sends one)
    is dropped, so it cannot break into the unwinding either."""
    return _Deferral(1)


def stop_allowed() -> _Deferral:
    """Inside :func:`stop_deferred`: a block where a SIGTERM stops the task at once (and one
    that arrived since the deferral began stops it on entry)."""
    return _Deferral(-1)


def _watch_parent() -> None:
    """Stop this worker when the driver is gone (even killed with SIGKILL): the parent's
    sentinel becomes ready when it exits."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    parent.join()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def _serve(conn, fn) -> None:
    """A worker: run each task received on ``conn`` and send back its result, until EOF
    or ``None``. SIGINT is the driver's to handle; SIGTERM ends the worker (a task first
    unwinds)."""
    global _busy
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watch_parent, daemon=True).start()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            try:
                _busy = True
                try:
                    result = ("ok", fn(task))
                except Exception as e:  # noqa: BLE001 - reported as the task's result
                    result = ("error", _one_line(e))
            finally:
                _busy = False
        except _Stop:
            os._exit(128 + signal.SIGTERM)
        try:
            conn.send(result)
        except (OSError, ValueError):
            return


@dataclass
class _Worker:
    proc: Any
    conn: Any
    task: Task | None = None


def _pool_tempdir() -> None:
    """Give this process's multiprocessing (the forkserver's socket) a marked temporary
    folder, ``sched-lab-pool.*`` (lab/report/staging.py), instead of its ``pymp-*``: a
    driver killed with SIGKILL leaves it behind either way, and a marked one is removed by
    the next sweep. Removed at exit as multiprocessing removes its own. Uses the
    ``tempdir`` entry of multiprocessing's process config (what ``util.get_temp_dir``
    reads); kept as it is once set."""
    config = multiprocessing.current_process()._config  # noqa: SLF001
    if config.get("tempdir") is not None:
        return
    parent = tempfile.gettempdir()
    # The forkserver binds a socket at FOLDER/listener-XXXXXXXX, and a socket's path holds at
    # most UNIX_PATH_MAX - 1 bytes: under a long $TMPDIR multiprocessing's shorter pymp-*
    # name is left to it (it is what Python does anyway).
    if len(os.fsencode(parent)) + len(POOL_PREFIX) + 8 + len("//listener-12345678") > 107:
        return
    try:
        folder = make_marked(Path(parent), POOL_PREFIX)
    except OSError:
        return  # multiprocessing makes its own
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(str(folder), True), exitpriority=-100)
    config["tempdir"] = str(folder)


def _context():
    if "forkserver" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def _start(ctx, fn) -> _Worker:
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(there, fn), daemon=True, name="sched-lab-worker")
    proc.start()
    there.close()
    return _Worker(proc, here)


def _pool(fn, tasks, on_error, jobs: int) -> Iterator[Result]:
    """Each worker process runs one task at a time, sent over its pipe. However this ends
    (done, a task's failure, a signal, the consumer stopping), every worker has exited
    when it returns or raises."""
    _pool_tempdir()
    ctx = _context()
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload([fn.__module__])
    todo = deque(tasks)
    workers: list[_Worker] = []
    stopped = True
    try:
        workers = [_start(ctx, fn) for _ in range(min(jobs, len(tasks)))]
        while todo or any(w.task is not None for w in workers):
            for i, w in enumerate(workers):
                if w.task is None and todo:
                    if not w.proc.is_alive():
                        w.conn.close()
                        workers[i] = w = _start(ctx, fn)
                    w.task = todo.popleft()
                    try:
                        w.conn.send(w.task)
                    except OSError:
                        pass  # it died: its sentinel says so below
            busy = [w for w in workers if w.task is not None]
            ready = set(wait([x for w in busy for x in (w.conn, w.proc.sentinel)]))
            for i, w in enumerate(workers):
                if w.task is None or not ready & {w.conn, w.proc.sentinel}:
                    continue
                task, w.task = w.task, None
                try:
                    kind, value = w.conn.recv()
                except (EOFError, OSError):
                    w.proc.join(STOP_GRACE_S)
                    w.conn.close()
                    workers[i] = _start(ctx, fn) if todo else w
                    yield on_error(task, f"its worker process ended (exit code {w.proc.exitcode})")
                    continue
                yield value if kind == "ok" else on_error(task, value)
        stopped = False
    finally:
        _stop(workers, terminate=stopped)


def _stop(workers: list[_Worker], terminate: bool) -> None:
    """End every worker: ask idle ones to exit (or SIGTERM all, with ``terminate``), wait
    up to :data:`STOP_GRACE_S`, then SIGKILL what is left. A signal meanwhile (a
    KeyboardInterrupt, e.g. a second Ctrl-C) is raised once every worker has ended, so none
    outlives the pool and each keeps its grace to remove its folder."""
    held: list[KeyboardInterrupt] = []
    for w in workers:
        _finish(lambda w=w: _ask(w, terminate), held)
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        _finish(lambda w=w: _end(w, deadline), held)
    if held:
        raise held[0]


def _ask(w: _Worker, terminate: bool) -> None:
    try:
        if terminate:
            w.proc.terminate()
        else:
            w.conn.send(None)
    except (OSError, ValueError):
        pass


def _end(w: _Worker, deadline: float) -> None:
    w.proc.join(max(0.0, deadline - time.monotonic()))
    if w.proc.exitcode is None:
        w.proc.kill()
        w.proc.join()
    w.conn.close()


def _finish(step: Callable[[], None], held: list[KeyboardInterrupt]) -> None:
    """Call ``step()`` until it returns (each step may run again); a KeyboardInterrupt on
    the way is appended to ``held``."""
    while True:
        try:
            step()
            return
        except KeyboardInterrupt as e:
            held.append(e)


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """UserError unless ``host:port`` (or ``ray://host:port``) accepts a TCP connection
    (``ray.init`` would retry for minutes); ``auto`` is left to Ray."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(
            f"--ray-address {address}: cannot connect ({e.strerror or e}); is a Ray head "
            "running there (ray start --head)?"
        ) from None


def _ray(fn, tasks, on_error, jobs: int, address: str | None) -> Iterator[Result]:
    try:
        import ray
    except ImportError:
        raise UserError(
            "--ray needs ray, which is not installed: pip install -e '.[ray]' in the lab's folder"
        ) from None
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address is None:  # a local Ray: its workers run this python and its sched_lab
            path = os.environ.get("PYTHONPATH", "")
            kwargs.update(
                address="local",  # a new instance, never one found running on this machine
                num_cpus=jobs,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
        else:
            _check_reachable(address)
            kwargs["address"] = address
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            flag = (
                "--ray: cannot start a local Ray"
                if address is None
                else (f"--ray-address {address}: cannot reach Ray")
            )
            raise UserError(f"{flag} ({' '.join(str(e).split())[:300]})") from None
    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    try:
        pending = {remote.remote(t): t for t in tasks}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                task = pending.pop(ref)
                try:
                    yield ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the task raised, or its worker died
                    yield on_error(task, _one_line(e))
    except BaseException:
        for ref in list(locals().get("pending", {})):
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()
