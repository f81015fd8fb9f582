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

from sched_lab import __version__
from sched_lab.core.errors import UserError
from sched_lab.report.folder import MANIFEST, check_out_dir, put_in_place, temp_folder
from sched_lab.report.staging import MARKER
from sched_lab.report.terminal import no_host_warning, stale_warning, warnings_markdown
from sched_lab.results.names import MISSING, canonical, format_value, latency_name

LEAD = ("point", "status", "error")
CAPACITY_AT = ("capacity", "lo", "hi")  # columns of capacity.csv holding values of ``over``
# a capacity search's status (capacity.csv) in words (terminal, report.md)
STATUS_WORDS = {"below_range": "below range", "above_range": "above range"}


def write_sweep(
    out: Path,
    sweep,
    tasks: Sequence,
    results: Sequence,
    timing: Mapping[str, Any],
    partial: str | None = None,
) -> Path:
    """Write the sweep's folder at ``out`` atomically; returns it. ``partial``: why the sweep
    is incomplete (a stopped sweep), said first in report.md; its tasks that did not run
    (``ran`` False) have status ``interrupted`` in the tables.

    Raises:
        UserError: ``out`` cannot be written or replaced.
        sched_lab.report.folder.ResultsNotPlaced: the final rename failed (the message says where).
    """
    out = check_out_dir(out)
    tmp = temp_folder(out)
    try:
        _write(tmp, sweep, tasks, results, timing, partial)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--out {out}: cannot write the results ({e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    put_in_place(tmp, out)
    return out


def _write(tmp: Path, sweep, tasks, results, timing, partial: str | None) -> None:
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
    whole = [sweep.search.over] if sweep.search is not None and sweep.search.integer else []
    # a key whose grid is integers and nulls (kv_cache.num_gpu_blocks: [2048, null]) stays
    # 2048, not the 2048.0 of a float column with empty cells
    int_keys = [k for k in sweep.keys if all(_int_or_none(t.point.values.get(k)) for t in tasks)]
    parquet = _table(tmp, name, whole_numbers(table, whole + int_keys))
    if capacity is not None:
        at = [c for c in CAPACITY_AT if whole]
        _table(tmp, "capacity", whole_numbers(capacity, at + int_keys))
    plots = _plots(tmp, sweep, table, capacity)
    (tmp / "report.md").write_text(_markdown(sweep, table, capacity, plots, partial, parquet))
    (tmp / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    files = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != MARKER)
    _manifest(tmp, files, folders)


def _manifest(folder: Path, files: list[str], folders: list[str]) -> None:
    body = {"written_by": f"sched-lab {__version__}", "files": files, "folders": folders}
    (folder / MANIFEST).write_text(json.dumps(body, indent=2) + "\n")


def _table(folder: Path, name: str, df: pd.DataFrame) -> bool:
    """``name``.csv and, with pyarrow, ``name``.parquet; a column holding an integer beyond
    int64 (which parquet cannot hold) is written as text in both. Returns whether the
    parquet file was written."""
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object and any(_big_int(v) for v in df[c]):
            df[c] = [None if v is None or _isnan(v) else str(v) for v in df[c]]
    df.to_csv(folder / f"{name}.csv", index=False)
    if not has_pyarrow():
        return False
    df.to_parquet(folder / f"{name}.parquet", index=False)
    return True


def has_pyarrow() -> bool:
    """Whether pyarrow imports (the tables are then also written as parquet)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _int_or_none(v: Any) -> bool:
    """None, or an int (not a bool) that a float64 column holds exactly (|v| <= 2^53; the
    column is float when a cell is empty, and a larger int would come back rounded)."""
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= 2**53)


def whole_numbers(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """``df`` with ``columns`` as nullable integers (``131072``, not ``131072.0``, in a CSV
    whose column also has empty cells), each when all its values are whole and fit int64."""
    out = df.copy()
    for c in columns:
        if c in out.columns:
            values = pd.to_numeric(out[c], errors="coerce")
            if values.notna().any() and (values.dropna() % 1 == 0).all():
                try:
                    out[c] = values.astype("Int64")
                except (TypeError, ValueError, OverflowError):  # beyond int64: left alone
                    pass
    return out


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# ---------------------------------------------------------------------------- tables
_INT64 = range(-(1 << 63), 1 << 63)  # integers a parquet column holds


def _big_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v not in _INT64


def _value(v: Any) -> Any:
    """A swept value as a table cell: scalars as they are (an integer beyond int64 as its
    digits, so the column becomes text), anything else as JSON text."""
    if _big_int(v):
        return str(v)
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
                rows.append({"point": t.point.name, "status": _failed(r), "error": r.error,
                             **values, "policy": label})  # fmt: skip
            continue
        for row in r.rows:
            # refused: a search's sample the config refused (its reason in ``refused``)
            status = "refused" if row.get("refused") else "stopped" if row.get("error") else "ok"
            rows.append({"point": t.point.name, "status": status, **values, **row})
    lead = [*LEAD, *sweep.keys, "policy", "rate_scale", "request_rate"]
    if sweep.search is not None:
        refused = ["refused"] if any("refused" in row for row in rows) else []
        lead[len(LEAD) + len(sweep.keys) : len(LEAD) + len(sweep.keys)] = [
            "sample",
            "met",
            *refused,
        ]
        lead.insert(len(LEAD) + len(sweep.keys) + 2, sweep.search.over)
    return _frame(rows, list(dict.fromkeys(lead)))


def _failed(result) -> str:
    """The status of a task without rows: failed, or interrupted (a stopped sweep's)."""
    return "failed" if result.ran else "interrupted"


def capacity_table(sweep, tasks, results) -> pd.DataFrame:
    """One row per point x policy: the capacity search's outcome (lab/sweeps/search.py)."""
    rows = []
    spec = sweep.search
    for t, r in zip(tasks, results):
        values = {k: _value(t.point.values.get(k)) for k in sweep.keys}
        cfg = sweep.configs[t.point.name]
        if r.error:
            cap = {"policy": cfg.policies[t.policy].label, "status": _failed(r),
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
# Columns the plots read (sweep.csv): policy, status, class, rate_scale, request_rate (offered
# req/s), goodput, slo_attainment, and the p99 latencies through latency_s().
# a configuration's line style, and its markers' fill in the scatter plot
DASHES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)), (0, (3, 1, 1, 1, 1, 1)))
FILLS = ("full", "none", "left", "bottom", "right", "top")


def latency_s(df: pd.DataFrame, metric: str, p: str = "p99") -> pd.Series:
    """A latency statistic in seconds, ``metric`` by vLLM's name (``ttft``, ``e2el``), read
    from vLLM's column (``p99_ttft_ms``) or an older one that names it (``ttft_s_p99``, in
    seconds: :func:`sched_lab.results.names.canonical`); NaN when the table has neither."""
    want = latency_name(p, metric)
    for column in df.columns:
        name, to_ms = canonical(str(column))
        if name == want:
            return df[column] * (to_ms / 1e3)
    return pd.Series(np.nan, df.index)


def offered_x(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """The x of a load plot and its label: the offered req/s (``request_rate``), or
    ``rate_scale`` where a row has no offered rate."""
    if "request_rate" in df.columns and df["request_rate"].notna().all():
        return df["request_rate"].astype(float), "offered load (req/s)"
    return df["rate_scale"].astype(float), "rate_scale (offered load)"


def _others(sweep, df: pd.DataFrame, x: str) -> list[str]:
    """The swept keys besides the load that vary: each value combination is a configuration."""
    loads = ("_x", "rate_scale", "trace.rate_scale")  # _x: the offered req/s
    load = {x, *loads} if x in loads else {x}
    return [
        k
        for k in sweep.keys
        if k not in load and k in df.columns and df[k].nunique(dropna=False) > 1
    ]


def _lines(sweep, df: pd.DataFrame, x: str) -> tuple[list[tuple[dict, pd.DataFrame]], dict]:
    """One line per policy and configuration: (matplotlib style, rows sorted by ``x``), and
    the legend's entries (policy -> colour and marker; configuration -> its index, which
    picks its line style and marker fill)."""
    from sched_lab.report.plots import policy_style

    others = _others(sweep, df, x)
    policies = {p: policy_style(i, p) for i, p in enumerate(dict.fromkeys(df["policy"]))}
    configs: dict[str, object] = {}
    out = []
    for vals, g in df.groupby(["policy", *others], sort=False, dropna=False):
        vals = vals if isinstance(vals, tuple) else (vals,)
        shown = ["null" if v is None or _isnan(v) else format_value(v, ".3g") for v in vals[1:]]
        config = ", ".join(f"{k}={v}" for k, v in zip(others, shown))
        n = configs.setdefault(config, len(configs))
        st = policies[vals[0]]
        style = {"color": st["color"], "marker": st["marker"], "lw": st["lw"] * 0.6,
                 "ms": st["ms"] * 0.7, "ls": DASHES[n % len(DASHES)], "alpha": 0.9,
                 "fillstyle": FILLS[n % len(FILLS)]}  # fmt: skip
        out.append((style, g.sort_values(x)))
    return out, {"policies": policies, "configs": configs if others else {}}


def _legend(fig, legend: dict) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=s["color"], marker=s["marker"], lw=2, label=p)
        for p, s in legend["policies"].items()
    ]
    handles += [
        Line2D([], [], color="black", ls=DASHES[n % len(DASHES)], marker="o",
               fillstyle=FILLS[n % len(FILLS)], label=c)
        for c, n in legend["configs"].items()
    ]  # fmt: skip
    ncol = min(len(handles), 6)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False,
               title="colour and marker: policy (later policies drawn thinner inside earlier "
               "ones: identical results stay visible)" + ("; line style and marker fill: "
                                                          "configuration"
                                                          if legend["configs"] else ""),
               title_fontsize=8)  # fmt: skip
    rows = -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, (0.45 + 0.22 * rows) / fig.get_figheight(), 1, 1))


