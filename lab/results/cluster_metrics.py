"""Cluster metrics: per-request replica columns and a per-replica summary of a cluster run
(lab/sim/cluster.py); the run's other metrics are the cluster's as a whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.core.request import Request
from sched_lab.results.metrics import latency_stats
from sched_lab.sim.cluster import ClusterResult, request_columns


def add_cluster(
    df: pd.DataFrame, result: ClusterResult, rows: Sequence[Request], summary: dict[str, Any]
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """``df`` (one row per request of ``rows``) with the cluster columns, and the summary's
    ``cluster`` section: layout, transfers (with each decode replica's host buffer size and
    how many transfers waited for room in it), and per replica its role, requests, steps,
    busy time and share, tokens fed, preemptions, queue peak (most requests waiting or swapped
    out after a step), KV use (mean, max), TTFT and TPOT of the finished requests whose tokens
    it sent to the client; a prefill replica also its ``prefill_ttft`` (arrival to the token
    it sampled, every request prefilled there), a decode replica its host buffer's peak
    (bytes and requests at once). Disaggregated, the section also holds the whole cluster's
    ``prefill_ttft`` statistics."""
    df = df.assign(**request_columns(result, rows))
    finished = df["status"] == "finished"
    duration = summary["duration"]
    replicas = {}
    for i, (rr, role) in enumerate(zip(result.replica_results, result.roles)):
        s = rr.steps
        busy = float(s["duration_s"].sum())
        kv = s["kv_used_blocks"] / max(rr.num_gpu_blocks, 1)
        first_here = df["prefill_replica"] == i if "prefill_replica" in df else df["replica"] == i
        decoded_here = df["replica"] == i
        replicas[str(i)] = {  # keyed by index: JSON-safe like every other section
            "role": role,
            "num_prompts": len(rr.requests),
            "num_steps": rr.num_steps,
            "busy_s": busy,
            "busy_fraction": busy / duration if duration > 0 else float("nan"),
            "prefill_tokens": int(s["num_prefill_tokens"].sum()),
            "decode_tokens": int(s["num_decode_tokens"].sum()),
            "num_preemptions": int(s["num_preempted"].sum()),
            "queue_peak": int((s["num_waiting"] + s["num_swapped"]).max(initial=0)),
            "mean_kv_cache_usage": float(np.average(kv, weights=s["duration_s"]))
            if busy > 0
            else 0.0,
            "max_kv_cache_usage": float(kv.max(initial=0.0)),
            **latency_stats("ttft", df.loc[finished & decoded_here.fillna(False), "ttft_s"]),
            **latency_stats("tpot", df.loc[finished & decoded_here.fillna(False), "tpot_s"]),
        }
        if role == "prefill":  # its own time to the token it samples (prefill_ttft_s)
            replicas[str(i)].update(
                latency_stats("prefill_ttft", df.loc[first_here.fillna(False), "prefill_ttft_s"])
            )
        if i in result.host_buffer_peak:  # a decode replica: KV landed, not admitted yet
            peak_bytes, peak_requests = result.host_buffer_peak[i]
            replicas[str(i)]["host_buffer_peak_bytes"] = peak_bytes
            replicas[str(i)]["host_buffer_peak_requests"] = peak_requests
    spec = result.roles
    out: dict[str, Any] = {
        "mode": "disaggregated" if "prefill" in spec else "aggregated",
        "num_replicas": len(spec),
        "num_gpu_blocks_total": int(sum(rr.num_gpu_blocks for rr in result.replica_results)),
    }
    if "transfer_s" in df:
        out.update(latency_stats("prefill_ttft", df["prefill_ttft_s"]))
        moved = df["transfer_s"].notna()
        out["kv_transfer"] = {
            "num_transfers": int(moved.sum()),
            "bytes": int(df.loc[moved, "kv_transfer_bytes"].sum()),
            **latency_stats("kv_transfer", df.loc[moved, "transfer_s"]),
            **latency_stats("kv_transfer_queue", df.loc[moved, "transfer_queue_s"]),
            "host_buffer_bytes": result.host_buffer_bytes,
            "num_back_pressured": result.num_back_pressured,
        }
    out["replicas"] = replicas
    return df, out
