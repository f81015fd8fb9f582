"""``sched-lab compare RUN_A RUN_B``: the distribution errors of one results folder's run
against another's (the simulator's prediction against a served run, an engine run against
vLLM's), in the table docs/fidelity.md uses.

    sched-lab compare results/quickstart results/quickstart_served --run fcfs

For each statistic X of TTFT, TPOT, ITL and E2E at p50, p90 and p99, and for the output
throughput: the relative error |B - A| / A (:func:`sched_lab.fidelity.compare.rel`), marked
✗ past the fidelity targets (5% at p50 and p90, 10% at p99, 3% for throughput); then each
statistic's two values and the signed difference (B - A) / A. Printed, and written as
markdown with ``--out FILE.md``. Runs of different workloads (another trace, another
number of requests, another rate scale) or partial runs compare too, with a note saying so
under the title.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sched_lab.core.errors import OneLineParser, UserError
from sched_lab.fidelity.compare import column, run_row
from sched_lab.fidelity.markdown import COLS, error_cell, error_target
from sched_lab.results.names import LATENCIES, format_value, label, upgrade_summary

THROUGHPUTS = ("output_throughput", "request_throughput", "total_token_throughput")


def read_run(folder: Path, run: str | None, flag: str) -> tuple[str, dict[str, Any]]:
    """(label, summary) of a run of the results folder ``folder``: ``run``, else its only run.

    Raises:
        UserError: no readable summary.json, an unknown label, or several runs and none named.
    """
    path = Path(folder) / "summary.json"
    try:
        runs = json.loads(path.read_text())
    except OSError as e:
        raise UserError(
            f"{path}: cannot be read ({e.strerror}); expected a results folder"
        ) from None
    except ValueError as e:
        raise UserError(f"{path}: not JSON ({e})") from None
    if (
        not isinstance(runs, dict)
        or not runs
        or not all(isinstance(v, dict) for v in runs.values())
    ):
        raise UserError(f"{path}: expected a mapping of run labels to summaries")
    names = ", ".join(runs)
    if run is None:
        if len(runs) > 1:
            raise UserError(f"{path}: holds runs {names}; name one with {flag}")
        run = next(iter(runs))
    if run not in runs:
        raise UserError(f"{flag} {run}: not a run of {path} (runs: {names})")
    return run, upgrade_summary(runs[run])


def compare_row(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> dict:
    """The errors of summary ``b`` against ``a``: :func:`sched_lab.fidelity.compare.run_row`'s
    row (``real_X``: A's, ``sim_X``: B's, ``err_X``; missing values NaN)."""
    keys = [column(m, p) for m, p in COLS] + ["output_throughput", "num_preemptions"]
    a = {**a, **{k: _number(a.get(k)) for k in keys}}
    b = {**b, **{k: _number(b.get(k)) for k in keys}}
    return run_row(label_a, 1.0, SimpleNamespace(label=label_b, summary=b), a, None)


def markdown(folder_a, folder_b, label_a: str, label_b: str, a: dict, b: dict) -> str:
    """The comparison as markdown: the error table, then every statistic's values."""
    row = compare_row(a, b, label_a, label_b)
    head = ["A", "B"] + [f"{LATENCIES[m][0]} {p}" for m, p in COLS] + ["throughput"]
    cells = [label_a, label_b] + [error_cell(row, m, p, False) for m, p in COLS]
    cells.append(error_cell(row, "throughput", "tp", False))
    lines = [
        f"# {label_b} vs {label_a}",
        "",
        f"A: `{folder_a}` (run `{label_a}`); B: `{folder_b}` (run `{label_b}`).",
        "",
        *[f"{note}\n" for note in notes(a, b)],
        "Relative error |B - A| / A of each percentile and of the output throughput; ✗ "
        f"marks a miss of {error_target('p50'):.0%} at p50 and p90, {error_target('p99'):.0%} "
        f"at p99, {error_target('tp'):.0%} for throughput (the targets of docs/fidelity.md).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| " + " | ".join(cells) + " |",
        "",
        "| statistic | A | B | (B - A) / A |",
        "|---|---|---|---|",
    ]
    for key in [column(m, p) for m, p in COLS] + list(THROUGHPUTS):
        va, vb = _number(a.get(key)), _number(b.get(key))
        diff = (vb - va) / va if va else float("nan")
        lines.append(
            f"| {label(key)} | {format_value(va, '.4g')} | {format_value(vb, '.4g')} "
            f"| {format_value(diff * 100, '+.1f')}{'%' if diff == diff else ''} |"
        )
    lines += ["", f"Requests finished: A {_count(a)}, B {_count(b)}.", ""]
    return "\n".join(lines)


