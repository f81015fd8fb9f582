"""A sweep's results folder (docs/sweeps.md): sweep.csv/.parquet,
capacity and curve tables with a search, ``points/``, plots, report.md, sweep.yaml and
timing.json. All but timing.json depend on the inputs alone."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from lab import __version__
from lab.core.errors import UserError
from lab.report.folder import MANIFEST, check_out_dir, put_in_place, temp_folder

LEAD = ("point", "status", "error")


def write_sweep(
    out: Path, sweep, tasks: Sequence, results: Sequence, timing: Mapping[str, Any]
) -> Path:
    """Write the sweep's folder at ``out`` atomically; returns it.

    Raises:
        UserError: ``out`` cannot be written or replaced.
        lab.report.folder.ResultsNotPlaced: the final rename failed (the message says where).
    """
    out = check_out_dir(out)
    tmp = temp_folder(out)
    try:
        _write(tmp, sweep, tasks, results, timing)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--out {out}: cannot write the results ({e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    put_in_place(tmp, out)
    return out


def _write(tmp: Path, sweep, tasks, results, timing) -> None:
    folders = []
    points = tmp / "points"
    for t, r in zip(tasks, results):
        if r.files:
            for rel, data in r.files.items():
                (points / t.point.name / rel).parent.mkdir(parents=True, exist_ok=True)
                (points / t.point.name / rel).write_bytes(data)
    if points.exists():
        names = sorted(p.name for p in points.iterdir())
        _manifest(points, [], names)
        folders.append("points")
    (tmp / "sweep.yaml").write_text(yaml.safe_dump(_plain(sweep.raw), sort_keys=False))
    table = sweep_table(sweep, tasks, results)
    capacity = capacity_table(sweep, tasks, results) if sweep.search is not None else None
    name = "curve" if sweep.search is not None else "sweep"
    _table(tmp, name, table)
    if capacity is not None:
        _table(tmp, "capacity", capacity)
    plots = _plots(tmp, sweep, table, capacity)
    (tmp / "report.md").write_text(_markdown(sweep, table, capacity, plots))
    (tmp / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    _manifest(tmp, files, folders)


def _manifest(folder: Path, files: list[str], folders: list[str]) -> None:
    body = {"written_by": f"sched-lab {__version__}", "files": files, "folders": folders}
    (folder / MANIFEST).write_text(json.dumps(body, indent=2) + "\n")


def _table(folder: Path, name: str, df: pd.DataFrame) -> None:
    df.to_csv(folder / f"{name}.csv", index=False)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return
    df.to_parquet(folder / f"{name}.parquet", index=False)


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# ---------------------------------------------------------------------------- tables
def _value(v: Any) -> Any:
    """A swept value as a table cell: scalars as they are, anything else as JSON text."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v, sort_keys=True)


def _frame(rows: list[dict[str, Any]], lead: Sequence[str]) -> pd.DataFrame:
    columns = list(dict.fromkeys([*lead, *(k for r in rows for k in r)]))
    df = pd.DataFrame(rows, columns=columns)
    for c in df.columns:  # a column of mixed kinds (numbers and text) becomes text
        kinds = {type(v).__name__ for v in df[c] if v is not None and not _isnan(v)}
        if len(kinds - {"int", "float"}) and len(kinds) > 1:
            df[c] = [None if v is None or _isnan(v) else str(v) for v in df[c]]
    return df


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def sweep_table(sweep, tasks, results) -> pd.DataFrame:
    """One row per point x run x class; a failed point has one row per policy with its error."""
    rows = []
    for t, r in zip(tasks, results):
        values = {k: _value(t.point.values.get(k)) for k in sweep.keys}
        cfg = sweep.configs[t.point.name]
        if r.error:
            labels = [cfg.policies[t.policy].label] if t.policy is not None else None
            for label in labels or [p.label for p in cfg.policies]:
                rows.append({"point": t.point.name, "status": "failed", "error": r.error,
                             **values, "policy": label})  # fmt: skip
            continue
        for row in r.rows:
            # refused: a search's sample the config refused (its reason in ``refused``)
            status = "refused" if row.get("refused") else "stopped" if row.get("error") else "ok"
            rows.append({"point": t.point.name, "status": status, **values, **row})
    lead = [*LEAD, *sweep.keys, "policy", "rate_scale"]
    if sweep.search is not None:
        refused = ["refused"] if any("refused" in row for row in rows) else []
        lead[len(LEAD) + len(sweep.keys) : len(LEAD) + len(sweep.keys)] = [
            "sample",
            "met",
            *refused,
        ]
        lead.insert(len(LEAD) + len(sweep.keys) + 2, sweep.search.over)
    return _frame(rows, list(dict.fromkeys(lead)))


