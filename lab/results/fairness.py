"""Per-class metrics and fairness between tenants, for traces of workload classes
(traces/classes.py); other runs' summaries do not get these keys.

* ``classes``: :func:`sched_lab.results.metrics.summarize`'s headline metrics per class with the
  class's SLOs (the top-level ``slo:`` overridden key by key), plus the ``max`` of TTFT, E2E
  and queueing delay; the run's ``request_goodput`` and ``slo_attainment`` use the class SLOs.
* ``tenants``: per tenant its requests, served tokens and TTFT.
* ``fairness``: service in windows of the run's duration / :data:`NUM_WINDOWS`, weighted as
  VTC charges it (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24:
  ``INPUT_WEIGHT`` per prompt token when the request is first admitted, ``OUTPUT_WEIGHT``
  per output token when it is produced; the paper's weights, whatever the run's policy, so
  that runs of one experiment compare).
  A tenant is backlogged in a window when a request of it waits throughout. ``jain_index``:
  (sum x)^2 / (n sum x^2) over the n >= 2 backlogged tenants, mean and min over windows.
  ``max_service_difference``: the largest |W_f - W_g| over whole windows where f and g are
  both backlogged (the paper's §4 bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.core.request import Request
from sched_lab.results.metrics import (
    DEFAULT_PERCENTILES,
    FAILED,
    SLO_KEYS,
    latency_stats,
    meets_slo,
    slo_attainment,
    summary_percentiles,
)
from sched_lab.results.names import LATENCIES, format_value
from sched_lab.sim.records import ReplayResult

NUM_WINDOWS = 120
INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # VTC's evaluation weights (w_p, w_q)


def class_slos(classes, slo: Mapping[str, float | None]) -> dict[str, dict[str, float | None]]:
    """Each class's SLOs: the top-level ``slo`` with the class's own keys over it."""
    return {c["name"]: {**slo, **c.get("slo", {})} for c in classes}


def meets_class_slo(df: pd.DataFrame, slos: Mapping[str, Mapping[str, float | None]]) -> np.ndarray:
    """Boolean per row: finished and within every SLO of its class."""
    ok = np.zeros(len(df), dtype=bool)
    for name, slo in slos.items():
        rows = (df["class"] == name).to_numpy()
        ok[rows] = meets_slo(df[rows], dict(slo))
    return ok


def summarize_classes(
    df: pd.DataFrame,
    rows: list[Request],
    result: ReplayResult,
    slos: Mapping[str, Mapping[str, float | None]],
    duration_s: float,
    percentiles=DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The keys this module adds to a run's summary (``rows``: the requests of ``df``, in its
    order); ``request_goodput`` and ``slo_attainment`` replace the run's. Per class and
    tenant: counts, throughput and latency statistics under the run's names
    (:mod:`sched_lab.results.names`)."""
    pcts = summary_percentiles(percentiles)
    good = meets_class_slo(df, slos)
    replayed = (df["status"] != "dropped").to_numpy()
    out: dict[str, Any] = {
        "request_goodput": float(good.sum()) / duration_s,
        **slo_attainment(good, df["status"]),
        **_attainment_by_slo(df, slos, replayed),
        "classes": {},
    }
    for name, slo in slos.items():
        mask = (df["class"] == name).to_numpy()
        given = {k: v for k, v in slo.items() if v is not None}
        out["classes"][name] = _group(df[mask], good[mask], duration_s, pcts) | {"slo": given}
        if not given:  # no SLO, no goodput (as vLLM's goodput is null without SLOs)
            out["classes"][name] |= {
                "request_goodput": None,
                "slo_attainment": None,
                "slo_attainment_finished": None,
            }
    tenants = sorted(set(df["tenant"]))
    out["tenants"] = {
        t: _group(df[(df["tenant"] == t).to_numpy()], None, duration_s, pcts) for t in tenants
    }
    edges, service, backlog = tenant_service(rows, result, duration_s)
    for t, s in service.items():
        out["tenants"][t]["served_tokens"] = float(s.sum())
    out["fairness"] = fairness(edges, service, backlog)
    return out


def _attainment_by_slo(
    df: pd.DataFrame, slos: Mapping[str, Mapping[str, float | None]], replayed: np.ndarray
) -> dict[str, float]:
    """``slo_attainment_{ttft,tpot,e2el}`` with each class's own limits (a class without
    that SLO meets it when finished)."""
    out = {}
    for key, name in zip(SLO_KEYS, ("ttft", "tpot", "e2el")):
        if all(slo.get(key) is None for slo in slos.values()):
            continue
        ok = (df["status"] == "finished").to_numpy().copy()
        for cls, slo in slos.items():
            if slo.get(key) is not None:
                rows = (df["class"] == cls).to_numpy()
                ok[rows] &= df.loc[rows, key].fillna(0.0).to_numpy() <= slo[key]
        out[f"slo_attainment_{name}"] = (
            float(ok[replayed].mean()) if replayed.any() else float("nan")
        )
    return out


