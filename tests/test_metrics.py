"""Metric definitions on hand-computed values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers import FixedCost, run

from sched_lab.core.kv import make_block_manager
from sched_lab.core.request import Request
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.results import gaps, metrics, vllm_result
from sched_lab.sim.replay import replay


def test_tpot_excludes_first_token_and_single_token_outputs():
    # (ttft, e2e, tokens) = (0.2, 0.2, 1), (0.1, 1.1, 11), (0.3, 1.1, 3):
    # TPOT = none, (1.1 - 0.1) / 10 = 0.1, (1.1 - 0.3) / 2 = 0.4 -> mean 0.25.
    tpot = metrics.tpot_s([0.2, 0.1, 0.3], [0.2, 1.1, 1.1], [1, 11, 3])
    assert np.isnan(tpot[0])
    np.testing.assert_allclose(tpot[1:], [0.1, 0.4])
    assert metrics.latency_stats("tpot", tpot)["mean_tpot_ms"] == pytest.approx(250.0)


def test_single_token_request_has_ttft_equal_e2e():
    res = run("fcfs", [("one", 0.0, 10, 1)])
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    row = df.iloc[0]
    assert row.ttft_s == pytest.approx(0.01) and row.e2e_s == pytest.approx(0.01)
    assert np.isnan(row.tpot_s) and len(itl) == 0


def test_request_table_and_summary_on_a_replay():
    # a (0.0, prompt 4, out 3): tokens 0.01, 0.02, 0.03. b (0.015, prompt 4, out 2): arrives
    # during step 2 (0.01-0.02); step 3 prefills it alone (prefill-first, 0.02-0.03), so a's
    # third token waits: a gets 0.01, 0.02, 0.04 and b gets 0.03, 0.04.
    res = run("fcfs", [("a", 0.0, 4, 3), ("b", 0.015, 4, 2)])
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    a, b = df.set_index("request_id").loc["a"], df.set_index("request_id").loc["b"]
    assert (a.ttft_s, a.e2e_s, a.tpot_s) == pytest.approx((0.01, 0.04, 0.015))
    assert (b.ttft_s, b.e2e_s, b.tpot_s, b.queue_s) == pytest.approx((0.015, 0.025, 0.01, 0.005))
    np.testing.assert_allclose(itl, [0.01, 0.02, 0.01])  # a's gaps, then b's, in token order
    s = metrics.summarize(df, itl, res, {"ttft_s": 0.012, "tpot_s": None, "e2e_s": None})
    assert s["duration"] == pytest.approx(0.04)
    assert s["request_throughput"] == pytest.approx(2 / 0.04)
    assert s["output_throughput"] == pytest.approx(5 / 0.04)
    assert s["total_token_throughput"] == pytest.approx(13 / 0.04)
    assert s["mean_itl_ms"] == pytest.approx(40 / 3)
    # TTFT 10 and 15 ms; E2E 40 and 25 ms; queue 0 and 5 ms
    assert (s["median_ttft_ms"], s["max_ttft_ms"]) == pytest.approx((12.5, 15.0))
    assert (s["p99.9_e2el_ms"], s["std_e2el_ms"]) == pytest.approx((39.985, 7.5))
    assert s["mean_queue_ms"] == pytest.approx(2.5)
    assert (s["num_prompts"], s["completed"], s["failed"]) == (2, 2, 0)
    assert s["request_rate"] == pytest.approx(1 / 0.015)  # (2 - 1) / 15 ms
    # Only a meets TTFT <= 12 ms.
    assert s["request_goodput"] == pytest.approx(1 / 0.04) and s["slo_attainment"] == 0.5
    assert s["slo_attainment_ttft"] == 0.5 and "slo_attainment_tpot" not in s


def test_slo_counts_rejected_as_miss():
    df = pd.DataFrame(
        {
            "status": ["finished", "rejected"],
            "ttft_s": [0.1, np.nan],
            "tpot_s": [np.nan, np.nan],
            "e2e_s": [0.1, np.nan],
        }
    )
    assert metrics.meets_slo(df, {"ttft_s": 1.0, "tpot_s": 0.01}).tolist() == [True, False]


def test_slo_attainment_is_over_every_replayed_request():
    # a, b (t=0, prompt 4, out 2) prefill together in step 1: TTFT 10 ms each. c arrives at
    # 15 ms, during step 2 (a's and b's last tokens); step 3 (20-30 ms) prefills it: TTFT
    # 15 ms, its last token at 40 ms. big (2,000 + 2 tokens > max_model_len 100): rejected.
    # TTFT SLO 12 ms: a and b meet it, c misses it, big misses it (rejected).
    rows = [("a", 0.0, 4, 2), ("b", 0.0, 4, 2), ("big", 0.0, 2000, 2), ("c", 0.015, 4, 2)]
    res = run("fcfs", rows, max_model_len=100)
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    assert df["status"].tolist() == ["finished", "finished", "rejected", "finished"]
    s = metrics.summarize(df, itl, res, {"ttft_s": 0.012})
    assert s["slo_attainment"] == 0.5  # 2 of 4, not 2 of the 3 finished
    assert s["slo_attainment_finished"] == pytest.approx(2 / 3)
    assert s["slo_attainment_ttft"] == 0.5
    assert s["request_goodput"] == pytest.approx(2 / 0.04)  # 2 good requests over 40 ms
    assert (s["num_prompts"], s["completed"], s["rejected"], s["failed"]) == (4, 3, 1, 1)


def test_requests_unfinished_when_the_run_stops_are_misses():
    # Sync, 10 ms steps: step 1 prefills a and b, step 2 gives a its last token (20 ms),
    # step 3 decodes b, step 4 fails: b is unfinished at 30 ms with the failure as reason.
    s = get_policy("fcfs")(SchedulerLimits(8, 64, 64), make_block_manager(8, 0, 4, 0.0, False))
    res = replay([Request("a", 0.0, 4, 2), Request("b", 0.0, 4, 6)], s, FailsAtStep(4))
    df, itl = metrics.request_table(res, "fcfs", 1.0)
    assert df["status"].tolist() == ["finished", "unfinished"]
    assert df["reason"][1] == (
        "not finished: the run stopped at t=0.030s (RuntimeError: the step failed)"
    )
    summary = metrics.summarize(df, itl, res, {"ttft_s": 1.0})
    assert (summary["completed"], summary["unfinished"], summary["aborted"]) == (1, 1, 0)
    assert summary["failed"] == 1
    assert summary["slo_attainment"] == 0.5 and summary["slo_attainment_finished"] == 1.0


def test_stats_percentiles_linear_interpolation():
    s = metrics.latency_stats("x", [1.0, 2.0, 3.0, 4.0, np.nan], (50, 90, 99.9))
    assert s == {
        "mean_x_ms": 2500.0, "median_x_ms": 2500.0, "std_x_ms": pytest.approx(1.25**0.5 * 1e3),
        "p50_x_ms": 2500.0, "p90_x_ms": pytest.approx(3700.0), "p99.9_x_ms": pytest.approx(3997.0),
        "max_x_ms": 4000.0,
    }  # fmt: skip
    assert all(np.isnan(v) for v in metrics.latency_stats("x", [np.nan]).values())


def test_summary_percentiles_hold_the_reports_and_vllms():
    assert metrics.summary_percentiles((99.9, 50)) == (50.0, 90.0, 99.0, 99.9)
    assert metrics.summary_percentiles((75,)) == (50.0, 75.0, 90.0, 99.0)


def test_stats_is_bitwise_the_same_with_overwrite_and_any_layout():
    rng = np.random.default_rng(0)
    values = rng.lognormal(0, 2, 100_003)  # pairwise summation: the order and layout matter
    pcts = metrics.DEFAULT_PERCENTILES
    want = {
        "mean_v_ms": float(values.mean()) * 1e3,
        "median_v_ms": float(np.median(values)) * 1e3,
        "std_v_ms": float(values.std()) * 1e3,
        **{f"p{p:g}_v_ms": float(np.percentile(values, p)) * 1e3 for p in pcts},
        "max_v_ms": float(values.max()) * 1e3,
    }
    strided = np.repeat(values, 2)[::2]  # the same values, not contiguous
    assert metrics.latency_stats("v", strided) == want
    assert metrics.latency_stats("v", values) == want
    copy = values.copy()
    assert metrics.latency_stats("v", copy, overwrite=True) == want
    assert sorted(copy) == sorted(values)  # reordered in place, same values
    with_nan = np.concatenate([values[:10], [np.nan, np.inf], values[10:]])
    assert metrics.latency_stats("v", with_nan) == want and np.isnan(with_nan[10])


@pytest.mark.parametrize("leaf", [128, 129, 1000, 8192])
def test_population_std_is_numpys_to_the_last_bit(leaf):
    rng = np.random.default_rng(leaf)
    for n in [1, 7, 128, 129, 1001, 8191, 8193, 65_537, *rng.integers(129, 200_000, 12)]:
        values = rng.lognormal(-4, 2, int(n))  # heavy-tailed, as latencies: the order matters
        assert metrics.population_std(values, leaf) == float(values.std()), (n, leaf)
    with pytest.raises(ValueError, match="leaf: 64 values; at least 128"):
        metrics.population_std(np.ones(1000), 64)


def test_stats_with_a_small_std_leaf_is_bitwise_the_same(monkeypatch):
    """latency_stats' std in leaves (the way the ITL gaps of a large run take it)."""
    values = np.random.default_rng(1).lognormal(0, 2, 100_003)
    want = metrics.latency_stats("v", values)
    monkeypatch.setattr(gaps, "LEAF", 1000)
    assert metrics.latency_stats("v", values) == want
    assert want["std_v_ms"] == float(values.std()) * 1e3


