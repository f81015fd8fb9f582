"""The summary ``sched-lab run`` prints (lab/report/terminal.py): statistics without values
print ``-``, no label is cut, runs of workload classes get rows per class; and what the
results folder says about the same runs (requests.csv, report.md)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from sched_lab.cli import main
from sched_lab.report.terminal import rows, summary_text

NAN = float("nan")


def fake_run(label: str, latency_s: dict[str, float | None], **summary) -> SimpleNamespace:
    """A run as the terminal reads it: 2 of 3 requests finished over 4 s, each latency
    statistic (TTFT, TPOT, ITL, E2E) one value in seconds, or None for none (then the
    vLLM-format dict holds vLLM's 0.0 and the summary NaN, as the lab writes them)."""
    vllm = {
        "completed": 2,
        "num_prompts": 3,
        "failed": 1,
        "duration": 4.0,
        "request_throughput": 0.5,
        "output_throughput": 10.0,
        "request_rate": 0.75,
    }
    s = {
        "slo": {},
        "num_preemptions_recompute": 1,
        "num_preemptions_swap": 0,
        "mean_kv_cache_usage": 0.25,
        "max_kv_cache_usage": 0.5,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        v = latency_s[name]
        for word in ("mean", "p50", "p90", "p99", "max"):
            vllm[f"{word}_{name}_ms"] = 0.0 if v is None else v * 1e3
            s[f"{word}_{name}_ms"] = NAN if v is None else v * 1e3
    return SimpleNamespace(
        label=label, policy=label, rate_scale=1.0, vllm=vllm, summary=s | summary
    )


def test_statistics_without_values_print_a_dash():
    # 'all rejected' has no latency at all; 'one token' finished 1-token outputs only: a
    # TTFT and an E2E, no TPOT and no ITL. The vLLM-format dict says 0.0 for each missing one.
    runs = [
        fake_run("all rejected", dict.fromkeys(["ttft", "tpot", "itl", "e2el"])),
        fake_run("one token", {"ttft": 0.25, "tpot": None, "itl": None, "e2el": 0.25}),
    ]
    table = [
        ("finished / replayed", "2/3", "2/3"),
        ("rejected/aborted/unfinished", "1", "1"),
        ("duration (s)", "4.0", "4.0"),
        ("request throughput (req/s)", "0.50", "0.50"),
        ("output throughput (tok/s)", "10", "10"),
        ("TTFT mean (s)", "-", "0.250"),
        ("TTFT p50 (s)", "-", "0.250"),
        ("TTFT max (s)", "-", "0.250"),
        ("TPOT mean (ms)", "-", "-"),
        ("TPOT p50 (ms)", "-", "-"),
        ("TPOT max (ms)", "-", "-"),
        ("ITL mean (ms)", "-", "-"),
        ("ITL p50 (ms)", "-", "-"),
        ("ITL max (ms)", "-", "-"),
        ("E2E mean (s)", "-", "0.250"),
        ("E2E p50 (s)", "-", "0.250"),
        ("E2E max (s)", "-", "0.250"),
        ("preemptions recompute / swap", "1 / 0", "1 / 0"),
        ("KV used mean / max (%)", "25 / 50", "25 / 50"),
    ]
    head = ["rate_scale 1, 0.75 req/s          all rejected       one token", "-" * 62]
    assert summary_text(runs, [50]).splitlines() == head + [
        f"{name:<30}{a:>16}{b:>16}" for name, a, b in table
    ]


def test_columns_are_as_wide_as_their_labels_and_wrap_past_the_width():
    values = {"ttft": 0.25, "tpot": 0.01, "itl": 0.01, "e2el": 0.5}
    labels = ["fcfs", "priority+preempt", "chunked_prefill+a-long-suffix"]
    text = summary_text([fake_run(x, values) for x in labels], [], width=80)
    first, second = text.split("\n\n")
    # fcfs 16 + priority+preempt 17 (its 16 characters and a space) fit 80 - 30; the third
    # (30 wide) does not, so it starts a block of its own.
    assert first.splitlines()[0] == "rate_scale 1, 0.75 req/s" + " " * 18 + "fcfs priority+preempt"
    assert first.splitlines()[2] == "finished / replayed" + " " * 11 + "2/3".rjust(
        16
    ) + "2/3".rjust(17)
    assert second.splitlines()[0] == "rate_scale 1, 0.75 req/s" + "      " + " " + labels[2]
    assert all(len(line) == 30 + 30 for line in second.splitlines()[1:])
    assert "~" not in text


def test_workload_classes_get_rows_of_their_own():
    def cls(finished: int, ttft: float, slo: dict, goodput: float | None) -> dict:
        return {
            "num_prompts": 4,
            "completed": finished,
            "p50_ttft_ms": ttft * 1e3,
            "p99_ttft_ms": 2 * ttft * 1e3,
            "p50_tpot_ms": 10.0,
            "p99_tpot_ms": 20.0,
            "p50_e2el_ms": 1000.0,
            "p99_e2el_ms": 3000.0,
            "num_preemptions_recompute": 2,
            "slo": slo,
            "request_goodput": goodput,
            "slo_attainment": None if goodput is None else goodput / 2,
        }

    values = {"ttft": 0.25, "tpot": 0.01, "itl": 0.01, "e2el": 0.5}
    run = fake_run(
        "priority",
        values,
        request_goodput=0.75,
        slo_attainment=0.375,
        classes={
            "chat": cls(4, 0.5, {"ttft_s": 1.0, "tpot_s": 0.1}, 0.5),
            "batch": cls(3, 4.0, {}, None),
        },
    )
    table = rows([run], [])
    # class SLOs alone give the run a goodput (lab/results/fairness.py computes it)
    assert ("goodput (req/s)", ["0.75"]) in table and ("SLO attainment (%)", ["37.5"]) in table
    start = [name for name, _ in table].index("class chat (SLO ttft <= 1 s, tpot <= 100 ms)")
    assert table[start:] == [
        ("class chat (SLO ttft <= 1 s, tpot <= 100 ms)", [""]),
        ("  finished / replayed", ["4/4"]),
        ("  TTFT p50 (s)", ["0.500"]),
        ("  TTFT p99 (s)", ["1.000"]),
        ("  TPOT p50 (ms)", ["10.0"]),
        ("  TPOT p99 (ms)", ["20.0"]),
        ("  E2E p50 (s)", ["1.000"]),
        ("  E2E p99 (s)", ["3.000"]),
        ("  goodput (req/s)", ["0.50"]),
        ("  SLO attainment (%)", ["25.0"]),
        ("  preemptions recompute", ["2"]),
        ("class batch", [""]),  # no SLO: no goodput rows
        ("  finished / replayed", ["3/4"]),
        ("  TTFT p50 (s)", ["4.000"]),
        ("  TTFT p99 (s)", ["8.000"]),
        ("  TPOT p50 (ms)", ["10.0"]),
        ("  TPOT p99 (ms)", ["20.0"]),
        ("  E2E p50 (s)", ["1.000"]),
        ("  E2E p99 (s)", ["3.000"]),
        ("  preemptions recompute", ["2"]),
    ]
    text = summary_text([run], [])
    assert "\n\nclass chat (SLO ttft <= 1 s, tpot <= 100 ms)\n  finished / replayed" in text
    assert text.endswith(
        "SLOs: per class (goodput: finished requests/s meeting their class's SLOs)"
    )


# ---------------------------------------------------------------------------- end to end
TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROWS_1_TOKEN = (  # request 0's 500 + 1 tokens exceed the 2 blocks of 16: rejected
    "2023-11-16 18:17:00,500,1\n2023-11-16 18:17:01,5,1\n2023-11-16 18:17:02,6,1\n"
)
ROWS_TOO_LONG = "2023-11-16 18:17:00,500,2\n2023-11-16 18:17:01,400,3\n"


def run_cli(tmp_path, rows: str, *args: str) -> tuple[str, dict]:
    (tmp_path / "t.csv").write_text(TRACE + rows)
    (tmp_path / "exp.yaml").write_text(
        "trace: {format: azure2023, path: t.csv}\npolicies: [fcfs]\n"
        "kv_cache: {num_gpu_blocks: 2, block_size: 16}\n"
    )
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "exp.yaml"), "--out", str(out), "--quiet", *args]) == 0
    return out, json.loads((out / "summary.json").read_text())["fcfs"]


