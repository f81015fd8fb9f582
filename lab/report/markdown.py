"""report.md, the results folder's summary in markdown, and config.yaml."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from sched_lab.config import ExperimentConfig, paths
from sched_lab.report.replicas import replicas_markdown
from sched_lab.report.terminal import bands_note, warnings, warnings_markdown
from sched_lab.results import fairness, spec_metrics
from sched_lab.results.bands import band_of, band_text
from sched_lab.results.names import format_value
from sched_lab.results.run import Run

SLO_DEFINITION = (
    "Goodput: requests per second that finished within every SLO. SLO attainment: the "
    "fraction of all replayed requests that did; rejected, aborted and unfinished ones "
    "count as misses. SLO attainment (finished): the same over finished requests only."
)


def summary_table(runs: list[Run]) -> str:
    """A markdown table of the headline numbers of every run."""
    head = (
        "| run | finished | rejected | aborted | req/s | out tok/s | TTFT p50 / p99 (s) "
        "| TPOT p50 / p99 (ms) | ITL p99 / p99.9 / max (ms) | E2E p50 / p99 (s) "
        "| preempt (rec / swap) | KV mean % |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in runs:
        s = r.summary

        def v(key: str, spec: str, r=r) -> str:
            return _cell(r, key, spec)

        def sec(key: str, spec: str, r=r) -> str:
            return _cell(r, key, spec, _s)

        lines.append(
            f"| {r.label} | {s['completed']} | {s['rejected']} | {s['aborted']} "
            f"| {v('request_throughput', '.2f')} | {v('output_throughput', '.0f')} "
            f"| {sec('p50_ttft_ms', '.3f')} / {sec('p99_ttft_ms', '.3f')} "
            f"| {v('p50_tpot_ms', '.1f')} / {v('p99_tpot_ms', '.1f')} "
            f"| {v('p99_itl_ms', '.1f')} / {v('p99.9_itl_ms', '.1f')} / {v('max_itl_ms', '.1f')} "
            f"| {sec('p50_e2el_ms', '.2f')} / {sec('p99_e2el_ms', '.2f')} "
            f"| {v('num_preemptions_recompute', 'd')} / {v('num_preemptions_swap', 'd')} "
            f"| {_cell(r, 'mean_kv_cache_usage', '.0f', _pct)} |"
        )
    if runs and runs[0].summary.get("seeds"):
        note = bands_note(runs)
        lines += ["", f"{note[0].upper()}{note[1:]}."]
    return "\n".join(lines)


def _cell(run: Run, key: str, spec: str, unit=lambda x: x) -> str:
    """A table cell of metric ``key`` in the table's ``unit``: ``median [lo, hi]`` over a
    run's seeded replicas (lab/results/bands.py), else its value."""
    band = band_of(run.summary, key)
    if band is None:
        return format_value(unit(run.summary.get(key)), spec)
    return band_text(key, band, spec, unit)


def _s(ms):
    """Milliseconds as seconds (None stays None)."""
    return None if ms is None else ms / 1e3


def _pct(fraction):
    """A fraction as a percentage (None stays None: a served run's KV use is unknown)."""
    return None if fraction is None else fraction * 100


def _served_line(served: Mapping[str, Any]) -> str:
    """report.md's line on a served run (summary key ``served``, sched-lab bench)."""
    how = {
        "trace": "at the trace's arrival times",
        "request_rate": f"at {served.get('request_rate')} req/s "
        f"(burstiness {served.get('burstiness') or 1:g})",
        "max_concurrency": "all at once",
    }.get(served.get("arrivals"), "")
    cap = served.get("max_concurrency")
    return (
        f"Served by `{served['base_url']}` (model `{served['model']}`, endpoint "
        f"`{served['endpoint']}`), requests sent by `sched-lab bench` {how}"
        + (f", at most {cap} in flight" if cap else "")
        + "; latencies measured on the client. A served run has no engine steps: the "
        "step-level sections (KV blocks, scheduling, preemptions, prefix cache, events, "
        "timelines) are absent, and their numbers are `-`."
    )


def _trace_options(trace: Mapping[str, Any]) -> str:
    keys = ("limit", "start_s", "end_s", "rate_scale", "num_requests")
    opts = ", ".join(f"{k} {trace[k]}" for k in keys if trace.get(k) is not None)
    return f" ({opts})" if opts else ""


def model_line(cfg: ExperimentConfig) -> str:
    """What ran, for report.md: the model and device or hardware (lab/setup ``describe``)."""
    from sched_lab.setup import setup_for

    return setup_for(cfg).describe()