def test_cdf_points(monkeypatch):
    # Levels linspace(0, 1, 3) = 0, 0.5, 1 of {1, 2, 3} (NaN left out); 2 points: 0 and 1.
    assert metrics.cdf_points([3.0, np.nan, 1.0, 2.0]).tolist() == [1.0, 2.0, 3.0]
    assert metrics.cdf_points([3.0, 1.0, 2.0], max_points=2).tolist() == [1.0, 3.0]
    assert len(metrics.cdf_points([np.nan])) == 0
    # Beyond CDF_SAMPLE values, every ceil(10 / 4) = 3rd one: 0, 3, 6, 9.
    monkeypatch.setattr(metrics, "CDF_SAMPLE", 4)
    values = np.arange(10.0)[::-1].copy()
    assert metrics.cdf_points(values).tolist() == [0.0, 3.0, 6.0, 9.0]
    assert values.tolist() == list(range(9, -1, -1))  # not overwritten


def test_steps_csv_in_chunks_is_the_concatenated_frame(tmp_path):
    """report._write_steps_csv writes the text of _steps_frame(...).to_csv, chunk by chunk,
    and the header alone when no run has a step."""
    from helpers import run

    from sched_lab.report.folder import _steps_frame, _write_steps_csv
    from sched_lab.run.experiment import Run

    def as_run(label, result):
        return Run(label, label, 1.0, result, None, None, {})

    runs = [
        as_run("fcfs", run("fcfs", [("a", 0.0, 4, 5), ("b", 0.01, 3, 4)])),
        as_run("swap", run("swap", [("c", 0.0, 2, 7)])),
    ]
    for rows in (1, 3, 1 << 20):
        _write_steps_csv(tmp_path / "chunked.csv", runs, rows=rows)
        _steps_frame(runs).to_csv(tmp_path / "whole.csv", index=False, float_format="%.9g")
        assert (tmp_path / "chunked.csv").read_text() == (tmp_path / "whole.csv").read_text()
    empty = [as_run("fcfs", run("fcfs", [("big", 0.0, 500, 5)]))]  # rejected: no step
    _write_steps_csv(tmp_path / "chunked.csv", empty)
    _steps_frame(empty).to_csv(tmp_path / "whole.csv", index=False, float_format="%.9g")
    assert (tmp_path / "chunked.csv").read_text() == (tmp_path / "whole.csv").read_text()


