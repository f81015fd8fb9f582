"""One name per metric (lab/results/names.py): vLLM's names, the older ones accepted on input
and converted, and every metric of a summary under a name the table knows."""

from __future__ import annotations

import math

import pytest
from helpers import run

from sched_lab.results import metrics
from sched_lab.results.names import (
    METRICS,
    MISSING,
    canonical,
    format_value,
    higher_is_better,
    label,
    latency_name,
    parse_latency,
    upgrade_summary,
)


def test_latency_names_are_vllms():
    assert latency_name(99, "ttft") == "p99_ttft_ms"
    assert latency_name(99.9, "itl") == "p99.9_itl_ms"
    assert latency_name("median", "e2el") == "median_e2el_ms"
    assert parse_latency("p99.9_e2el_ms") == ("p99.9", "e2el")
    assert parse_latency("max_queue_ms") == ("max", "queue")
    assert parse_latency("ttft_s_p99") is None and parse_latency("p99_ttft_s") is None


def test_older_names_are_aliases_with_their_unit():
    assert canonical("ttft_s_p99") == ("p99_ttft_ms", 1e3)  # sweep tables, seconds
    assert canonical("ttft_s.p50") == ("p50_ttft_ms", 1e3)  # summary.json, nested
    assert canonical("e2e_s_mean") == ("mean_e2el_ms", 1e3)  # E2E is vLLM's e2el
    assert canonical("queue_s_max") == ("max_queue_ms", 1e3)
    assert canonical("goodput") == ("request_goodput", 1.0)
    assert canonical("finished") == ("completed", 1.0)
    assert canonical("preemptions.swap") == ("num_preemptions_swap", 1.0)
    assert canonical("kv_used_fraction_mean") == ("mean_kv_cache_usage", 1.0)
    assert canonical("p99_ttft_ms") == ("p99_ttft_ms", 1.0)
    assert canonical("no_such") == ("no_such", 1.0)


def test_one_formatter_for_every_table():
    import numpy as np
    import pandas as pd

    assert MISSING == "-"
    for nothing in (None, math.nan, np.float64("nan"), pd.NA):
        assert format_value(nothing, ".2f") == "-"
    assert format_value(1.23456, ".2f") == "1.23"
    assert format_value(0.125, ".1%") == "12.5%"
    # whole numbers keep every digit under a g spec (a KV budget, a seq limit)
    assert format_value(131072.0, ".4g") == "131072"
    assert format_value(np.int64(66560), ".4g") == "66560"
    assert format_value(146040.6, ".4g") == "1.46e+05"
    assert format_value(2.0, ".2f") == "2.00"
    assert format_value(True) == "True" and format_value("p000") == "p000"
    # a nonzero value an f spec would show as 0 keeps 2 significant digits (a CPU engine's
    # 0.31 tok/s); zero stays 0, and values that do not round to 0 are as the spec says
    assert format_value(0.3125, ".0f") == "0.31" and format_value(0.004, ".2f") == "0.004"
    assert format_value(-4e-05, ".1f") == "-4e-05" and format_value(np.float64(0.0), ".0f") == "0"
    assert format_value(0.5, ".0f") == "0.5" and format_value(0.6, ".0f") == "1"


def test_labels_and_directions():
    assert label("p99.9_tpot_ms") == "TPOT p99.9 (ms)"
    assert label("request_goodput") == "goodput (req/s)"
    assert higher_is_better("slo_attainment") and higher_is_better("request_goodput")
    assert not higher_is_better("p99_ttft_ms") and not higher_is_better("num_preemptions")


def test_an_older_summary_entry_is_read_under_todays_names():
    old = {
        "finished": 9, "duration_s": 2.0, "goodput": 4.0, "slo_attainment": 0.8,
        "ttft_s": {"mean": 0.25, "p50": 0.125, "p99": float("nan")},
        "preemptions": {"recompute": 3, "swap": 2, "requests_preempted": 4},
        "kv_used_fraction": {"mean": 0.5, "max": 1.0},
        "classes": {"chat": {"num_requests": 5, "e2e_s": {"max": 1.5}}},
        "cluster": {"replicas": {"0": {"preemptions": 7, "tpot_s": {"p50": 0.01}}},
                    "kv_transfer": {"num_transfers": 2, "transfer_s": {"mean": 0.002}}},
        "limits": {"max_num_seqs": 8},
    }  # fmt: skip
    new = upgrade_summary(old)
    assert new["completed"] == 9 and new["duration"] == 2.0 and new["request_goodput"] == 4.0
    assert (new["mean_ttft_ms"], new["p50_ttft_ms"]) == (250.0, 125.0)
    assert math.isnan(new["p99_ttft_ms"])
    assert (new["num_preemptions_recompute"], new["num_preemptions_swap"]) == (3, 2)
    assert (new["num_preemptions"], new["num_preempted_requests"]) == (5, 4)
    assert (new["mean_kv_cache_usage"], new["max_kv_cache_usage"]) == (0.5, 1.0)
    assert new["classes"]["chat"] == {"num_prompts": 5, "max_e2el_ms": 1500.0}
    replica = new["cluster"]["replicas"]["0"]
    assert replica == {"num_preemptions": 7, "p50_tpot_ms": 10.0}
    assert new["cluster"]["kv_transfer"] == {"num_transfers": 2, "mean_kv_transfer_ms": 2.0}
    assert new["limits"] == {"max_num_seqs": 8}  # a section of facts, as it was
    assert upgrade_summary(new) == new  # today's names come back as they are


def test_every_metric_of_a_summary_has_a_known_name():
    res = run("fcfs", [("a", 0.0, 16, 3), ("b", 0.004, 16, 2)], gpu_blocks=64)
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    s = metrics.summarize(df, itl, res, {"ttft_s": 0.012, "tpot_s": 0.5}, (50, 99.9))
    facts = {"slo", "rejected", "aborted", "unfinished", "dropped", "num_gpu_blocks",
             "num_steps", "async_scheduling", "num_wasted_tokens", "prefix_caching"}  # fmt: skip
    for key in s:
        known = key in METRICS or parse_latency(key) or key in facts
        assert known or key.startswith(("prefix_cache", "slo_attainment_")), key
    # the report's percentiles and vLLM's, and max: p99.9 and max are in summary.json
    for stat in ("mean", "median", "std", "p50", "p90", "p99", "p99.9", "max"):
        assert f"{stat}_ttft_ms" in s and f"{stat}_itl_ms" in s
    assert s["max_ttft_ms"] == pytest.approx(16.0)  # TTFT 10 and 16 ms
    assert s["slo_attainment_ttft"] == 0.5 and s["slo_attainment_tpot"] == 1.0
