"""The vLLM-format result files (lab/results/vllm_result.py): vLLM's documented field names, and
values hand-computed on a replay with 10 ms steps (tests/helpers.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from helpers import run

from sched_lab.results import metrics
from sched_lab.results.vllm_result import percentile_word, result_date, vllm_result

ROOT = Path(__file__).resolve().parent.parent

# The keys `vllm bench serve --save-result` writes, from vLLM's source,
# vllm/benchmarks/serve.py (vllm-project/vllm, read at commit 009e6d4a): `main_async` puts
# date, endpoint_type, backend, label, model_id, tokenizer_id, num_prompts, request_rate,
# burstiness, max_concurrency in `result_json`; `benchmark` returns duration, completed,
# failed, total_input_tokens, total_output_tokens, request_throughput, request_goodput,
# output_throughput, total_token_throughput, max_output_tokens_per_s,
# max_concurrent_requests; `process_one_metric` adds mean_/median_/std_{m}_ms and
# p{P}_{m}_ms for each of --percentile-metrics ("ttft", "tpot", "itl", "e2el") and
# --metric-percentiles, P spelled str(int(p)) when whole, else str(p) ("p99.9").
VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests",
]  # fmt: skip
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")


def vllm_keys(percentiles) -> list[str]:
    out = list(VLLM_KEYS)
    for m in VLLM_METRICS:
        out += [f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms"]
        out += [f"p{percentile_word(p)}_{m}_ms" for p in percentiles]
    return out


def test_percentile_words_are_vllms():
    assert [percentile_word(p) for p in (50.0, 99.0, 99.9, 99.99)] == ["50", "99", "99.9", "99.99"]


def test_values_by_hand():
    # a (16 + 3) arrives at 0, b (16 + 2) at 4 ms. Step 0 [0, 10 ms) prefills a; step 1
    # prefills b (fcfs: prefill-first, a waits); step 2 decodes both (b's last token);
    # step 3 decodes a. Tokens: a at 10, 30, 40 ms; b at 20, 30 ms.
    res = run("fcfs", [("a", 0.0, 16, 3), ("b", 0.004, 16, 2)], gpu_blocks=64)
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    summary = metrics.summarize(df, itl, res, {"ttft_s": 0.012})
    v = vllm_result(
        df, itl, summary, res.step_end_s, res.steps["num_decode_tokens"],
        label="fcfs", model="m", backend="sched-lab-sim", percentiles=(50, 90, 99, 99.9),
    )  # fmt: skip
    assert set(vllm_keys((50, 90, 99, 99.9))) <= set(v)
    approx = pytest.approx
    assert (v["completed"], v["failed"], v["num_prompts"]) == (2, 0, 2)
    assert (v["total_input_tokens"], v["total_output_tokens"]) == (32, 5)
    assert v["duration"] == approx(0.04)
    assert v["request_throughput"] == approx(50.0)
    assert v["output_throughput"] == approx(125.0)
    assert v["total_token_throughput"] == approx(925.0)
    assert v["request_rate"] == approx(250.0)  # (2 - 1) / 4 ms
    # TTFT 10 and 16 ms
    assert v["mean_ttft_ms"] == approx(13.0) and v["median_ttft_ms"] == approx(13.0)
    assert v["std_ttft_ms"] == approx(3.0) and v["p90_ttft_ms"] == approx(15.4)
    assert v["p99.9_ttft_ms"] == approx(15.994) and v["max_ttft_ms"] == approx(16.0)
    # TPOT (40 - 10) / 2 = 15 and (30 - 20) / 1 = 10 ms
    assert v["mean_tpot_ms"] == approx(12.5) and v["std_tpot_ms"] == approx(2.5)
    # ITL: a's 20 and 10 ms, b's 10 ms
    assert v["mean_itl_ms"] == approx(40 / 3) and v["median_itl_ms"] == approx(10.0)
    assert v["std_itl_ms"] == approx((200 / 9) ** 0.5)
    assert v["p99_itl_ms"] == approx(19.8) and v["max_itl_ms"] == approx(20.0)
    # E2E 40 and 26 ms
    assert v["mean_e2el_ms"] == approx(33.0) and v["std_e2el_ms"] == approx(7.0)
    # SLO ttft <= 12 ms: a only, over 40 ms
    assert v["request_goodput"] == approx(25.0) and v["slo_attainment"] == approx(0.5)
    assert v["goodput_slo_ms"] == approx({"ttft": 12.0})
    assert v["max_concurrent_requests"] == 2 and v["max_output_tokens_per_s"] == 5


def test_decode_output_tokens_made_in_parts(monkeypatch):
    """DecodeOutputTokens: rows lo:hi of decode_output_tokens, made STEP_ROWS (here 2) steps
    at a time; the vLLM result with it is the one with the whole column."""
    res = run("fcfs", [("a", 0.0, 16, 3), ("b", 0.004, 16, 2)], gpu_blocks=64)
    monkeypatch.setattr(metrics, "STEP_ROWS", 2)
    tokens = metrics.DecodeOutputTokens(res)
    whole = metrics.decode_output_tokens(res.steps)
    assert whole.tolist() == [0.0, 0.0, 2.0, 1.0]  # steps 2 (a and b) and 3 (a) decode
    assert len(tokens) == 4 and tokens[0:4].tolist() == whole.tolist()
    assert tokens[1:4].tolist() == [0.0, 2.0, 1.0] and tokens[3:10].tolist() == [1.0]
    with pytest.raises(ValueError):
        tokens[::2]
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    summary = metrics.summarize(df, itl, res, {"ttft_s": 0.012})
    kw = dict(label="fcfs", model="m", backend="sched-lab-sim")
    assert vllm_result(df, itl, summary, res.step_end_s, tokens, **kw) == vllm_result(
        df, itl, summary, res.step_end_s, whole, **kw
    )


def test_no_slo_means_no_goodput_as_in_vllm():
    res = run("fcfs", [("a", 0.0, 16, 3)], gpu_blocks=64)
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    summary = metrics.summarize(df, itl, res, {})
    v = vllm_result(
        df, itl, summary, res.step_end_s, res.steps["num_decode_tokens"],
        label="fcfs", model="m", backend="sched-lab-sim",
    )  # fmt: skip
    assert v["request_goodput"] is None and v["request_rate"] is None  # one arrival: no rate
    assert v["metric_percentiles"] == "50,90,99,99.9"


def test_peak_output_rate_in_parts_is_the_whole_runs():
    """The busiest second from the first arrival: 3 decode tokens and a first token in
    second 1 (4), against 3 in second 0 (a step ending before the first arrival counts
    there); the steps binned 1, 2 or all at a time give the same."""
    import numpy as np
    import pandas as pd

    from sched_lab.results.vllm_result import peak_output_rate

    df = pd.DataFrame({"arrival_s": [0.5, 0.7], "first_token_s": [0.9, 1.6]})
    ends, tokens = np.array([0.2, 0.6, 1.8, 2.0, 2.9]), np.array([1.0, 1.0, 2.0, 1.0, 1.0])
    # from 0.5: ends -0.3 (second 0), 0.1 (0), 1.3 (1), 1.5 (1), 2.4 (2); firsts 0.4, 1.1
    for rows in (1, 2, 5, 1 << 20):
        assert peak_output_rate(df, ends, tokens, rows) == 4.0
    rng = np.random.default_rng(7)
    ends = np.sort(rng.uniform(0.0, 50.0, 1000))
    tokens = rng.integers(0, 300, 1000).astype(float)
    df = pd.DataFrame({"arrival_s": [0.0, 3.0], "first_token_s": [1.5, np.nan]})
    seconds = np.concatenate([ends.astype(np.int64), [1]])
    expected = np.bincount(seconds, np.concatenate([tokens, [1.0]])).max()
    assert [peak_output_rate(df, ends, tokens, rows) for rows in (7, 100, 1000)] == [expected] * 3


def test_date_is_vllms_format_and_reproducible(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert result_date(1764679384.9) == "20251202-124304"
        monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764633600")
        assert result_date() == "20251202-000000"
        monkeypatch.delenv("SOURCE_DATE_EPOCH")
        assert re.fullmatch(r"\d{8}-\d{6}", result_date())
    finally:
        monkeypatch.undo()
        time.tzset()


def test_results_folder_holds_one_vllm_file_per_run(tmp_path):
    import run_experiment

    out = tmp_path / "q"
    args = [str(ROOT / "experiments/quickstart.yaml"), "--limit", "40", "--out", str(out)]
    assert run_experiment.main([*args, "--no-progress", "--metric-percentiles", "50,99.9"]) == 0
    files = sorted(p.name for p in out.glob("*qps-llama-3.1-8b.json"))
    assert [f.split("-")[0] for f in files] == ["chunked_prefill", "fcfs", "swap"]
    summary = json.loads((out / "summary.json").read_text())
    for name in files:
        v = json.loads((out / name).read_text())
        assert set(vllm_keys((50, 99.9))) <= set(v)
        assert "p90_ttft_ms" not in v
        s = summary[v["label"]]
        assert re.fullmatch(r"\d{8}-\d{6}", v["date"])  # vLLM's %Y%m%d-%H%M%S
        assert v["completed"] == s["completed"]
        for key in vllm_keys((50, 99.9)):  # the summary's numbers, under the same names
            if key.endswith("_ms") or key in ("request_throughput", "request_rate"):
                assert v[key] == s[key], key
        assert "p90_ttft_ms" in s  # the summary holds what report.md shows too
        assert name == f"{v['label']}-{v['request_rate']:.2f}qps-llama-3.1-8b.json"
