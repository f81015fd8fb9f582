"""The summary ``sched-lab run`` prints: metrics down, runs across, at most :data:`WIDTH`
columns (more runs continue in another block); seconds for TTFT and E2E, ms for TPOT and ITL.
"""

from __future__ import annotations

WIDTH = 100
LABEL = 30  # width of the metric names
CELL = 16  # width of one run's column


def rows(runs, percentiles) -> list[tuple[str, list[str]]]:
    """(metric name, one cell per run) of the table."""

    def cells(f) -> list[str]:
        return [f(r) for r in runs]

    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out: list[tuple[str, list[str]]] = [
        ("finished / replayed", cells(lambda r: f"{r.vllm['completed']}/{r.vllm['num_prompts']}")),
        ("rejected + aborted", cells(lambda r: str(r.vllm["failed"]))),
        ("duration (s)", cells(lambda r: num(r.vllm["duration"], ".1f"))),
        ("request throughput (req/s)", cells(lambda r: num(r.vllm["request_throughput"], ".2f"))),
        ("output throughput (tok/s)", cells(lambda r: num(r.vllm["output_throughput"], ".0f"))),
    ]
    slo = runs[0].summary.get("slo") or {}
    if slo:
        out.append(("goodput (req/s)", cells(lambda r: num(r.summary["request_goodput"], ".2f"))))
        out.append(
            ("SLO attainment (%)", cells(lambda r: num(100 * r.summary["slo_attainment"], ".1f")))
        )
    words = [("mean", "mean")] + [(f"p{_word(p)}", f"p{_word(p)}") for p in percentiles]
    words.append(("max", "max"))
    for name, title, unit in (
        ("ttft", "TTFT", "s"),
        ("tpot", "TPOT", "ms"),
        ("itl", "ITL", "ms"),
        ("e2el", "E2E", "s"),
    ):
        scale, fmt = (1e-3, ".3f") if unit == "s" else (1.0, ".1f")
        for word, key in words:
            field = f"{key}_{name}_ms"
            out.append(
                (
                    f"{title} {word} ({unit})",
                    cells(lambda r, f=field, k=scale, g=fmt: num(_scaled(r.vllm.get(f), k), g)),
                )
            )
    out.append(
        (
            "preemptions recompute / swap",
            cells(
                lambda r: (
                    f"{r.summary['num_preemptions_recompute']} / {r.summary['num_preemptions_swap']}"
                )
            ),
        )
    )
    out.append(
        ("KV used mean / max (%)", cells(
            lambda r: f"{100 * r.summary['mean_kv_cache_usage']:.0f} / "
            f"{100 * r.summary['max_kv_cache_usage']:.0f}"
        ))
    )  # fmt: skip
    return out


def summary_text(runs, percentiles, width: int = WIDTH) -> str:
    """The table as text: a block per load, its runs across (continued below past ``width``)."""
    per_block = max((width - LABEL) // CELL, 1)
    blocks = []
    for scale in dict.fromkeys(r.rate_scale for r in runs):
        group = [r for r in runs if r.rate_scale == scale]
        rate = group[0].vllm.get("request_rate")
        title = f"rate_scale {scale:g}" + (f", {rate:.2f} req/s" if rate else "")
        table = rows(group, percentiles)
        for lo in range(0, len(group), per_block):
            part = group[lo : lo + per_block]
            head = "".join(_cut(r.policy).rjust(CELL) for r in part)
            lines = [title.ljust(LABEL) + head, "-" * (LABEL + CELL * len(part))]
            for name, cells in table:
                row = "".join(c.rjust(CELL) for c in cells[lo : lo + per_block])
                lines.append(name.ljust(LABEL) + row)
            blocks.append("\n".join(lines))
    slo = runs[0].summary.get("slo") or {}
    note = []
    if slo:
        note.append(f"SLOs: {slo_text(slo)} (goodput: finished requests/s meeting every SLO)")
    return "\n\n".join(blocks + note)


def slo_text(slo: dict) -> str:
    """``ttft <= 2 s, tpot <= 50 ms``: SLOs in the units of the tables."""
    parts = []
    for key, v in slo.items():
        name = key.removesuffix("_s")
        parts.append(f"{name} <= {v * 1e3:g} ms" if name == "tpot" else f"{name} <= {v:g} s")
    return ", ".join(parts)


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _scaled(x, scale: float):
    return None if x is None else x * scale


def _cut(label: str) -> str:
    return label if len(label) < CELL else label[: CELL - 2] + "~"