def _whole_runs(df: pd.DataFrame) -> pd.DataFrame:
    ok = df[df["status"] == "ok"]
    if "class" in ok.columns:
        ok = ok[ok["class"].isna() | (ok["class"] == "all")]
    return ok


def _plots(folder: Path, sweep, table: pd.DataFrame, capacity) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sched_lab.report.plots import LATENCIES, log_axis, rate_scale_axis

    plots: list[tuple[str, str]] = []
    if sweep.search is not None:
        return _capacity_plot(folder, sweep, table, capacity, plt)
    df = _whole_runs(table)
    if df.empty:
        return plots
    df = df.assign(_x=offered_x(df)[0])
    xlabel = offered_x(df)[1]
    lines, legend = _lines(sweep, df, "_x")
    if df["rate_scale"].nunique() > 1:
        fig, axes = plt.subplots(1, 4, figsize=(18, 5.2))
        for ax, (key, title, unit, k) in zip(axes, LATENCIES):
            for style, g in lines:
                ax.plot(g["_x"], latency_s(g, key) * k, **style)
            log_axis(ax)
            ax.set_ylabel(f"{title} p99 ({unit}, log scale)")
            ax.set_title(f"{title} p99 vs load")
        for ax in axes:
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            rate_scale_axis(ax, df["_x"], df["rate_scale"])
        _legend(fig, legend)
        plots.append(_save_fig(fig, folder, "latency_vs_load.png", "Latency p99 vs load"))
        fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
        for style, g in lines:
            axes[0].plot(g["_x"], g["request_goodput"], **style)
            axes[1].plot(g["_x"], 100 * g["slo_attainment"], **style)
        top = float(df["_x"].max())
        if xlabel.startswith("offered"):
            axes[0].plot([0, top], [0, top], color="grey", lw=0.8, ls=":")
            axes[0].text(top, top, " = offered", color="grey", fontsize=8, va="center")
        axes[0].set(title="Goodput vs load", ylabel="goodput (req/s meeting every SLO)")
        axes[1].set(title="SLO attainment vs load", ylabel="% of requests meeting every SLO",
                    ylim=(0, 102))  # fmt: skip
        for ax in axes:
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            rate_scale_axis(ax, df["_x"], df["rate_scale"])
        _legend(fig, legend)
        plots.append(
            _save_fig(fig, folder, "goodput_vs_load.png", "Goodput and SLO attainment vs load")
        )
    fig, ax = plt.subplots(figsize=(8, 6))
    ttft = latency_s(df, "ttft")
    for style, g in lines:
        ax.plot(latency_s(g, "ttft"), g["request_goodput"], **{**style, "ls": ""})
    front = pareto_front(ttft.to_numpy(float), df["request_goodput"].to_numpy(float))
    f = df.iloc[front].assign(_ttft=ttft.iloc[front]).sort_values("_ttft")
    ax.plot(f["_ttft"], f["request_goodput"], "k--", lw=1)
    ax.text(0.99, 0.01, "dashed: Pareto front", transform=ax.transAxes, ha="right",
            fontsize=8, color="k")  # fmt: skip
    log_axis(ax, "x")
    ax.set_xlabel("TTFT p99 (s, log scale)")
    ax.set_ylabel("goodput (req/s)")
    ax.set_title("Goodput vs TTFT p99 (every point and policy)")
    ax.grid(alpha=0.3)
    _legend(fig, legend)
    plots.append(_save_fig(fig, folder, "pareto.png", "Pareto: goodput vs TTFT p99"))
    return plots


