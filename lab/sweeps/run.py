"""Running a sweep: its tasks (a point, or with ``search:`` one policy's search at a point),
the function every executor calls, and the driver. A task's results come back as bytes, so
the folder is the same wherever it ran."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.config import validate
from lab.config.keypaths import get_path, set_path
from lab.core.errors import UserError
from lab.report.folder import write_results
from lab.run.experiment import run_experiment
from lab.setup import setup_class, setup_for
from lab.sweeps.sweep import Point, Sweep

log = logging.getLogger("lab.sweeps.sweep")

SKIPPED_SUMMARY_KEYS = ("trace", "slo", "partial")  # not columns of the results table


@dataclass(frozen=True)
class Task:
    """What a worker needs: the point, where its paths resolve, and what to do."""

    index: int
    point: Point
    source: str
    base_dir: Path
    fmt: str = "csv"
    search: Any = None  # lab.sweeps.search.SearchSpec: search this policy instead of running
    policy: int | None = None  # index in the point's policies, with ``search``
    start: float | None = None  # the search's start value


@dataclass
class TaskResult:
    """``rows``: results-table rows; ``files``: the point's folder (relative path -> bytes) or
    None; ``capacity``: a search's :class:`~lab.sweeps.search.Capacity` as a dict; ``error``:
    why the task failed (no rows then)."""

    index: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, bytes] | None = None
    capacity: dict[str, Any] | None = None
    error: str | None = None
    wall_s: float = 0.0


def make_tasks(sweep: Sweep, fmt: str = "csv") -> list[Task]:
    """One task per point, or per (point, policy) with a capacity search."""
    tasks: list[Task] = []
    for p in sweep.points:
        if sweep.search is None:
            tasks.append(Task(len(tasks), p, sweep.source, sweep.base_dir, fmt))
            continue
        cfg = sweep.configs[p.name]
        start = sweep.search.start(cfg, p)
        for j in range(len(cfg.policies)):
            tasks.append(
                Task(len(tasks), p, sweep.source, sweep.base_dir, fmt, sweep.search, j, start)
            )
    return tasks


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Per-phase log lines off while a task runs."""
    loggers = [logging.getLogger(n) for n in ("lab", "traces")]
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
    with tempfile.TemporaryDirectory(prefix="sched-lab-point.") as tmp:
        folder = write_results(
            Path(tmp) / task.point.name, cfg, runs, decode, fmt=task.fmt, bars=False
        )
        files = {
            str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
    rows = [row for run in runs for row in run_rows(run, cfg.slo.to_dict())]
    return TaskResult(task.index, rows, files)


def _search(task: Task) -> TaskResult:
    from lab.sweeps.search import find_capacity

    spec = task.search
    raw = copy.deepcopy(dict(task.point.raw))
    base = validate(raw, task.source, task.base_dir)
    policy = base.policies[task.policy]
    raw["policies"] = [policy.to_dict()]
    rows: list[dict[str, Any]] = []

    def meets(x: float) -> bool:
        at = copy.deepcopy(raw)
        set_path(at, spec.over, x, task.source)
        cfg = validate(at, task.source, task.base_dir)
        run = run_experiment(cfg, progress=False)[0]
        row = run_rows(run, cfg.slo.to_dict())[0]
        ok = spec.meets(row.get(spec.metric)) and not run.result.failure
        rows.append({"sample": len(rows), spec.over: x, "met": ok, **row})
        return ok

    # A whole-number key (e.g. scheduler.max_num_seqs) is searched in whole numbers: its
    # value in the YAML, else in the resolved config (its default), says which it is.
    now = get_path(raw, spec.over)
    if now is None:
        now = get_path(base.to_dict(), spec.over)
    integer = isinstance(now, int) and not isinstance(now, bool)
    cap = find_capacity(meets, spec, task.start, integer)
    capacity = {
        "policy": policy.label,
        "status": cap.status,
        "metric": spec.metric,
        "target": spec.target,
        "over": spec.over,
        "capacity": cap.capacity,
        "lo": cap.lo,
        "hi": cap.hi,
        "tolerance": spec.tolerance,
        "evaluations": len(cap.samples),
    }
    return TaskResult(task.index, rows, capacity=capacity)


# ---------------------------------------------------------------------------- rows
def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run's summary.json entry as flat columns: ``ttft_s.p99`` -> ``ttft_s_p99``;
    lists become JSON text; ``trace`` and ``slo`` are left out."""
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
    row["request_rate"] = (run.vllm or {}).get("request_rate")  # offered req/s
    row["error"] = run.result.failure
    rows = [row]
    df = run.requests
    if "class" in df.columns and df["class"].nunique() > 1:
        row["class"] = "all"
        classes = run.summary.get("classes", {})
        for name, g in df.groupby("class", sort=True):
            own = classes[name]["slo"] if name in classes else slo
            rows.append({"policy": run.policy, "rate_scale": run.rate_scale,
                         "class": name, **class_metrics(g, row["duration_s"], own)})  # fmt: skip
    return rows


def class_metrics(df, duration_s: float, slo: Mapping[str, float | None]) -> dict[str, Any]:
    """Counts, latency statistics, goodput and SLO attainment of one class's requests.csv
    rows, over the run's ``duration_s``."""
    from lab.results.metrics import meets_slo, stats

    fin = df[df["status"] == "finished"]
    replayed = (df["status"] != "dropped").to_numpy()
    good = meets_slo(df, dict(slo))
    out: dict[str, Any] = {"num_requests": int(replayed.sum()), "finished": len(fin)}
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        out.update({f"{key}_{s}": v for s, v in stats(fin[key]).items()})
    out["goodput"] = float(good.sum()) / duration_s if duration_s > 0 else math.nan
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
) -> tuple[Path, list[TaskResult]]:
    """Run every task and write the results folder ``out``; returns it and the results in
    task order. Tasks whose backend has no process pool (the engine's) run here, last.

    Raises:
        UserError: ``out`` cannot be written (checked first), or ray is missing or unreachable.
    """
    from lab.report.folder import check_out_dir
    from lab.report.progress import Phase
    from lab.sweeps import executors
    from lab.sweeps.report import write_sweep

    out = check_out_dir(out)
    tasks = make_tasks(sweep, fmt)
    pooled = [setup_class(sweep.configs[t.point.name].backend).process_pool for t in tasks]
    pool = [t for t, p in zip(tasks, pooled) if p]
    here = [t for t, p in zip(tasks, pooled) if not p]
    unit, units = ("search", "searches") if sweep.search is not None else ("point", "points")
    results: dict[int, TaskResult] = {}
    t0 = time.perf_counter()
    with Phase(f"sweep {sweep.name}: {len(tasks)} {units}", len(tasks), unit, progress) as phase:
        done = executors.run_tasks(
            run_task, pool, failed, jobs=jobs, ray=ray, ray_address=ray_address
        )
        for r in _chain(done, (run_task(t) for t in here)):
            results[r.index] = r
            phase.advance()
            if r.error:
                log.warning("%s failed: %s", tasks[r.index].point.name, r.error)
    ordered = [results[t.index] for t in tasks]
    timing = {
        "executor": executors.describe(jobs, ray, ray_address),
        "wall_s": time.perf_counter() - t0,
        "tasks": {
            f"{t.point.name}" + ("" if t.policy is None else f"/{t.policy}"): r.wall_s
            for t, r in zip(tasks, ordered)
        },
    }
    write_sweep(out, sweep, tasks, ordered, timing)
    return out, ordered


def _chain(*its):
    for it in its:
        yield from it
