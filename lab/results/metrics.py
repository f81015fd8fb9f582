"""Per-request metrics and per-policy aggregates, with vLLM's serving-benchmark definitions
(vllm/benchmarks/serve.py); percentiles by numpy's linear interpolation, as vLLM.

* TTFT: arrival to first output token. E2E: arrival to last output token.
* TPOT per request: (E2E - TTFT) / (n - 1), only for requests with n > 1 output tokens.
* ITL: every gap between consecutive output tokens, pooled over requests; tokens one step
  yields split the gap before them (:func:`lab.results.spec_metrics.split_gaps`).
* Throughput over t = 0 to the last request's end, finished requests only.
* Goodput (DistServe, OSDI'24 §2): finished requests per second that meet every SLO given
  (a 1-token request meets any TPOT SLO, as in vLLM). SLO attainment: the fraction of all
  replayed requests (rejected and aborted ones miss) that meet every SLO.
* Trace rows not replayed (status ``dropped``) are counted apart; no metric includes them.
* Queueing delay: arrival to first scheduled; preemptions per request by mode.
* Per class and tenant: :mod:`lab.results.fairness`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from lab.core.request import Request, RequestStatus
from lab.results.spec_metrics import split_gaps
from lab.sim.records import ReplayResult

PERCENTILES = (50, 90, 99)
CDF_POINTS = 2000  # points of a latency CDF kept for the plots
CDF_SAMPLE = 1 << 20  # values a CDF's quantiles are taken from, at most
REQUEST_COLUMNS = [
    "policy", "rate_scale", "request_id", "status", "reason", "arrival_s", "prompt_tokens",
    "output_tokens", "num_generated_tokens", "first_token_s", "finish_s", "ttft_s", "tpot_s",
    "e2e_s", "queue_s", "num_preemptions", "num_preemptions_recompute", "num_preemptions_swap",
    "num_cached_tokens", "num_resumed_cached_tokens",
]  # fmt: skip


def in_trace_order(trace: list[Request], replayed: list[Request]) -> list[Request]:
    """Every request of ``trace``: ``replayed`` (in replay order) with each dropped trace row
    placed after the replayed request that precedes it in ``trace``."""
    after: dict[int, list[Request]] = {}
    prev = -1  # id() of the replayed request before, -1 = none yet
    for r in trace:
        if r.status is RequestStatus.DROPPED:
            after.setdefault(prev, []).append(r)
        else:
            prev = id(r)
    if not after:
        return replayed
    out = list(after.get(-1, ()))
    for r in replayed:
        out.append(r)
        out.extend(after.get(id(r), ()))
    return out


def request_table(
    result: ReplayResult,
    policy: str,
    rate_scale: float,
    progress: Callable[[int], None] | None = None,
    requests: list[Request] | None = None,
    split_itl: bool = False,
) -> tuple[pd.DataFrame, np.ndarray]:
    """One row per request, and the pooled ITL gaps (seconds, float64) of finished requests.

    Latency columns are NaN where undefined (not finished; TPOT of 1-token outputs);
    ``num_generated_tokens`` is an integer in every row (0 for rejected and dropped requests,
    the tokens received before its end for an aborted one; the status and reason say why).

    Args:
        progress: optional callable(num_requests_done), called every 4,096 requests.
        requests: the rows, in order (default ``result.requests``; see :func:`in_trace_order`).
        split_itl: tokens that arrive together split the gap before them evenly.
    """
    requests = result.requests if requests is None else requests
    finished = (r for r in requests if r.status is RequestStatus.FINISHED)
    num_gaps = sum(result.num_token_times(r) - 1 for r in finished)
    itl = np.empty(max(num_gaps, 0))
    cols: dict[str, list] = {c: [] for c in REQUEST_COLUMNS}
    pos = 0
    for i, r in enumerate(requests):
        finished = r.status is RequestStatus.FINISHED
        first = last = np.nan
        if finished:
            times = result.token_times(r)
            first, last = times[0], times[-1]
            n = len(times) - 1
            if split_itl:
                itl[pos : pos + n] = split_gaps(times)
            else:
                np.subtract(times[1:], times[:-1], out=itl[pos : pos + n])  # np.diff, in place
            pos += n
        queue = r.first_scheduled_s - r.arrival_s if r.first_scheduled_s >= 0 else np.nan
        for c, v in zip(
            cols.values(),
            (
                policy,
                rate_scale,
                r.request_id,
                r.status.value,
                r.reason,
                r.arrival_s,
                r.prompt_len,
                r.output_len,
                r.num_output_tokens if finished else _num_received(result, r),
                first,
                r.finish_s if r.finish_s >= 0 else np.nan,
                first - r.arrival_s,
                np.nan,
                last - r.arrival_s,
                queue,
                r.num_preemptions,
                r.num_preemptions_recompute,
                r.num_preemptions_swap,
                r.num_cached_tokens,
                r.num_resumed_cached_tokens,
            ),
        ):
            c.append(v)
        if progress is not None and (i + 1) % 4096 == 0:
            progress(i + 1)
    df = pd.DataFrame(cols)
    del cols
    df["tpot_s"] = tpot_s(df["ttft_s"], df["e2e_s"], df["num_generated_tokens"])
    if any(r.class_name for r in requests):  # workload classes (traces/classes.py)
        df["class"] = [r.class_name for r in requests]
        df["tenant"] = [r.tenant for r in requests]
        df["priority"] = [r.priority for r in requests]
        df["recomputed_tokens"] = [r.num_recomputed_tokens for r in requests]
    return df, itl


def _num_received(result: ReplayResult, r: Request) -> int:
    """Output tokens a request that did not finish received before its end."""
    if r.status in (RequestStatus.REJECTED, RequestStatus.DROPPED):
        return 0
    return result.num_tokens_received(r)


def decode_output_tokens(steps: dict) -> np.ndarray:
    """Output tokens each step's decodes produced (float array, one per step): decodes less
    ``num_wasted_tokens`` plus ``num_accepted_tokens``; first tokens from prefills excluded."""
    out = steps["num_decode_tokens"].astype(float)
    if "num_wasted_tokens" in steps:
        out = out - steps["num_wasted_tokens"]
    if "num_accepted_tokens" in steps:
        out = out + steps["num_accepted_tokens"]
    return out


def cdf_points(values, max_points: int = CDF_POINTS, overwrite: bool = False) -> np.ndarray:
    """The finite values' quantiles at ``np.linspace(0, 1, k)``, k = min(count, ``max_points``),
    exact up to ``CDF_SAMPLE`` values, else of every j-th value (j = ceil(count / CDF_SAMPLE)).
    ``overwrite``: as in :func:`stats`."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.all():
        v, overwrite = v[finite], True
    if len(v) > CDF_SAMPLE:
        v, overwrite = v[:: -(-len(v) // CDF_SAMPLE)].copy(), True
    if len(v) == 0:
        return np.zeros(0)
    return np.quantile(v, np.linspace(0, 1, min(len(v), max_points)), overwrite_input=overwrite)


def tpot_s(ttft_s, e2e_s, num_tokens) -> np.ndarray:
    """Per-request TPOT = (E2E - TTFT) / (n - 1); NaN where n <= 1 (vLLM's definition)."""
    n = np.asarray(num_tokens, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (np.asarray(e2e_s, dtype=np.float64) - np.asarray(ttft_s, dtype=np.float64)) / (n - 1)
    return np.where(n > 1, out, np.nan)


def stats(values, overwrite: bool = False) -> dict[str, float]:
    """mean and P50/P90/P99 of the finite values (NaN when there are none). ``overwrite``:
    ``values`` (float64) may be reordered in place; the result is bit-identical either way."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if finite.all():
        contiguous = np.ascontiguousarray(v)
        overwrite = overwrite or contiguous is not v
        v = contiguous
    else:
        v, overwrite = v[finite], True  # a copy of our own
    del finite
    if len(v) == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    mean = float(v.mean())  # before any percentile reorders v
    return {
        "mean": mean,
        **{f"p{p}": float(np.percentile(v, p, overwrite_input=overwrite)) for p in PERCENTILES},
    }


def meets_slo(df: pd.DataFrame, slo: dict[str, float | None]) -> np.ndarray:
    """Boolean per row: finished and within every SLO given (keys ttft_s, tpot_s, e2e_s)."""
    ok = (df["status"] == "finished").to_numpy().copy()
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        limit = slo.get(key)
        if limit is not None:
            ok &= df[key].fillna(0.0).to_numpy() <= limit  # NaN TPOT: 1-token output
    return ok


def summarize(
    df: pd.DataFrame, itl: np.ndarray, result: ReplayResult, slo: dict[str, float | None]
) -> dict:
    """The aggregates of one policy's run (JSON-ready). ``itl`` (from ``request_table``) is
    reordered in place."""
    fin = df[df["status"] == "finished"]
    steps = result.steps
    end = max(
        float(df["finish_s"].max(skipna=True) or 0.0), float(result.step_end_s.max(initial=0.0))
    )
    duration = end if end > 0 else float("nan")
    counts = df["status"].value_counts()
    replayed = (df["status"] != "dropped").to_numpy()
    good = meets_slo(df, slo)
    kv_frac = steps["kv_used_blocks"] / max(result.num_gpu_blocks, 1)
    return {
        "num_requests": int(replayed.sum()),
        **{s: int(counts.get(s, 0)) for s in ("finished", "rejected", "aborted", "dropped")},
        "duration_s": duration,
        "request_throughput": len(fin) / duration,
        "output_throughput": float(fin["num_generated_tokens"].sum()) / duration,
        "total_token_throughput": float((fin["prompt_tokens"] + fin["num_generated_tokens"]).sum())
        / duration,
        "ttft_s": stats(fin["ttft_s"]),
        "tpot_s": stats(fin["tpot_s"]),
        "itl_s": stats(itl, overwrite=True),
        "e2e_s": stats(fin["e2e_s"]),
        "queue_s": stats(fin["queue_s"]),
        "slo": {k: v for k, v in slo.items() if v is not None},
        "goodput": float(good.sum()) / duration,
        "slo_attainment": float(good[replayed].mean()) if replayed.any() else float("nan"),
        "preemptions": {
            "recompute": int(df["num_preemptions_recompute"].sum()),
            "swap": int(df["num_preemptions_swap"].sum()),
            "requests_preempted": int((df["num_preemptions"] > 0).sum()),
        },
        # Time-weighted: a 50 ms step counts five times a 10 ms one.
        "kv_used_fraction": {
            "mean": float(np.average(kv_frac, weights=steps["duration_s"]))
            if len(kv_frac) and steps["duration_s"].sum() > 0
            else 0.0,
            "max": float(kv_frac.max(initial=0.0)),
        },
        "num_gpu_blocks": result.num_gpu_blocks,
        "num_steps": int(len(steps["time_s"])),
        # Async scheduling: decode slots of requests whose last token was already sampled.
        "async_scheduling": result.async_scheduling,
        "num_wasted_tokens": int(steps["num_wasted_tokens"].sum()),
        **prefix_cache_summary(df, result),
    }


def prefix_cache_summary(df: pd.DataFrame, result: ReplayResult) -> dict:
    """summary.json's ``prefix_caching``, ``prefix_cache_hit_rate`` (vLLM's: prompt tokens cached
    at first admission / prompt tokens admitted), ``prefix_cache_resumed_tokens`` (found again
    after recompute preemptions, not in the hit rate) and ``prefix_cache_evicted_blocks``."""
    admitted = df["queue_s"].notna()
    prompt = int(df.loc[admitted, "prompt_tokens"].sum())
    cached = int(df["num_cached_tokens"].sum())
    return {
        "prefix_caching": result.prefix_caching,
        "prefix_cache_hit_rate": cached / prompt if prompt else float("nan"),
        "prefix_cache_cached_tokens": cached,
        "prefix_cache_resumed_tokens": int(df["num_resumed_cached_tokens"].sum()),
        "prefix_cache_evicted_blocks": result.num_evicted_blocks,
    }