def _save_fig(fig, folder: Path, name: str, caption: str) -> tuple[str, str]:
    """Save without another tight_layout (the legend's room is set)."""
    import matplotlib.pyplot as plt

    fig.savefig(folder / name, dpi=110)
    plt.close(fig)
    return name, caption


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


def _capacity_plot(folder, sweep, curve, capacity, plt) -> list[tuple[str, str]]:
    from sched_lab.report.plots import log_axis

    spec = sweep.search
    df = curve[curve["status"].isin(("ok", "stopped"))]
    if spec.metric not in df.columns or not np.isfinite(_search_metric(df, spec.metric)).any():
        return []  # no value to draw (a latency is NaN where no request finished)
    fig, ax = plt.subplots(figsize=(9, 6))
    lines, legend = _lines(sweep, df, spec.over)
    y = _search_metric(df, spec.metric)
    for style, g in lines:
        ax.plot(g[spec.over], y.loc[g.index], **style)
    ax.axhline(spec.target, color="k", lw=1, ls=":")
    found = capacity[capacity["status"] == "found"]
    ax.scatter(found["capacity"], [spec.target] * len(found), marker="|", s=200, color="k")
    ax.text(0.01, 0.99, f"dotted: target {spec.target:g}; |: capacity found",
            transform=ax.transAxes, va="top", fontsize=8)  # fmt: skip
    log_axis(ax, "x")
    if not spec.higher_is_better:
        log_axis(ax)
    ax.set_xlabel(spec.over)
    ax.set_ylabel(spec.metric)
    ax.set_title(f"Capacity search: {spec.metric} vs {spec.over} (samples)")
    ax.grid(alpha=0.3)
    _legend(fig, legend)
    return [_save_fig(fig, folder, "capacity.png", "Sampled curves of the capacity search")]


