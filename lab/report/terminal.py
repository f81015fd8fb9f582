"""The summary ``sched-lab run`` prints: metrics down, runs across, at most :data:`WIDTH`
columns (more runs continue in another block); seconds for TTFT and E2E, ms for TPOT and ITL.
A statistic without values (TTFT when every request was rejected, TPOT of 1-token outputs)
prints ``-``; runs of workload classes add a block of rows per class.
"""

from __future__ import annotations

from sched_lab.results.bands import band_of, band_text
from sched_lab.results.names import MISSING, format_value, percentile_word

MIN_BAND_REPLICAS = 20  # fewer: the terminal says the band is about the replicas' range

WIDTH = 100
LABEL = 30  # width of the metric names, at least
CELL = 16  # width of one run's column, at least (wider when its label or a cell needs it)
LATENCIES = (  # (name in {stat}_{name}_ms, title, unit shown)
    ("ttft", "TTFT", "s"),
    ("tpot", "TPOT", "ms"),
    ("itl", "ITL", "ms"),
    ("e2el", "E2E", "s"),
)
CLASS_STATS = ("p50", "p99")  # per class: of TTFT, TPOT and E2E (lab/results/fairness.py)


def rows(runs, percentiles) -> list[tuple[str, list[str]]]:
    """(metric name, one cell per run) of the table; a row whose cells are all empty heads
    the rows of one workload class."""

    def cells(f) -> list[str]:
        return [f(r) for r in runs]

    out: list[tuple[str, list[str]]] = [
        ("finished / replayed", cells(lambda r: f"{r.vllm['completed']}/{r.vllm['num_prompts']}")),
        ("rejected/aborted/unfinished", cells(lambda r: str(r.vllm["failed"]))),
        ("duration (s)", cells(lambda r: banded(r, "duration", ".1f", r.vllm["duration"]))),
        (
            "request throughput (req/s)",
            cells(lambda r: banded(r, "request_throughput", ".2f", r.vllm["request_throughput"])),
        ),
        (
            "output throughput (tok/s)",
            cells(lambda r: banded(r, "output_throughput", ".0f", r.vllm["output_throughput"])),
        ),
    ]
    if _has_slo(runs[0].summary):
        out.append(("goodput (req/s)", cells(lambda r: banded(r, "request_goodput", ".2f"))))
        out.append(
            ("SLO attainment (%)", cells(lambda r: banded(r, "slo_attainment", ".1f", scale=100)))
        )
    words = ["mean", *(f"p{percentile_word(p)}" for p in percentiles), "max"]
    for name, title, unit in LATENCIES:
        scale, fmt = (1e-3, ".3f") if unit == "s" else (1.0, ".1f")
        for word in words:
            field = f"{word}_{name}_ms"
            out.append(
                (
                    f"{title} {word} ({unit})",
                    cells(lambda r, f=field, k=scale, g=fmt: banded(r, f, g, scale=k)),
                )
            )
    out.append(
        (
            "preemptions recompute / swap",
            cells(
                lambda r: (
                    f"{banded(r, 'num_preemptions_recompute', 'g')} / "
                    f"{banded(r, 'num_preemptions_swap', 'g')}"
                )
            ),
        )
    )
    out.append(
        ("KV used mean / max (%)", cells(
            lambda r: f"{banded(r, 'mean_kv_cache_usage', '.0f', scale=100)} / "
            f"{banded(r, 'max_kv_cache_usage', '.0f', scale=100)}"
        ))
    )  # fmt: skip
    return out + class_rows(runs)


def banded(run, key: str, spec: str, value=None, scale: float = 1.0) -> str:
    """A cell of metric ``key``: ``median [lo, hi]`` of a run with seeded replicas (summary
    keys of lab/results/bands.py), else its value (``value``, default the summary's), each
    times ``scale`` and formatted with ``spec``."""
    band = band_of(run.summary, key)
    if band is None:
        v = run.summary.get(key) if value is None else value
        return format_value(_scaled(v, scale), spec)
    return band_text(key, band, spec, lambda x: x * scale)


