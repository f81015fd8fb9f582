"""The sim side's comparisons, pure functions of engine and simulator results: relative
errors, per-run rows, per-step predictions and shapes, and policy rankings."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from sched_lab.results.bands import inside, relative_width
from sched_lab.results.names import band_name, latency_name, seed_median_name, upgrade_summary

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names (sched_lab.results.names)
PCTS = ("p50", "p90", "p99")
RANKED = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("e2el", "p50"))


def column(metric: str, p: str) -> str:
    """The summary's name of a compared statistic: ``p50_ttft_ms`` for ("ttft", "p50")."""
    return latency_name(p, metric)


def rel(sim: float, real: float) -> float:
    """|sim - real| / real (NaN where real is 0)."""
    return abs(sim - real) / real if real else float("nan")


def run_row(
    slice_name: str, load: float, s, r: dict, again: dict | None, banded: dict | None = None
) -> dict[str, Any]:
    """One run's table row: simulated ``s`` against the engine's summary ``r`` (and its
    repeat ``again``), summaries of either naming (:func:`sched_lab.results.names.upgrade_summary`).
    For each statistic ``X`` (``p50_ttft_ms``): ``real_X``, ``sim_X``, ``again_X`` in ms, and
    the relative errors ``err_X`` (sim against the engine) and ``spread_X`` (the repeat
    against the engine). The band columns (:func:`band_cells`) come from ``banded``, the
    summary of a seeded run of the same config, or else from ``s`` if it was seeded."""
    r = upgrade_summary(r)
    sim = s.summary
    rep = upgrade_summary(again[s.label]) if again is not None else None
    row: dict[str, Any] = {"slice": slice_name, "load": load, "policy": s.label}
    for m in METRICS:
        for p in PCTS:
            key = column(m, p)
            row[f"real_{key}"] = r[key]
            row[f"sim_{key}"] = sim[key]
            row[f"err_{key}"] = rel(sim[key], r[key])
            if rep is not None:
                row[f"again_{key}"] = rep[key]
                row[f"spread_{key}"] = rel(rep[key], r[key])
    row["err_throughput"] = rel(sim["output_throughput"], r["output_throughput"])
    if rep is not None:
        row["spread_throughput"] = rel(rep["output_throughput"], r["output_throughput"])
    row["real_preemptions"] = r["num_preemptions"]
    row["sim_preemptions"] = sim["num_preemptions"]
    bands = banded if banded is not None else sim
    if band_name(TP) in bands:  # the sim side ran seeded replicas: their 90% band
        for m in METRICS:
            for p in PCTS:
                row.update(band_cells(column(m, p), bands, r[column(m, p)]))
        row.update(band_cells(TP, bands, r[TP], "throughput"))
    return row


TP = "output_throughput"


def missing_number(summary: dict) -> str | None:
    """The first key a table row reads from an engine run's summary (either naming) that is
    not a number there, or None."""
    s = upgrade_summary(summary)
    keys = [column(m, p) for m in METRICS for p in PCTS] + [TP, "num_preemptions"]
    for key in keys:
        v = s.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return key
    return None


def band_cells(key: str, sim, real: float, name: str | None = None) -> dict[str, Any]:
    """A run's band columns of metric ``key`` (named ``name``, default ``key``): ``inside_X``
    (the engine's value in the simulator's 90% band), ``width_X`` (the band's width over
    its median) and ``band_lo_X``, ``band_hi_X``."""
    name = name or key
    band = sim[band_name(key)]
    return {
        f"inside_{name}": inside(real, band),
        f"width_{name}": relative_width(sim[seed_median_name(key)], band),
        f"band_lo_{name}": band[0],
        f"band_hi_{name}": band[1],
    }


def coverage(rows: list[dict[str, Any]], name: str) -> tuple[float, float, int]:
    """(coverage: the share of ``rows`` whose engine value of ``name`` lies inside the band,
    the median relative band width, how many rows have a band); NaNs without any."""
    import numpy as np

    had = [r for r in rows if f"inside_{name}" in r]
    if not had:
        return float("nan"), float("nan"), 0
    hits = sum(bool(r[f"inside_{name}"]) for r in had)
    return hits / len(had), float(np.median([r[f"width_{name}"] for r in had])), len(had)


