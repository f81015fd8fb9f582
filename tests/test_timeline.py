"""A request's story from its events (lab/report/timeline.py), the over-time binning of the plots
(lab/report/plots.py) and the width of the terminal summary (lab/report/terminal.py), on hand-computed
replays with 10 ms steps (tests/helpers.py: step k runs over [10k, 10k + 10) ms)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers import run

from sched_lab.report import plots, timeline
from sched_lab.report.plots import PartSpread, _bin_mean, _spread
from sched_lab.results import metrics

ROOT = Path(__file__).resolve().parent.parent


def story_of(policy: str, trace, request_id: str, **kw) -> timeline.Story:
    res = run(policy, trace, **kw)
    df, _ = metrics.request_table(res, policy, 1.0)
    events = timeline.events_frame(SimpleNamespace(result=res, policy=policy, rate_scale=1.0))
    steps = pd.DataFrame({k: res.steps[k] for k in ("time_s", "duration_s", "num_decode_tokens")})
    (st,) = timeline.stories_for([request_id], df, events, steps)
    return st


def test_the_story_of_a_recomputed_request():
    # As tests/test_events.py: 3 blocks of 4; a and b (3 + 6 tokens) run from step 0; at
    # step 1 both need a second block, b (the newest) is recomputed; it waits for 2 blocks
    # until a finishes (step 5), is re-prefilled at step 6 (3 + 1 tokens) and decodes 4
    # tokens in steps 7-10.
    st = story_of("fcfs", [("a", 0.0, 3, 6), ("b", 0.0, 3, 6)], "b", gpu_blocks=3, block_size=4)
    assert st.lines == [
        "request b: prompt 3 tokens, output 6 tokens; finished",
        "arrived at t=0.000 s",
        "step 0 (t=0.000 s): admitted with 1 KV block",
        "step 0 (t=0.000 s): prefill of all 3 tokens; token 1 at t=0.010 s",
        "step 1 (t=0.010 s): preempted by recompute: its KV dropped, chosen as the newest "
        "running request",
        "steps 2-5: waited 4 steps (0.050 s)",  # out of the batch from step 1 on
        "steps 2-5: blocked 4 steps at the head of the queue: needs 2 KV blocks, 1 free above "
        "the watermark (at its first step)",
        "step 6 (t=0.060 s): admitted with 2 KV blocks (recomputed: the prompt and 1 "
        "generated token)",
        "step 6 (t=0.060 s): prefill of all 4 tokens; token 2 at t=0.070 s",
        "steps 7-10: decoded 4 tokens (to 6), t=0.070-0.110 s",
        "step 10 (t=0.100 s): finished, last token at t=0.110 s: TTFT 0.010 s, E2E 0.110 s, "
        "TPOT 20.0 ms",
    ]
    lanes = [(k, round(t0, 3), round(t1, 3)) for k, t0, t1, _ in st.segments]
    assert lanes == [
        ("prefill", 0.0, 0.01),
        ("preempted (recompute)", 0.01, 0.06),
        ("prefill", 0.06, 0.07),
        ("decode", 0.07, 0.11),
    ]


def test_a_swapped_request_and_stalled_decodes():
    # tests/test_events.py's swap case: b swapped out at step 1, back at step 6; c (arrived
    # during step 1, admitted at step 7) makes step 7 a prefill-only step: b's decode stalls.
    st = story_of(
        "swap",
        [("a", 0.0, 3, 6), ("b", 0.0, 3, 6), ("c", 0.015, 3, 1)],
        "b",
        gpu_blocks=3,
        block_size=4,
    )
    assert st.lines[4:9] == [
        "step 1 (t=0.010 s): swapped out to CPU swap space, chosen as the newest running request",
        "steps 2-5: waited 4 steps (0.050 s)",
        "steps 2-5: blocked 4 steps at the head of the queue: swap-in needs 2 KV blocks, 1 free "
        "above the watermark (at first)",
        "step 6 (t=0.060 s): swapped in (2 KV blocks back on the GPU)",
        "steps 6-11: decoded 5 tokens (to 6), t=0.060-0.120 s; 1 prefill-only step in between, "
        "without decodes",
    ]
    assert ("decode stalled", 0.07, 0.08) in [
        (k, round(t0, 3), round(t1, 3)) for k, t0, t1, _ in st.segments
    ]
    # c waited at the head while fcfs held the whole queue for the swapped request
    st = story_of(
        "swap",
        [("a", 0.0, 3, 6), ("b", 0.0, 3, 6), ("c", 0.015, 3, 1)],
        "c",
        gpu_blocks=3,
        block_size=4,
    )
    assert st.lines[2:4] == [
        "steps 2-6: waited 5 steps (0.055 s)",
        "the whole queue was held 5 steps: swapped requests come back first (admission not tried)",
    ]


def test_events_rows_kept_small_are_written_as_before():
    """The events' columns are kept small (event names as int8 codes, text as codes,
    numbers in the narrowest integer type that holds them); the frames written are
    events.csv's: integers int64, text as str, and the rows in parts are the whole frame's."""
    cols = timeline._rows(2, request_id=[0, -1], event="decode", step=[3, 2**40], steps=1,
                          tokens=[300, -5], blocks=[70000, 0])  # fmt: skip
    assert cols["event"].dtype == np.int8 and timeline._EVENT_TEXTS[cols["event"]].tolist() == [
        "decode",
        "decode",
    ]
    assert cols["step"].dtype == np.int64 and cols["steps"].dtype == np.int8  # 2**40 > int32
    assert cols["tokens"].dtype == np.int16 and cols["blocks"].dtype == np.int32
    assert cols["request_id"].tolist() == [0, -1] and cols["request_id"].dtype == np.int8
    assert timeline._REASON_TEXTS[cols["reason"]].tolist() == ["", ""]
    texts = timeline._Texts(np.array(["a", "b", timeline.QUEUE], dtype=object))
    assert texts.ids[cols["request_id"]].tolist() == ["a", "*"]
    assert texts.add(["x", "y"]) == 1 and texts.add(["z"]) == 3
    texts.waits = [("max_num_seqs", None, 0, 1, 2, 8, 0), ("kv_blocks", None, 0, 0, 1, 3, 2)]
    assert texts.detail(np.array([3, 0, -2, -1, 1])).tolist() == [
        "z", "", "needs 3 KV blocks, 2 free above the watermark (at its first step)",
        "max_num_seqs (8) requests running", "x",
    ]  # fmt: skip
    codes = timeline._event_codes(np.array(["prefill", "waited", "aborted"], dtype=object), 3)
    assert timeline._EVENT_TEXTS[codes].tolist() == ["prefill", "waited", "aborted"]
    assert timeline._EVENT_RANKS[codes].tolist() == [2, 0, 5]
    with pytest.raises(ValueError, match="unknown event 'x'"):
        timeline._event_codes(np.array(["prefill", "x"], dtype=object), 2)
    a, b = SimpleNamespace(), SimpleNamespace()
    assert timeline._positions([a, b], np.array([id(b), id(a), id(b)])).tolist() == [1, 0, 1]
    with pytest.raises(KeyError):
        timeline._positions([a], np.array([id(a), id(b)]))
    res = run("swap", [("a", 0.0, 3, 6), ("b", 0.0, 3, 6), ("c", 0.015, 3, 1)], gpu_blocks=3,
              block_size=4)  # fmt: skip
    one = SimpleNamespace(result=res, policy="swap", rate_scale=1.0)
    whole = timeline.events_frame(one)
    # within a step: waits, admissions, chunks, decodes, preemptions, ends
    assert list(zip(whole["request_id"], whole["event"], whole["step"])) == [
        ("a", "admitted", 0), ("b", "admitted", 0), ("a", "prefill", 0), ("b", "prefill", 0),
        ("a", "decode", 1), ("b", "preempted", 1), ("b", "waited", 2), ("*", "waited", 2),
        ("a", "finished", 5), ("b", "swapped_in", 6), ("b", "decode", 6), ("c", "admitted", 7),
        ("c", "prefill", 7), ("c", "finished", 7), ("b", "finished", 11),
    ]  # fmt: skip
    assert set(whole["event"]) == {"admitted", "prefill", "preempted", "swapped_in", "waited",
                                   "decode", "finished"}  # fmt: skip
    for c in ("step", "last_step", "steps", "tokens", "blocks"):
        assert whole[c].dtype == np.int64
    for c in ("request_id", "event", "reason", "detail"):
        assert whole[c].dtype == object and all(type(v) is str for v in whole[c])
    for rows in (1, 4, len(whole)):
        parts = list(timeline.events_frames(one, rows))
        pd.testing.assert_frame_equal(pd.concat(parts, ignore_index=True), whole)


def test_bins_hold_the_state_of_the_steps_covering_them():
    # steps [0, 1) at 1.0, [1, 3) at 0.5, idle [3, 5), [5, 5.5) at 1.0; bins of 2 s
    start, end = np.array([0.0, 1.0, 5.0]), np.array([1.0, 3.0, 5.5])
    edges = np.array([0.0, 2.0, 4.0, 6.0])
    assert _bin_mean(start, end, np.array([1.0, 0.5, 1.0]), edges) == pytest.approx(
        [0.75, 0.25, 0.25]
    )
    # 10 tokens over [0, 1), 20 over [1, 3), 5 over [5, 5.5)
    assert _spread(start, end, np.array([10.0, 20.0, 5.0]), edges) == pytest.approx([20, 10, 5])
    # steps out of order (async, a cluster's instances) or starting together: sorted first
    order = [2, 0, 1]
    assert _spread(start[order], end[order], np.array([5.0, 10.0, 20.0]), edges) == pytest.approx(
        [20, 10, 5]
    )
    tied = _spread(np.array([0.0, 0.0, 1.0]), np.array([1.0, 2.0, 3.0]), np.ones(3), edges)
    assert tied == pytest.approx([1 + 1 + 0.5, 0.5, 0])  # [0, 1), [0, 2), [1, 3): 1 each


def test_spread_of_steps_in_order_is_the_sorted_computation_to_the_bit():
    """Steps in time order skip the sort: the same sums, bit for bit, as with it."""
    rng = np.random.default_rng(3)
    start = np.cumsum(rng.lognormal(-4, 1, 5000))
    end = start + rng.lognormal(-5, 1, 5000)
    amount = rng.random(5000) * 100
    edges = np.linspace(0.0, end[-1], 301)
    rate = amount / np.maximum(end - start, 1e-12)
    order_s, order_e = np.argsort(start, kind="stable"), np.argsort(end, kind="stable")
    cs = np.concatenate([[0.0], np.cumsum((rate * start)[order_s])])
    cr_s = np.concatenate([[0.0], np.cumsum(rate[order_s])])
    ce = np.concatenate([[0.0], np.cumsum((rate * end)[order_e])])
    cr_e = np.concatenate([[0.0], np.cumsum(rate[order_e])])
    i = np.searchsorted(start[order_s], edges, "right")
    j = np.searchsorted(end[order_e], edges, "right")
    want = np.diff((edges * cr_s[i] - cs[i]) - (edges * cr_e[j] - ce[j]))
    assert _spread(start, end, amount, edges).tolist() == want.tolist()


def test_spread_in_parts_is_the_whole_spread_to_the_bit():
    """PartSpread: steps added a part at a time (1, 2, 7, 128 steps) give _spread's sums
    bit for bit; steps out of order are refused, adding nothing."""
    start, end = np.array([0.0, 1.0, 5.0]), np.array([1.0, 3.0, 5.5])
    edges = np.array([0.0, 2.0, 4.0, 6.0])
    spread = PartSpread(edges)
    for k in range(3):  # 10 tokens over [0, 1), 20 over [1, 3), 5 over [5, 5.5)
        assert spread.add(start[k : k + 1], end[k : k + 1], np.array([10.0, 20.0, 5.0])[k : k + 1])
    assert spread.sums().tolist() == [20.0, 10.0, 5.0]
    assert not spread.add(np.array([5.5]), np.array([5.5]), np.ones(1))  # ends with the last
    assert not spread.add(np.array([6.0, 6.0]), np.array([7.0, 8.0]), np.ones(2))  # tied starts
    assert spread.sums().tolist() == [20.0, 10.0, 5.0]
    rng = np.random.default_rng(3)
    start = np.cumsum(rng.lognormal(-4, 1, 5000))
    # ends in order too, though a step may end after the next one starts
    end = np.maximum.accumulate(start + rng.lognormal(-4, 1, 5000)) + np.arange(5000) * 1e-9
    assert (end > start).all() and (end[1:] > end[:-1]).all() and (end[:-1] > start[1:]).any()
    amount = rng.random(5000) * 100
    edges = np.linspace(0.0, end[-1], 301)
    want = _spread(start, end, amount, edges).tolist()
    for rows in (1, 2, 7, 128, 5000):
        spread = PartSpread(edges)
        for lo in range(0, 5000, rows):
            assert spread.add(start[lo : lo + rows], end[lo : lo + rows], amount[lo : lo + rows])
        assert spread.sums().tolist() == want, rows


def test_over_time_binned_in_parts_is_the_whole_binning(monkeypatch):
    """over_time and prefix_series read the steps STEP_ROWS at a time: with 1, 3 or all of
    them at a time, the series of the whole columns (_bin_mean, _spread), bit for bit."""
    trace = [(f"r{i}", 0.003 * i, 40 + 7 * i, 5 + (3 * i) % 11) for i in range(12)]
    res = run("fcfs", trace, gpu_blocks=40, enable_prefix_caching=True)
    df, _ = metrics.request_table(res, "fcfs", 1.0)
    one = SimpleNamespace(result=res, requests=df)
    s = res.steps
    start = s["time_s"]
    end = start + s["duration_s"]
    edges = np.linspace(0.0, float(end.max(initial=1.0)), plots.TIME_BINS + 1)
    blocks = max(plots.total_blocks(one), 1)
    kv = _bin_mean(start, end, s["kv_used_blocks"] / blocks, edges)
    queue = _bin_mean(start, end, (s["num_waiting"] + s["num_swapped"]).astype(float), edges)
    tokens = _spread(start, end, metrics.decode_output_tokens(s), edges)
    first = df["first_token_s"].to_numpy(float)
    tokens += np.histogram(first[np.isfinite(first)], edges)[0]
    width = edges[1] - edges[0]
    want = [(edges[:-1] + edges[1:]) / 2, tokens / width, kv, queue]
    cached = _spread(start, end, s["num_cached_tokens"].astype(float), edges)
    fed = _spread(start, end, s["num_prefill_tokens"].astype(float), edges)
    keyed = s["kv_cached_blocks"] / max(res.num_gpu_blocks, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        hit = 100 * cached / (cached + fed)
    want_prefix = [want[0], hit, 100 * _bin_mean(start, end, keyed, edges)]
    assert res.num_steps > 6 and tokens.sum() > 0
    for rows in (1, 3, res.num_steps):
        monkeypatch.setattr(plots, "STEP_ROWS", rows)
        got, got_prefix = plots.over_time(one), plots.prefix_series(one)
        for a, b in zip(got, want, strict=True):
            assert a.tobytes() == b.tobytes(), rows
        for a, b in zip(got_prefix, want_prefix, strict=True):
            assert a.tobytes() == b.tobytes(), rows


def test_terminal_summary_fits_100_columns(tmp_path):
    from sched_lab.report.terminal import summary_text

    vllm = {
        "completed": 19366, "num_prompts": 19366, "failed": 0, "duration": 1752.3,
        "request_throughput": 11.05, "output_throughput": 3000.0, "request_rate": 11.04,
        **{f"{w}_{m}_ms": 12345.678 for w in ("mean", "p50", "p99.9", "max")
           for m in ("ttft", "tpot", "itl", "e2el")},
    }  # fmt: skip
    summary = {
        "slo": {"ttft_s": 2.0, "tpot_s": 0.05}, "request_goodput": 4.58, "slo_attainment": 0.414,
        "num_preemptions_recompute": 623, "num_preemptions_swap": 0,
        "mean_kv_cache_usage": 0.88, "max_kv_cache_usage": 1.0,
    }  # fmt: skip
    runs = [
        SimpleNamespace(label=f"{p}@x{s}", policy=p, rate_scale=s, vllm=vllm, summary=summary)
        for s in (1.0, 2.0)
        for p in ("fcfs", "swap", "chunked_prefill", "priority", "sjf")
    ]
    text = summary_text(runs, (50, 99.9))
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 100
    assert lines[0].split() == ["rate_scale", "1,", "11.04", "req/s", "fcfs", "swap"] + [
        "chunked_prefill",
        "priority",
    ]
    assert sum(x.startswith("rate_scale 2,") for x in lines) == 2  # 5 policies: 4 + 1
    assert "TTFT p99.9 (s)" in text and "ITL max (ms)" in text and "goodput (req/s)" in text
    assert "SLOs: ttft <= 2 s, tpot <= 50 ms" in text


def test_explain_and_timeline_commands(tmp_path, capsys):
    import run_experiment
    from sched_lab.cli import main

    out = tmp_path / "q"
    args = [str(ROOT / "experiments/quickstart.yaml"), "--limit", "30", "--out", str(out)]
    assert run_experiment.main([*args, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["explain", str(out), "--request", "3"]) == 2
    assert capsys.readouterr().err == (
        f"error: {out}: 3 runs; choose one with --run: fcfs, swap, chunked_prefill\n"
    )
    assert main(["explain", str(out), "--run", "fcfs", "--request", "nope"]) == 2
    assert capsys.readouterr().err == f"error: {out}: run fcfs has no request 'nope'\n"
    assert main(["explain", str(out), "--run", "fcfs", "--request", "9" * 5000]) == 2
    err = capsys.readouterr().err  # the id is cut to ~80 characters
    assert err.startswith(f"error: {out}: run fcfs has no request '999") and len(err) < 200
    assert main(["explain", str(out), "--run", "swap", "--request", "3"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("request 3: prompt ") and text[0].endswith("[run swap]")
    assert text[-1].startswith("  step ") and ": finished, last token at t=" in text[-1]
    png = tmp_path / "t.png"
    assert main(["timeline", str(out), "--run", "fcfs", "--slowest", "3", "--out", str(png)]) == 0
    assert capsys.readouterr().out == f"wrote {png}: 3 requests of run fcfs\n"
    assert png.stat().st_size > 10_000
    # an id the run lacks is refused, named, not left out of the picture
    assert main(["timeline", str(out), "--run", "fcfs", "--requests", "3,abc", "--out",
                 str(tmp_path / "u.png")]) == 2  # fmt: skip
    assert capsys.readouterr().err == f"error: {out}: run fcfs has no request 'abc'\n"
    assert not (tmp_path / "u.png").exists()
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope'}: no such folder\n"


def run_mooncake(tmp_path, rows, yaml_tail: str = "", name: str = "one"):
    """``sched-lab run --no-plots`` of a Mooncake trace of ``rows`` ((input, output) lengths,
    one every 100 s) on the 8B H200 preset with fcfs (``yaml_tail``: more YAML lines); the
    results folder."""
    from sched_lab.cli import main

    lines = [f'{{"timestamp": {100 * i}, "input_length": {n}, "output_length": {o}}}'
             for i, (n, o) in enumerate(rows)]  # fmt: skip
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "exp.yaml").write_text(
        f"name: {name}\nbackend: sim\ntrace: {{format: mooncake, path: t.jsonl}}\n"
        "model: llama-3.1-8b\nhardware: h200-sxm\npolicies: [fcfs]\n" + yaml_tail
    )
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "exp.yaml"), "--no-plots", "-q", "--no-progress",
                 "--out", str(out)]) == 0  # fmt: skip
    return out


def test_a_folder_with_dropped_rows_is_read_by_report_explain_and_timeline(tmp_path, capsys):
    """A dropped trace row (output_length 0) has no arrival in requests.csv: the folder is not
    damaged, and explain says the request was dropped."""
    from sched_lab.cli import main

    out = run_mooncake(tmp_path, [(50 + i, o) for i, o in enumerate([20, 20, 0, 20])],
                       name="drop")  # fmt: skip
    rows = pd.read_csv(out / "requests.csv")
    assert rows["status"].tolist() == ["finished", "finished", "dropped", "finished"]
    assert np.isnan(rows["arrival_s"][2])
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").stat().st_size > 10_000
    assert main(["explain", str(out), "--request", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "request 2: dropped (not replayed: 'output_length' == 0 in t.jsonl (a request needs "
        ">= 1 output token)) [run fcfs]"
    )
    assert main(["explain", str(out), "--request", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "  arrived at t=0.300 s"
    assert main(["timeline", str(out), "--slowest", "3", "--out", str(tmp_path / "t.png")]) == 0


def test_the_story_of_a_speculative_request_counts_accepted_drafts():
    """k = 2, the first draft always accepted and the second never: prompt 8, output 10.
    Step 0 prefills and samples token 1; steps 1-4 each verify 2 drafts, accept 1 and
    sample 1 (2 tokens a step: to 3, 5, 7, 9; an accepted draft ends the decode span); step
    5 has 1 token left, so no drafts: token 10. The request's own count is 10, and so is
    the story's."""
    from test_spec_sim import spec_replay

    res, _ = spec_replay((1.0, 0.0), 2, [("a", 0.0, 8, 10)])
    df, _ = metrics.request_table(res, "fcfs", 1.0, split_itl=True)
    events = timeline.events_frame(SimpleNamespace(result=res, policy="fcfs", rate_scale=1.0))
    decodes = events[events["event"] == "decode"]
    assert decodes["tokens"].tolist() == [2, 2, 2, 2, 1]
    assert decodes["detail"].tolist() == ["1 of them accepted drafts"] * 4 + [""]
    steps = pd.DataFrame({k: res.steps[k] for k in ("time_s", "duration_s", "num_decode_tokens")})
    (st,) = timeline.stories_for(["a"], df, events, steps)
    assert st.lines[4:] == [
        "step 1: decoded 2 tokens, 1 of them accepted drafts (to 3), t=0.010-0.020 s",
        "step 2: decoded 2 tokens, 1 of them accepted drafts (to 5), t=0.020-0.030 s",
        "step 3: decoded 2 tokens, 1 of them accepted drafts (to 7), t=0.030-0.040 s",
        "step 4: decoded 2 tokens, 1 of them accepted drafts (to 9), t=0.040-0.050 s",
        "step 5: decoded 1 token (to 10), t=0.050-0.060 s",
        "step 5 (t=0.050 s): finished, last token at t=0.060 s: TTFT 0.010 s, E2E 0.060 s, "
        "TPOT 5.6 ms",
    ]
    assert int(df.loc[0, "output_tokens"]) == 10


