"""Per-request metrics and per-policy aggregates, with vLLM's serving-benchmark definitions
(vllm/benchmarks/serve.py); percentiles by numpy's linear interpolation, as vLLM.

* TTFT: arrival to first output token. E2E: arrival to last output token.
* TPOT per request: (E2E - TTFT) / (n - 1), only for requests with n > 1 output tokens.
* ITL: every gap between consecutive output tokens, pooled over requests; tokens one step
  yields split the gap before them (:func:`sched_lab.results.spec_metrics.split_gaps`).
* Throughput over t = 0 to the last request's end, finished requests only.
* Goodput (DistServe, OSDI'24 §2): finished requests per second that meet every SLO given
  (a 1-token request meets any TPOT SLO, as in vLLM). SLO attainment (``slo_attainment``):
  the fraction of all replayed requests that finished within every SLO; rejected, aborted
  and unfinished requests (the run stopped before they ended) count as misses, as in
  DistServe's and vLLM's goodput. ``slo_attainment_finished``: the same over finished
  requests only (how well served the requests that were served are).
* Trace rows not replayed (status ``dropped``) are counted apart; no metric includes them.
* Queueing delay: arrival to first scheduled; preemptions per request by mode.
* LoRA (a ``lora:`` section): adapters loaded and distinct adapters per step
  (:func:`lora_summary`).
* Per class and tenant: :mod:`sched_lab.results.fairness`.

A summary's keys are the names of :mod:`sched_lab.results.names` (vLLM's where vLLM has one):
latencies in ms as ``{mean,median,std,p<P>,max}_{ttft,tpot,itl,e2el,queue}_ms``.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

import numpy as np
import pandas as pd

from sched_lab.core.request import Request, RequestStatus
from sched_lab.results.gaps import (
    Joined,
    TokenGaps,
    pairwise_sums,
    population_std,
    spans_of_pieces,
)
from sched_lab.results.names import LATENCIES, percentile_word
from sched_lab.results.spec_metrics import split_gaps
from sched_lab.sim.records import ReplayResult

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0, 99.9)  # vLLM's --metric-percentiles here
REPORT_PERCENTILES = (50.0, 90.0, 99.0)  # in every summary, whatever vLLM's file holds
SLO_KEYS = ("ttft_s", "tpot_s", "e2e_s")  # the slo: block's keys
FAILED = ("rejected", "aborted", "unfinished")  # replayed, not finished: vLLM's "failed"
CDF_POINTS = 2000  # points of a latency CDF kept for the plots
CDF_SAMPLE = 1 << 20  # values a CDF's quantiles are taken from, at most
GAPS_IN_MEMORY = 1 << 20  # a run's ITL gaps kept as an array up to this many, else TokenGaps
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
) -> tuple[pd.DataFrame, np.ndarray | TokenGaps]:
    """One row per request, and the pooled ITL gaps (seconds, float64) of finished requests:
    an array, or for many (:func:`_token_spans`) a :class:`TokenGaps` with its statistics.

    Latency columns are NaN where undefined (not finished; TPOT of 1-token outputs);
    ``num_generated_tokens`` is an integer in every row (0 for rejected and dropped requests,
    the tokens received before its end for an aborted one; the status and reason say why).

    Args:
        progress: optional callable(num_requests_done), called when the table is done.
        requests: the rows, in order (default ``result.requests``; see :func:`in_trace_order`).
        split_itl: tokens that arrive together split the gap before them evenly.
    """
    requests = result.requests if requests is None else requests
    n = len(requests)
    fin = np.fromiter((r.status is RequestStatus.FINISHED for r in requests), bool, n)
    first, last, itl = _token_spans(result, [r for r, f in zip(requests, fin) if f], split_itl)
    first_s = np.full(n, np.nan)
    last_s = np.full(n, np.nan)
    first_s[fin], last_s[fin] = first, last
    del first, last
    # Columns made one at a time, each from a list freed once it is an array or a Series.
    arrival = np.fromiter((r.arrival_s for r in requests), np.float64, n)
    cols = {
        "policy": _series([policy] * n),
        "rate_scale": _series([rate_scale] * n),
        "request_id": _series([r.request_id for r in requests]),
        "status": _series([r.status.value for r in requests]),
        "reason": _series([r.reason for r in requests]),
        "arrival_s": arrival,
        "prompt_tokens": _ints([r.prompt_len for r in requests]),
        "output_tokens": _ints([r.output_len for r in requests]),
        "num_generated_tokens": _ints(
            [r.num_output_tokens if f else _num_received(result, r) for r, f in zip(requests, fin)]
        ),
        "first_token_s": first_s,
    }
    finish = np.fromiter((r.finish_s for r in requests), np.float64, n)
    cols["finish_s"] = np.where(finish >= 0, finish, np.nan)
    del finish
    cols["ttft_s"] = first_s - arrival
    cols["tpot_s"] = np.full(n, np.nan)
    cols["e2e_s"] = last_s - arrival
    del first_s, last_s
    scheduled = np.fromiter((r.first_scheduled_s for r in requests), np.float64, n)
    cols["queue_s"] = np.where(scheduled >= 0, scheduled - arrival, np.nan)
    del scheduled, arrival
    for c in ("num_preemptions", "num_preemptions_recompute", "num_preemptions_swap",
              "num_cached_tokens", "num_resumed_cached_tokens"):  # fmt: skip
        cols[c] = _ints([getattr(r, c) for r in requests])
    if progress is not None:
        progress(len(requests))
    df = pd.DataFrame(cols, copy=False)  # the arrays above, not a consolidated copy of them
    del cols
    df["tpot_s"] = tpot_s(df["ttft_s"], df["e2e_s"], df["num_generated_tokens"])
    if any(r.class_name for r in requests):  # workload classes (traces/classes.py)
        df["class"] = [r.class_name for r in requests]
        df["tenant"] = [r.tenant for r in requests]
        df["priority"] = [r.priority for r in requests]
        df["recomputed_tokens"] = [r.num_recomputed_tokens for r in requests]
    for column in ("lora_name", "cache_salt"):  # prefix-cache key names, where a trace has them
        if any(getattr(r, column) for r in requests):
            df[column] = [getattr(r, column) for r in requests]
    return df, itl


def _series(values: list) -> pd.Series | list:
    """A request table's column made from ``values`` as the DataFrame would make it (the
    list itself where empty: the DataFrame gives an empty list float64, a Series object)."""
    return pd.Series(values) if values else values


def _ints(values: list) -> np.ndarray | list:
    """int64 where every value fits (as pandas would infer), else the list as it is."""
    try:
        return np.array(values, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return values


def _token_spans(
    result: ReplayResult, finished: list[Request], split_itl: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first token time, last token time) of each finished request, and the pooled gaps
    between their consecutive tokens in request order (seconds; ``split_itl``: see
    :func:`request_table`). Without speculative tokens, where ``result`` keeps its token
    times as :class:`ReplayResult` does (a cluster's do not), the times of every request are
    gathered and ordered at once, and more than :data:`GAPS_IN_MEMORY` gaps are a
    :class:`TokenGaps`, not an array."""
    own_times = type(result).token_times is not ReplayResult.token_times  # a cluster's
    if own_times or split_itl or any(r.spec_steps for r in finished):
        return _token_spans_each(result, finished, split_itl)
    end = result.step_end_s
    # Pieces of tokens: each prefill token (its step), each decode segment (its ticks'
    # steps). A request's pieces ordered by their first token's time, then expanded, give
    # its tokens in time order unless pieces overlap in time (then everything is sorted).
    # (made from the requests' lists straight into arrays: no Python int a token)
    n = len(finished)
    chain = itertools.chain.from_iterable
    # (mapped over the requests: no Python frame a request)
    prefill = operator.attrgetter("prefill_token_steps")
    decode = operator.attrgetter("decode_segments")
    num_prefill = np.fromiter(map(len, map(prefill, finished)), np.int64, n)
    num_segments = np.fromiter(map(len, map(decode, finished)), np.int64, n)
    steps = np.fromiter(  # each prefill token's step
        chain(map(prefill, finished)), np.int64, int(num_prefill.sum())
    )
    segments = np.fromiter(  # (first tick, end tick) of each decode segment
        chain(chain(map(decode, finished))), np.int64, 2 * int(num_segments.sum())
    ).reshape(-1, 2)
    a_, b_ = segments[:, 0], segments[:, 1]
    source = Joined(steps, result.tick_steps)  # each token's step, by position (below)
    start = np.concatenate([np.arange(len(steps), dtype=np.int64), len(steps) + a_])
    size = np.concatenate([np.ones(len(steps), dtype=np.int64), b_ - a_])
    del segments, a_, b_
    who = np.arange(n, dtype=np.int64)  # each piece's request (its index among ``finished``)
    piece_who = np.concatenate([np.repeat(who, num_prefill), np.repeat(who, num_segments)])
    del who, num_prefill, num_segments
    keep = size > 0
    start, size, piece_who = start[keep], size[keep], piece_who[keep]
    order = np.lexsort((end[source[start]], piece_who))
    start, size, piece_who = start[order], size[order], piece_who[order]
    del order
    counts = np.bincount(piece_who, weights=size, minlength=n).astype(np.int64)
    if n and counts.min() == 0:  # a finished request always has a token
        return _token_spans_each(result, finished, split_itl)
    if int(counts.sum()) - n > GAPS_IN_MEMORY:
        pooled = TokenGaps.of_pieces(source, end, start, size, piece_who, counts)
        if pooled is not None:  # (None: pieces overlap in time, sorted below)
            return pooled.first, pooled.last, pooled
    first, last = np.empty(n), np.empty(n)
    gaps = np.empty(max(int(counts.sum()) - n, 0))
    # Requests in chunks of about SPAN_TOKENS tokens: the token arrays are a chunk's, not
    # the run's (each request's gaps and order are its own, so the values are the same).
    tokens_before = np.concatenate([[0], np.cumsum(counts)])
    cuts = np.unique(np.searchsorted(tokens_before, np.arange(0, tokens_before[-1], SPAN_TOKENS)))
    cuts = np.append(cuts[cuts < n], n) if n else np.zeros(1, dtype=np.int64)
    piece_at = np.searchsorted(piece_who, cuts)
    for lo, hi, p0, p1 in zip(cuts[:-1], cuts[1:], piece_at[:-1], piece_at[1:]):
        g0 = int(tokens_before[lo]) - int(lo)  # gaps of the requests before this chunk
        first[lo:hi], last[lo:hi], chunk_gaps = spans_of_pieces(
            source, end, start[p0:p1], size[p0:p1], piece_who[p0:p1] - lo, counts[lo:hi]
        )
        gaps[g0 : g0 + len(chunk_gaps)] = chunk_gaps
    return first, last, gaps