def config_yaml(cfg: ExperimentConfig, runs: list[Run]) -> str:
    """config.yaml: the resolved config, with ``trace_file`` (path, sha256, rows) of the
    replayed trace; trace and profile paths as :func:`sched_lab.config.paths.portable` writes them
    (bundled data relative, so the file reads the same from any checkout or install)."""
    d = cfg.to_dict()
    specs = d["trace"] if isinstance(d["trace"], list) else [d["trace"]]
    for spec, key in [*((s, "path") for s in specs), (d["cost_model"], "profile")]:
        if isinstance(spec.get(key), str):
            spec[key] = paths.portable(spec[key], cfg.base_dir)
    info = runs[0].summary.get("trace") if runs else None
    if info is not None and info.get("path") is not None:
        d["trace_file"] = {**info, "path": paths.portable(cfg.trace.path, cfg.base_dir)}
    return yaml.safe_dump(d, sort_keys=False)


def _prefix_cache_lines(runs: list[Run]) -> list[str]:
    """Whether runs cached prefixes; with caching on, a table of its numbers."""
    if not any(r.summary.get("prefix_caching") for r in runs):
        return ["Prefix caching: off.", ""]
    out = [
        "Prefix caching (`kv_cache.enable_prefix_caching`; hit rate = prompt tokens found "
        "cached at first admission / prompt tokens admitted):",
        "",
        "| run | caching | hit rate | cached tokens | found again after preemption "
        "| blocks evicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary
        on = s.get("prefix_caching")
        out.append(
            f"| {r.label} | {'on' if on else 'off'} | "
            + (
                f"{s['prefix_cache_hit_rate']:.1%} | {s['prefix_cache_cached_tokens']:,} "
                f"| {s['prefix_cache_resumed_tokens']:,} | {s['prefix_cache_evicted_blocks']:,} |"
                if on
                else "- | - | - | - |"
            )
        )
    return [*out, ""]


def _cost_model_lines(cm: dict | None) -> list[str]:
    """report.md's lines on what made the step times (summary key ``cost_model``)."""
    if not cm:
        return []
    fp = cm.get("fingerprint")
    fp_text = (
        "engine fingerprint " + ", ".join(f"{k} `{v}`" for k, v in sorted(fp.items()))
        if fp
        else "no engine fingerprint"
    )
    if cm["kind"] == "measured":
        return [f"Step times measured on the engine; {fp_text}.", ""]
    lines = [f"Cost model: {cm['kind']}"]
    if cm.get("profile"):
        lines[0] += f", from `{cm['profile']}`; {fp_text}"
    lines[0] += "."
    if cm["kind"] == "analytic":
        v = cm.get("values")
        used = (
            f" (flops_efficiency {v['flops_efficiency']:g}, bandwidth_efficiency "
            f"{v['bandwidth_efficiency']:g}, step_overhead_s {v['step_overhead_s']:g})"
            if v
            else ""
        )
        lines += ["", f"**Analytic cost model**: {cm['why']}; {_efficiency_text(cm)}{used}."]
    return [*lines, ""]


def _efficiency_text(cm: dict) -> str:
    """Where an analytic run's efficiencies came from and their known error (summary keys of
    sched_lab.run.experiment.analytic_source)."""
    src, own = cm.get("efficiencies"), cm.get("efficiencies_from_yaml") or []
    if src is None:
        return "its efficiencies' source was not recorded"
    if src == "yaml":
        return "its efficiencies were set in the YAML: their error is unknown"
    text = (
        "its efficiencies are datasheet guesses (no profile of this hardware): their error "
        "is unknown"
        if src == "guess"
        else "its efficiencies are measured: fitted to "
        + ", ".join(f"`{p}`" for p in cm["efficiency_profiles"])
    )
    if own:
        return text + f", except {', '.join(own)} (set in the YAML: error unknown)"
    if src == "profile":
        if len(cm["efficiency_profiles"]) > 1:
            text += " (a joint fit: this model has no profile of its own)"
        text += (
            f", median step-time error {cm['efficiency_error']:.1%} on the profile rows it prices"
        )
    return text


def _scheduling_lines(runs: list[Run]) -> list[str]:
    """report.md's line on the runs' scheduling mode (summary key ``async_scheduling``)."""
    on = [r.label for r in runs if r.summary.get("async_scheduling")]
    off = [r.label for r in runs if not r.summary.get("async_scheduling")]
    what = (
        "asynchronous (vLLM V1's async scheduler: step N+1 is planned while step N runs; an "
        "end by length frees its slot and blocks when its last token is scheduled, an EOS or "
        "stop end is followed by one wasted slot and frees its blocks a step late)"
    )
    if not on:
        lines = ["Scheduling: synchronous (each step is planned after the previous one ended)."]
    elif not off:
        lines = [f"Scheduling: {what}."]
    else:
        lines = [f"Scheduling: {what} for {', '.join(on)}; synchronous for {', '.join(off)}."]
    return [*lines, ""]


NO_PLOTS = (
    "**No plots**: this run was made with `sched-lab run --no-plots`, so no PNG and no "
    "interactive timeline were drawn; to draw them now (this report becomes the one a run "
    "with plots writes): `sched-lab report RESULTS`; a timeline of other requests: "
    "`sched-lab timeline RESULTS --run RUN`."
)


def plot_sections(plots: list[tuple[str, str]]) -> list[str]:
    """report.md's lines for the (file name, caption) pictures, a section each."""
    lines = []
    for name, caption in plots:
        lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
    return lines


def report_markdown(
    cfg: ExperimentConfig,
    runs: list[Run],
    plots: list[tuple[str, str]],
    fmt: str = "csv",
    *,
    plots_drawn: bool = True,
) -> str:
    """report.md; ``fmt``: the format requests, steps and events were written in (the files
    it names); ``plots_drawn`` False: says that no plot was drawn (``--no-plots``)."""
    from sched_lab.report.terminal import slo_text

    if cfg.trace.classes:
        what = "workload classes " + ", ".join(
            f"`{c['name']}` ({c['format']}{_trace_options(c)})" for c in cfg.trace.classes
        )
    else:
        trace = cfg.trace.spec
        where = f"`{paths.shown(cfg.trace.path, cfg.base_dir)}`" if cfg.trace.path else ""
        what = f"trace `{trace.get('format')}` {where}{_trace_options(trace)}"
    served = runs[0].summary.get("served")
    if served:  # sched-lab bench: measured on a client, no engine steps
        lines = [f"# {cfg.name}", "", f"{_served_line(served)} Replayed: {what}.", ""]
        lines += [summary_table(runs), ""]
    else:
        lines = [
            f"# {cfg.name}",
            "",
            f"Backend `{cfg.backend}`; {what}; {model_line(cfg)}; "
            f"{runs[0].summary['num_gpu_blocks']} GPU KV blocks of {cfg.kv_cache.block_size} "
            f"tokens{' per replica' if cfg.cluster is not None else ''}.",
            "",
            *_cost_model_lines(runs[0].summary.get("cost_model")),
            *_scheduling_lines(runs),
            *warnings_markdown(warnings(runs)),  # the terminal's, word for word
            summary_table(runs),
            "",
        ]
        lines += _prefix_cache_lines(runs)
    lines += spec_metrics.markdown(runs)  # speculative runs only
    wasted = [
        f"{r.label} {r.summary['num_wasted_tokens']}"
        for r in runs
        if r.summary.get("async_scheduling")
    ]
    if wasted:  # async scheduling: the slot after an unforeseen end's last token
        lines += ["Wasted decode slots (async scheduling): " + ", ".join(wasted) + ".", ""]
    dropped = runs[0].summary.get("dropped", 0)  # the same trace rows in every run
    if dropped:
        reasons = runs[0].requests.loc[runs[0].requests["status"] == "dropped", "reason"]
        why = "; ".join(sorted({x.removeprefix("not replayed: ") for x in reasons}))
        lines += [
            f"Trace rows not replayed: {dropped} (status `dropped` in requests.{fmt}): {why}.",
            "",
        ]
    for r in runs:
        if r.result.failure:
            lines += [
                f"**Run {r.label} stopped early**: {r.result.failure}. Its requests not "
                "ended by then are listed with status `unfinished` and this reason; they "
                "count as SLO misses.",
                "",
            ]
    slo = runs[0].summary["slo"]
    if slo:
        lines += [
            "SLOs: " + slo_text(slo),
            "",
            SLO_DEFINITION,
            "",
            "| run | goodput (req/s) | SLO attainment | SLO attainment (finished) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r.label} | {format_value(r.summary['request_goodput'], '.2f')} "
            f"| {format_value(r.summary['slo_attainment'], '.1%')} "
            f"| {format_value(r.summary.get('slo_attainment_finished'), '.1%')} |"
            for r in runs
        ]
        lines.append("")
    lines += fairness.markdown(runs)  # workload classes only
    lines += replicas_markdown(runs)  # cluster runs only
    lines += plot_sections(plots)
    if not plots_drawn:
        lines += [NO_PLOTS, ""]
    tokens = (
        "`tokens.jsonl` (generated token ids, and text), "
        if any(r.output_token_ids for run in runs for r in run.result.requests)
        else ""
    )
    events = all(r.result.events is not None for r in runs)  # a cluster records none
    lines += [
        f"Files: `requests.{fmt}` (one row per trace request per run), `steps.{fmt}` "
        + ("(empty: no engine steps)" if served else "(one row per engine step)")
        + f", `summary.json` (aggregates per run), {tokens}`timing.json` (wall time of each "
        f"replay), `config.yaml` (the resolved config), `events.{fmt}` ("
        + (
            "what the scheduler did to each request and why it waited"
            if events
            else "empty: a served run's client sees no scheduler events"
            if served
            else "each request's end only: a cluster's replicas record no scheduler events"
        )
        + "), one `{run}-{rate}qps-{model}.json` per run (the format of `vllm bench serve "
        "--save-result`), `report.html` (this report"
        + (" with interactive timelines" if events else "")
        + ").",
        "",
    ]
    if events:
        lines += [
            "A request's life: `sched-lab explain RESULTS --run "
            f"{runs[0].label} --request ID`; a timeline of chosen requests: `sched-lab "
            "timeline RESULTS --run RUN --requests ID,ID`.",
            "",
        ]
    return "\n".join(lines)