def _search_metric(df: pd.DataFrame, metric: str) -> pd.Series:
    """The searched metric's column (as the search names it)."""
    return df[metric].astype(float)


# ---------------------------------------------------------------------------- markdown
def uniform_slo(sweep) -> dict[str, float]:
    """The SLOs given (keys ttft_s, tpot_s, e2e_s) when every point has the same; else {}."""
    slos = {tuple(c.slo.to_dict().items()) for c in sweep.configs.values()}
    if len(slos) != 1:
        return {}
    return {k: v for k, v in next(iter(slos)) if v is not None}


def capacity_cell(row, spec) -> str:
    """The capacity in ``spec.over``'s units, for people: the value found, ``< lo`` when the
    lowest value tried already missed (below the range), ``>= hi`` when the highest still met
    (above it); whole numbers in full."""
    status = row.get("status")
    if status == "below_range":
        return f"< {format_value(row.get('hi'), '.4g')}"
    if status == "above_range":
        return f">= {format_value(row.get('capacity'), '.4g')}"
    return format_value(row.get("capacity"), ".4g")


def status_word(row) -> str:
    """A capacity row's status in words (``below range``)."""
    return STATUS_WORDS.get(row.get("status"), str(row.get("status")))


def bound_text(row, spec, slo: dict | None = None) -> str:
    """What bound a capacity, read as a condition that failed at the first value past it:
    ``tpot <= 50 ms (met by 62%)`` with the SLOs ``slo`` (keys ttft_s, tpot_s, e2e_s),
    ``p99_ttft_ms <= 500 (got 2350)`` for a latency target, ``refused by the config`` or
    ``stopped early`` for a probe with no metric to read; ``-`` when nothing missed."""
    what, value = row.get("bound_by"), row.get("bound_value")
    if not isinstance(what, str) or not what:
        return MISSING
    if what in PROBE_ENDS:
        return PROBE_ENDS[what]
    if spec.metric != "slo_attainment":
        return f"{what} <= {spec.target:g} (got {format_value(value, '.4g')})"
    limit = (slo or {}).get({"e2el": "e2e_s"}.get(what, f"{what}_s"))
    if limit is not None:
        what += f" <= {limit * 1e3:g} ms" if what == "tpot" else f" <= {limit:g} s"
    return f"{what} (met by {_share_rounded_down(value)})"


