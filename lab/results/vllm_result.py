"""A run's results in the format of vLLM's serving benchmark (``vllm bench serve
--save-result``), so that scripts written for its JSON files read ours.

Names, units and definitions: ``vllm/benchmarks/serve.py`` (``calculate_metrics``,
``benchmark``, ``main_async``): flat keys, latencies in ms, ``mean_`` / ``median_`` / ``std_``
(population) and ``p{P}_`` per ``--metric-percentiles`` for ``ttft``, ``tpot``, ``itl`` and
``e2el``; ``completed``, ``failed``; ``request_throughput``, ``request_goodput`` (None without
SLOs), ``output_throughput``, ``total_token_throughput``, ``max_output_tokens_per_s``,
``max_concurrent_requests``.

The lab adds ``max_{metric}_ms``, ``metric_percentiles``, ``percentile_metrics``,
``goodput_slo_ms``, ``rate_scale``, ``policy``, ``slo_attainment``. ``request_rate`` is the
trace's offered load as replayed (req/s), not vLLM's configured Poisson rate.
"""

from __future__ import annotations

import math
import os
import re
import time

import numpy as np
import pandas as pd

from sched_lab.results.gaps import TokenGaps
from sched_lab.results.metrics import (
    DEFAULT_PERCENTILES,
    DecodeOutputTokens,
    latency_stats,
    offered_rate,
)
from sched_lab.results.names import LATENCIES, latency_name, percentile_word

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's --percentile-metrics, all of them
# The request table's columns vllm_result reads
_COLUMNS = ("status", "arrival_s", "first_token_s", "prompt_tokens", "num_generated_tokens",
            *(column for _, column in LATENCIES.values() if column))  # fmt: skip