def notes(a: dict, b: dict) -> list[str]:
    """What makes the two runs' errors not a like-for-like comparison: a different
    workload (trace file contents, requests replayed, rate scale), a partial run."""
    out = []
    keys = [("num_prompts", "requests"), ("rate_scale", "rate scale")]
    differ = [what for key, what in keys if a.get(key) != b.get(key)]
    sha_a, sha_b = _trace(a).get("sha256"), _trace(b).get("sha256")
    if sha_a and sha_b and sha_a != sha_b:
        differ.insert(0, "trace")
    if differ:
        out.append(
            f"**Different workloads** ({', '.join(differ)}): A replayed {_workload(a)}, B "
            f"{_workload(b)}; the errors compare different loads."
        )
    for name, s in (("A", a), ("B", b)):
        if s.get("partial"):
            out.append(f"**{name} is a partial run**: {s['partial']}.")
    return out


def _trace(s: dict) -> dict:
    t = s.get("trace")
    return t if isinstance(t, dict) else {}


def _workload(s: dict) -> str:
    t = _trace(s)
    sha = f" (sha256 {t['sha256'][:12]})" if isinstance(t.get("sha256"), str) else ""
    return (
        f"{s.get('num_prompts', '?')} requests of `{t.get('path', '?')}`{sha} at rate scale "
        f"{s.get('rate_scale', '?')}"
    )


def _labels(folder: Path) -> list[str]:
    """The run labels of ``folder``'s summary.json; empty when it cannot be read."""
    try:
        runs = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return []
    return list(runs) if isinstance(runs, dict) else []


def _count(s: dict) -> str:
    return f"{s.get('completed', '-')} of {s.get('num_prompts', '-')}"


def _number(v: Any) -> float:
    """A summary value as a float; NaN for None (JSON's null for NaN) or a non-number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return float("nan")
    return float(v) if math.isfinite(v) else float("nan")


def main(argv: list[str] | None = None, prog: str = "sched-lab compare") -> int:
    """``sched-lab compare``'s entry point; returns the exit status (2 for bad input)."""
    ap = OneLineParser(
        prog=prog,
        description="Relative errors per metric (TTFT, TPOT, ITL, E2E at p50/p90/p99; "
        "output throughput) of run B against run A, from two results folders.",
    )
    ap.add_argument("folder_a", metavar="RUN_A", help="results folder A (the reference)")
    ap.add_argument("folder_b", metavar="RUN_B", help="results folder B (compared with A)")
    ap.add_argument("--run", help="A's run label (needed when A holds several runs)")
    ap.add_argument(
        "--run-b", help="B's run label (default: --run's label if B has it, else B's only run)"
    )
    ap.add_argument("--out", help="also write the comparison to this markdown file")
    args = ap.parse_args(argv)
    try:
        label_a, a = read_run(Path(args.folder_a), args.run, "--run")
        run_b = args.run_b
        if run_b is None and args.run is not None and args.run in _labels(Path(args.folder_b)):
            run_b = args.run
        label_b, b = read_run(Path(args.folder_b), run_b, "--run-b")
        text = markdown(args.folder_a, args.folder_b, label_a, label_b, a, b)
        if args.out:
            try:
                Path(args.out).write_text(text)
            except OSError as e:
                raise UserError(f"--out {args.out}: cannot write ({e.strerror})") from None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0