def class_rows(runs) -> list[tuple[str, list[str]]]:
    """Per workload class (summary key ``classes``): a heading row, then its rows indented;
    none for runs without classes."""
    names = list(runs[0].summary.get("classes") or {})
    out: list[tuple[str, list[str]]] = []
    for name in names:
        per = [r.summary.get("classes", {}).get(name) for r in runs]

        def cells(f, per=per) -> list[str]:
            return [MISSING if c is None else f(c) for c in per]

        slo = next((c["slo"] for c in per if c is not None and c.get("slo")), None)
        out.append((f"class {name}" + (f" (SLO {slo_text(slo)})" if slo else ""), [""] * len(runs)))
        out.append(
            ("  finished / replayed", cells(lambda c: f"{c['completed']}/{c['num_prompts']}"))
        )
        for metric, title, unit in LATENCIES:
            if f"p50_{metric}_ms" not in next(c for c in per if c is not None):
                continue  # ITL: not per class
            scale, fmt = (1e-3, ".3f") if unit == "s" else (1.0, ".1f")
            for word in CLASS_STATS:
                out.append(
                    (
                        f"  {title} {word} ({unit})",
                        cells(
                            lambda c, f=f"{word}_{metric}_ms", m=scale, g=fmt: format_value(
                                _scaled(c.get(f), m), g
                            )
                        ),
                    )
                )
        if slo:
            out.append(
                ("  goodput (req/s)", cells(lambda c: format_value(c["request_goodput"], ".2f")))
            )
            out.append(
                (
                    "  SLO attainment (%)",
                    cells(lambda c: format_value(_pct(c["slo_attainment"]), ".1f")),
                )
            )
        out.append(
            ("  preemptions recompute", cells(lambda c: str(c["num_preemptions_recompute"])))
        )
    return out


def summary_text(runs, percentiles, width: int = WIDTH) -> str:
    """The table as text: a block per load, its runs across (continued below past ``width``).
    Columns are as wide as their longest label or cell; no label is cut."""
    blocks = []
    for scale in dict.fromkeys(r.rate_scale for r in runs):
        group = [r for r in runs if r.rate_scale == scale]
        rate = group[0].vllm.get("request_rate")
        title = f"rate_scale {scale:g}" + (f", {rate:.2f} req/s" if rate else "")
        table = rows(group, percentiles)
        label = max([LABEL] + [len(n) + 1 for n, c in table if any(c)])
        cols = [
            max([CELL, len(r.policy) + 1] + [len(c[i]) + 1 for _, c in table])
            for i, r in enumerate(group)
        ]
        for part in _blocks(cols, width - label):
            head = "".join(group[i].policy.rjust(cols[i]) for i in part)
            lines = [title.ljust(label) + head, "-" * (label + sum(cols[i] for i in part))]
            for name, cells in table:
                if not any(cells):  # a class's heading
                    lines += ["", name]
                    continue
                lines.append(name.ljust(label) + "".join(cells[i].rjust(cols[i]) for i in part))
            blocks.append("\n".join(lines))
    summary = runs[0].summary
    note = []
    if summary.get("slo"):
        note.append(
            f"SLOs: {slo_text(summary['slo'])} (goodput: finished requests/s meeting every SLO)"
            "\nSLO attainment: of all replayed requests (rejected, aborted, unfinished: misses)"
        )
    elif _has_slo(summary):
        note.append("SLOs: per class (goodput: finished requests/s meeting their class's SLOs)")
    if summary.get("seeds"):
        note.append(bands_note(runs))
    return "\n\n".join(blocks + note)