SPAN_TOKENS = 1 << 20  # tokens whose times one chunk of _token_spans gathers at once


def _token_spans_each(
    result: ReplayResult, finished: list[Request], split_itl: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_token_spans`, request by request (tokens that speculative steps added)."""
    num_gaps = sum(result.num_token_times(r) - 1 for r in finished)
    itl = np.empty(max(num_gaps, 0))
    first, last = np.empty(len(finished)), np.empty(len(finished))
    pos = 0
    for i, r in enumerate(finished):
        times = result.token_times(r)
        first[i], last[i] = times[0], times[-1]
        n = len(times) - 1
        if split_itl:
            itl[pos : pos + n] = split_gaps(times)
        else:
            np.subtract(times[1:], times[:-1], out=itl[pos : pos + n])  # np.diff, in place
        pos += n
    return first, last, itl


def _num_received(result: ReplayResult, r: Request) -> int:
    """Output tokens a request that did not finish received before its end."""
    if r.status in (RequestStatus.REJECTED, RequestStatus.DROPPED):
        return 0
    return result.num_tokens_received(r)


# the step columns decode_output_tokens reads (those of them a run has)
DECODE_COLUMNS = ("num_decode_tokens", "num_wasted_tokens", "num_accepted_tokens")


def decode_output_tokens(steps: dict) -> np.ndarray:
    """Output tokens each step's decodes produced (float array, one per step): decodes less
    ``num_wasted_tokens`` plus ``num_accepted_tokens``; first tokens from prefills excluded."""
    out = steps["num_decode_tokens"].astype(float)
    if "num_wasted_tokens" in steps:
        out = out - steps["num_wasted_tokens"]
    if "num_accepted_tokens" in steps:
        out = out + steps["num_accepted_tokens"]
    return out


class DecodeOutputTokens:
    """:func:`decode_output_tokens` of a replay's steps, as ``tokens[lo:hi]`` (a float array)
    made on slicing from ``result.step_rows``, :data:`STEP_ROWS` steps at a time: the
    column without the whole columns it is made of. ``len``: the steps."""

    def __init__(self, result: ReplayResult) -> None:
        self.result = result

    def __len__(self) -> int:
        return self.result.num_steps

    def __getitem__(self, rows: slice) -> np.ndarray:
        lo, hi, stride = rows.indices(len(self))
        if stride != 1:
            raise ValueError("DecodeOutputTokens: rows lo:hi only")
        out = np.empty(max(hi - lo, 0))
        for a in range(lo, hi, STEP_ROWS):
            b = min(a + STEP_ROWS, hi)
            rows = self.result.step_rows(a, b, DECODE_COLUMNS)
            out[a - lo : b - lo] = decode_output_tokens(rows)
        return out


STEP_ROWS = 1 << 18  # steps whose columns DecodeOutputTokens makes at a time


def cdf_points(values, max_points: int = CDF_POINTS, overwrite: bool = False) -> np.ndarray:
    """The finite values' quantiles at ``np.linspace(0, 1, k)``, k = min(count, ``max_points``),
    exact up to ``CDF_SAMPLE`` values, else of every j-th value (j = ceil(count / CDF_SAMPLE));
    of a :class:`TokenGaps`, exact. ``overwrite``: as in :func:`latency_stats`."""
    if isinstance(values, TokenGaps):
        n = len(values)
        return values.quantile(np.linspace(0, 1, min(n, max_points))) if n else np.zeros(0)
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


def latency_stats(
    metric: str, values_s, percentiles=DEFAULT_PERCENTILES, overwrite: bool = False
) -> dict[str, float]:
    """``mean_/median_/std_/p{P}_/max_{metric}_ms`` of the finite values (seconds in, ms
    out; :mod:`sched_lab.results.names`), NaN when there are none. std is the population's, as
    vLLM. ``values_s``: an array, or a :class:`TokenGaps` (the same numbers). ``overwrite``:
    an array (float64) may be reordered in place; the result is bit-identical either way."""
    names = ["mean", "median", "std"] + [f"p{percentile_word(p)}" for p in percentiles] + ["max"]
    if isinstance(values_s, TokenGaps):  # the same numbers, from what the gaps are made of
        if not len(values_s):
            return {f"{s}_{metric}_ms": float("nan") for s in names}
        g = values_s
        qs = g.percentile(list(percentiles)) if percentiles else []
        return _stats_ms(metric, percentiles, g.mean(), g.median(), g.std(), qs, g.max())
    v = np.asarray(values_s, dtype=np.float64)
    finite = np.isfinite(v)
    if finite.all():
        contiguous = np.ascontiguousarray(v)
        overwrite = overwrite or contiguous is not v
        v = contiguous
    else:
        v, overwrite = v[finite], True  # a copy of our own
    del finite
    if len(v) == 0:
        return {f"{s}_{metric}_ms": float("nan") for s in names}
    # mean and std before anything reorders v (their sums depend on the order)
    mean, std, top = float(v.mean()), population_std(v), float(v.max())
    median = float(np.median(v, overwrite_input=overwrite))
    qs = np.percentile(v, list(percentiles), overwrite_input=overwrite) if percentiles else []
    return _stats_ms(metric, percentiles, mean, median, std, qs, top)


def _stats_ms(metric: str, percentiles, mean, median, std, qs, top) -> dict[str, float]:
    """:func:`latency_stats`'s dict from the statistics in seconds."""
    out = {f"mean_{metric}_ms": mean * 1e3, f"median_{metric}_ms": median * 1e3}
    out[f"std_{metric}_ms"] = std * 1e3
    for p, q in zip(percentiles, qs):
        out[f"p{percentile_word(p)}_{metric}_ms"] = float(q) * 1e3
    out[f"max_{metric}_ms"] = top * 1e3
    return out


def meets_slo(df: pd.DataFrame, slo: dict[str, float | None]) -> np.ndarray:
    """Boolean per row: finished and within every SLO given (keys ttft_s, tpot_s, e2e_s)."""
    ok = (df["status"] == "finished").to_numpy().copy()
    for key in SLO_KEYS:
        limit = slo.get(key)
        if limit is not None:
            ok &= _within(df, key, limit)
    return ok


def _within(df: pd.DataFrame, key: str, limit: float) -> np.ndarray:
    return df[key].fillna(0.0).to_numpy() <= limit  # NaN TPOT: 1-token output


def offered_rate(arrival_s) -> float:
    """Requests per second of arrivals: (n - 1) / (last - first); NaN for < 2 or one instant."""
    a = np.asarray(arrival_s, dtype=float)
    a = a[np.isfinite(a)]
    if len(a) < 2 or a.max() <= a.min():
        return float("nan")
    return (len(a) - 1) / float(a.max() - a.min())


def slo_attainment(good: np.ndarray, status: pd.Series) -> dict[str, float]:
    """``slo_attainment`` (``good`` over replayed rows: every request but dropped trace rows)
    and ``slo_attainment_finished`` (over finished rows); NaN where there is no row.

    Args:
        good: boolean per row, e.g. :func:`meets_slo` (never True for an unfinished row).
        status: requests.csv's ``status`` column, aligned with ``good``."""
    out = {}
    for key, rows in (
        ("slo_attainment", (status != "dropped").to_numpy()),
        ("slo_attainment_finished", (status == "finished").to_numpy()),
    ):
        out[key] = float(good[rows].mean()) if rows.any() else float("nan")
    return out


def slo_attainment_by_slo(df: pd.DataFrame, slo: dict[str, float | None]) -> dict[str, float]:
    """``slo_attainment_{ttft,tpot,e2el}``: per SLO given, the fraction of replayed requests
    that finished within that one SLO (which SLO binds a load)."""
    replayed = (df["status"] != "dropped").to_numpy()
    fin = (df["status"] == "finished").to_numpy()
    out = {}
    for key, name in zip(SLO_KEYS, ("ttft", "tpot", "e2el")):
        limit = slo.get(key)
        if limit is not None:
            ok = fin & _within(df, key, limit)
            out[f"slo_attainment_{name}"] = (
                float(ok[replayed].mean()) if replayed.any() else float("nan")
            )
    return out


def summary_percentiles(percentiles) -> tuple[float, ...]:
    """The percentiles a summary holds: ``percentiles`` and those report.md shows (50, 90,
    99), ascending."""
    return tuple(sorted({float(p) for p in (*REPORT_PERCENTILES, *percentiles)}))


def summarize(
    df: pd.DataFrame,
    itl: np.ndarray,
    result: ReplayResult,
    slo: dict[str, float | None],
    percentiles=DEFAULT_PERCENTILES,
    end_s: float | None = None,
) -> dict:
    """The aggregates of one policy's run (JSON-ready), flat, under the names of
    :mod:`sched_lab.results.names`. ``itl`` (from ``request_table``) is reordered in place.
    The duration runs from 0 to the last finish or step end, or to ``end_s`` if later (a
    served run: when its last response returned, failed ones included, as vLLM's benchmark
    duration)."""
    percentiles = summary_percentiles(percentiles)
    # the finished rows, with the columns read here only
    latencies = [column for _, column in LATENCIES.values() if column]
    fin = df.loc[
        (df["status"] == "finished").to_numpy(),
        ["prompt_tokens", "num_generated_tokens", *latencies],
    ]
    steps = result.steps
    end = max(
        float(df["finish_s"].max(skipna=True) or 0.0),
        float(result.step_end_s.max(initial=0.0)),
        end_s or 0.0,
    )
    duration = end if end > 0 else float("nan")
    counts = df["status"].value_counts()
    replayed = (df["status"] != "dropped").to_numpy()
    good = meets_slo(df, slo)
    mean_kv, max_kv, wasted = step_usage(result)
    recompute = int(df["num_preemptions_recompute"].sum())
    swap = int(df["num_preemptions_swap"].sum())
    out = {
        "num_prompts": int(replayed.sum()),
        "completed": int(counts.get("finished", 0)),
        "failed": int(sum(counts.get(s, 0) for s in FAILED)),
        **{s: int(counts.get(s, 0)) for s in (*FAILED, "dropped")},
        "duration": duration,
        "request_rate": offered_rate(df.loc[replayed, "arrival_s"].to_numpy()),
        "request_throughput": len(fin) / duration,
        "output_throughput": float(fin["num_generated_tokens"].sum()) / duration,
        "total_token_throughput": float((fin["prompt_tokens"] + fin["num_generated_tokens"]).sum())
        / duration,
    }
    for name, (_, column) in LATENCIES.items():
        values = itl if column is None else fin[column]
        out.update(latency_stats(name, values, percentiles, overwrite=column is None))
    out.update(
        {
            "slo": {k: v for k, v in slo.items() if v is not None},
            "request_goodput": float(good.sum()) / duration,
            **slo_attainment(good, df["status"]),
            **slo_attainment_by_slo(df, slo),
            "num_preemptions": recompute + swap,
            "num_preemptions_recompute": recompute,
            "num_preemptions_swap": swap,
            "num_preempted_requests": int((df["num_preemptions"] > 0).sum()),
            "mean_kv_cache_usage": mean_kv,
            "max_kv_cache_usage": max_kv,
            "num_gpu_blocks": result.num_gpu_blocks,
            "num_steps": result.num_steps,
            # Async scheduling: decode slots of requests whose last token was already sampled.
            "async_scheduling": result.async_scheduling,
            "num_wasted_tokens": wasted,
            **prefix_cache_summary(df, result),
        }
    )
    if "num_lora_loads" in steps:  # a lora: section (lab/core/lora.py)
        out.update(lora_summary(steps))
    return out


def step_usage(result: ReplayResult) -> tuple[float, float, int]:
    """The summary's ``mean_kv_cache_usage`` (time-weighted: a 50 ms step counts five times
    a 10 ms one; ``np.average`` of the steps' KV fractions weighted by their durations, 0.0
    without steps or time), ``max_kv_cache_usage`` and ``num_wasted_tokens``, from
    ``result.step_rows`` :data:`STEP_ROWS` steps at a time: numpy's pairwise sums of the
    whole columns walked in runs (:func:`sched_lab.results.gaps.pairwise_sums`), the same
    numbers to the last bit."""
    blocks = max(result.num_gpu_blocks, 1)
    top, wasted = 0.0, 0

    def sums(lo: int, k: int) -> np.ndarray:  # each run's, in order
        nonlocal top, wasted
        s = result.step_rows(lo, lo + k, ("kv_used_blocks", "duration_s", "num_wasted_tokens"))
        kv, dur = s["kv_used_blocks"] / blocks, s["duration_s"]
        top = max(top, float(kv.max(initial=0.0)))
        wasted += int(s["num_wasted_tokens"].sum())
        return np.array([np.sum(np.multiply(kv, dur)), np.sum(dur)])

    n = result.num_steps
    if not n:
        return 0.0, 0.0, 0
    weighted, busy = pairwise_sums(n, sums, max(STEP_ROWS, 128))
    return (float(weighted / busy) if busy > 0 else 0.0), top, wasted


def lora_summary(steps: dict[str, np.ndarray]) -> dict:
    """summary.json's ``num_lora_loads`` (adapters loaded into a GPU slot over the run) and
    ``mean_loras_per_step`` (distinct adapters per step, mean over steps)."""
    loras = steps["num_loras"]
    return {
        "num_lora_loads": int(steps["num_lora_loads"].sum()),
        "mean_loras_per_step": float(loras.mean()) if len(loras) else 0.0,
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