def test_dropped_rows_are_a_reporting_matter():
    """replay() refuses dropped trace rows; in_trace_order puts them back after the replayed
    request that precedes them in the trace."""
    import pytest
    from helpers import FixedCost

    from sched_lab.core.kv import BlockManager
    from sched_lab.core.request import Request, RequestStatus
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.results.metrics import in_trace_order
    from sched_lab.sim.replay import replay

    def dropped(i):
        r = Request(i, float("nan"), 1, 0)
        r.status, r.reason = RequestStatus.DROPPED, "not replayed: 0 output tokens"
        return r

    trace = [dropped("d0"), Request("a", 0.5, 4, 2), dropped("d1"), Request("b", 0.1, 4, 2)]
    scheduler = get_policy("fcfs")(SchedulerLimits(8, 64, 64), BlockManager(8, 0, 4, 0.0))
    with pytest.raises(ValueError, match="requests d0, d1 are dropped trace rows"):
        replay(trace, scheduler, FixedCost())
    result = replay(trace[1::2], scheduler, FixedCost())
    assert [r.request_id for r in result.requests] == ["b", "a"]  # by arrival
    assert [r.request_id for r in in_trace_order(trace, result.requests)] == [
        "d0", "b", "a", "d1"]  # fmt: skip


def test_decode_output_tokens_drop_wasted_slots_and_add_accepted_drafts():
    import numpy as np

    from sched_lab.results.metrics import decode_output_tokens

    steps = {"num_decode_tokens": np.array([4, 3, 0])}
    assert decode_output_tokens(steps).tolist() == [4.0, 3.0, 0.0]
    steps["num_wasted_tokens"] = np.array([0, 1, 0])  # async: one finished request's slot
    steps["num_accepted_tokens"] = np.array([5, 0, 0])  # speculation: 5 drafts accepted
    assert decode_output_tokens(steps).tolist() == [9.0, 2.0, 0.0]