def _share_rounded_down(value) -> str:
    """A share in percent to 0.1, rounded down, so that a miss never reads as the target
    (0.89988 -> ``89.9%``, not ``90%``); ``-`` when missing."""
    if format_value(value) == MISSING:
        return MISSING
    return f"{math.floor(float(value) * 1000 + 1e-9) / 10:g}%"


# bound_by of a probe whose run gave no metric (lab/sweeps/run.py bound_by), in words
PROBE_ENDS = {"refused": "refused by the config", "stopped": "stopped early"}


def sweep_warnings(table: pd.DataFrame) -> list[tuple[str, str]]:
    """(kind, text) of a single run's warnings (:func:`sched_lab.report.terminal.warnings`)
    over a sweep's runs, from its table (sweep.csv, or curve.csv of a search; columns
    ``cost_model_stale``, ``cost_model_profile``, ``cost_model_why``,
    ``cost_model_host_note``, ``async_scheduling``): a stale profile once per profile and
    reason, naming its points unless every point ran with it; async runs priced without host
    time, named ``point policy``, once per reason. The terminal and report.md print them."""
    if "cost_model_stale" not in table.columns:  # no run made a summary
        return []
    rows = table[table["status"].isin(("ok", "stopped"))]
    if "class" in rows.columns:
        rows = rows[rows["class"].isna() | (rows["class"] == "all")]
    stale: dict[tuple[str, str], list[str]] = {}
    no_host: dict[str, list[str]] = {}
    for _, r in rows.iterrows():
        if _true(r.get("cost_model_stale")):
            key = (str(r.get("cost_model_profile")), str(r.get("cost_model_why")))
            stale.setdefault(key, []).append(r["point"])
        note = r.get("cost_model_host_note")
        if _true(r.get("async_scheduling")) and isinstance(note, str) and note:
            no_host.setdefault(note, []).append(f"{r['point']} {r['policy']}")
    every = set(rows["point"])
    out = []
    for note, runs in no_host.items():
        out.append(("warning", no_host_warning([_listed(runs)], note)))
    for (profile, why), points in stale.items():
        where = "" if set(points) == every else f" (points {_listed(points)})"
        out.append(("warning", stale_warning(profile, why) + where))
    return out


