"""Where a sweep's tasks run: serially, on a local process pool (``forkserver``, else
``spawn``; workers ignore SIGINT), or on Ray (one ``num_cpus=1`` task each).

Results come back as they complete; the caller orders them. A task must not raise; a worker
that dies, or a task that raises anyway, gives ``on_error(task, message)``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from lab.config.paths import DATA_ROOT
from lab.core.errors import UserError

log = logging.getLogger("lab.sweeps.executors")

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


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pool(fn, tasks, on_error, jobs: int) -> Iterator[Result]:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([fn.__module__])
    else:
        ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx, initializer=_ignore_sigint)
    try:
        pending = {pool.submit(fn, t): t for t in tasks}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                task = pending.pop(fut)
                try:
                    yield fut.result()
                except Exception as e:  # noqa: BLE001 - a worker died, or fn raised
                    yield on_error(task, _one_line(e))
    except BaseException:
        # Interrupted (or the consumer stopped): no waiting for the running tasks.
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        raise
    pool.shutdown(wait=True)


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
            "--ray needs ray, which is not installed: pip install 'sched-lab[ray]'"
        ) from None
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address is None:  # a local Ray: its workers import this checkout's lab
            path = os.pathsep.join(p for p in (str(DATA_ROOT), os.environ.get("PYTHONPATH")) if p)
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