def tail_points(
    values_s, decades: float = 6.0, points: int = 240, overwrite: bool = False
) -> np.ndarray:
    """(fraction of values above, value) pairs, shape (2, n), for a log-scale tail plot:
    quantiles at 1 - 10**-x, x from 1 to ``decades``, then the max at 1 / count.
    ``overwrite``: ``values_s`` (float64) may be reordered in place (no copy of it). Also of
    a :class:`sched_lab.results.gaps.TokenGaps`."""
    if isinstance(values_s, TokenGaps):
        n = len(values_s)
        if not n:
            return np.zeros((2, 0))
        above = 10.0 ** -np.linspace(1.0, decades, points)
        above = above[above >= 1.0 / n]
        q = values_s.quantile(1.0 - above)
        return np.array([np.append(above, 1.0 / n), np.append(q, values_s.max())])
    v = np.asarray(values_s, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.all():
        v, overwrite = v[finite], True  # a copy of our own
    del finite
    if len(v) == 0:
        return np.zeros((2, 0))
    above = 10.0 ** -np.linspace(1.0, decades, points)
    above = above[above >= 1.0 / len(v)]
    q = np.quantile(v, 1.0 - above, overwrite_input=overwrite)
    return np.array([np.append(above, 1.0 / len(v)), np.append(q, v.max())])


def peak_output_rate(df: pd.DataFrame, step_end_s, num_decode_tokens, rows: int = 1 << 20) -> float:
    """Output tokens in the busiest whole second, counted from the first arrival (vLLM's
    1-second buckets): decode tokens (whole numbers) at their steps' ends plus each first
    token. Steps are binned ``rows`` at a time: the temporaries are a part's, not the run's.
    ``num_decode_tokens``: an array, or anything sliced like one (rows ``lo:hi`` read at
    a time: :class:`sched_lab.results.metrics.DecodeOutputTokens`)."""
    start = float(np.nanmin(df["arrival_s"])) if len(df) else 0.0
    ends = np.asarray(step_end_s, dtype=float)
    first = df["first_token_s"].to_numpy(dtype=float) - start
    first = first[np.isfinite(first)]
    if not len(ends) and not len(first):
        return 0.0
    # sparse 1-second bins (a run may span more simulated seconds than memory holds), summed
    # part by part, then the parts' sums: whole numbers, so exact in any grouping
    parts = [
        _per_second(
            ends[lo : lo + rows] - start, np.asarray(num_decode_tokens[lo : lo + rows], float)
        )
        for lo in range(0, len(ends), rows)
    ]
    parts.append(_per_second(first, np.ones(len(first))))
    bins, sums = (np.concatenate(x) for x in zip(*parts))
    return float(_per_second(bins, sums)[1].max())


def _per_second(times_s: np.ndarray, amount: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(whole seconds that hold a time, ``amount`` summed over each), for times in seconds
    (negative ones count in second 0)."""
    sec = times_s.astype(np.int64).clip(0)
    bins, where = np.unique(sec, return_inverse=True)
    return bins, np.bincount(where, amount, len(bins))


def peak_concurrency(df: pd.DataFrame) -> int:
    """The most finished requests in flight at once, over half-open [arrival, arrival + E2E)."""
    fin = df[df["status"] == "finished"]
    start = fin["arrival_s"].to_numpy(dtype=float)
    end = start + fin["e2e_s"].to_numpy(dtype=float)
    times = np.concatenate([start, end])
    delta = np.concatenate([np.ones(len(start)), -np.ones(len(end))])
    order = np.lexsort((delta, times))  # an end before a start at the same time
    return int(np.cumsum(delta[order]).max(initial=0))


def vllm_result(
    df: pd.DataFrame,
    itl_s: np.ndarray,
    summary: dict,
    step_end_s: np.ndarray,
    num_decode_tokens: np.ndarray | DecodeOutputTokens,
    *,
    label: str,
    model: str,
    backend: str,
    percentiles=DEFAULT_PERCENTILES,
    date: str = "",
) -> dict:
    """The run's ``vllm bench serve --save-result`` dict.

    Args:
        df: the run's request table (sched_lab.results.metrics.request_table).
        itl_s: every inter-token gap of the finished requests (seconds).
        summary: the run's summary (sched_lab.results.metrics.summarize).
        step_end_s, num_decode_tokens: per step, its end and its decodes' output tokens
            (:func:`sched_lab.results.metrics.decode_output_tokens`, or a
            :class:`sched_lab.results.metrics.DecodeOutputTokens` of them).
        date: vLLM's ``date`` key (:func:`result_date`).
    """
    # the rows replayed, and of those the finished ones, with the columns read here only
    columns = [c for c in _COLUMNS if c in df]
    replayed = df.loc[(df["status"] != "dropped").to_numpy(), columns]
    fin = replayed[replayed["status"] == "finished"]
    duration = summary["duration"]
    slo = summary.get("slo") or {}
    out_tokens = int(fin["num_generated_tokens"].sum())
    in_tokens = int(fin["prompt_tokens"].sum())
    result = {
        "date": date,
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": None,
        "num_prompts": len(replayed),
        "request_rate": _finite(offered_rate(replayed["arrival_s"].to_numpy())),
        "burstiness": None,
        "max_concurrency": None,
        "duration": _finite(duration),
        "completed": len(fin),
        "failed": len(replayed) - len(fin),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": _finite(summary["request_throughput"]),
        "request_goodput": _finite(summary["request_goodput"]) if slo else None,
        "output_throughput": _finite(summary["output_throughput"]),
        "total_token_throughput": _finite(summary["total_token_throughput"]),
        "max_output_tokens_per_s": peak_output_rate(fin, step_end_s, num_decode_tokens),
        "max_concurrent_requests": peak_concurrency(fin),
    }
    for name in METRICS:
        stats = ("mean", "median", "std", *percentiles, "max")
        keys = [latency_name(st, name) for st in stats]
        if all(k in summary for k in keys):  # the summary's own numbers
            found = {k: summary[k] for k in keys}
        else:
            column = LATENCIES[name][1]
            v = itl_s if column is None else fin[column].to_numpy(dtype=float)
            found = latency_stats(name, v, percentiles)
        # 0.0 where there are no values, as vLLM
        result.update({k: x if math.isfinite(x) else 0.0 for k, x in found.items()})
    result.update(
        {
            "percentile_metrics": ",".join(METRICS),
            "metric_percentiles": ",".join(percentile_word(p) for p in percentiles),
            "goodput_slo_ms": {_SLO_NAMES[k]: v * 1e3 for k, v in slo.items()} or None,
            "slo_attainment": _finite(summary["slo_attainment"]) if slo else None,
            "policy": summary.get("policy"),
            "rate_scale": summary.get("rate_scale"),
        }
    )
    return result


_SLO_NAMES = {"ttft_s": "ttft", "tpot_s": "tpot", "e2e_s": "e2el"}


def result_date(now: float | None = None) -> str:
    """vLLM's ``date``, ``%Y%m%d-%H%M%S`` in local time: of ``now`` (seconds since the epoch),
    else of ``SOURCE_DATE_EPOCH`` when set (reproducible files), else of the present."""
    if now is None:
        epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
        now = float(epoch) if epoch.isdigit() else time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def result_filename(label: str, request_rate: float | None, model: str) -> str:
    """vLLM's default name, ``{label}-{request_rate}qps-{model}.json``, without its date;
    characters a file name should not hold become _."""
    rate = "inf" if request_rate is None else f"{request_rate:.2f}"
    name = f"{label}-{rate}qps-{model.split('/')[-1]}.json"
    return re.sub(r"[^A-Za-z0-9._+@-]", "_", name)


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