def bands_note(runs) -> str:
    """What a cell ``median [lo, hi]`` means, for runs with seeded replicas; names a run an
    interruption left with fewer replicas than asked for (summary ``seeds_requested``)."""
    summary = runs[0].summary
    lo, hi = (format_value(p) for p in summary["band_percentiles"])
    n = summary.get("seeds_requested") or summary["seeds"]
    short = [
        f"{r.label} {r.summary['seeds']} of {n}" for r in runs if r.summary.get("seeds_requested")
    ]
    cut = f"; interrupted: {', '.join(short)} replicas" if short else ""
    # a p5-p95 band of a few draws is about their range, not a 90% band
    replicas, are = ("replica", "is") if n == 1 else ("replicas", "are")
    few = f"; {n} {replicas} {are} few: the band is about their range (20 or more for a 90% band)"
    return (
        f"cells: median [p{lo}, p{hi}] over {n} seeded {replicas} "
        "(step times drawn around the cost model's; summary.json and the vLLM-format file hold "
        f"replica 0's values beside the bands){cut}{few if n < MIN_BAND_REPLICAS else ''}"
    )


def warnings_text(runs) -> str:
    """The terminal's lines of :func:`warnings` (``kind: text``), "" when none."""
    return "\n".join(f"{kind}: {text}" for kind, text in warnings(runs))


def warnings(runs) -> list[tuple[str, str]]:
    """(kind, text) of what priced the steps and may be wrong, one each: async runs whose cost
    model has no host time (``cost_model.host_note``), a profile that does not describe this
    engine (its fingerprint differs or is missing; ``cost_model.stale``), both ``warning``;
    a calibrated run with adapters whose profile does not price their compute
    (``cost_model.lora_note``), a ``note``. The terminal and report.md print the same text."""
    cm = runs[0].summary.get("cost_model") or {}
    out = []
    asynchronous = [r.label for r in runs if r.summary.get("async_scheduling")]
    if asynchronous and cm.get("host_note"):
        out.append(("warning", no_host_warning(asynchronous, cm["host_note"])))
    if cm.get("stale"):
        out.append(("warning", stale_warning(cm.get("profile"), cm.get("why"))))
    if cm.get("lora_note"):  # a calibrated run with adapters (lab/setup/sim.py)
        out.append(("note", f"profile {cm.get('profile')}: {cm['lora_note']}"))
    return out


def no_host_warning(labels, host_note: str) -> str:
    """The warning for async runs ``labels`` priced by a cost model without host time."""
    return (
        f"{', '.join(labels)}: async_scheduling is on, but {host_note}; these runs are priced "
        "as synchronous ones"
    )


def stale_warning(profile, why) -> str:
    """The warning for a profile that may describe another engine (``why``: its staleness)."""
    return f"stale profile {profile}: {why}"


def warnings_markdown(found: list[tuple[str, str]]) -> list[str]:
    """:func:`warnings` as report.md paragraphs (``**Warning**: text.``), each followed by a
    blank line."""
    out = []
    for kind, text in found:
        out += [f"**{kind.capitalize()}**: {text}.", ""]
    return out


def slo_text(slo: dict) -> str:
    """``ttft <= 2 s, tpot <= 50 ms``: SLOs in the units of the tables."""
    parts = []
    for key, v in slo.items():
        name = key.removesuffix("_s")
        parts.append(f"{name} <= {v * 1e3:g} ms" if name == "tpot" else f"{name} <= {v:g} s")
    return ", ".join(parts)


def _blocks(cols: list[int], room: int) -> list[list[int]]:
    """Column indices in blocks that fit ``room`` characters (at least one column each)."""
    out: list[list[int]] = [[]]
    used = 0
    for i, w in enumerate(cols):
        if out[-1] and used + w > room:
            out.append([])
            used = 0
        out[-1].append(i)
        used += w
    return out


def _has_slo(summary: dict) -> bool:
    """Whether the run has SLOs: top-level, or of some workload class."""
    classes = summary.get("classes") or {}
    return bool(summary.get("slo")) or any(c.get("slo") for c in classes.values())


def _pct(x):
    return None if x is None else 100 * x


def _scaled(x, scale: float):
    return None if x is None else x * scale
