"""One table over every held-out fidelity doc: both models, short and long windows, saturation.

    python benchmarks/fidelity_overview.py            # the docs/fidelity*.md listed in DOCS

Reads what ``sched-lab fidelity --sim --seeds N`` wrote for each archive: the doc's first
line (plans, step-level error, point errors beside the engine's own spread) and its table
``DIR/NAME/heldout.csv`` (per run: ``err_X``, ``spread_X``, ``inside_X``, ``width_X``, ``load``).
Prints markdown: per archive and per group of runs (all, saturated: offered load > 1), the
median point error (engine's spread) and the coverage / median width of the 90% band for
TTFT, TPOT and E2E p50, and how many of the 13 metrics have coverage in 85-95%. Nothing is
recomputed: regenerate the docs first (their headers say how).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.fidelity.markdown import COVERAGE_TARGET  # noqa: E402

# (doc, model, what its windows are)
DOCS = (
    ("docs/fidelity.md", "Qwen3-0.6B", "Azure conv/code, BurstGPT; 100 requests at t = 0, 0.5-1.3x"),
    ("docs/fidelity_long/fidelity_long.md", "Qwen3-0.6B", "Azure conv/code, 500 requests, own arrivals x4-24"),
    ("docs/fidelity_mooncake/fidelity_mooncake.md", "Qwen3-0.6B", "Mooncake, 530 requests, prefix caching, own arrivals x2"),
    ("docs/fidelity_8b/fidelity_8b.md", "Llama-3.1-8B", "Azure conv, 500 requests at t = 0, 0.8x"),
    ("docs/fidelity_8b/fidelity_8b_mooncake.md", "Llama-3.1-8B", "Mooncake, 16 requests, prefix caching, 0.8-1.1x"),
)  # fmt: skip
METRICS = [f"p{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in (50, 90, 99)]
SHOWN = (("p50_ttft_ms", "TTFT p50"), ("p50_tpot_ms", "TPOT p50"), ("p50_e2el_ms", "E2E p50"))


def pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"


def step_error(doc: Path) -> str:
    """'median / P90' of the step-level error from the doc's first paragraph."""
    m = re.search(r"step-level error median ([\d.]+%), P90 ([\d.]+%)", doc.read_text())
    return f"{m[1]} / {m[2]}" if m else "-"


def row(t: pd.DataFrame) -> list[str]:
    """Cells of a group of runs: per shown metric 'error (spread)' and 'coverage / width';
    then the metrics in the coverage target."""
    cells = []
    for key, _ in SHOWN:
        spread = pct(t[f"spread_{key}"].median()) if f"spread_{key}" in t else "-"
        cells.append(f"{pct(t[f'err_{key}'].median())} ({spread})")
    for key, _ in SHOWN:
        cov = t[f"inside_{key}"].astype(bool).mean() if f"inside_{key}" in t else float("nan")
        width = t[f"width_{key}"].median() if f"width_{key}" in t else float("nan")
        cells.append(f"{pct(cov)} / {pct(width)}")
    lo, hi = COVERAGE_TARGET
    covs = [
        t[f"inside_{k}"].astype(bool).mean() for k in [*METRICS, "throughput"] if f"inside_{k}" in t
    ]
    cells.append(f"{sum(lo <= c <= hi for c in covs)} of {len(covs)}" if covs else "-")
    return cells


def missing() -> str:
    """What of DOCS is absent or unreadable, as one line ('' when nothing): a doc, its table,
    or a column of its table the overview reads."""
    for doc, _, _ in DOCS:
        path = ROOT / doc
        table = path.parent / path.stem / "heldout.csv"
        for p in (path, table):
            if not p.is_file():
                return f"{p.relative_to(ROOT)}: missing (regenerate it: the doc's header says how)"
        try:
            columns = pd.read_csv(table, nrows=0).columns
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            return f"{table.relative_to(ROOT)}: not a readable CSV ({type(e).__name__})"
        need = ["load", *(f"err_{key}" for key, _ in SHOWN)]
        if absent := [c for c in need if c not in columns]:
            return f"{table.relative_to(ROOT)}: missing column(s) {', '.join(absent)}"
    return ""


def main() -> int:
    """Exit status 0, or 2 with one line on stderr (:func:`missing`) before any output."""
    if why := missing():
        print(f"fidelity_overview.py: {why}", file=sys.stderr)
        return 2
    head = ["archive", "model", "runs", "step error median / P90"]
    head += [f"{name} error (engine spread)" for _, name in SHOWN]
    head += [f"{name} coverage / width" for _, name in SHOWN]
    head += ["metrics in 85-95%"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for doc, model, windows in DOCS:
        path = ROOT / doc
        table = path.parent / path.stem / "heldout.csv"
        t = pd.read_csv(table)
        name = f"[{windows}]({Path(doc).relative_to('docs')})"
        print("| " + " | ".join([name, model, str(len(t)), step_error(path), *row(t)]) + " |")
        sat = t[t["load"] > 1]
        if len(sat) and len(sat) < len(t):
            print("| " + " | ".join(["saturated runs (load > 1) of the above", model, str(len(sat)), "-", *row(sat)]) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
