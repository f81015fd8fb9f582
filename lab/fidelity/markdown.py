"""The sim side's markdown: headline, setup, plan match, step-level error, distribution
errors, the saturated regime and rankings, filled into :data:`TEMPLATE`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sched_lab.fidelity.compare import METRICS, PCTS, column, coverage
from sched_lab.fidelity.protocol import ROOT
from sched_lab.results.names import LATENCIES, MISSING, is_missing

COLS = [(m, p) for m in METRICS for p in PCTS]
TP50 = column("ttft", "p50")  # p50_ttft_ms


def pct(v: float) -> str:
    """A fraction as a percentage with one decimal; ``-`` for NaN."""
    return MISSING if is_missing(v) else f"{v * 100:.1f}%"


def error_target(p: str) -> float:
    """The relative error a cell of percentile ``p`` must meet (throughput: any other ``p``)."""
    return {"p50": 0.05, "p90": 0.05, "p99": 0.10}.get(p, 0.03)


def shown(archive: Path) -> str:
    """The archive's path as the doc names it: relative to the repository when inside it."""
    try:
        return str(Path(archive).resolve().relative_to(ROOT))
    except ValueError:
        return str(archive)


def write_doc(
    table, steps, rankings, plans, record, stale, profile: Path, archive: Path,
    protocol: dict[str, Any], equivalent, figures: str = "fidelity", noise=None,
) -> str:  # fmt: skip
    """The doc's markdown (without the archive's notes) from the sim side's results, the
    archive's ``record``, ``stale`` (folder -> (stale, why)), profile, path, protocol and
    ``equivalent`` policy pairs; its plots are linked in the folder ``figures`` beside it;
    ``noise``: what the seeded replicas drew (a StepNoise; :func:`coverage_section`)."""
    import numpy as np

    run_table, met, missed = _run_table(table)
    every, steps = steps, first_pass(steps)  # the figures are the first pass's (table: both)
    e = np.abs(steps.err.to_numpy())
    sat_steps = steps[steps.saturated]
    n_plans = int(plans.steps_recorded.sum())
    identical = int(plans.steps_matched.sum())
    first_bad = plans[plans.first_mismatch.notna()]
    fp = json.loads(json.dumps(_read_fp(profile)))
    exp = protocol.get("experiment", {})
    async_protocol = bool((exp.get("scheduler") or {}).get("async_scheduling"))
    windows = ", ".join(protocol.get("slices", {})) or "?"
    text = TEMPLATE.format(
        title=f"{protocol.get('checkpoint', {}).get('preset', exp.get('model', '?'))} on {windows}",
        figures=figures,
        archive=shown(archive),
        repeat=" (and its `_repeat` archive)"
        if _has_spread(table) and table[f"spread_{TP50}"].notna().any()
        else " (no repeat pass)",
        setup=_setup_line(protocol),
        source=_source(record, fp),
        loads=_loads_text(table),
        fingerprint=", ".join(f"{k} `{v}`" for k, v in sorted((fp or {}).items())) or "none",
        calibration=_calibration_text(record, async_protocol),
        stale=_stale_text(stale),
        capacity="\n".join(
            f"| {k} | {v['requests']} | {v['native_req_s']:.3f} | {v['capacity_req_s']:.1f} |"
            for k, v in record.get("capacity", {}).items()
        ),
        skipped=", ".join(record.get("skipped", [])) or "none",
        identical_pct=pct(identical / max(n_plans, 1)),
        identical=identical,
        n_plans=n_plans,
        n_runs=len(plans),
        plan_note=(
            "every step of every run was planned as on the engine."
            if first_bad.empty
            else "runs with a mismatch: "
            + "; ".join(f"{r.run}: {r.first_mismatch}" for r in first_bad.itertuples())
        ),
        async_steps=(
            " (asynchronous scheduling: the clock the simulator runs, max(device time of N, "
            "host time of N + 1), as the engine's durations are)"
            if async_protocol
            else ""
        ),
        step_p50=pct(np.median(e)),
        step_p90=pct(np.percentile(e, 90)),
        step_sat=pct(np.median(np.abs(sat_steps.err))) if len(sat_steps) else MISSING,
        headline=_headline(table, steps, rankings, identical, n_plans),
        saturated=_saturated(table, steps),
        by_kind="\n".join(_by_kind(every)),
        met=met,
        total=met + missed,
        medians="\n".join(_medians(table)),
        table="\n".join(run_table),
        agree=sum(r["agree"] for r in rankings),
        pairs=len(rankings),
        rank_table="\n".join(_rank_lines(rankings)) or "| - | - | - | - | - | - | - | - |",
        same_plans=_equivalent_text(equivalent),
    )
    return text + "".join(f"{line}\n" for line in coverage_section(table, noise))