def _true(v: Any) -> bool:
    """A boolean cell as written or as read back from CSV (``True``; NaN: no value)."""
    return str(v) == "True"


def _listed(names: Sequence[str], most: int = 8) -> str:
    """Distinct ``names`` joined by commas, the first ``most`` of them and a count after."""
    names = list(dict.fromkeys(names))
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"


def _markdown(
    sweep, table: pd.DataFrame, capacity, plots, partial: str | None = None, parquet: bool = False
) -> str:
    """report.md; ``parquet``: whether the tables were also written as .parquet."""
    n = len(sweep.points)
    lines = [f"# {sweep.name}", ""]
    if partial is not None:
        lines += [f"**Partial results**: {partial}; the rest have status `interrupted`.", ""]
    keys = ", ".join(f"`{k}`" for k in sweep.keys) or "nothing (one point)"
    lines += [f"Sweep of {n} point{'s' if n != 1 else ''} over {keys}.", ""]
    lines += warnings_markdown(sweep_warnings(table))  # the terminal's, word for word
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
            vals = "".join(f"{format_value(r[k], '.3g')} | " for k in sweep.keys)
            lines.append(
                f"| {r['point']} | {vals}{r['policy']} | {capacity_cell(r, sweep.search)} | "
                f"{format_value(r['capacity_request_rate'], '.4g')} | {bound_text(r, sweep.search, uniform_slo(sweep))} | "
                f"[{format_value(r['lo'], '.4g')}, {format_value(r['hi'], '.4g')}) | "
                f"{format_value(r['evaluations'], '.3g')} | {status_word(r)} |"
            )
        lines.append("")
        failed = capacity[capacity["status"].isin(("failed", "interrupted"))]
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
            vals = "".join(f"{format_value(r[k], '.3g')} | " for k in sweep.keys)
            run = (
                r["policy"]
                if pd.isna(r.get("rate_scale"))
                else f"{r['policy']}@x{r['rate_scale']:g}"
            )
            ttft = r.get("p99_ttft_ms")
            lines.append(
                f"| {r['point']} | {vals}{run} | {r['status']} | "
                f"{format_value(None if ttft is None else ttft / 1e3, '.3g')} | "
                f"{format_value(r.get('p99_tpot_ms'), '.3g')} | "
                f"{format_value(r.get('request_goodput'), '.3g')} | "
                f"{format_value(r.get('slo_attainment'), '.1%')} |"
            )
        lines.append("")
        failed = whole[whole["status"] != "ok"]
    for _, r in failed.drop_duplicates("point").iterrows():
        if r["status"] != "interrupted":
            lines += [f"**Point {r['point']} {r['status']}**: {r['error']}", ""]
    gone = failed[failed["status"] == "interrupted"]
    if not gone.empty:  # a search's by point and policy
        who = gone["point"] if capacity is None else gone["point"] + " " + gone["policy"]
        missing = ", ".join(dict.fromkeys(who))
        lines += [f"**Not run** (the sweep was stopped): {missing}", ""]
    for name, caption in plots:
        lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
    also = " / `.parquet`" if parquet else ""  # only what was written
    tables = (
        f"`sweep.csv`{also} (one row per point x run x class), `points/<point>/` "
        "(each point's results folder)"
        if capacity is None
        else f"`capacity.csv`{also} (one row per point x policy), `curve.csv`{also} "
        "(every load the search tried)"
    )
    lines += [
        f"Files: {tables}, `sweep.yaml` (the sweep as given), `timing.json` (executor and "
        "wall times).",
        "",
    ]
    return "\n".join(lines)