def capacity_table(sweep, tasks, results) -> pd.DataFrame:
    """One row per point x policy: the capacity search's outcome (lab/sweeps/search.py)."""
    rows = []
    spec = sweep.search
    for t, r in zip(tasks, results):
        values = {k: _value(t.point.values.get(k)) for k in sweep.keys}
        cfg = sweep.configs[t.point.name]
        if r.error:
            cap = {"policy": cfg.policies[t.policy].label, "status": "failed",
                   **{k: v for k, v in spec.to_dict().items() if k in ("metric", "target", "over")},
                   "capacity": math.nan, "tolerance": spec.tolerance}  # fmt: skip
            rows.append({"point": t.point.name, "error": r.error, **values, **cap})
        else:
            rows.append({"point": t.point.name, "error": None, **values, **r.capacity})
    lead = ["point", "status", "error", *sweep.keys, "policy", "metric", "target", "over",
            "capacity", "capacity_request_rate", "bound_by", "bound_value", "lo", "hi",
            "tolerance", "evaluations"]  # fmt: skip
    return _frame(rows, lead)


# ---------------------------------------------------------------------------- plots
def _groups(sweep, df: pd.DataFrame, x: str) -> list[tuple[str, pd.DataFrame]]:
    """Lines to draw: per policy, and per value of every other swept key."""
    load = {x, "trace.rate_scale"} if x in ("rate_scale", "trace.rate_scale") else {x}
    others = [
        k
        for k in sweep.keys
        if k not in load and k in df.columns and df[k].nunique(dropna=False) > 1
    ]
    keys = ["policy", *others]
    out = []
    for vals, g in df.groupby(keys, sort=False, dropna=False):
        vals = vals if isinstance(vals, tuple) else (vals,)
        shown = ["null" if v is None or _isnan(v) else _fmt(v) for v in vals[1:]]
        label = ", ".join([str(vals[0]), *(f"{k}={v}" for k, v in zip(others, shown))])
        out.append((label, g.sort_values(x)))
    return out