def predicted_durations(model, st, async_scheduling: bool = False):
    """Each step's duration in seconds predicted by ``model`` (a CalibratedCostModel: coef,
    host_coef, block_size) from its exact batch, for one policy's steps.csv frame ``st`` in
    step order. Synchronous: S (host + device);
    asynchronous: max(S_n - H_n, H_{n+1}), H_{n+1} counted only if step n + 1 starts where
    n ends."""
    import numpy as np

    from sched_lab.sim.calibrated import design, host_design, steps_as_profile

    prof = steps_as_profile(st, model.block_size)  # the run's blocks: the profile's size
    step_s = design(prof) @ model.coef
    if not async_scheduling:
        return step_s
    host = np.zeros(len(st)) if model.host_coef is None else host_design(prof) @ model.host_coef
    host = np.clip(host, 0.0, step_s)
    start, end = st.time_s.to_numpy(float), (st.time_s + st.duration_s).to_numpy(float)
    chained = np.abs(start[1:] - end[:-1]) <= 1e-7 * np.maximum(1.0, end[:-1])
    host_next = np.append(np.where(chained, host[1:], 0.0), 0.0)
    return np.maximum(step_s - host, host_next)


def step_noise(st):
    """Each engine step's |d / median - 1| against the run's steps of the same shape (NaN
    where fewer than 5 share it)."""
    import numpy as np

    decodes = st.num_decode_tokens.to_numpy()
    key = [
        st.num_prefills.to_numpy(),
        st.num_prefill_tokens.to_numpy() // 64,
        decodes,
        st.decode_context_tokens.to_numpy() // (512 * np.maximum(decodes, 1)),
        st.prefill_context_tokens.to_numpy() // 512,
        (st.num_swap_out_blocks + st.num_swap_in_blocks).to_numpy() > 0,
    ]
    d = st.duration_s
    groups = d.groupby(key)
    med, size = groups.transform("median"), groups.transform("size")
    return ((d / med - 1).abs()).where(size >= 5).to_numpy()


def step_kind(st) -> list[str]:
    """Each engine step's kind: swap, mixed, prefill or decode."""
    out = []
    for p, d, so, si in zip(st.num_prefill_tokens, st.num_decode_tokens,
                            st.num_swap_out_blocks, st.num_swap_in_blocks):  # fmt: skip
        out.append("swap" if so + si else "mixed" if p and d else "prefill" if p else "decode")
    return out


def rank_agreement(table, equivalent: frozenset = frozenset()) -> list[dict[str, Any]]:
    """For every (slice, load), metric and policy pair whose engine difference exceeds the
    engine's spread (|a - b| > |a - a'| + |b - b'|) and which the repeat orders alike: does
    the simulator order them alike (``engine``, ``noise`` and ``sim`` differences in ms)?
    Pairs in ``equivalent`` are left out; empty without repeat columns."""
    out = []
    if f"again_{column('ttft', 'p50')}" not in table:
        return out
    for (sl, load), g in table.groupby(["slice", "load"]):
        g = g.set_index("policy")
        for m, p in RANKED:
            col = column(m, p)
            for a, b in combinations(g.index, 2):
                if (sl, load, a, b) in equivalent:
                    continue
                ra, rb = g.at[a, f"real_{col}"], g.at[b, f"real_{col}"]
                aa, ab = g.at[a, f"again_{col}"], g.at[b, f"again_{col}"]
                if any(v != v for v in (ra, rb, aa, ab)):  # NaN: no repeat
                    continue
                noise = abs(ra - aa) + abs(rb - ab)
                if abs(ra - rb) <= noise or (ra - rb) * (aa - ab) <= 0:
                    continue
                sa, sb = g.at[a, f"sim_{col}"], g.at[b, f"sim_{col}"]
                out.append({"slice": sl, "load": load, "metric": col, "pair": f"{a} vs {b}",
                            "engine": ra - rb, "noise": noise, "sim": sa - sb,
                            "agree": (ra - rb) * (sa - sb) > 0})  # fmt: skip
    return out