COVERAGE_TARGET = (0.85, 0.95)  # of a 90% band: narrower misses, wider says too little


def noise_line(noise) -> str:
    """What the seeded replicas drew, in a sentence: the run factor's sigma and the slow
    spells (lab/sim/noise.py)."""
    sigma = noise.run_sigma
    if len(set(sigma.values())) > 1:  # one per kind (the profile rows' own): each named
        text = "Run factor sigma " + ", ".join(f"{pct(x)} {k}" for k, x in sigma.items())
    else:
        text = "Run factor sigma " + (pct(next(iter(sigma.values()))) if sigma else "none")
    sp = noise.spells
    if sp is None:
        return text + "; no slow spells (no calibration replays, or none that changed state)."
    return (
        f"{text}; slow spells fitted from the calibration replays: {sp.slow_s * 1e3:.2f} ms "
        f"more per step while slow, {pct(sp.slow_share)} of the time, mean dwells "
        f"{sp.fast_dwell_s:.2f} s fast and {sp.slow_dwell_s:.2f} s slow ({sp.transitions} "
        f"changes of state in {sp.runs} replay runs)."
    )


def coverage_section(table, noise=None) -> list[str]:
    """The coverage of the simulator's 90% bands (sim side run with ``--seeds``): per
    metric, the share of runs whose engine value lies inside the band, the band's median
    relative width and the point error beside it (and, given the replicas' ``noise``, its
    :func:`noise_line`); no lines without bands."""
    if not any(c.startswith("inside_") for c in table.columns):
        return []
    rows = table.to_dict("records")
    lo, hi = COVERAGE_TARGET
    lines = [
        "",
        "## Coverage of the simulator's 90% band",
        "",
        f"Seeded replicas of every run (step times drawn around the calibrated prediction, "
        f"lab/sim/noise.py); coverage is the share of runs whose engine value lies inside the "
        f"simulator's p5-p95 band (target {pct(lo)}-{pct(hi)}: a band too wide is as wrong as "
        "one too narrow); width is (p95 - p5) / median. The point error is the deterministic "
        "run's, as in the tables above; beside it the engine's own spread between its two "
        "passes (median over runs), which a band as wide as the engine's variation from one "
        "run to the next would have to span.",
        *(["", noise_line(noise)] if noise is not None else []),
        "",
        "| metric | runs | coverage | median band width | median point error | engine's spread |",
        "|---|---|---|---|---|---|",
    ]
    names = [(column(m, p), f"{LATENCIES[m][0]} {p}") for m, p in COLS]
    for key, title in [*names, ("throughput", "output throughput")]:
        cov, width, n = coverage(rows, key)
        if not n:
            continue
        mark = "" if lo <= cov <= hi else " ✗"
        err = table[f"err_{key}"].median()
        spread = pct(table[f"spread_{key}"].median()) if f"spread_{key}" in table else "-"
        lines.append(f"| {title} | {n} | {pct(cov)}{mark} | {pct(width)} | {pct(err)} | {spread} |")
    return lines


def _has_spread(table) -> bool:
    return f"spread_{TP50}" in table


