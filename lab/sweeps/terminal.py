"""What ``sched-lab run`` prints after a sweep or a capacity search, read back from the
tables it wrote: one row per point, policy and load (offered and achieved req/s, TTFT,
TPOT and E2E p50 / p99, goodput, SLO attainment, preemptions), or per point and policy the
capacity in req/s and what bound it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from sched_lab.results.names import MISSING, format_value, percentile_word
from sched_lab.sweeps.report import (
    PROBE_ENDS,
    bound_text,
    capacity_cell,
    status_word,
    sweep_warnings,
    uniform_slo,
)

PERCENTILES = (50.0, 99.0)  # of the sweep table's latencies, unless --metric-percentiles says


def _latency(row, metric: str, words: Sequence[str], scale: float, fmt: str) -> str:
    """A latency's percentiles ``words`` (``p50``, ``p99``) joined by ``/``, in the table's
    unit (``scale`` from ms)."""
    values = (row.get(f"{w}_{metric}_ms") for w in words)
    return "/".join(format_value(None if x is None else x * scale, fmt) for x in values)


def _short(key: str) -> str:
    """A swept key's column title: its last part without ``num_``
    (``kv_cache.num_gpu_blocks`` -> ``gpu_blocks``)."""
    return key.rsplit(".", 1)[-1].removeprefix("num_")


def render(header: Sequence[tuple[str, str]], rows: list[list[str]]) -> str:
    """A fixed-width table: two header lines (names, units), text left-aligned in the first
    columns up to and including ``policy``, numbers right-aligned."""
    cols = list(zip(*rows)) if rows else [[] for _ in header]
    widths = [max(len(n), len(u), *(len(c) for c in col)) for (n, u), col in zip(header, cols)]
    left = next((i for i, (n, _) in enumerate(header) if n == "policy"), -1)

    def line(cells) -> str:
        out = [
            c.ljust(w) if i <= left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    lines = [line([n for n, _ in header]), line([u for _, u in header])]
    lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, *(line(r) for r in rows)])


def sweep_text(
    table: pd.DataFrame, keys: Sequence[str], percentiles: Sequence[float] = PERCENTILES
) -> str:
    """The sweep table of the terminal: a row per point, policy and load (whole runs), with
    TTFT, TPOT and E2E at ``percentiles`` (each a column of the table: p50, p90, p99 and
    those of ``report.metric_percentiles``)."""
    words = [f"p{percentile_word(p)}" for p in percentiles]
    shown = "/".join(words)
    df = table
    if "class" in df.columns:
        df = df[df["class"].isna() | (df["class"] == "all")]
    keys = [k for k in keys if k not in ("trace.rate_scale", "rate_scale")]
    header = [("point", ""), *((_short(k), "") for k in keys), ("policy", ""), ("scale", "x"),
              ("offered", "req/s"), ("achieved", "req/s"), ("TTFT", f"{shown} s"),
              ("TPOT", f"{shown} ms"), ("E2E", f"{shown} s"), ("goodput", "req/s"),
              ("SLO", "% met"), ("preempt", "")]  # fmt: skip
    rows, notes = [], []
    for _, r in df.iterrows():
        r = r.to_dict()
        lead = [r["point"], *(format_value(r.get(k)) for k in keys), str(r["policy"])]
        if r.get("status") == "failed":
            rows.append([*lead, "failed", *[MISSING] * (len(header) - len(lead) - 1)])
            notes.append(f"{r['point']} failed: {r.get('error')}")
            continue
        if r.get("status") == "stopped":
            notes.append(f"{r['point']} {r['policy']} stopped early: {r.get('error')}")
        att = r.get("slo_attainment")
        att = None if att is None else 100 * att
        rows.append([
            *lead, format_value(r.get("rate_scale")),
            format_value(r.get("request_rate"), ".2f"),
            format_value(r.get("request_throughput"), ".2f"),
            _latency(r, "ttft", words, 1e-3, ".2f"), _latency(r, "tpot", words, 1.0, ".1f"),
            _latency(r, "e2el", words, 1e-3, ".1f"), format_value(r.get("request_goodput"), ".2f"),
            format_value(att, ".0f"), format_value(r.get("num_preemptions")),
        ])  # fmt: skip
    return "\n".join([render(header, rows), *dict.fromkeys(notes)])


def capacity_text(
    capacity: pd.DataFrame,
    keys: Sequence[str],
    spec,
    slo: dict | None = None,
    curve: pd.DataFrame | None = None,
) -> str:
    """The capacity per point and policy: the largest value of ``spec.over`` that met the
    target (``< lo`` below the range tried, ``>= hi`` above it), the offered req/s there, the
    bracket and the condition that failed just above; a probe refused or stopped early is
    explained under the table from ``curve`` (curve.csv)."""
    cmp = ">=" if spec.higher_is_better else "<="
    title = (
        f"capacity: the largest {spec.over} with {spec.metric} {cmp} {spec.target:g} "
        "(req/s: offered at that capacity; bound by: what failed at the next value tried)"
    )
    header = [("point", ""), *((_short(k), "") for k in keys), ("policy", ""),
              ("capacity", "req/s"), (_short(spec.over), ""), ("bracket", ""),
              ("bound by", ""), ("runs", ""), ("status", "")]  # fmt: skip
    rows, notes = [], []
    for _, r in capacity.iterrows():
        r = r.to_dict()
        who = f"{r['point']} {r['policy']}"
        if isinstance(r.get("error"), str) and r["error"]:
            notes.append(f"{who} failed: {r['error']}")
        if r.get("status") == "below_range":
            lowest = spec.integer and r.get("hi") == 1
            hint = ("the key holds whole numbers from 1: nothing lower to try" if lowest
                    else "a lower search.lo may find it")  # fmt: skip
            notes.append(
                f"{who}: below range: {spec.over} {format_value(r.get('hi'), '.4g')}, the "
                f"lowest value tried, already failed the target ({hint})"
            )
        why = _probe_end(curve, r, spec.over)
        if why:
            notes.append(f"{who}: at {spec.over} {format_value(r.get('hi'), '.4g')}: {why}")
        lo, hi = (format_value(r.get(k), ".4g") for k in ("lo", "hi"))
        rows.append([
            r["point"], *(format_value(r.get(k)) for k in keys), str(r["policy"]),
            format_value(r.get("capacity_request_rate"), ".2f"), capacity_cell(r, spec),
            f"[{lo}, {hi})", bound_text(r, spec, slo), format_value(r.get("evaluations")),
            status_word(r),
        ])  # fmt: skip
    return "\n".join([title, render(header, rows), *notes])


def _probe_end(curve: pd.DataFrame | None, row: dict, over: str) -> str:
    """Why the probe just above a capacity gave no metric (refused, or its run stopped), from
    its curve.csv row; empty when it did."""
    if curve is None or over not in curve.columns:
        return ""
    at = curve[(curve["point"] == row["point"]) & (curve["policy"] == row["policy"])]
    at = at[at[over] == row.get("hi")]
    if row.get("bound_by") not in PROBE_ENDS:  # a latency is missing where none finished
        if at.empty or "completed" not in at or at["completed"].iloc[-1] != 0:
            return ""
        last = at.iloc[-1]
        return f"no request finished ({last['rejected']:.0f} of {last['num_prompts']:.0f} rejected)"
    for column in ("refused", "error"):
        if column in at.columns and at[column].notna().any():
            return f"{PROBE_ENDS[row['bound_by']]}: {at[column].dropna().iloc[-1]}"
    return ""


def folder_text(out: Path, sweep, percentiles: Sequence[float] = PERCENTILES) -> str:
    """The terminal's text for the sweep folder ``out`` (its CSV tables; a sweep's latencies at
    ``percentiles``), with the SLOs when every point has the same and the warnings about
    what priced the steps (:func:`~sched_lab.sweeps.report.sweep_warnings`)."""
    from sched_lab.report.terminal import slo_text

    slo = uniform_slo(sweep)
    table = pd.read_csv(out / ("curve.csv" if sweep.search is not None else "sweep.csv"))
    if sweep.search is not None:
        capacity = pd.read_csv(out / "capacity.csv")
        text = capacity_text(capacity, sweep.keys, sweep.search, slo, table)
    else:
        text = sweep_text(table, sweep.keys, percentiles)
    if slo:
        text += f"\nSLOs: {slo_text(slo)} (goodput: finished requests/s meeting every SLO)"
    found = sweep_warnings(table)  # as report.md says them
    if found:
        text += "\n\n" + "\n".join(f"{kind}: {line}" for kind, line in found)
    return text