def table_row(stdout: str, name: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(name))[30:].strip()


def test_one_token_outputs_have_no_tpot_or_itl(tmp_path, capsys):
    out, summary = run_cli(tmp_path, ROWS_1_TOKEN, "--no-progress")
    stdout = capsys.readouterr().out
    assert summary["p50_tpot_ms"] is None and summary["p50_itl_ms"] is None
    for name in ("TPOT mean (ms)", "TPOT p99 (ms)", "ITL p50 (ms)", "ITL max (ms)"):
        assert table_row(stdout, name) == "-"
    assert table_row(stdout, "TTFT p50 (s)") == f"{summary['p50_ttft_ms'] / 1e3:.3f}"
    assert table_row(stdout, "finished / replayed") == "2/3"
    # an integer in every row: the rejected request generated nothing, and says why
    req = pd.read_csv(out / "requests.csv", dtype=str, keep_default_na=False)
    assert req["num_generated_tokens"].tolist() == ["0", "1", "1"]
    assert req["status"].tolist() == ["rejected", "finished", "finished"]
    assert req.loc[0, "reason"].startswith("prompt 500 + output 1 = 501 tokens (32 blocks)")


def test_every_request_rejected_prints_no_latency(tmp_path, capsys):
    out, summary = run_cli(tmp_path, ROWS_TOO_LONG, "--no-progress")
    stdout = capsys.readouterr().out
    assert summary["mean_ttft_ms"] is None and summary["p99_e2el_ms"] is None
    for name in ("TTFT mean (s)", "TTFT max (s)", "TPOT p50 (ms)", "E2E p99 (s)"):
        assert table_row(stdout, name) == "-"
    assert table_row(stdout, "finished / replayed") == "0/2"
    assert table_row(stdout, "rejected/aborted/unfinished") == "2"
    req = pd.read_csv(out / "requests.csv")
    assert req["num_generated_tokens"].dtype == "int64"
    assert req["num_generated_tokens"].tolist() == [0, 0]
    report = (out / "report.md").read_text()
    assert "nan" not in report
    assert "| fcfs | 0 | 2 | 0 | 0.00 | 0 | - / - | - / - | - / - / - | - / - |" in report


def test_report_names_the_files_of_its_format(tmp_path):
    pytest.importorskip("pyarrow")
    out, _ = run_cli(tmp_path, ROWS_1_TOKEN, "--no-progress", "--format", "parquet")
    files = next(x for x in (out / "report.md").read_text().splitlines() if x.startswith("Files:"))
    for name in ("requests.parquet", "steps.parquet", "events.parquet"):
        assert f"`{name}`" in files and (out / name).exists()
    assert ".csv" not in files
    req = pd.read_parquet(out / "requests.parquet")
    assert req["num_generated_tokens"].tolist() == [0, 1, 1]