def test_requests_of_runs_with_and_without_a_column_keep_it_integer():
    """A column one run lacks (spec counts of a run without speculation) stays integer in
    the rows that have it and is empty in the others; float and text columns as before."""
    from sched_lab.report.folder import concat_requests

    on = pd.DataFrame({"policy": ["on", "on"], "num_drafts": [12, 3], "rate": [1.5, 2.0]})
    off = pd.DataFrame({"policy": ["off"], "ttft_s": [0.25]})
    df = concat_requests([off, on])
    assert str(df["num_drafts"].dtype) == "Int64"
    assert df.to_csv(index=False) == (
        "policy,ttft_s,num_drafts,rate\noff,0.25,,\non,,12,1.5\non,,3,2.0\n"
    )
    assert str(concat_requests([on, on])["num_drafts"].dtype) == "int64"  # as pd.concat


class FailsAtStep(FixedCost):
    """10 ms steps until step ``n`` (counted from 1), which raises: the run stops there."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.k = n, 0

    def execute(self, plan):
        self.k += 1
        if self.k == self.n:
            raise RuntimeError("the step failed")
        return super().execute(plan)


@pytest.mark.parametrize(
    "asynchronous, fails_at, received",
    [
        # sync: step 1 prefills a and b (a token each), steps 2-4 decode (a token each)
        (False, 5, 4),
        (False, 2, 1),
        # async: step 2 is planned (and launched) before step 1 ends, so when step k fails
        # steps 1..k-2 ended; step 1's prefill token, then a decode token per step
        (True, 5, 3),
        (True, 2, 0),
    ],
)
def test_unfinished_requests_count_the_tokens_they_received(asynchronous, fails_at, received):
    bm = make_block_manager(8, 8, 16, 0.0, False)
    s = get_policy("fcfs")(SchedulerLimits(256, 10**6, 10**6), bm, async_scheduling=asynchronous)
    res = replay([Request("a", 0.0, 4, 6), Request("b", 0.0, 4, 6)], s, FailsAtStep(fails_at))
    assert res.failure == "RuntimeError: the step failed"
    df, _ = metrics.request_table(res, "fcfs", 1.0)
    assert df["status"].tolist() == ["unfinished", "unfinished"]
    assert df["num_generated_tokens"].dtype == np.int64
    assert df["num_generated_tokens"].tolist() == [received, received]
    assert df["ttft_s"].isna().all()  # latencies of finished requests only


@pytest.mark.parametrize("span_tokens", [1 << 22, 7, 40])
@pytest.mark.parametrize("policy", ["fcfs", "swap"])
def test_token_times_gathered_at_once_equal_request_by_request(policy, span_tokens, monkeypatch):
    """Requests preempted under KV pressure (a re-prefill token between decode segments):
    the gathered token times give each request's first and last token and the ITL gaps in
    the order and values of the request-by-request path, whatever the chunk of requests
    gathered at once (7 tokens: one request a chunk; 40: two)."""
    monkeypatch.setattr(metrics, "SPAN_TOKENS", span_tokens)
    res = run(
        policy,
        [(f"r{i}", 0.001 * i, 8, 20) for i in range(6)],
        gpu_blocks=12,
        block_size=4,
    )
    fin = [r for r in res.requests if r.status.value == "finished"]
    assert any(r.num_preemptions for r in fin)  # the case at stake
    first, last, gaps = metrics._token_spans(res, fin, split_itl=False)
    first_1, last_1, gaps_1 = metrics._token_spans_each(res, fin, split_itl=False)
    assert first.tolist() == first_1.tolist() and last.tolist() == last_1.tolist()
    assert gaps.tolist() == gaps_1.tolist()
    assert len(fin) == 6 and len(gaps) == 6 * 19  # 20 tokens each: 19 gaps


def test_token_gaps_by_hand(monkeypatch):
    """Steps end at 1, 2, 4, 7, 11 s. Request a: a prefill token at step 0, then decodes at
    steps 1-3 (times 1, 2, 4, 7: gaps 1, 2, 3); b: steps 1, then 3-4 (times 2, 7, 11: gaps
    5, 4). The gaps in request order are [1, 2, 3, 5, 4]."""
    end = np.array([1.0, 2.0, 4.0, 7.0, 11.0])
    source = np.array([0, 1, 1, 2, 3, 4])  # two prefill tokens, then the ticks' steps
    start, size = np.array([0, 2, 1, 5 - 1]), np.array([1, 3, 1, 2])
    who, counts = np.array([0, 0, 1, 1]), np.array([4, 3])
    g = gaps.TokenGaps.of_pieces(source, end, start, size, who, counts)
    assert g.to_array().tolist() == [1.0, 2.0, 3.0, 5.0, 4.0]
    # the distinct gaps by value, and how many gaps are at most each: a's inside 1, 2, 3,
    # b's inside 4, between b's pieces 5
    assert g._values.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and g._cum.tolist() == [1, 2, 3, 4, 5]
    for rows in (1, 2, 4):  # source positions taken at a time: the same
        monkeypatch.setattr(gaps, "ROWS", rows)
        part = gaps.TokenGaps.of_pieces(source, end, start, size, who, counts)
        assert part._values.tolist() == g._values.tolist()
        assert part._cum.tolist() == g._cum.tolist()
    # two pieces over ticks 1-3 (source 3 .. 5): the gaps 3 and 4 counted twice each
    two = gaps.TokenGaps.of_pieces(
        source, end, np.array([3, 3]), np.array([3, 3]), np.array([0, 1]), np.array([3, 3])
    )
    assert two._values.tolist() == [3.0, 4.0] and two._cum.tolist() == [2, 4]
    assert two.to_array().tolist() == [3.0, 4.0, 3.0, 4.0]
    # steps ending 1 s apart: a's gaps 1, 1, 1 and b's 2 (between its pieces), 1; the 1 s
    # gaps counted together, whatever the parts
    for rows in (1, 1 << 20):
        monkeypatch.setattr(gaps, "ROWS", rows)
        even = gaps.TokenGaps.of_pieces(source, np.arange(1.0, 6.0), start, size, who, counts)
        assert even._values.tolist() == [1.0, 2.0] and even._cum.tolist() == [4, 5]
        assert even.to_array().tolist() == [1.0, 1.0, 1.0, 2.0, 1.0]
        ps = [0, 50, 80, 100]
        assert even.percentile(ps).tolist() == np.percentile(even.to_array(), ps).tolist()
        assert even.percentile(ps).tolist() == pytest.approx([1.0, 1.0, 1.2, 2.0])
    monkeypatch.setattr(gaps, "ROWS", 1 << 20)
    assert g.first.tolist() == [1.0, 2.0] and g.last.tolist() == [7.0, 11.0]
    assert (len(g), g.mean(), g.median(), g.max()) == (5, 3.0, 3.0, 5.0)
    assert g.std() == math.sqrt(2.0)  # squares 4, 1, 0, 4, 1 over 5
    # p90: index 4 * 0.9 = 3.6 between the sorted 4th and 5th gaps (4 and 5): 4.6
    assert (
        g.percentile([0, 90, 100]).tolist()
        == np.percentile([1, 2, 3, 5, 4.0], [0, 90, 100]).tolist()
    )
    assert g.percentile([90])[0] == pytest.approx(4.6)
    one = gaps.TokenGaps.of_pieces(
        source, end, np.array([0]), np.array([1]), np.array([0]), np.array([1])
    )
    assert len(one) == 0 and np.isnan([one.mean(), one.std(), one.median()]).all()
    # pieces out of time order (b's second piece before its first): not a TokenGaps
    assert (
        gaps.TokenGaps.of_pieces(source, end, start[[0, 1, 3, 2]], size[[0, 1, 3, 2]], who, counts)
        is None
    )


@pytest.mark.parametrize("rows", [128, 1000, 1 << 18])
def test_step_usage_in_runs_is_numpys_on_the_whole_columns(rows, monkeypatch):
    """The summary's KV usage and wasted tokens, read STEP_ROWS steps at a time: np.average,
    max and sum of the whole columns, to the last bit."""
    monkeypatch.setattr(metrics, "STEP_ROWS", rows)
    rng = np.random.default_rng(5)
    n = 5000
    steps = {
        "kv_used_blocks": rng.integers(0, 700, n),
        "duration_s": rng.lognormal(-4, 1, n),
        "num_wasted_tokens": rng.integers(0, 3, n),
    }
    res = SimpleNamespace(
        num_steps=n,
        num_gpu_blocks=700,
        step_rows=lambda lo, hi, columns: {k: steps[k][lo:hi] for k in columns},
    )
    kv = steps["kv_used_blocks"] / 700
    want = (
        float(np.average(kv, weights=steps["duration_s"])),
        float(kv.max()),
        int(steps["num_wasted_tokens"].sum()),
    )
    assert metrics.step_usage(res) == want
    empty = SimpleNamespace(num_steps=0, num_gpu_blocks=0, step_rows=None)
    assert metrics.step_usage(empty) == (0.0, 0.0, 0)
    # by hand: 2 blocks of 4 for 1 s, 4 of 4 for 3 s: (0.5 + 3) / 4 s; 1 + 2 tokens wasted
    steps = {"kv_used_blocks": np.array([2, 4]), "duration_s": np.array([1.0, 3.0]),
             "num_wasted_tokens": np.array([1, 2])}  # fmt: skip
    res.num_steps, res.num_gpu_blocks = 2, 4
    assert metrics.step_usage(res) == (0.875, 1.0, 3)
    # sums of several arrays at once: each np.sum's, to the last bit
    a, b = rng.random(3000), rng.lognormal(0, 3, 3000)
    got = gaps.pairwise_sums(
        3000, lambda lo, k: [np.sum(a[lo : lo + k]), np.sum(b[lo : lo + k])], 128
    )
    assert got.tolist() == [np.sum(a), np.sum(b)]


def test_merge_counts_and_joined_by_hand():
    values, weights = gaps.merge_counts(np.array([3.0, 1.0, 3.0, 2.0]), np.array([1, 2, 5, 1]))
    assert values.tolist() == [1.0, 2.0, 3.0] and weights.tolist() == [2, 1, 6]
    assert weights.dtype == np.int64
    values, weights = gaps.merge_counts(np.zeros(0), np.zeros(0, dtype=np.int32))
    assert len(values) == len(weights) == 0 and weights.dtype == np.int64
    joined = gaps.Joined(np.array([7, 8]), np.array([10, 11, 12]))
    assert len(joined) == 5
    assert joined[np.array([4, 0, 2, 1, 3])].tolist() == [12, 7, 10, 8, 11]
    assert joined[np.array([[1, 2], [3, 0]])].tolist() == [[8, 10], [11, 7]]


@pytest.mark.parametrize("rows", [1, 3, 64, 1 << 20])
@pytest.mark.parametrize("seed", range(6))
def test_token_gaps_statistics_are_numpys_to_the_last_bit(seed, rows, monkeypatch):
    """Random requests, each a run of consecutive ticks that others share (gaps counted
    several times), some with a prefill token first: every statistic equals numpy's on the
    array of the gaps, with the sums walked in runs of 128 and of 1000 values, whatever
    the source positions of_pieces takes at a time (``rows``)."""
    monkeypatch.setattr(gaps, "ROWS", rows)
    rng = np.random.default_rng(seed)
    num_ticks, n = int(rng.integers(50, 3000)), int(rng.integers(1, 60))
    end = np.cumsum(rng.lognormal(-4, 1.5, 10 + num_ticks))  # the steps' ends, ascending
    prefill_steps = np.sort(rng.integers(0, 10, n))  # before the ticks' steps (10 ..)
    source = np.concatenate([prefill_steps, 10 + np.arange(num_ticks)])
    a = rng.integers(0, num_ticks - 1, n)
    b = np.minimum(a + rng.integers(1, num_ticks, n), num_ticks)
    has_prefill = rng.random(n) < 0.5
    start, size, who = [], [], []
    for i in range(n):
        if has_prefill[i]:
            start, size, who = [*start, i], [*size, 1], [*who, i]
        start, size, who = [*start, n + a[i]], [*size, b[i] - a[i]], [*who, i]
    start, size, who = np.array(start), np.array(size), np.array(who)
    counts = np.bincount(who, weights=size, minlength=n).astype(np.int64)
    g = gaps.TokenGaps.of_pieces(source, end, start, size, who, counts)
    v = g.to_array()
    times = [end[source[s : s + k]] for s, k in zip(start, size)]
    by_request = [np.concatenate([t for t, w in zip(times, who) if w == i]) for i in range(n)]
    assert v.tolist() == np.concatenate([np.diff(t) for t in by_request]).tolist()
    if not len(v):
        return
    qs = np.concatenate([[0, 1e-9, 0.5, 1], rng.random(50), np.linspace(0, 1, 2000)])
    ps = [0.0, 50.0, 90.0, 99.0, 99.9, 100.0]
    for leaf in (128, 1000):
        monkeypatch.setattr(gaps, "LEAF", leaf)
        assert (g.mean(), g.std()) == (float(v.mean()), float(v.std()))
    assert (g.median(), g.max()) == (float(np.median(v)), float(v.max()))
    assert g.quantile(qs).tolist() == np.quantile(v, qs).tolist()
    assert g.percentile(ps).tolist() == np.percentile(v, ps).tolist()
    assert metrics.latency_stats("itl", g, ps) == metrics.latency_stats("itl", v.copy(), ps)
    assert vllm_result.tail_points(g).tolist() == vllm_result.tail_points(v.copy()).tolist()


@pytest.mark.parametrize("keep", [0, 1 << 23])
def test_token_gaps_std_reuses_the_means_runs_up_to_keep(keep, monkeypatch):
    """Up to KEEP gaps the std sums the runs of gaps the mean made (each made once), above
    it makes them again; the numbers are numpy's either way, and nothing is kept after."""
    monkeypatch.setattr(gaps, "KEEP", keep)
    monkeypatch.setattr(gaps, "LEAF", 128)
    end = np.cumsum(np.arange(1, 1001) % 7 * 0.001 + 0.002)  # 1,000 steps' ends
    source = np.arange(1000)
    start, size = np.array([0, 100, 450]), np.array([500, 300, 550])  # 3 requests, 1 piece
    who, counts = np.arange(3), size.copy()
    g = gaps.TokenGaps.of_pieces(source, end, start, size, who, counts)
    v = np.concatenate([np.diff(end[s : s + k]) for s, k in zip(start, size)])
    made = []
    chunk = g.chunk
    monkeypatch.setattr(g, "chunk", lambda lo, hi: made.append((lo, hi)) or chunk(lo, hi))
    assert (g.mean(), g.std()) == (float(v.mean()), float(v.std()))
    # numpy's pairwise halves of 1,347 gaps down to 128: 672 (8 runs of 80-88) and 675 (8)
    assert len(v) == 1347 and len(made) == (16 if keep else 32)
    assert g._kept is None


