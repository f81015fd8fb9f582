"""Running a sweep: its tasks (a point, or with ``search:`` one policy's search at a point),
the function every executor calls, and the driver. A task's results come back as bytes, so
the folder is the same wherever it ran."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sched_lab.config import validate
from sched_lab.config.keypaths import set_path
from sched_lab.core.errors import UserError
from sched_lab.report.folder import ResultsNotPlaced, write_results
from sched_lab.report.staging import make_marked, remove_stale
from sched_lab.run.experiment import run_experiment
from sched_lab.setup import setup_class, setup_for
from sched_lab.sweeps import executors
from sched_lab.sweeps.sweep import Point, Sweep

log = logging.getLogger("sched_lab.sweeps.sweep")

SKIPPED_SUMMARY_KEYS = ("trace", "slo", "partial")  # not columns of the results table
POINT_PREFIX = "sched-lab-point."  # a point's results folder is written in one of these


@dataclass(frozen=True)
class Task:
    """What a worker needs: the point, where its paths resolve, and what to do."""

    index: int
    point: Point
    source: str
    base_dir: Path
    fmt: str = "csv"
    search: Any = None  # sched_lab.sweeps.search.SearchSpec: search this policy instead of running
    policy: int | None = None  # index in the point's policies, with ``search``
    start: float | None = None  # the search's start value
    date: str | None = None  # the vLLM-format files' date: the sweep's, the same in every point
    probe_lines: bool = False  # with ``search``: one line on stderr per load tried
    plots: bool = True  # False: the point's folder as ``sched-lab run --no-plots`` writes it


@dataclass
class TaskResult:
    """``rows``: results-table rows; ``files``: the point's folder (relative path -> bytes) or
    None; ``capacity``: a search's :class:`~sched_lab.sweeps.search.Capacity` as a dict; ``error``:
    why the task failed (no rows then); ``ran``: False for a task a stopped sweep did not
    finish (``error`` says so)."""

    index: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, bytes] | None = None
    capacity: dict[str, Any] | None = None
    error: str | None = None
    wall_s: float = 0.0
    ran: bool = True


class SweepStopped(KeyboardInterrupt):
    """A sweep stopped by a signal (``signum``) after some tasks had finished. ``message``
    says how far it got; ``out`` is the folder holding the finished ones, or None when
    writing them failed (``message`` says why)."""

    def __init__(self, signum: int, message: str, out: Path | None) -> None:
        super().__init__(signum)
        self.signum, self.message, self.out = signum, message, out


def make_tasks(
    sweep: Sweep,
    fmt: str = "csv",
    date: str | None = None,
    probe_lines: bool = False,
    plots: bool = True,
) -> list[Task]:
    """One task per point, or per (point, policy) with a capacity search (``probe_lines``:
    each prints a line per load it tries; ``plots``: False, points' folders without plots)."""
    tasks: list[Task] = []
    for p in sweep.points:
        if sweep.search is None:
            tasks.append(
                Task(len(tasks), p, sweep.source, sweep.base_dir, fmt, date=date, plots=plots)
            )
            continue
        cfg = sweep.configs[p.name]
        start = sweep.search.start(cfg, p)
        for j in range(len(cfg.policies)):
            tasks.append(
                Task(
                    len(tasks),
                    p,
                    sweep.source,
                    sweep.base_dir,
                    fmt,
                    sweep.search,
                    j,
                    start,
                    probe_lines=probe_lines,
                )  # fmt: skip
            )
    return tasks


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Per-phase log lines off while a task runs."""
    loggers = [logging.getLogger("sched_lab")]  # traces and backend included
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_task(task: Task) -> TaskResult:
    """Run one task (every executor calls this); never raises for a failing point."""
    t0 = time.perf_counter()
    with _quiet():
        try:
            out = _search(task) if task.search is not None else _point(task)
        except Exception as e:  # noqa: BLE001 - a failed point is a result, the rest go on
            text = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            out = TaskResult(task.index, error=" ".join(text.split())[:500])
    out.wall_s = time.perf_counter() - t0
    return out


def failed(task: Task, message: str) -> TaskResult:
    """The result of a task whose worker died or raised."""
    return TaskResult(task.index, error=message)


def _point(task: Task) -> TaskResult:
    cfg = validate(task.point.raw, task.source, task.base_dir)
    runs = run_experiment(cfg, progress=False)
    decode = setup_for(cfg).text_decoder()
    with executors.stop_deferred():  # a stopped worker removes its folder (executors.py)
        tmp = make_marked(Path(tempfile.gettempdir()), POINT_PREFIX)  # marked: see run_sweep
        try:
            with executors.stop_allowed():
                folder = write_results(
                    tmp / task.point.name, cfg, runs, decode, fmt=task.fmt, bars=False,
                    date=task.date, plots=task.plots,
                )  # fmt: skip
                files = {
                    str(p.relative_to(folder)): p.read_bytes()
                    for p in sorted(folder.rglob("*"))
                    if p.is_file()
                }
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = [row for run in runs for row in run_rows(run, cfg.slo.to_dict())]
    return TaskResult(task.index, rows, files)


def _search(task: Task) -> TaskResult:
    from sched_lab.sweeps.search import find_capacity

    spec = task.search
    raw = copy.deepcopy(dict(task.point.raw))
    base = validate(raw, task.source, task.base_dir)
    policy = base.policies[task.policy]
    raw["policies"] = [policy.to_dict()]
    rows: list[dict[str, Any]] = []

    def meets(x: float) -> bool:
        # A value the config refuses (say KV beyond the GPU's memory) is a miss: it bounds
        # the bracket, and the samples that met the target are kept.
        t0 = time.perf_counter()
        at = copy.deepcopy(raw)
        set_path(at, spec.over, x, task.source)
        try:
            cfg = validate(at, task.source, task.base_dir)
            run = run_experiment(cfg, progress=False)[0]
        except UserError as e:
            why = " ".join(str(e).removeprefix(f"{task.source}: ").split())[:500]
            rows.append({"sample": len(rows), spec.over: x, "met": False, "refused": why,
                         "policy": policy.label})  # fmt: skip
        else:
            row = run_rows(run, cfg.slo.to_dict())[0]
            ok = spec.meets(row.get(spec.metric)) and not run.result.failure
            rows.append({"sample": len(rows), spec.over: x, "met": ok, **row})
        if task.probe_lines:
            # one write per line, so that lines of workers running at once do not interleave
            sys.stderr.write(
                probe_line(task, policy.label, rows[-1], time.perf_counter() - t0) + "\n"
            )
            sys.stderr.flush()
        return rows[-1]["met"]

    cap = find_capacity(meets, spec, task.start, spec.integer)
    capacity = {
        "policy": policy.label,
        "status": cap.status,
        "metric": spec.metric,
        "target": spec.target,
        "over": spec.over,
        "capacity": cap.capacity,
        "capacity_request_rate": _at(rows, spec.over, cap.lo, "request_rate"),
        **bound_by(spec, _at(rows, spec.over, cap.hi)),
        "lo": cap.lo,
        "hi": cap.hi,
        "tolerance": spec.tolerance,
        "evaluations": len(cap.samples),
    }
    return TaskResult(task.index, rows, capacity=capacity)


def probe_line(task: Task, policy: str, row: Mapping[str, Any], wall_s: float) -> str:
    """A search's progress line for one load tried (its curve.csv ``row``), e.g.
    ``p001 fcfs: rate_scale 2.5 (13.75 req/s): slo_attainment 0.934, met (probe 3, 41.2 s)``."""
    from sched_lab.report.progress import seconds_text
    from sched_lab.results.names import format_value

    spec = task.search
    over = spec.over.removeprefix("trace.")
    rate = row.get("request_rate")
    load = f"{over} {format_value(row[spec.over], '.4g')}"
    if rate is not None and spec.over != "trace.arrival.rate":
        load += f" ({format_value(rate, '.4g')} req/s)"
    if row.get("refused"):
        result = f"refused ({row['refused'][:120]})"
    elif row.get("error"):
        result = "stopped early, missed"
    else:
        got = format_value(row.get(spec.metric), ".4g")
        result = f"{spec.metric} {got}, {'met' if row['met'] else 'missed'}"
    probe = f"probe {row['sample'] + 1}, {seconds_text(wall_s)}"
    return f"{task.point.name} {policy}: {load}: {result} ({probe})"


def _at(rows: list[dict[str, Any]], over: str, x: float | None, key: str | None = None):
    """The last sample row at load ``x`` (or its ``key``); None without one."""
    found = [r for r in rows if x is not None and r[over] == x]
    if not found:
        return None
    return found[-1] if key is None else found[-1].get(key)


def bound_by(spec, missed: Mapping[str, Any] | None) -> dict[str, Any]:
    """``bound_by`` and ``bound_value``: what missed the target at the first load past the
    capacity (``missed``, its sample row): for ``slo_attainment`` the SLO met by the fewest
    requests (``ttft``, ``tpot``, ``e2el``) and that fraction; else the metric and its value.
    A probe the config refused is bound by ``refused``, one whose run stopped early by
    ``stopped`` (curve.csv says why)."""
    if missed is None:
        return {"bound_by": None, "bound_value": math.nan}
    for end, key in (("refused", "refused"), ("stopped", "error")):
        if missed.get(key):
            return {"bound_by": end, "bound_value": math.nan}
    if spec.metric != "slo_attainment":
        return {"bound_by": spec.metric, "bound_value": missed.get(spec.metric, math.nan)}
    each = {name: missed.get(f"slo_attainment_{name}") for name in ("ttft", "tpot", "e2el")}
    known = {k: v for k, v in each.items() if v is not None and not math.isnan(v)}
    if not known:
        return {"bound_by": None, "bound_value": math.nan}
    name = min(known, key=known.get)
    return {"bound_by": name, "bound_value": known[name]}


# ---------------------------------------------------------------------------- rows
def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run's summary.json entry as flat columns: metrics keep their names
    (:mod:`sched_lab.results.names`), a section's keys get its name in front (``cost_model.kind``
    -> ``cost_model_kind``); lists become JSON text; ``trace`` and ``slo`` are left out."""
    out: dict[str, Any] = {}
    for k, v in summary.items():
        if not prefix and k in SKIPPED_SUMMARY_KEYS:
            continue
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{name}_"))
        elif isinstance(v, (list, tuple)):
            out[name] = json.dumps(v)
        else:
            out[name] = v
    return out


def run_rows(run, slo: Mapping[str, float | None]) -> list[dict[str, Any]]:
    """The table rows of one run: the whole run, then one per request class when there are
    several, each judged by its own SLOs (``slo`` overlaid with the class's)."""
    row = flatten(run.summary)
    row["error"] = run.result.failure
    rows = [row]
    df = run.requests
    if "class" in df.columns and df["class"].nunique() > 1:
        row["class"] = "all"
        classes = run.summary.get("classes", {})
        for name, g in df.groupby("class", sort=True):
            own = classes[name]["slo"] if name in classes else slo
            rows.append({"policy": run.policy, "rate_scale": run.rate_scale,
                         "class": name, **class_metrics(g, row["duration"], own)})  # fmt: skip
    return rows


def class_metrics(df, duration_s: float, slo: Mapping[str, float | None]) -> dict[str, Any]:
    """Counts, latency statistics, goodput and SLO attainment of one class's requests.csv
    rows, over the run's ``duration_s``, under the summary's names."""
    from sched_lab.results.metrics import latency_stats, meets_slo
    from sched_lab.results.names import LATENCIES

    fin = df[df["status"] == "finished"]
    replayed = (df["status"] != "dropped").to_numpy()
    good = meets_slo(df, dict(slo))
    out: dict[str, Any] = {"num_prompts": int(replayed.sum()), "completed": len(fin)}
    for name, (_, column) in LATENCIES.items():
        if column is not None:
            out.update(latency_stats(name, fin[column]))
    out["request_goodput"] = float(good.sum()) / duration_s if duration_s > 0 else math.nan
    out["slo_attainment"] = float(good[replayed].mean()) if replayed.any() else math.nan
    return out


# ---------------------------------------------------------------------------- driver
def run_sweep(
    sweep: Sweep,
    out: Path,
    *,
    jobs: int = 2,
    ray: bool = False,
    ray_address: str | None = None,
    fmt: str = "csv",
    progress: bool = True,
    plots: bool = True,
) -> tuple[Path, list[TaskResult]]:
    """Run every task and write the results folder ``out``; returns it and the results in
    task order. Tasks whose backend has no process pool (the engine's) run here, last.
    ``plots``: False writes each point's folder without plots (``sched-lab report`` draws
    them later); the sweep's own figures are drawn either way.

    Raises:
        UserError: ``out`` cannot be written (checked first), or ray is missing or unreachable.
        SweepStopped: a signal (KeyboardInterrupt) stopped the sweep after some tasks had
            finished; those are written as partial results (the others listed, not run).
        KeyboardInterrupt: a signal stopped it before any task had finished; nothing written.
    """
    from sched_lab.report.folder import check_out_dir
    from sched_lab.report.progress import Phase
    from sched_lab.results.vllm_result import result_date
    from sched_lab.sweeps.report import write_sweep

    out = check_out_dir(out)
    for prefix in (POINT_PREFIX, executors.POOL_PREFIX):  # left by a sweep killed (SIGKILL)
        remove_stale(Path(tempfile.gettempdir()), prefix)
    # A search's task runs for minutes: a line per load tried (INFO, as a phase's line), and
    # then no bar, which those lines (from the workers) would break.
    probe_lines = sweep.search is not None and log.isEnabledFor(logging.INFO)
    tasks = make_tasks(sweep, fmt, result_date(), probe_lines, plots)
    pooled = [setup_class(sweep.configs[t.point.name].backend).process_pool for t in tasks]
    pool = [t for t, p in zip(tasks, pooled) if p]
    here = [t for t, p in zip(tasks, pooled) if not p]
    unit, units = ("search", "searches") if sweep.search is not None else ("point", "points")
    results: dict[int, TaskResult] = {}
    stop: KeyboardInterrupt | None = None
    t0 = time.perf_counter()
    bars = progress and not probe_lines
    what = f"{len(tasks)} {unit if len(tasks) == 1 else units}"
    with Phase(f"sweep {sweep.name}: {what}", len(tasks), unit, bars) as phase:
        done = executors.run_tasks(
            run_task, pool, failed, jobs=jobs, ray=ray, ray_address=ray_address
        )
        try:
            try:
                for r in _chain(done, (run_task(t) for t in here)):
                    results[r.index] = r
                    phase.advance()
                    if r.error:
                        log.warning("%s failed: %s", tasks[r.index].point.name, r.error)
            finally:
                # However the loop ended, the pool's workers end here; a signal meanwhile is
                # raised once they have (executors._stop), and is this sweep's stop.
                done.close()
        except KeyboardInterrupt as e:  # SIGINT, or SIGTERM / SIGHUP raised as one (lab/cli.py)
            phase.close(ok=False)  # no "done" line for a stopped sweep
            if not results:
                raise
            stop = e
    why = f"not run: the sweep was interrupted by {_signame(stop)}" if stop else ""
    ordered = [results.get(t.index) or TaskResult(t.index, error=why, ran=False) for t in tasks]
    timing = {
        "executor": executors.describe(jobs, ray, ray_address),
        "wall_s": time.perf_counter() - t0,
        "tasks": {
            f"{t.point.name}" + ("" if t.policy is None else f"/{t.policy}"): r.wall_s
            for t, r in zip(tasks, ordered)
        },
    }
    partial = None
    if stop is not None:
        partial = f"interrupted by {_signame(stop)} after {len(results)} of {len(tasks)} {units}"
    try:
        write_sweep(out, sweep, tasks, ordered, timing, partial=partial)
    except KeyboardInterrupt as e:
        if stop is None:
            raise SweepStopped(_signum(e), f"interrupted by {_signame(e)} while writing the "
                               f"results of all {len(tasks)} {units}; nothing written",
                               None) from None  # fmt: skip
        raise SweepStopped(_signum(stop), f"{partial}, and again while writing them; nothing "
                           "written", None) from None  # fmt: skip
    except (UserError, ResultsNotPlaced) as e:
        if stop is None:
            raise
        raise SweepStopped(_signum(stop), f"{partial}; {e}", None) from None
    if stop is not None:
        raise SweepStopped(
            _signum(stop), f"{partial}; wrote them to {out}/ as partial results", out
        )
    return out, ordered


def _signum(e: KeyboardInterrupt) -> int:
    """The signal behind ``e``: its ``signum`` (lab/cli.py raises SIGTERM / SIGHUP as a
    KeyboardInterrupt with one), else SIGINT."""
    return getattr(e, "signum", signal.SIGINT)


def _signame(e: KeyboardInterrupt) -> str:
    return signal.Signals(_signum(e)).name


def _chain(*its):
    for it in its:
        yield from it