def _whole_runs(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"]
    if "class" in ok.columns:
        ok = ok[ok["class"].isna() | (ok["class"] == "all")]
    return ok


def _plots(folder: Path, sweep, table: pd.DataFrame, capacity) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab.report.folder import save_png as _save

    plots: list[tuple[str, str]] = []
    if sweep.search is not None:
        return _capacity_plot(folder, sweep, table, capacity, plt, _save)
    df = _whole_runs(table)
    if df.empty:
        return plots
    if df["rate_scale"].nunique() > 1:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
        for ax, (key, title) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"),
                                           ("e2el", "E2E"))):  # fmt: skip
            for label, g in _groups(sweep, df, "rate_scale"):
                ax.plot(g["rate_scale"], g[f"p99_{key}_ms"], "-o", ms=3, label=label)
            ax.set_yscale("log")
            ax.set_xlabel("rate_scale (offered load)")
            ax.set_ylabel(f"{title} p99 (ms)")
            ax.set_title(f"{title} p99 vs load")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        plots.append(_save(fig, folder, "latency_vs_load.png", "Latency p99 vs load per policy"))
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        for label, g in _groups(sweep, df, "rate_scale"):
            axes[0].plot(g["rate_scale"], g["request_goodput"], "-o", ms=3, label=label)
            axes[1].plot(g["rate_scale"], g["slo_attainment"], "-o", ms=3, label=label)
        for ax, ylabel in zip(axes, ("goodput (req/s meeting every SLO)", "SLO attainment")):
            ax.set_xlabel("rate_scale (offered load)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].set_title("Goodput vs load")
        axes[1].set_title("SLO attainment vs load")
        axes[0].legend(fontsize=7)
        plots.append(
            _save(fig, folder, "goodput_vs_load.png", "Goodput and SLO attainment vs load")
        )
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for policy, g in df.groupby("policy", sort=False):
        ax.scatter(g["p99_ttft_ms"], g["request_goodput"], s=18, label=policy)
    front = pareto_front(df["p99_ttft_ms"].to_numpy(float), df["request_goodput"].to_numpy(float))
    f = df.iloc[front].sort_values("p99_ttft_ms")
    ax.plot(f["p99_ttft_ms"], f["request_goodput"], "k--", lw=1, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p99 (ms)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title("Goodput vs TTFT p99 (every point and policy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plots.append(_save(fig, folder, "pareto.png", "Pareto: goodput vs TTFT p99"))
    return plots


def pareto_front(latency: np.ndarray, goodput: np.ndarray) -> list[int]:
    """Indices of the rows no other row dominates (lower latency, higher goodput); NaN rows
    are left out."""
    ok = np.isfinite(latency) & np.isfinite(goodput)
    idx = [i for i in range(len(latency)) if ok[i]]
    front = []
    for i in idx:
        dominated = any(
            latency[j] <= latency[i]
            and goodput[j] >= goodput[i]
            and (latency[j] < latency[i] or goodput[j] > goodput[i])
            for j in idx
        )
        if not dominated:
            front.append(i)
    return front


def _capacity_plot(folder, sweep, curve, capacity, plt, save) -> list[tuple[str, str]]:
    spec = sweep.search
    df = curve[curve["status"].isin(("ok", "stopped"))]
    if df.empty or spec.metric not in df.columns:
        return []
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, g in _groups(sweep, df, spec.over):
        g = g.sort_values(spec.over)
        (line,) = ax.plot(g[spec.over], g[spec.metric], "-o", ms=3, label=label)
    ax.axhline(spec.target, color="k", lw=1, ls=":", label=f"target {spec.target:g}")
    found = capacity[capacity["status"] == "found"]
    ax.scatter(found["capacity"], [spec.target] * len(found), marker="|", s=200, color="k")
    ax.set_xscale("log")
    if not spec.higher_is_better:
        ax.set_yscale("log")
    ax.set_xlabel(spec.over)
    ax.set_ylabel(spec.metric)
    ax.set_title(f"Capacity search: {spec.metric} vs {spec.over} (samples)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return [save(fig, folder, "capacity.png", "Sampled curves of the capacity search")]


# ---------------------------------------------------------------------------- markdown
def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or _isnan(v):
        return "-"
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15 and spec == ".3g":
        return str(int(v))
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def uniform_slo(sweep) -> dict[str, float]:
    """The SLOs given (keys ttft_s, tpot_s, e2e_s) when every point has the same; else {}."""
    slos = {tuple(c.slo.to_dict().items()) for c in sweep.configs.values()}
    if len(slos) != 1:
        return {}
    return {k: v for k, v in next(iter(slos)) if v is not None}


def bound_text(row, spec, slo: dict | None = None) -> str:
    """What bound a capacity, for people: ``tpot (met by 62%)``, ``tpot <= 50 ms (met by
    62%)`` with the SLOs ``slo`` (keys ttft_s, tpot_s, e2e_s), ``p99_ttft_ms (2350)``; ``-``
    when nothing missed."""
    what, value = row.get("bound_by"), row.get("bound_value")
    if not isinstance(what, str) or not what:
        return "-"
    if spec.metric != "slo_attainment":
        return f"{what} ({_fmt(value, '.4g')})"
    limit = (slo or {}).get({"e2el": "e2e_s"}.get(what, f"{what}_s"))
    if limit is not None:
        what += f" <= {limit * 1e3:g} ms" if what == "tpot" else f" <= {limit:g} s"
    return f"{what} (met by {_fmt(value, '.0%')})"


def _markdown(sweep, table: pd.DataFrame, capacity, plots) -> str:
    n = len(sweep.points)
    lines = [f"# {sweep.name}", ""]
    keys = ", ".join(f"`{k}`" for k in sweep.keys) or "nothing (one point)"
    lines += [f"Sweep of {n} point{'s' if n != 1 else ''} over {keys}.", ""]
    if capacity is not None:
        s = sweep.search
        cmp = ">=" if s.higher_is_better else "<="
        lines += [
            f"Capacity: the largest `{s.over}` with `{s.metric}` {cmp} {s.target:g}, "
            f"bracketed to a relative width of {s.tolerance:g} (capacity = the bracket's "
            "lower end; `lab/sweeps/search.py`).",
            "",
            "| point | "
            + "".join(f"{k} | " for k in sweep.keys)
            + "policy | capacity | capacity (req/s) | bound by | bracket | evaluations | status |",
            "|" + "---|" * (8 + len(sweep.keys)),
        ]
        for _, r in capacity.iterrows():
            vals = "".join(f"{_fmt(r[k])} | " for k in sweep.keys)
            lines.append(
                f"| {r['point']} | {vals}{r['policy']} | {_fmt(r['capacity'], '.4g')} | "
                f"{_fmt(r['capacity_request_rate'], '.4g')} | {bound_text(r, sweep.search, uniform_slo(sweep))} | "
                f"[{_fmt(r['lo'], '.4g')}, {_fmt(r['hi'], '.4g')}) | "
                f"{_fmt(r['evaluations'])} | {r['status']} |"
            )
        lines.append("")
        failed = capacity[capacity["status"] == "failed"]
    else:
        whole = table if "class" not in table.columns else table[table["class"].isna()
                                                                  | (table["class"] == "all")]  # fmt: skip
        lines += [
            "| point | "
            + "".join(f"{k} | " for k in sweep.keys)
            + "run | status | TTFT p99 (s) | TPOT p99 (ms) | goodput (req/s) | SLO attainment |",
            "|" + "---|" * (7 + len(sweep.keys)),
        ]
        for _, r in whole.iterrows():
            vals = "".join(f"{_fmt(r[k])} | " for k in sweep.keys)
            run = (
                r["policy"]
                if pd.isna(r.get("rate_scale"))
                else f"{r['policy']}@x{r['rate_scale']:g}"
            )
            ttft = r.get("p99_ttft_ms")
            lines.append(
                f"| {r['point']} | {vals}{run} | {r['status']} | "
                f"{_fmt(None if ttft is None or pd.isna(ttft) else ttft / 1e3)} | "
                f"{_fmt(r.get('p99_tpot_ms'))} | "
                f"{_fmt(r.get('request_goodput'))} | {_fmt(r.get('slo_attainment'), '.1%')} |"
            )
        lines.append("")
        failed = whole[whole["status"] != "ok"]
    for _, r in failed.drop_duplicates("point").iterrows():
        lines += [f"**Point {r['point']} {r['status']}**: {r['error']}", ""]
    for name, caption in plots:
        lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
    tables = (
        "`sweep.csv` / `.parquet` (one row per point x run x class), `points/<point>/` "
        "(each point's results folder)"
        if capacity is None
        else "`capacity.csv` / `.parquet` (one row per point x policy), `curve.csv` / "
        "`.parquet` (every load the search tried)"
    )
    lines += [
        f"Files: {tables}, `sweep.yaml` (the sweep as given), `timing.json` (executor and "
        "wall times).",
        "",
    ]
    return "\n".join(lines)