def test_steps_in_view_leave_out_steps_that_only_touch_an_edge():
    """Steps [0, 1), [1, 2), [2, 3), [3, 3.5) in a view of (1, 3): the first ends where the
    view starts and the last starts where it ends (not in view); the same steps when the
    times come back from a CSV's 9 significant digits, a little off the edges."""
    from sched_lab.report.timeline import steps_in_view

    t, d = np.array([0.0, 1.0, 2.0, 3.0]), np.array([1.0, 1.0, 1.0, 0.5])
    assert steps_in_view(t, d, 1.0, 3.0).tolist() == [1, 2]
    read_back = t + np.array([1e-9, -1e-9, 0.0, -1e-9])  # within 5e-9 of 1 s and 3 s
    assert steps_in_view(read_back, d, 1.0, 3.0).tolist() == [1, 2]
    assert steps_in_view(t, d, 0.5, 3.25).tolist() == [0, 1, 2, 3]  # overlaps count


def test_explain_a_cluster_request_without_a_replica_or_times(tmp_path, capsys):
    """A cluster run's rejected and dropped requests have no replica and no TTFT: explain
    gives their status and reason, never 'replica nan' or 'TTFT nan s'."""
    from sched_lab.cli import main

    cluster = (
        "cluster:\n  prefill: {replicas: 1}\n  decode: {replicas: 2, host_buffer_gib: 0.1}\n"
        "  kv_transfer: ib-ndr\n"
    )
    out = run_mooncake(tmp_path, [(50, 20), (5000, 20), (60, 0), (70, 20)], cluster, "pd")
    rows = pd.read_csv(out / "requests.csv")
    assert rows["status"].tolist() == ["finished", "rejected", "dropped", "finished"]
    capsys.readouterr()
    said = []
    for rid in "0123":
        assert main(["explain", str(out), "--request", rid]) == 0
        said.append(capsys.readouterr().out)
    assert not any("nan" in s for s in said)
    tail = "Cluster runs record no scheduler events per request"
    assert said[0].startswith("request 0: finished on replica 1 after prefill on replica 0 ")
    assert said[1].startswith(
        "request 1: rejected (its prompt's KV (0.61 GiB) exceeds a decode replica's host buffer "
        "(0.1 GiB, cluster.decode.host_buffer_gib)) [run fcfs]; arrived at t=0.100 s, "
        f"0 preemptions. {tail}"
    )
    assert said[2].startswith("request 2: dropped (not replayed: 'output_length' == 0 in t.jsonl")


