"""Speculative-decoding metrics, per run and per request, with vLLM's names
(vllm/v1/spec_decode/metrics.py, counters ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``):

* ``num_drafts``: verify steps (a decode that verified d' >= 1 drafts);
* ``num_draft_tokens``: drafts verified (proposals the scheduler cut are not counted);
* ``num_accepted_tokens``: drafts accepted;
* ``num_accepted_tokens_per_pos[i]``: verify steps that accepted draft i + 1;
* ``mean_acceptance_length`` = 1 + num_accepted_tokens / num_drafts;
* ``acceptance_rate_per_position[i]`` = num_accepted_tokens_per_pos[i] / num_drafts;
* ``draft_acceptance_rate`` = num_accepted_tokens / num_draft_tokens;
* the lab's ``num_reached_per_pos[i]`` (verify steps that fed draft i + 1 with drafts 1..i
  accepted) and ``conditional_acceptance_rates[i]`` = accepted / reached, the p_i that
  ``acceptance_from`` reads back (lab/sim/spec_executor.py).

All come from ``Request.spec_steps`` (one (step, d', a) per verify step).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from sched_lab.core.request import Request
from sched_lab.results.names import MISSING, format_value
from sched_lab.sim.spec_executor import ACCEPTED_KEY, RATES_KEY, REACHED_KEY

#: requests.csv columns of a spec run, in order.
REQUEST_COLUMNS = (
    "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length",
    "draft_acceptance_rate", "acceptance_rate_per_position",
)  # fmt: skip


def split_gaps(times: np.ndarray) -> np.ndarray:
    """len(times) - 1 inter-token gaps of one request's sorted token times: m tokens at t after
    the previous group's t0 give m gaps of (t - t0) / m; tokens at the first time give 0."""
    t = np.asarray(times, dtype=np.float64)
    if len(t) < 2:
        return np.zeros(0)
    start = np.empty(len(t), dtype=bool)
    start[0] = True
    np.not_equal(t[1:], t[:-1], out=start[1:])
    group = np.cumsum(start) - 1  # group index of each token
    sizes = np.bincount(group)
    at = t[start]
    per_group = np.concatenate([[0.0], np.diff(at) / sizes[1:]])
    return per_group[group[1:]]


def counts(steps: Iterable[tuple[int, int, int]], k: int) -> dict[str, list[int] | int]:
    """The counters of verify steps (step, d', a), positions 1..k."""
    accepted, reached = [0] * k, [0] * k
    drafts = draft_tokens = num_acc = 0
    for _, d, a in steps:
        drafts += 1
        draft_tokens += d
        num_acc += a
        for i in range(min(a, k)):
            accepted[i] += 1
        for i in range(min(a + 1, d, k)):
            reached[i] += 1
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": num_acc,
        ACCEPTED_KEY: accepted,
        REACHED_KEY: reached,
    }


def rates(c: dict) -> dict[str, float | list[float] | None]:
    """The derived rates of :func:`counts` (None where a denominator is 0)."""
    n, d = c["num_drafts"], c["num_draft_tokens"]
    return {
        "mean_acceptance_length": 1 + c["num_accepted_tokens"] / n if n else None,
        "acceptance_rate_per_position": [x / n for x in c[ACCEPTED_KEY]] if n else None,
        "draft_acceptance_rate": c["num_accepted_tokens"] / d if d else None,
        RATES_KEY: [a / r if r else None for a, r in zip(c[ACCEPTED_KEY], c[REACHED_KEY])],
    }


def run_summary(requests: list[Request], spec) -> dict:
    """summary.json's ``speculative`` key of a run: method, k, every counter and rate, over the
    run's requests of every status."""
    k = spec.num_speculative_tokens
    c = counts((s for r in requests for s in r.spec_steps), k)
    return {"method": spec.method, "num_speculative_tokens": k, **c, **rates(c)}


def add_request_columns(df: pd.DataFrame, rows: list[Request], k: int) -> pd.DataFrame:
    """``df`` (rows in ``rows`` order) with :data:`REQUEST_COLUMNS` (NaN / empty where a request
    verified nothing); per-position rates as one text cell, e.g. ``0.8;0.64``."""
    cols: dict[str, list] = {c: [] for c in REQUEST_COLUMNS}
    for r in rows:
        c = counts(r.spec_steps, k)
        x = rates(c)
        per_pos = x["acceptance_rate_per_position"]
        for name, v in zip(
            REQUEST_COLUMNS,
            (
                c["num_drafts"],
                c["num_draft_tokens"],
                c["num_accepted_tokens"],
                x["mean_acceptance_length"],
                x["draft_acceptance_rate"],
                ";".join(f"{p:.6g}" for p in per_pos) if per_pos else "",
            ),
        ):
            cols[name].append(np.nan if v is None else v)
    for name, values in cols.items():
        df[name] = values
    return df


def step_columns(result, num_steps: int) -> dict[str, np.ndarray]:
    """Per-step ``num_accepted_tokens`` (steps.csv of a spec run)."""
    accepted = np.zeros(num_steps, dtype=np.int64)
    for r in result.requests:
        for s, _, a in r.spec_steps:
            if s < num_steps:
                accepted[s] += a
    return {"num_accepted_tokens": accepted}


def markdown(runs) -> list[str]:
    """report.md's speculative-decoding table (empty when no run speculated)."""
    rows = [r for r in runs if r.summary.get("speculative")]
    if not rows:
        return []

    out = [
        "Speculative decoding (vLLM's metrics; mean acceptance length = 1 + accepted / "
        "verify steps; per-position rate = verify steps accepting draft i / verify steps):",
        "",
        "| run | method | k | verify steps | drafts | accepted | mean acceptance length "
        "| draft acceptance rate | per position |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r.summary["speculative"]
        pos = s["acceptance_rate_per_position"]
        out.append(
            f"| {r.label} | {s['method']} | {s['num_speculative_tokens']} | "
            f"{s['num_drafts']:,} | {s['num_draft_tokens']:,} | {s['num_accepted_tokens']:,} | "
            f"{format_value(s['mean_acceptance_length'], '.3f')} | "
            f"{format_value(s['draft_acceptance_rate'], '.1%')} | "
            + (", ".join(f"{p:.2f}" for p in pos) if pos else MISSING)
            + " |"
        )
    return [*out, ""]


def vllm_keys(summary: dict) -> dict:
    """Keys the run's vLLM-format result gains (``spec_decode_`` + vLLM's counter names)."""
    s = summary.get("speculative")
    if not s:
        return {}
    return {
        "spec_decode_num_drafts": s["num_drafts"],
        "spec_decode_num_draft_tokens": s["num_draft_tokens"],
        "spec_decode_num_accepted_tokens": s["num_accepted_tokens"],
        "spec_decode_num_accepted_tokens_per_pos": s[ACCEPTED_KEY],
        "spec_decode_mean_acceptance_length": s["mean_acceptance_length"],
        "spec_decode_draft_acceptance_rate": s["draft_acceptance_rate"],
        "spec_decode_acceptance_rate_per_position": s["acceptance_rate_per_position"],
    }