@pytest.mark.parametrize("policy", ["fcfs", "swap"])
def test_request_table_with_token_gaps_is_the_one_with_the_array(policy, monkeypatch):
    """Above GAPS_IN_MEMORY gaps the table's ITL gaps are a TokenGaps: the same rows, the
    same gaps, and every statistic the results take of them the same to the last bit."""
    res = run(policy, [(f"r{i}", 0.001 * i, 8, 20 + 7 * i) for i in range(12)], gpu_blocks=40,
              block_size=4)  # fmt: skip
    assert any(r.num_preemptions for r in res.requests)  # the case at stake
    want_df, array = metrics.request_table(res, policy, 1.0)
    monkeypatch.setattr(metrics, "GAPS_IN_MEMORY", 0)
    monkeypatch.setattr(gaps, "LEAF", 128)
    df, g = metrics.request_table(res, policy, 1.0)
    assert isinstance(g, gaps.TokenGaps) and isinstance(array, np.ndarray)
    pd.testing.assert_frame_equal(df, want_df, check_exact=True)
    assert len(g) == 12 * 19 + 7 * 66 and g.to_array().tolist() == array.tolist()
    stats = metrics.summarize(df, g, res, {})
    assert stats == metrics.summarize(want_df, array.copy(), res, {})
    want_cdf = np.quantile(array, np.linspace(0, 1, min(len(array), metrics.CDF_POINTS)))
    assert metrics.cdf_points(g).tolist() == want_cdf.tolist()