def error_cell(r, m: str, p: str, has_spread: bool) -> str:
    """A row's relative error ``err_X`` in metric ``m`` at ``p`` (``m`` "throughput": any
    ``p``), with its repeat's spread ``spread_X`` in brackets when ``has_spread``; ✗ past
    :func:`error_target` (or past the spread, when larger)."""
    key = column(m, p) if m != "throughput" else "throughput"
    e = r[f"err_{key}"]
    s = r.get(f"spread_{key}", float("nan")) if has_spread else float("nan")
    limit = max(error_target(p), s if s == s else 0.0)
    spread = f" ({pct(s)})" if has_spread else ""
    return f"{pct(e)}{spread}" + ("" if e <= limit else " ✗")


def _run_table(table) -> tuple[list[str], int, int]:
    """The per-run table's lines, and how many of its error cells met and missed."""
    has_spread = _has_spread(table)
    head = ["window", "load", "policy"] + [f"{LATENCIES[m][0]} {p}" for m, p in COLS]
    head += ["throughput", "preempt engine / sim", "plans identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = missed = 0
    for _, r in table.iterrows():
        scale = r.get("rate_scale")
        shown = f"{r.load:g}" if scale is None or scale != scale else f"{r.load:g} (x{scale:g})"
        cells = [r.slice, shown, r.policy]
        cells += [error_cell(r, m, p, has_spread) for m, p in COLS]
        cells += [error_cell(r, "throughput", "tp", has_spread)]
        met += sum("✗" not in c for c in cells[3:])
        missed += sum("✗" in c for c in cells[3:])
        cells += [f"{r.real_preemptions} / {r.sim_preemptions}", pct(r.plans_identical)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines, met, missed


def _medians(table) -> list[str]:
    """The table of median errors (and engine spreads) over groups of runs."""
    med = ["| median over runs | " + " | ".join(f"{LATENCIES[m][0]} {p}" for m, p in COLS)
           + " | throughput |", "|" + "---|" * (len(COLS) + 2)]  # fmt: skip
    saturated = ", ".join(f"{x:g}" for x in sorted(table.load[table.load > 1.0].unique()))
    for label, prefix, sel in (
        ("simulator vs engine, all loads", "err_", table.load > 0),
        ("simulator vs engine, loads <= 0.95", "err_", table.load <= 0.95),
        (f"simulator vs engine, saturated ({saturated or 'none'})", "err_", table.load > 1.0),
        ("engine vs its repeat, all loads", "spread_", table.load > 0),
        ("engine vs its repeat, saturated", "spread_", table.load > 1.0),
    ):
        if prefix == "spread_" and not _has_spread(table):
            continue
        t = table[sel]
        vals = [t[f"{prefix}{column(m, p)}"].median() for m, p in COLS] + [
            t[f"{prefix}throughput"].median()
        ]
        label += f" ({t[f'{prefix}{TP50}'].notna().sum()} runs)"
        med.append(f"| {label} | " + " | ".join(pct(v) for v in vals) + " |")
    return med


def _noise(g, q: float) -> str:
    """Percentile ``q`` of the steps' same-shape engine spread; ``-`` without any."""
    import numpy as np

    n = g.noise.dropna().to_numpy() if "noise" in g else np.array([])
    return pct(np.percentile(n, q)) if len(n) else MISSING


def first_pass(steps):
    """The first engine pass's rows of a per-step frame (all of them without a ``pass``
    column)."""
    return steps[steps["pass"] == "first"] if "pass" in steps else steps


def _by_kind(steps) -> list[str]:
    """The step-level error table's rows: the first pass's steps, all then each kind; with
    repeat-pass rows (``pass`` ``repeat``), the repeat's all and each kind, then both
    passes' all."""
    import numpy as np

    first = first_pass(steps)
    groups = [("all", first), *first.groupby("kind")]
    again = steps[steps["pass"] == "repeat"] if "pass" in steps else steps.iloc[:0]
    if len(again):
        groups += [("repeat pass: all", again)]
        groups += [(f"repeat pass: {k}", g) for k, g in again.groupby("kind")]
        groups += [("both passes: all", steps)]
    return [
        f"| {k} | {len(g):,} | {pct(np.median(np.abs(g.err)))} | "
        f"{pct(np.percentile(np.abs(g.err), 90))} | {pct(np.median(g.err))} | "
        f"{_noise(g, 50)} / {_noise(g, 90)} |"
        for k, g in groups
    ]


def _rank_lines(rankings) -> list[str]:
    return [
        f"| {r['slice']} | {r['load']:g} | {r['metric']} | {r['pair']} | "
        f"{r['engine']:+.2f} | {r['noise']:.2f} | {r['sim']:+.2f} | "
        f"{'yes' if r['agree'] else '**tie**' if r['sim'] == 0 else '**no**'} |"
        for r in rankings
    ]


def _mdn(t, col: str) -> str:
    return pct(t[col].median()) if col in t and len(t) else MISSING


def _headline(table, steps, rankings, identical: int, n_plans: int) -> str:
    """The doc's first paragraph (printed for docs/simulator.md's fidelity paragraph too)."""
    import numpy as np

    e = np.abs(steps.err.to_numpy())
    return (
        f"Held out ({len(table)} engine runs): plans identical under replayed durations "
        f"{pct(identical / max(n_plans, 1))} of {n_plans:,} steps; step-level error median "
        f"{pct(np.median(e))}, P90 {pct(np.percentile(e, 90))} (engine's own step-to-step "
        f"spread {_noise(steps, 50)}, {_noise(steps, 90)}); median errors (engine's own "
        f"spread in brackets) TTFT p50 {_mdn(table, 'err_p50_ttft_ms')} "
        f"({_mdn(table, 'spread_p50_ttft_ms')}), TPOT p50 {_mdn(table, 'err_p50_tpot_ms')} "
        f"({_mdn(table, 'spread_p50_tpot_ms')}), E2E p50 {_mdn(table, 'err_p50_e2el_ms')} "
        f"({_mdn(table, 'spread_p50_e2el_ms')}), throughput {_mdn(table, 'err_throughput')} "
        f"({_mdn(table, 'spread_throughput')}); policy pairs ordered as on the engine: "
        f"{sum(r['agree'] for r in rankings)} of {len(rankings)}."
    )


def _saturated(table, steps) -> str:
    """The saturated-regime section (loads above 1), or a line saying there are none."""
    import numpy as np

    sat, low = table[table.load > 1.0], table[table.load <= 1.0]
    if sat.empty:
        return "No saturated runs (loads above 1) in this archive.\n"
    sat_steps = steps[steps.saturated]
    unsat = steps[~steps.saturated]
    return SATURATED.format(
        sat_loads=" and ".join(f"{x:g}" for x in sorted(set(sat.load))),
        sat_bias=pct(np.median(sat_steps.err)) if len(sat_steps) else MISSING,
        # the comparison with loads <= 1 only where the archive has such runs
        low_bias=f" ({pct(np.median(unsat.err))} at loads <= 1)" if len(unsat) else "",
        sat_ttft=_mdn(sat, "err_p50_ttft_ms"),
        sat_ttft_spread=_mdn(sat, "spread_p50_ttft_ms"),
        low_ttft=(
            f" (the simulator's error at loads <= 1: {_mdn(low, 'err_p50_ttft_ms')})"
            if len(low)
            else ""
        ),
        sat_e2e=_mdn(sat, "err_p50_e2el_ms"),
        sat_e2e_spread=_mdn(sat, "spread_p50_e2el_ms"),
        sat_tp=_mdn(sat, "err_throughput"),
        sat_tp_spread=_mdn(sat, "spread_throughput"),
    )


def _source(record: dict[str, Any], fp) -> str:
    """Where the engine runs came from: the record's ``source``, else the engine side's log."""
    return record.get("source") or (
        f"`sched-lab fidelity --engine` made them on one {(fp or {}).get('gpu', 'GPU')} (started "
        f"{record.get('started', '?')} UTC; step times in s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in record.get("steps", {}).items() if k.endswith("_s"))
        + "), the profile first, minutes before the replays, on the same machine. Protocol: "
        f"`{record.get('protocol', 'benchmarks/fidelity_heldout.yaml')}` (what it leaves out of "
        "a full protocol, and why, is written there)."
    )


def _calibration_text(record: dict[str, Any], async_protocol: bool) -> str:
    """What the simulator was calibrated on, in words."""
    if not record.get("calibration"):
        return (
            "the simulator's only calibration data is the profile grid (`profile.csv` in "
            "the archive); no engine replay step is fitted."
        )
    return (
        "the simulator's calibration data is the profile grid (`profile.csv` in the "
        "archive) and the engine's steps in synthetic calibration replays run right after "
        f"it (`calibration/` in the archive: {', '.join(record['calibration'])}; "
        "arrivals and lengths drawn from the protocol's distributions, no trace row); no "
        "step of an evaluated window is fitted"
        + (
            " (the replays ran with synchronous scheduling: their steps are step times, "
            "whose host part the profile's `host_s` fit splits off)."
            if async_protocol
            else "."
        )
    )


def _stale_text(stale: dict[str, tuple]) -> str:
    stale_notes = sorted({why for s, why in stale.values() if s})
    if not stale_notes and all(s is False for s, _ in stale.values()):
        return (
            "The profile matches the engine runs' fingerprint (made by the same engine, GPU "
            "and versions)."
        )
    return (
        "**Stale**: "
        + "; ".join(stale_notes or ["the profile or the engine runs have no fingerprint"])
        + "."
    )


def _setup_line(protocol: dict[str, Any]) -> str:
    """The protocol's model and engine setup, in words, for the doc."""
    exp, ck = protocol.get("experiment", {}), protocol.get("checkpoint", {})
    eng, kv, sch = exp.get("engine", {}), exp.get("kv_cache", {}), exp.get("scheduler", {})
    pols = [
        p if isinstance(p, str) else p.get("label", p.get("name", "?"))
        for p in exp.get("policies", [])
    ]
    mode = "asynchronous" if sch.get("async_scheduling") else "synchronous"
    return (
        f"Model: {ck.get('preset', exp.get('model', '?'))} shape, random {ck.get('dtype', '?')} "
        f"weights, {eng.get('attention_backend', '?')} attention, {kv.get('num_gpu_blocks', '?')} "
        f"KV blocks of {kv.get('block_size', '?')} tokens, policies {', '.join(pols)}, "
        f"{mode} scheduling."
    )


def _equivalent_text(equivalent) -> str:
    """The policy pairs that plan alike under the same step durations, in words."""
    if not equivalent:
        return "none (every pair of policies planned differently under the same durations)"
    pairs = "; ".join(f"{a} and {b} at {sl} {load:g}x" for sl, load, a, b in sorted(equivalent))
    return (
        f"{len(equivalent)} pairs whose second policy, fed the first's engine step "
        f"durations, made the first's plan on every step, so that what differs between them "
        f"on the engine is its noise ({pairs})"
    )


def _loads_text(table) -> str:
    """What the table's loads are: fractions of capacity, and/or the offered loads of the
    rate-scale runs (the window's own arrival times, scaled)."""
    scaled = (
        table["rate_scale"].notna() if "rate_scale" in table else table.load.isna()
    )  # all False without rate scales
    parts = []
    if (~scaled).any():
        loads = ", ".join(f"{x:g}" for x in sorted(table.load[~scaled].unique()))
        parts.append(f"loads are {loads}\ntimes it")
    if scaled.any():
        runs = table[scaled].drop_duplicates(["slice", "rate_scale"])
        each = ", ".join(f"{r.slice} x{r.rate_scale:g} = {r.load:g}" for r in runs.itertuples())
        parts.append(
            "rate-scale runs replay the window's own arrival times at that scale of its own "
            f"rate, tabled at their offered load (scale x own rate / capacity): {each}"
        )
    return "; ".join(parts)


def _read_fp(profile: Path):
    from sched_lab.sim.calibrated import read_fingerprint

    return read_fingerprint(profile)


TEMPLATE = """# Simulator fidelity, held out: {title}

{headline}

Generated by `sched-lab fidelity --sim` from `{archive}`{repeat}. {source}
{setup}

**Held out**: {calibration} Profile fingerprint: {fingerprint}. {stale}

Windows and the engine's capacity on each (all requests at t = 0, fcfs); {loads}:

| window | requests | own rate (req/s) | capacity (req/s) |
|---|---|---|---|
{capacity}

Skipped for time: {skipped}.

## Plans identical under replayed durations

Fed each engine run's measured step durations in order (`cost_model: {{durations_from:
RUN/steps.csv}}`), the simulator planned **{identical_pct}** of the engine's steps
identically ({identical:,} of {n_plans:,} steps in {n_runs} runs: same prefill tokens and
chunks, decodes, contexts, preemptions, swap-outs and swap-ins); {plan_note}

## Step-level error

Each engine step's duration predicted by the calibrated model from that step's exact batch{async_steps}:
median {step_p50}, P90 {step_p90} (absolute, the engine's first pass; saturated runs alone:
median {step_sat}; the repeat pass's steps, where the archive has them, are in the table's
"repeat pass" rows).
Targets: median <= 3%, P90 <= 8%. The last column is the engine's own spread between steps
of one shape: each step's distance from the median of the run's steps of its shape (kind,
prompt tokens to 64, prompts, decodes, context to 512 tokens a sequence; shapes of >= 5
steps), median / P90. A model that sees only a step's shape cannot do better than that.

| step kind | steps | median abs error | P90 abs error | median signed error | engine's spread, same shape |
|---|---|---|---|---|---|
{by_kind}

![per-step error by step kind]({figures}/heldout_step_error.png)

## Distribution errors

Relative error |sim - engine| / engine of each percentile; in brackets the engine's own
spread, |repeat - first| / first, for the same run. ✗ marks a miss of max(5% at P50/P90, 10%
at P99, 3% for throughput, the engine's own spread): {met} of {total} cells met.
`{figures}/heldout.csv` has every run's numbers under vLLM's names: for each X in
`p{{50,90,99}}_{{ttft,tpot,itl,e2el}}_ms`, `real_X`, `sim_X` and `again_X` (the repeat) in ms,
`err_X` and `spread_X` the relative errors above.

{medians}

Per run:

{table}

![engine (solid) vs simulator (dashed): TTFT and E2E CDFs]({figures}/heldout_cdfs.png)

{saturated}
## Rankings

For every (window, load), metric (TTFT p50, TTFT p99, TPOT p50, E2E p50) and pair of
policies whose engine difference exceeds the engine's own spread (|a - b| > |a - a'| +
|b - b'|, a' the repeat, and the repeat orders them the same way): the simulator orders
{agree} of {pairs} such pairs as the engine does (a tie in the simulator counts as not).
Left out: {same_plans}. Differences in ms.

| window | load | metric | pair | engine a - b | spread | sim a - b | same order |
|---|---|---|---|---|---|---|---|
{rank_table}
"""


SATURATED = """## The saturated regime ({sat_loads} x capacity)

Above capacity the queue grows for the whole window, so a request's TTFT is its wait behind
everything that arrived before it: the sum of many steps' durations, where at low load it is
about one prefill step. A bias in the step times then carries into TTFT whole instead of
averaging out: the saturated runs' step predictions have a signed median error of
{sat_bias}{low_bias}, and their median TTFT p50 error is {sat_ttft}
against the engine's own spread of {sat_ttft_spread}{low_ttft}. E2E p50:
{sat_e2e} (engine {sat_e2e_spread}). Throughput there is the engine's service rate: error
{sat_tp} (engine {sat_tp_spread}).
"""
