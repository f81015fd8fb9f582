"""Cluster metrics: per-request replica columns and a per-replica summary of a cluster run
(lab/sim/cluster.py). The run's other metrics (lab/results/metrics.py) are the cluster's as a whole:
TTFT, TPOT, goodput over every request; ``kv_used_fraction`` over every replica's steps,
each step's blocks over its own replica's (a time-weighted mean of the replicas' use while
they run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from lab.core.request import Request
from lab.results.metrics import stats
from lab.sim.cluster import ClusterResult, request_columns


def add_cluster(
    df: pd.DataFrame, result: ClusterResult, rows: Sequence[Request], summary: dict[str, Any]
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """``df`` (one row per request of ``rows``) with the cluster columns appended, and the
    summary's ``cluster`` section: the layout, the transfers, one entry per replica.

    A replica's entry: its role, the requests routed to it, steps, busy time (the sum of
    its step durations) and its share of the run's duration, prompt and decode tokens it
    fed, preemptions, KV use (time-weighted mean and max), the TTFT of the requests whose
    first token it produced and the TPOT of those it decoded (finished requests).
    """
    df = df.assign(**request_columns(result, rows))
    finished = df["status"] == "finished"
    duration = summary["duration_s"]
    replicas = {}
    for i, (rr, role) in enumerate(zip(result.replica_results, result.roles)):
        s = rr.steps
        busy = float(s["duration_s"].sum())
        kv = s["kv_used_blocks"] / max(rr.num_gpu_blocks, 1)
        first_here = df["prefill_replica"] == i if "prefill_replica" in df else df["replica"] == i
        decoded_here = df["replica"] == i
        replicas[str(i)] = {  # keyed by index: JSON-safe like every other section
            "role": role,
            "num_requests": len(rr.requests),
            "num_steps": int(len(s["time_s"])),
            "busy_s": busy,
            "busy_fraction": busy / duration if duration > 0 else float("nan"),
            "prefill_tokens": int(s["num_prefill_tokens"].sum()),
            "decode_tokens": int(s["num_decode_tokens"].sum()),
            "preemptions": int(s["num_preempted"].sum()),
            "kv_used_fraction": {
                "mean": float(np.average(kv, weights=s["duration_s"])) if busy > 0 else 0.0,
                "max": float(kv.max(initial=0.0)),
            },
            "ttft_s": stats(df.loc[finished & first_here.fillna(False), "ttft_s"]),
            "tpot_s": stats(df.loc[finished & decoded_here.fillna(False), "tpot_s"]),
        }
    spec = result.roles
    out: dict[str, Any] = {
        "mode": "disaggregated" if "prefill" in spec else "aggregated",
        "num_replicas": len(spec),
        "num_gpu_blocks_total": int(sum(rr.num_gpu_blocks for rr in result.replica_results)),
    }
    if "transfer_s" in df:
        moved = df["transfer_s"].notna()
        out["kv_transfer"] = {
            "num_transfers": int(moved.sum()),
            "bytes": int(df.loc[moved, "kv_transfer_bytes"].sum()),
            "transfer_s": stats(df.loc[moved, "transfer_s"]),
            "transfer_queue_s": stats(df.loc[moved, "transfer_queue_s"]),
        }
    out["replicas"] = replicas
    return df, out