def _group(
    df: pd.DataFrame, good: np.ndarray | None, duration_s: float, percentiles
) -> dict[str, Any]:
    fin = df[df["status"] == "finished"]
    replayed = int((df["status"] != "dropped").sum())
    counts = df["status"].value_counts()
    out = {
        "num_prompts": replayed,
        "completed": int(counts.get("finished", 0)),
        **{s: int(counts.get(s, 0)) for s in (*FAILED, "dropped")},
        "request_throughput": len(fin) / duration_s,
        "output_throughput": float(fin["num_generated_tokens"].sum()) / duration_s,
    }
    for name, (_, column) in LATENCIES.items():
        if column is not None:  # ITL: pooled over the run only
            out.update(latency_stats(name, fin[column].to_numpy(dtype=float), percentiles))
    out["num_preemptions_recompute"] = int(df["num_preemptions_recompute"].sum())
    out["recomputed_tokens"] = int(df["recomputed_tokens"].sum())
    if good is not None:
        out["request_goodput"] = float(good.sum()) / duration_s
        out.update(slo_attainment(good, df["status"]))
    return out


def tenant_service(
    rows: list[Request], result: ReplayResult, duration_s: float
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Window edges (``NUM_WINDOWS + 1``, seconds), and per tenant the weighted tokens
    served in each window and whether it was backlogged throughout each window."""
    end = duration_s if np.isfinite(duration_s) and duration_s > 0 else 1.0
    edges = np.linspace(0.0, end, NUM_WINDOWS + 1)
    by_tenant: dict[str, list[Request]] = {}
    for r in rows:
        if r.finish_s >= 0 or r.first_scheduled_s >= 0:
            by_tenant.setdefault(r.tenant, []).append(r)
    service, backlog = {}, {}
    for t, reqs in sorted(by_tenant.items()):
        times, weights = [], []
        for r in reqs:
            if r.first_scheduled_s >= 0:  # admitted: its prompt is charged then
                times.append([r.first_scheduled_s])
                weights.append([INPUT_WEIGHT * r.prompt_len])
            tok = result.token_times(r)
            if len(tok):
                times.append(tok)
                weights.append(np.full(len(tok), OUTPUT_WEIGHT))
        if times:
            at = np.concatenate(times)
            idx = np.clip(np.searchsorted(edges, at, side="right") - 1, 0, NUM_WINDOWS - 1)
            service[t] = np.bincount(idx, np.concatenate(weights), NUM_WINDOWS)
        else:
            service[t] = np.zeros(NUM_WINDOWS)
        backlog[t] = _backlogged(reqs, edges)
    return edges, service, backlog


def _backlogged(reqs: list[Request], edges: np.ndarray) -> np.ndarray:
    """Per window: some request waits (arrival to first scheduled, or to its end) all of it."""
    leave = [r.first_scheduled_s if r.first_scheduled_s >= 0 else r.finish_s for r in reqs]
    start = np.array([r.arrival_s for r in reqs])
    times = np.concatenate([start, np.array(leave)])
    delta = np.concatenate([np.ones(len(reqs)), -np.ones(len(reqs))])
    order = np.argsort(times, kind="stable")
    t, count = times[order], np.cumsum(delta[order])
    last = np.r_[t[1:] != t[:-1], True]  # the count after every event at one instant
    t, count = t[last], count[last]
    out = np.zeros(len(edges) - 1, dtype=bool)
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        k0, k1 = np.searchsorted(t, a, side="right"), np.searchsorted(t, b, side="left")
        at_start = count[k0 - 1] if k0 > 0 else 0.0
        out[i] = min(at_start, count[k0:k1].min(initial=at_start)) > 0
    return out


def fairness(
    edges: np.ndarray, service: Mapping[str, np.ndarray], backlog: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """Jain's index over windows and the maximum service difference."""
    tenants = sorted(service)
    jain = []
    for i in range(len(edges) - 1):
        x = np.array([service[t][i] for t in tenants if backlog[t][i]])
        if len(x) >= 2 and (x * x).sum() > 0:
            jain.append(x.sum() ** 2 / (len(x) * (x * x).sum()))
    worst = 0.0
    for a in range(len(tenants)):
        for b in range(a + 1, len(tenants)):
            f, g = tenants[a], tenants[b]
            both = backlog[f] & backlog[g]
            diff = service[f] - service[g]
            run: list[float] = []
            for i in range(len(both) + 1):  # maximal runs of windows where both are backlogged
                if i < len(both) and both[i]:
                    run.append(diff[i])
                    continue
                if run:
                    d = np.concatenate([[0.0], np.cumsum(run)])
                    worst = max(worst, float(d.max() - d.min()))
                    run = []
    return {
        "window_s": float(edges[1] - edges[0]),
        "weights": {"input": INPUT_WEIGHT, "output": OUTPUT_WEIGHT},
        "jain_index": {
            "mean": float(np.mean(jain)) if jain else float("nan"),
            "min": float(np.min(jain)) if jain else float("nan"),
            "windows": len(jain),
        },
        "max_service_difference": worst,
    }


# ---------------------------------------------------------------------------- report
def markdown(runs) -> list[str]:
    """report.md lines: per class and per tenant tables, fairness (empty without classes)."""
    runs = [r for r in runs if "classes" in r.summary]
    if not runs:
        return []
    lines = [
        "## Per class",
        "",
        "| run | class | finished | TTFT p50 / p99 / max (s) | E2E p50 / p99 / max (s) "
        "| queue max (s) | out tok/s | preempt / recomputed tok | goodput (req/s) "
        "| SLO attainment |",
        "|" + "---|" * 10,
    ]
    for r in runs:
        for name, c in r.summary["classes"].items():
            t = [c[f"{s}_ttft_ms"] / 1e3 for s in ("p50", "p99", "max")]
            e = [c[f"{s}_e2el_ms"] / 1e3 for s in ("p50", "p99", "max")]
            lines.append(
                f"| {r.label} | {name} | {c['completed']} "
                f"| {format_value(t[0], '.3f')} / {format_value(t[1], '.3f')} / {format_value(t[2], '.3f')} "
                f"| {format_value(e[0], '.2f')} / {format_value(e[1], '.2f')} / {format_value(e[2], '.2f')} "
                f"| {format_value(c['max_queue_ms'] / 1e3, '.2f')} | {format_value(c['output_throughput'], '.0f')} "
                f"| {c['num_preemptions_recompute']} / {c['recomputed_tokens']} "
                + (
                    f"| {format_value(c['request_goodput'], '.2f')} | {format_value(c['slo_attainment'], '.1%')} |"
                    if c["slo_attainment"] is not None
                    else "| - | - (no SLO) |"
                )
            )
    runs = [r for r in runs if len(r.summary["tenants"]) >= 2]
    if not runs:
        return lines + [""]
    lines += [
        "",
        "## Fairness between tenants",
        "",
        "| run | served tokens per tenant | Jain's index mean / min | max service difference |",
        "|---|---|---|---|",
    ]
    for r in runs:
        f = r.summary["fairness"]
        served = ", ".join(
            f"{t or '(none)'} {v['served_tokens']:.0f}" for t, v in r.summary["tenants"].items()
        )
        j = f["jain_index"]
        if np.isfinite(j["mean"]):
            shares = f"{j['mean']:.3f} / {j['min']:.3f} | {f['max_service_difference']:.0f}"
        else:
            shares = "- | - (never two tenants backlogged at once)"
        lines.append(f"| {r.label} | {served} | {shares} |")
    w = runs[0].summary["fairness"]
    lines += [
        "",
        f"Service in weighted tokens (prompt x {w['weights']['input']:g}, output x "
        f"{w['weights']['output']:g}), windows of {w['window_s']:.3g} s; see lab/results/fairness.py.",
        "",
    ]
    return lines


def tenant_series(run) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """:func:`tenant_service`'s window edges and weighted tokens per tenant of a run with
    classes, as its plot reads them: kept in ``run.plot_series`` (a results folder drawn
    later, lab/report/later.py), else computed from its requests and token times."""
    kept = (getattr(run, "plot_series", None) or {}).get("tenant_service")
    if kept is not None:
        return kept
    edges, service, _ = tenant_service(run.result.requests, run.result, run.summary["duration"])
    return edges, service


def plots(folder, runs, save) -> list[tuple[str, str]]:
    """Served tokens per tenant over time and the TTFT CDF per class, as (png, caption) pairs;
    none without classes."""
    runs = [r for r in runs if "classes" in r.summary]
    if not runs:
        return []
    import matplotlib.pyplot as plt

    out = []
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs) + 1, 3.8), squeeze=False)
    for ax, r in zip(axes[0], runs):
        edges, service = tenant_series(r)
        for t, s in service.items():
            ax.plot(edges[1:], np.cumsum(s), label=t or "(none)")
        ax.set_title(r.label)
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("served weighted tokens (cumulative)")
    out.append(save(fig, folder, "tenant_service.png", "Served tokens per tenant over time"))
    names = list(runs[0].summary["classes"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names) + 1, 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for r in runs:
            df = r.requests
            x = np.sort(df.loc[(df["class"] == name) & (df["status"] == "finished"), "ttft_s"])
            if len(x):
                ax.plot(x, np.linspace(0, 1, len(x)), label=r.label)
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF, class {name}")
        ax.set_xlabel("TTFT (s, log scale)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    out.append(save(fig, folder, "ttft_by_class.png", "TTFT CDF per class"))
    return out
