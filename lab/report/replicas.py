"""A cluster run's per-replica table (summary key ``cluster.replicas``,
lab/results/cluster_metrics.py) for report.md and the terminal, and the line naming the cost
model that priced its steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sched_lab.results.names import MISSING, format_value

GIB = 1024**3
HEAD = ("replica", "role", "requests", "busy %", "KV mean / max %", "preemptions", "queue peak")
HOST_BUFFER = "host buffer peak (GiB / requests)"  # decode replicas of a disaggregated cluster


def replica_rows(cluster: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(column names, one row of cells per replica) of a run's ``cluster`` summary; the
    host-buffer column only when a replica reports its peak."""
    replicas = cluster["replicas"]
    buffered = any("host_buffer_peak_bytes" in r for r in replicas.values())
    head = [*HEAD, HOST_BUFFER] if buffered else list(HEAD)
    rows = []
    for i, r in replicas.items():
        row = [
            i,
            r["role"],
            str(r["num_prompts"]),
            f"{100 * r['busy_fraction']:.0f}",
            f"{100 * r['mean_kv_cache_usage']:.0f} / {100 * r['max_kv_cache_usage']:.0f}",
            str(r["num_preemptions"]),
            format_value(r.get("queue_peak")),
        ]
        if buffered:
            peak = r.get("host_buffer_peak_bytes")
            row.append(
                MISSING if peak is None else f"{peak / GIB:.2f} / {r['host_buffer_peak_requests']}"
            )
        rows.append(row)
    return head, rows


def prefill_side_text(cluster: Mapping[str, Any]) -> str:
    """``prefill side: time to the prefill replica's token (prefill_ttft) p50 73 ms, p99
    15.5 s``: a disaggregated run's prefill-side time beside its TTFT (which is the
    client's, at the decode replica); "" for an aggregated run."""
    p50, p99 = cluster.get("p50_prefill_ttft_ms"), cluster.get("p99_prefill_ttft_ms")
    if p50 is None:
        return ""
    return (
        "prefill side: time to the prefill replica's token (prefill_ttft) "
        f"p50 {_ms(p50)}, p99 {_ms(p99)}; TTFT above is the client's, at the decode replica"
    )


def _ms(v) -> str:
    if format_value(v) == MISSING:
        return MISSING
    return f"{v:.0f} ms" if v < 1000 else f"{v / 1e3:.3g} s"


def replicas_markdown(runs) -> list[str]:
    """report.md lines: a per-replica table for each cluster run (none for a single engine)."""
    lines: list[str] = []
    for run in runs:
        cluster = run.summary.get("cluster")
        if not cluster:
            continue
        head, rows = replica_rows(cluster)
        lines += [
            f"Replicas of {run.label} ({cluster['mode']}; busy: share of the run's duration "
            "spent in steps; queue peak: most requests waiting or swapped out at once):",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
        ]
        if prefill := prefill_side_text(cluster):
            lines += [prefill[0].upper() + prefill[1:], ""]
    return lines


def replicas_text(runs) -> str:
    """The terminal's per-replica tables, one per cluster run ("" without a cluster)."""
    blocks = []
    for run in runs:
        cluster = run.summary.get("cluster")
        if not cluster:
            continue
        head, rows = replica_rows(cluster)
        widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(head)]
        lines = [f"{run.label}: {cluster['num_replicas']} replicas ({cluster['mode']})"]
        lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        if prefill := prefill_side_text(cluster):
            lines.append(prefill)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def cost_model_text(cost_model: Mapping[str, Any] | None) -> str:
    """``cost model: calibrated (profiles/x.csv)``: what priced the simulated steps."""
    if not cost_model:
        return ""
    kind = cost_model.get("kind", "?")
    source = cost_model.get("profile") or ", ".join(cost_model.get("efficiency_profiles") or [])
    if kind == "analytic" and source:
        return f"cost model: analytic (efficiencies fitted to {source})"
    return f"cost model: {kind}" + (f" ({source})" if source else "")


def cluster_text(runs) -> str:
    """What ``sched-lab run`` prints after the summary for a cluster: the cost model and the
    per-replica tables ("" without a cluster)."""
    tables = replicas_text(runs)
    if not tables:
        return ""
    line = cost_model_text(runs[0].summary.get("cost_model"))
    return "\n\n".join(x for x in (line, tables) if x)