def test_timeline_draws_a_repeated_id_once_and_refuses_a_window_past_the_run(tmp_path, capsys):
    from sched_lab.cli import main

    out = run_mooncake(tmp_path, [(50, 20)] * 4)
    capsys.readouterr()
    png = tmp_path / "t.png"
    assert main(["timeline", str(out), "--requests", "1,1", "--out", str(png)]) == 0
    assert capsys.readouterr().out == f"wrote {png}: 1 requests of run fcfs\n"
    end = pd.read_csv(out / "steps.csv").eval("time_s + duration_s").max()
    args = ["timeline", str(out), "--requests", "1", "--window", "100", "200"]
    assert main([*args, "--out", str(tmp_path / "u.png")]) == 2
    assert capsys.readouterr().err == (
        f"error: --window: expected a window that holds a step of run fcfs (0.000-{end:.3f} s), "
        "got 100-200 s\n"
    )
    assert not (tmp_path / "u.png").exists()
    assert main(["timeline", str(out), "--slowest", "0", "--out", str(tmp_path / "u.png")]) == 2
    assert capsys.readouterr().err == "error: --slowest: expected an integer >= 1, got 0\n"


def test_a_report_timeline_that_matches_no_request_says_so(tmp_path, caplog):
    """report.timeline_window_s past the run (or timeline_ids naming no request of it): no
    timeline, and a warning that says why (was: none, silently)."""
    from sched_lab.cli import main

    tail = "report: {timeline_window_s: [5000, 6000]}\n"
    out = run_mooncake(tmp_path, [(50, 20)] * 2, tail)
    with caplog.at_level("WARNING", logger="sched_lab.report.folder"):
        assert main(["report", str(out)]) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "sched_lab.report.folder"] == [
        "no timeline of run fcfs: none of its requests is among the requests in flight in "
        "5000-6000 s (report:)"
    ]
    assert not list(out.glob("timeline_*.png"))


def test_explain_and_timeline_on_a_sweep_folder_name_a_point(tmp_path, capsys):
    """A sweep's folder holds no run: explain and timeline point at its points' folders."""
    from sched_lab.cli import main

    (tmp_path / "points" / "p000").mkdir(parents=True)
    (tmp_path / "points" / "p001").mkdir()
    (tmp_path / "sweep.csv").write_text("point,status\n")
    want = (
        f"error: {tmp_path}: a sweep's folder: its runs are in its points' folders, e.g. "
        f"{tmp_path / 'points' / 'p000'}\n"
    )
    assert main(["explain", str(tmp_path), "--request", "0"]) == 2
    assert capsys.readouterr().err == want
    assert main(["timeline", str(tmp_path), "--out", str(tmp_path / "t.png")]) == 2
    assert capsys.readouterr().err == want
