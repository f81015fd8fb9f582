"""A served run's record: the client's measurements as a :class:`~sched_lab.results.run.Run`,
so that the results folder's writers (lab/report/folder.py) write it as they write a
simulated one.

What the client measures fills the requests table (``requests.csv``) with the lab's
definitions (:mod:`sched_lab.results.metrics`): ``arrival_s`` is when the request was sent,
``first_token_s`` / ``finish_s`` the first and last chunk with text, TTFT, TPOT and E2E
from them, ITL the gaps between chunks. ``prompt_tokens`` and ``output_tokens`` are the
trace's; ``server_prompt_tokens`` what the server's tokenizer made of the synthetic prompt,
``num_generated_tokens`` the server's completion count. What only the server knows
(queueing, preemptions, KV use, steps) is NaN in the table and None in the summary; the
steps table is empty.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.client.http import Measured
from sched_lab.core.request import Request, RequestStatus
from sched_lab.results import metrics, vllm_result
from sched_lab.results.run import Run
from sched_lab.sim.records import ReplayResult, StepRecorder

# Summary keys of the server's inside, which a client cannot see.
UNMEASURED = (
    "num_preemptions", "num_preemptions_recompute", "num_preemptions_swap",
    "num_preempted_requests", "mean_kv_cache_usage", "max_kv_cache_usage", "num_gpu_blocks",
    "num_cpu_blocks", "async_scheduling", "num_wasted_tokens", "prefix_caching",
    "prefix_cache_resumed_tokens", "prefix_cache_evicted_blocks", "limits", "cost_model",
)  # fmt: skip
_NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class ServedRun:
    """What names a served run: its label, the policy label and load it is filed under, the
    trace's info (:func:`sched_lab.run.experiment.trace_info`) and the summary's ``served``
    block (where and how the requests were sent)."""

    label: str
    policy: str
    rate_scale: float
    trace: dict[str, Any]
    served: dict[str, Any]


def served_run(
    run: ServedRun,
    rows: list[Request],
    measured: dict[str, Measured],
    wall_s: float,
    slo: dict[str, float | None],
    percentiles,
) -> Run:
    """The Run of one replay against a server.

    Args:
        rows: the trace's requests in trace order (dropped rows too: never sent); their
            status, reason, arrival and token counts are set from ``measured``.
        measured: by request id, every request sent.
        wall_s: the replay's wall time, until every request had returned (failed ones
            too): the run's duration, as vLLM's benchmark duration.
        slo: the YAML's SLOs (``slo:`` as a dict), for goodput and attainment.
    """
    df, itl, chunk_ends = _table(run, rows, measured)
    steps, ticks = StepRecorder().columns()  # a served run has no engine steps
    result = ReplayResult(rows, steps, ticks, wall_s)
    summary = {
        "policy": run.policy,
        "rate_scale": run.rate_scale,
        "trace": run.trace,
        **metrics.summarize(df, itl, result, slo, percentiles, end_s=wall_s),
    }
    summary.update({k: None for k in UNMEASURED})
    summary.update(_server_counts(df))
    summary["served"] = run.served
    vllm = vllm_result.vllm_result(
        df,
        itl,
        summary,
        chunk_ends,
        np.ones(len(chunk_ends)),
        label=run.label,
        model=run.served["model"],
        backend="openai-chat" if run.served["endpoint"] == "chat" else "openai",
        percentiles=percentiles,
    )
    vllm["burstiness"] = run.served.get("burstiness")
    vllm["max_concurrency"] = run.served.get("max_concurrency")
    itl_tail = vllm_result.tail_points(itl)
    itl = metrics.cdf_points(itl, overwrite=True)
    return Run(run.label, run.policy, run.rate_scale, result, df, itl, summary, vllm, itl_tail)


def _table(
    run: ServedRun, rows: list[Request], measured: dict[str, Measured]
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """(requests table, ITL gaps of finished requests, arrival times of their chunks after
    each one's first: the peak output rate's token times)."""
    cols: dict[str, list] = {c: [] for c in metrics.REQUEST_COLUMNS}
    extra: dict[str, list] = {"scheduled_s": [], "server_prompt_tokens": [], "http_status": []}
    gaps, later_chunks = [], []
    for r in rows:
        m = measured.get(r.request_id)
        scheduled = r.arrival_s
        if m is not None:
            _apply(r, m)
        fin = r.status is RequestStatus.FINISHED
        first = m.chunk_s[0] if fin else _NAN
        last = m.chunk_s[-1] if fin else _NAN
        if fin:
            gaps.append(np.diff(m.chunk_s))
            later_chunks.append(m.chunk_s[1:])
        values = (
            run.policy, run.rate_scale, r.request_id, r.status.value, r.reason, r.arrival_s,
            r.prompt_len, r.output_len, r.num_output_tokens, first, last, first - r.arrival_s,
            _NAN, last - r.arrival_s, _NAN, _NAN, _NAN, _NAN,
            _NAN if m is None or m.cached_tokens is None else m.cached_tokens, _NAN,
        )  # fmt: skip
        for c, v in zip(cols.values(), values):
            c.append(v)
        extra["scheduled_s"].append(scheduled)
        extra["server_prompt_tokens"].append(None if m is None else m.prompt_tokens)
        extra["http_status"].append(None if m is None else m.http_status)
    df = pd.DataFrame(cols)
    df["tpot_s"] = metrics.tpot_s(df["ttft_s"], df["e2e_s"], df["num_generated_tokens"])
    for name, values in extra.items():
        df[name] = pd.array(values, dtype="Float64" if name == "scheduled_s" else "Int64")
    itl = np.concatenate(gaps) if gaps else np.zeros(0)
    ends = np.concatenate([np.asarray(c, dtype=float) for c in later_chunks] or [np.zeros(0)])
    return df, itl, ends


def _apply(r: Request, m: Measured) -> None:
    """Set a trace request's end from its measurement (``arrival_s``: when it was sent)."""
    r.arrival_s = m.sent_s
    r.status = RequestStatus.FINISHED if m.status == "finished" else RequestStatus.ABORTED
    r.reason = m.reason
    r.num_output_tokens = m.num_output_tokens
    r.finish_s = m.chunk_s[-1] if r.status is RequestStatus.FINISHED else -1.0


def _server_counts(df: pd.DataFrame) -> dict[str, Any]:
    """The server's own counts: prompt and cached tokens it reported (None where it reported
    none), and the prefix-cache hit rate they give (vLLM's: cached / prompt tokens)."""
    sent = df[df["status"] != "dropped"]
    prompt = sent["server_prompt_tokens"].dropna()
    cached = sent.loc[sent["num_cached_tokens"].notna()]
    out: dict[str, Any] = {
        "server_prompt_tokens": int(prompt.sum()) if len(prompt) else None,
        "prefix_cache_cached_tokens": None,
        "prefix_cache_hit_rate": None,
    }
    if len(cached):
        total = cached["server_prompt_tokens"].dropna().sum()
        out["prefix_cache_cached_tokens"] = int(cached["num_cached_tokens"].sum())
        out["prefix_cache_hit_rate"] = (
            float(cached["num_cached_tokens"].sum() / total) if total else None
        )
    return out
