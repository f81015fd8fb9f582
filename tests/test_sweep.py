"""Sweeps (lab/sweeps/sweep.py), capacity search (lab/sweeps/search.py) and their executors: grids expand
as documented, the search finds a capacity known in closed form, bad inputs are one line,
and a sweep's files are byte-identical serially, on the process pool and on a local Ray."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

import pandas as pd
import pytest

import run_experiment
import sched_lab.sweeps.report
from sched_lab.config.keypaths import set_path
from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import StepFeatures
from sched_lab.sim.analytic_defaults import defaults as analytic_defaults
from sched_lab.sim.cost_model import AnalyticCostModel
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS
from sched_lab.sweeps.search import SearchSpec, find_capacity, parse_search
from sched_lab.sweeps.sweep import expand, load_sweep

ROOT = Path(__file__).resolve().parent.parent

SYNTH = (
    "trace: {format: synthetic, num_requests: 12, arrival: {process: poisson, rate: 4}, "
    "prompt_len: 64, output_len: 8}\nkv_cache: {num_gpu_blocks: 256}\n"
    "slo: {ttft_s: 0.5}\n"
)


def write(tmp_path: Path, text: str, name: str = "sw.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------- expansion
def test_grid_and_points_expand_in_the_documented_order():
    combos, keys = expand(
        {
            "points": [{"model": "a"}, {"model": "b", "hardware": "x"}],
            "grid": {"kv_cache.num_gpu_blocks": [1024, 2048], "rate_scale": [1, 2]},
        },
        "f.yaml",
    )
    assert keys == ("model", "hardware", "kv_cache.num_gpu_blocks", "trace.rate_scale")
    g = "kv_cache.num_gpu_blocks"
    r = "trace.rate_scale"
    assert combos == [
        {"model": "a", g: 1024, r: 1},
        {"model": "a", g: 1024, r: 2},
        {"model": "a", g: 2048, r: 1},
        {"model": "a", g: 2048, r: 2},
        {"model": "b", "hardware": "x", g: 1024, r: 1},
        {"model": "b", "hardware": "x", g: 1024, r: 2},
        {"model": "b", "hardware": "x", g: 2048, r: 1},
        {"model": "b", "hardware": "x", g: 2048, r: 2},
    ]
    assert expand({"points": [{"seed": 1}, {"seed": 2}]}, "f")[0] == [{"seed": 1}, {"seed": 2}]
    assert expand(None, "f") == ([{}], ())


def test_set_path_picks_policies_by_label_or_index_and_creates_sections():
    raw = {"policies": ["fcfs", {"name": "chunked_prefill", "label": "cp"}], "trace": {}}
    set_path(raw, "policies.fcfs.max_num_seqs", 8, "f")
    set_path(raw, "policies[1].max_num_batched_tokens", 512, "f")
    set_path(raw, "kv_cache.num_gpu_blocks", 64, "f")
    set_path(raw, "rate_scale", 3, "f")
    assert raw == {
        "policies": [
            {"name": "fcfs", "max_num_seqs": 8},
            {"name": "chunked_prefill", "label": "cp", "max_num_batched_tokens": 512},
        ],
        "trace": {"rate_scale": 3},
        "kv_cache": {"num_gpu_blocks": 64},
    }
    empty = {"kv_cache": None}  # `kv_cache:` with nothing under it
    set_path(empty, "kv_cache.block_size", 32, "f")
    assert empty == {"kv_cache": {"block_size": 32}}
    with pytest.raises(ConfigError, match=r"f: trace.limit.x: trace.limit is 5, not a mapping"):
        set_path({"trace": {"limit": 5}}, "trace.limit.x", 1, "f")
    no_policies = {}
    set_path(no_policies, "policies.swap.max_num_seqs", 4, "f")  # the default list
    assert no_policies["policies"] == [
        "fcfs",
        {"name": "swap", "max_num_seqs": 4},
        "chunked_prefill",
    ]


def test_points_are_validated_configs(tmp_path):
    path = write(
        tmp_path,
        SYNTH
        + "policies: [fcfs, {name: chunked_prefill, max_num_batched_tokens: 128, max_num_seqs: 32}]\n"
        "sweep:\n  grid:\n    policies.chunked_prefill.max_num_batched_tokens: [64, 256]\n"
        "    kv_cache.num_gpu_blocks: [128, 512]\n",
    )
    sweep = load_sweep(path)
    assert [p.name for p in sweep.points] == ["p000", "p001", "p002", "p003"]
    cfgs = [sweep.configs[p.name] for p in sweep.points]
    assert [(c.policies[1].max_num_batched_tokens, c.kv_cache.num_gpu_blocks) for c in cfgs] == [
        (64, 128),
        (64, 512),
        (256, 128),
        (256, 512),
    ]
    assert [c.name for c in cfgs] == [f"sw-p00{i}" for i in range(4)]


# ---------------------------------------------------------------------------- bad inputs
BAD = [
    (
        "sweep: {grid: {kv_cache.num_gpu_block: [1, 2]}}\n",
        "sweep point p000 (kv_cache.num_gpu_block=1): unknown key kv_cache.num_gpu_block "
        "(did you mean num_gpu_blocks?); allowed: block_size, gpu_memory_utilization, num_gpu_blocks, swap_space_gib, watermark",
    ),
    (
        "sweep: {grid: {trace.num_request: [5]}}\n",
        "sweep point p000 (trace.num_request=5): trace: unknown key 'num_request' (did you "
        "mean 'num_requests'?); allowed keys: arrival, end_s, format, hash_block_size, limit, num_requests, output_len, "
        "prefix, prompt_len, rate_scale, seed, start_s",
    ),
    ("sweep: {grid: {}}\n", "sweep.grid: expected a mapping of key paths to non-empty lists"),
    ("sweep: {grid: {seed: []}}\n", "sweep.grid.seed: expected a non-empty list of values, got []"),
    ("sweep: {}\n", "sweep: expected a mapping with grid and/or points, got {}"),
    ("sweep: {max_points: 5}\n", "sweep: expected a mapping with grid and/or points, got"),
    (
        "sweep: {grid: {seed: [1]}, max_points: 0}\n",
        "sweep.max_points: expected an integer in [1, 1,000,000] (",
    ),
    (
        "sweep: {grid: {seed: [1, 2, 3], rate_scale: [1, 2]}, max_points: 5}\n",
        "sweep: 3 x 2 = 6 points, more than the limit of 5; raise it with sweep.max_points or "
        "--max-points if you mean it",
    ),
    (
        "sweep: {points: [{seed: 1}, {seed: 2}], grid: {rate_scale: [1, 2, 3]}, max_points: 5}\n",
        "sweep: 2 x 3 = 6 points, more than the limit of 5",
    ),
    ("sweep: {grid: {name: [a, b]}}\n", "name: cannot be swept"),
    (
        "sweep: {grid: {policies.fcfz.max_num_seqs: [1]}}\n",
        "no entry of policies is labelled 'fcfz'; labels: fcfs",
    ),
    (
        "search: {metric: slo_attainment, target: 1.5}\n",
        "search.target: expected a fraction in (0, 1] for slo_attainment, got 1.5",
    ),
    (
        "search: {metric: slo_attainment, target: 0}\n",
        "search.target: expected a fraction in (0, 1] for slo_attainment, got 0",
    ),
    (
        "search: {metric: goodputt, target: 0.9}\n",
        "search.metric: unknown metric 'goodputt'; known: slo_attainment, or a latency "
        "{mean,median,std,max,p<P>}_{ttft,tpot,itl,e2el,queue}_ms (e.g. p99_ttft_ms)",
    ),
    (
        "search: {metric: p99_ttft_ms, target: 0}\n",
        "search.target: expected milliseconds > 0 for p99_ttft_ms, got 0",
    ),
    (
        "search: {metric: ttft_s_p99, target: -1}\n",
        "search.target: expected seconds > 0 for ttft_s_p99, got -1",
    ),
    (
        "search: {metric: p75_ttft_ms, target: 100}\n",
        "search.metric: p75_ttft_ms needs 75 in report.metric_percentiles (the summary holds "
        "50, 90, 99, 99.9)",
    ),
    (
        "sweep: {grid: {rate_scale: [1, 2]}}\nsearch: {metric: ttft_s_p99, target: 1}\n",
        "search.over: trace.rate_scale is a sweep key too; the search sets it itself",
    ),
    (
        "search: {metric: ttft_s_p99, target: 1, lo: 2, hi: 1}\n",
        "search: expected lo < hi, got lo 2, hi 1",
    ),
    (  # a typo of over: refused, not searched over the default
        "search: {metric: p99_ttft_ms, target: 500, ovr: rate_scale}\n",
        "unknown key search.ovr; allowed: metric, target, over, lo, hi, tolerance",
    ),
    (  # a typo of search in a sweep: named once for the file, not at its first point
        "sweep: {grid: {seed: [1, 2]}}\nserch: {metric: p99_ttft_ms, target: 500}\n",
        "unknown key serch (did you mean search?); allowed: name, backend, seed, seeds, trace,",
    ),
]


@pytest.mark.parametrize("extra,message", BAD, ids=range(len(BAD)))
def test_bad_sweeps_are_one_line(tmp_path, capsys, extra, message):
    path = write(tmp_path, SYNTH + "policies: [fcfs]\n" + extra)
    assert run_experiment.main([str(path), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: ") and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_sweep_flags_on_a_plain_experiment(tmp_path, capsys):
    path = write(tmp_path, SYNTH)
    assert run_experiment.main([str(path), "--jobs", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {path}: --jobs, --max-points, --ray and --ray-address are for a YAML with "
        "sweep: or search:"
    )


def test_max_points_from_the_command_line_wins_over_the_yaml(tmp_path, capsys):
    path = write(tmp_path, SYNTH + "sweep: {grid: {seed: [1, 2, 3], rate_scale: [1, 2]}, "
                 "max_points: 5}\n")  # fmt: skip
    assert len(load_sweep(path, max_points=6).points) == 6
    out = str(tmp_path / "o")
    assert run_experiment.main([str(path), "--max-points", "4", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {path}: sweep: 3 x 2 = 6 points, more than the limit of 4; raise it with "
        "sweep.max_points or --max-points if you mean it"
    )
    assert run_experiment.main([str(path), "--max-points", "0", "--out", out]) == 2
    assert "--max-points: expected an integer in [1, 1,000,000] (" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_default_limit_counts_before_expanding():
    # 10 axes of 10 values: 10**10 points, refused from the axis lengths alone.
    grid = {f"policies[0].x{i}": list(range(10)) for i in range(10)}
    with pytest.raises(ConfigError, match=r"10 x 10 .* = 10,000,000,000 points, more than any "
                       r"sweep may have \(1,000,000: "):  # fmt: skip
        expand({"grid": grid}, "sw.yaml")
    with pytest.raises(ConfigError, match=r"= 1,000,000 points, more than the limit of 10,000; "):
        expand({"grid": dict(list(grid.items())[:6])}, "sw.yaml")
    combos, keys = expand({"grid": {"seed": list(range(100))}, "max_points": 100}, "sw.yaml")
    assert len(combos) == 100 and keys == ("seed",)


def test_limit_caps_every_point_even_one_that_sets_the_trace(tmp_path):
    # --limit replaces the trace's limit, as for one run, after each point's values: a
    # swept trace.limit or a point's own trace does not undo it.
    trace = (
        "{format: synthetic, num_requests: 30, arrival: {process: poisson, rate: 4}, "
        "prompt_len: 64, output_len: 8}"
    )
    path = write(tmp_path, SYNTH + "policies: [fcfs]\nsweep:\n  grid: {trace.limit: [3, 20]}\n"
                 f"  points: [{{seed: 1}}, {{trace: {trace}}}]\n")  # fmt: skip
    sweep = load_sweep(path, limit=5)
    limits = {name: cfg.trace.spec.get("limit") for name, cfg in sweep.configs.items()}
    assert limits == {"p000": 5, "p001": 5, "p002": 5, "p003": 5}


def test_search_needs_an_slo_for_attainment(tmp_path):
    path = write(tmp_path, SYNTH.replace("slo: {ttft_s: 0.5}\n", "") + "search: "
                 "{metric: slo_attainment, target: 0.9}\n")  # fmt: skip
    with pytest.raises(ConfigError, match="slo_attainment needs an slo: block"):
        load_sweep(path)


# ---------------------------------------------------------------------------- search
def test_bisection_samples_by_hand():
    spec = parse_search({"metric": "ttft_s_p99", "target": 1.0, "lo": 1, "hi": 4,
                         "tolerance": 0.05}, "f")  # fmt: skip
    cap = find_capacity(lambda x: x <= 2.37, spec, None)
    # 1 meets, 4 misses; then 2.5 F, 1.75 T, 2.125 T, 2.3125 T (bracket [2.3125, 2.5):
    # 0.1875 > 0.05 * 2.3125 = 0.115625), 2.40625 F: 0.09375 <= 0.115625, so it stops.
    assert [x for x, _ in cap.samples] == [1, 4, 2.5, 1.75, 2.125, 2.3125, 2.40625]
    assert (cap.status, cap.capacity, cap.hi) == ("found", 2.3125, 2.40625)
    # Without a range: from the start value, doubling until a miss, then bisection.
    spec = SearchSpec("p99_ttft_ms", 1000.0, tolerance=0.1)
    cap = find_capacity(lambda x: x <= 5.0, spec, 1.0)
    assert [x for x, _ in cap.samples] == [1, 2, 4, 8, 6, 5, 5.5]
    assert (cap.capacity, cap.hi) == (5.0, 5.5)
    cap = find_capacity(lambda x: x <= 0.3, spec, 1.0)  # halving, then bisection
    assert [x for x, _ in cap.samples] == [1, 0.5, 0.25, 0.375, 0.3125, 0.28125, 0.296875]
    assert (cap.capacity, cap.hi) == (0.296875, 0.3125)
    assert find_capacity(lambda x: False, spec, 1.0).status == "below_range"
    assert find_capacity(lambda x: True, spec, 1.0).status == "above_range"


def test_integer_key_search_tries_whole_numbers():
    spec = SearchSpec("p99_ttft_ms", 1000.0, tolerance=0.02)
    cap = find_capacity(lambda x: x <= 37, spec, 8, integer=True)
    # Doubling 8, 16, 32 (met), 64 (missed); floor midpoints 48, 40, 36, 38, 37; the
    # bracket [37, 38) is max(1, 0.02 * 37) = 1 wide.
    assert [x for x, _ in cap.samples] == [8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert all(type(x) is int for x, _ in cap.samples)
    assert (cap.status, cap.capacity, cap.hi) == ("found", 37, 38)
    cap = find_capacity(lambda x: x <= 2, spec, 5, integer=True)  # halving: 5, 2
    assert [x for x, _ in cap.samples] == [5, 2, 3] and cap.capacity == 2
    assert find_capacity(lambda x: False, spec, 3, integer=True).status == "below_range"
    spec = parse_search({"metric": "ttft_s_p99", "target": 1.0, "lo": 1.5, "hi": 9.2}, "f")
    cap = find_capacity(lambda x: x <= 4, spec, None, integer=True)
    assert [x for x, _ in cap.samples] == [1, 10, 5, 3, 4]


def test_search_over_an_integer_key_runs_every_point(tmp_path):
    path = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\n"
        "search: {metric: ttft_s_p99, target: 1000, over: scheduler.max_num_seqs, lo: 1, hi: 6}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    curve = pd.read_csv(out / "curve.csv")
    assert curve["scheduler.max_num_seqs"].tolist() == [1, 6]  # both meet: above the range
    assert pd.read_csv(out / "capacity.csv").iloc[0]["status"] == "above_range"


def test_an_integer_grid_key_with_a_null_stays_whole_in_the_csvs(tmp_path):
    # kv_cache.num_gpu_blocks: [256, null] makes a float column with an empty cell: written
    # as "256", not "256.0", in curve.csv and capacity.csv
    path = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\nsweep: {grid: {kv_cache.num_gpu_blocks: [256, null]}}\n"
        "search: {metric: ttft_s_p99, target: 1000, over: rate_scale, lo: 1, hi: 2}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    for name in ("curve.csv", "capacity.csv"):
        lines = (out / name).read_text().splitlines()
        at = lines[0].split(",").index("kv_cache.num_gpu_blocks")
        cells = {line.split(",")[at] for line in lines[1:]}
        assert cells == {"256", ""}, (name, cells)
    # beyond 2^53 the float column (it has an empty cell) holds the key rounded: a key with
    # such a value is left as floats, not written as a wrong exact-looking integer
    from sched_lab.sweeps.report import _int_or_none

    assert float(2**53 + 1) == 2**53  # what the column would hold
    assert _int_or_none(None) and _int_or_none(-(2**53)) and _int_or_none(2**53)
    assert not _int_or_none(2**53 + 1) and not _int_or_none(True) and not _int_or_none(2.0)


def test_whole_number_keys_come_from_the_section_dataclasses():
    from sched_lab.sweeps.search import whole_number_key

    ints = ["kv_cache.num_gpu_blocks", "kv_cache.block_size", "scheduler.max_num_seqs",
            "policies.fcfs.max_num_seqs", "policies[0].max_num_batched_tokens",
            # sections that may be absent (None in ExperimentConfig), and the cluster's pools
            "lora.max_loras", "speculative.num_speculative_tokens", "cluster.replicas",
            "cluster.decode.replicas"]  # fmt: skip
    floats = ["trace.rate_scale", "kv_cache.watermark", "kv_cache.gpu_memory_utilization",
              "kv_cache.enable_prefix_caching", "slo.ttft_s", "trace.arrival.rate",
              "lora.zipf_alpha", "cluster.decode.host_buffer_gib"]  # fmt: skip
    assert [whole_number_key(k) for k in ints] == [True] * len(ints)
    assert [whole_number_key(k) for k in floats] == [False] * len(floats)


def _search(tmp_path, search: str, kv: str = "kv_cache: {num_gpu_blocks: 256}\n"):
    """The curve rows and capacity of a one-policy search over SYNTH."""
    from sched_lab.sweeps.run import make_tasks, run_task

    path = write(tmp_path, SYNTH.replace("kv_cache: {num_gpu_blocks: 256}\n", kv)
                 + "policies: [fcfs]\n" + search)  # fmt: skip
    (task,) = make_tasks(load_sweep(path))
    result = run_task(task)
    assert result.error is None, result.error
    return result.rows, result.capacity


def test_a_key_absent_from_the_yaml_is_searched_in_whole_numbers(tmp_path):
    rows, cap = _search(
        tmp_path,
        "search: {metric: ttft_s_p99, target: 1000, over: kv_cache.num_gpu_blocks, "
        "lo: 100, hi: 400}\n",
        kv="",
    )
    # lo 100, hi 400: both met (12 short requests), so above the range.
    assert [(r["kv_cache.num_gpu_blocks"], r["met"]) for r in rows] == [(100, True), (400, True)]
    assert all(type(r["kv_cache.num_gpu_blocks"]) is int and "refused" not in r for r in rows)
    assert (cap["status"], cap["capacity"]) == ("above_range", 400)


def test_a_search_prints_a_line_per_load_it_tries(tmp_path, capsys):
    from sched_lab.sweeps.run import make_tasks, probe_line, run_task

    path = write(tmp_path, SYNTH + "policies: [fcfs]\nsearch: {metric: ttft_s_p99, "
                 "target: 1000, over: scheduler.max_num_seqs, lo: 1, hi: 6}\n")  # fmt: skip
    (task,) = make_tasks(load_sweep(path), probe_lines=True)
    assert run_task(task).error is None
    lines = capsys.readouterr().err.splitlines()
    # both loads met (as in test_search_over_an_integer_key_runs_every_point)
    assert [ln.split(" (")[0] for ln in lines] == [
        "p000 fcfs: scheduler.max_num_seqs 1",
        "p000 fcfs: scheduler.max_num_seqs 6",
    ]
    assert [ln.split(", ")[-2] for ln in lines] == ["met (probe 1", "met (probe 2"]
    (quiet,) = make_tasks(load_sweep(path))
    assert run_task(quiet).error is None and capsys.readouterr().err == ""
    # a refused load and one whose run stopped, by hand
    row = {"sample": 2, "scheduler.max_num_seqs": 9, "met": False, "refused": "too big"}
    assert probe_line(task, "fcfs", row, 0.04) == (
        "p000 fcfs: scheduler.max_num_seqs 9: refused (too big) (probe 3, 40 ms)"
    )
    row = {"sample": 0, "scheduler.max_num_seqs": 2, "met": False, "request_rate": 13.75,
           "error": "no progress"}  # fmt: skip
    assert probe_line(task, "fcfs", row, 41.25) == (
        "p000 fcfs: scheduler.max_num_seqs 2 (13.75 req/s): stopped early, missed (probe 1, 41.2 s)"
    )


def test_a_one_search_sweep_logs_one_search(tmp_path, caplog):
    """The sweep's closing line counts its tasks in the right number (``1 search``, not ``1
    searches``); its time is :func:`~sched_lab.report.progress.seconds_text`'s
    (tests/test_progress.py)."""
    from sched_lab.sweeps.run import run_sweep

    path = write(tmp_path, SYNTH + "policies: [fcfs]\nsearch: {metric: ttft_s_p99, "
                 "target: 1000, over: scheduler.max_num_seqs, lo: 1, hi: 6}\n")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="sched_lab.report.progress"):
        run_sweep(load_sweep(path), tmp_path / "out", jobs=1, progress=False)
    (line,) = [m for m in caplog.messages if m.startswith("sweep ")]
    assert re.fullmatch(r"sweep sw: 1 search in (\d+\.\d s|\d+ ms|< 1 ms)", line), line


def test_num_gpu_blocks_left_to_the_simulator_starts_at_its_sizing(tmp_path):
    from sched_lab.config import validate
    from sched_lab.setup.sim import sim_parts

    rows, cap = _search(
        tmp_path,
        "search: {metric: ttft_s_p99, target: 1000, over: kv_cache.num_gpu_blocks}\n",
        kv="",
    )
    sized = sim_parts(validate({"trace": {"format": "synthetic"}}, "x", tmp_path))[1]
    assert rows[0]["kv_cache.num_gpu_blocks"] == sized and rows[0]["met"]
    assert sized <= cap["capacity"] and cap["status"] == "found"


def test_a_key_at_its_default_starts_the_search(tmp_path):
    # scheduler.max_num_seqs is not in the YAML: the search starts at its default, 256, and
    # doubles while 12 requests meet the target. The budget is max(max_model_len, 2048) =
    # 256 blocks x 16 tokens = 4096, and more running requests than that the config refuses:
    # 8192 bounds the bracket, and the bisection closes on 4096.
    rows, cap = _search(
        tmp_path, "search: {metric: slo_attainment, target: 0.01, over: scheduler.max_num_seqs}\n"
    )
    seqs = [r["scheduler.max_num_seqs"] for r in rows]
    assert seqs[:6] == [256, 512, 1024, 2048, 4096, 8192]
    assert [r["met"] for r in rows[:6]] == [True] * 5 + [False]
    assert all(type(x) is int for x in seqs)
    assert (
        rows[5]["refused"]
        == "policies[fcfs]: max_num_batched_tokens 4096 must be >= max_num_seqs 8192"
    )
    assert (cap["status"], cap["capacity"]) == ("found", 4096)


def test_a_refused_probe_bounds_the_bracket_and_keeps_the_samples(tmp_path):
    # From 256 blocks, doubling reaches 131072 blocks (275 GB of KV for llama-3.1-8b): the
    # config refuses it, which ends the doubling like a miss; the bisection then finds the
    # most blocks an h200-sxm holds (141 GB). Every sample that met the target is kept.
    rows, cap = _search(
        tmp_path, "search: {metric: ttft_s_p99, target: 1000, over: kv_cache.num_gpu_blocks}\n"
    )
    blocks = [r["kv_cache.num_gpu_blocks"] for r in rows]
    assert blocks[:10] == [256 * 2**i for i in range(10)]
    refused = [r for r in rows if "refused" in r]
    assert refused[0]["kv_cache.num_gpu_blocks"] == 131072
    assert "more than the 141 GB of a h200-sxm" in refused[0]["refused"]
    assert all(not r["met"] and r["kv_cache.num_gpu_blocks"] > cap["capacity"] for r in refused)
    met = [r["kv_cache.num_gpu_blocks"] for r in rows if r["met"]]
    assert met[:9] == blocks[:9] and max(met) == cap["capacity"]
    assert cap["status"] == "found" and 65536 <= cap["capacity"] < cap["hi"] <= 131072
    assert cap["hi"] - cap["capacity"] <= 0.02 * cap["capacity"]


def test_capacity_of_a_fixed_cost_queue_matches_the_closed_form(tmp_path, capsys):
    """One request per step (max_num_seqs 1), one output token (done at its prefill), the
    same prompt: every step costs the same c seconds. Requests arrive every d0 / s seconds
    at rate_scale s; below capacity none waits, above it request i waits, and its TTFT is
    (i + 1) c - i d. With N = 10 requests and a TTFT SLO of X = 1.5 c, attainment >= 0.9
    needs request k = 8 to meet it: s <= d0 k / ((k + 1) c - X)."""
    prompt = 100
    d0_ms = 10
    lines = [
        json.dumps({"timestamp": i * d0_ms, "input_length": prompt, "output_length": 1})
        for i in range(10)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    # the config's defaults: llama-3.1-8b on h200-sxm, efficiencies fitted to its profile
    fitted = analytic_defaults("llama-3.1-8b", "h200-sxm").values
    cm = AnalyticCostModel(MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"], **fitted)
    c = cm.step_time(StepFeatures(prompt, 1, 0, prompt * (prompt + 1) / 2, 0, 0, 1, 0), 16)
    x = 1.5 * c
    path = write(
        tmp_path,
        "trace: {format: mooncake, path: t.jsonl}\nkv_cache: {num_gpu_blocks: 256}\n"
        f"scheduler: {{max_num_seqs: 1}}\npolicies: [fcfs]\nslo: {{ttft_s: {x!r}}}\n"
        "search: {metric: slo_attainment, target: 0.9, tolerance: 0.01}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    cap = pd.read_csv(out / "capacity.csv")
    expected = (d0_ms / 1e3) * 8 / (9 * c - x)
    row = cap.iloc[0]
    assert row["status"] == "found" and row["policy"] == "fcfs"
    assert row["lo"] <= expected < row["hi"] and row["hi"] - row["lo"] <= 0.01 * row["lo"]
    curve = pd.read_csv(out / "curve.csv")
    assert len(curve) == row["evaluations"]
    assert curve["met"].tolist() == [s <= expected for s in curve["trace.rate_scale"]]
    assert (curve["met"] == (curve["slo_attainment"] >= 0.9)).all()
    # in req/s: 10 arrivals d0 / lo apart offer lo / d0 requests per second
    assert row["capacity_request_rate"] == pytest.approx(row["lo"] / (d0_ms / 1e3))
    assert row["bound_by"] == "ttft" and row["bound_value"] < 0.9  # the one SLO, at hi
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("p000"))
    assert f"{row['capacity_request_rate']:.2f}" in line and "found" in line
    assert f"ttft <= {x:g} s (met by" in line


def test_a_lower_bound_that_fails_is_below_range_not_a_failed_search(tmp_path, capsys, monkeypatch):
    # The probe at lo stops early (a run that stops is a miss): the search ends below its
    # range, exit 0; the terminal says "< lo", "below range", and why lo gave no metric.
    import sched_lab.sweeps.run

    def run(cfg, progress=True):
        runs = real(cfg, progress)
        if cfg.rate_scales == (1.0,):
            runs[0].result.failure = "deadlock: made up for the test"
        return runs

    real = sched_lab.sweeps.run.run_experiment
    monkeypatch.setattr(sched_lab.sweeps.run, "run_experiment", run)
    path = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\nsearch: {metric: slo_attainment, target: 0.9, lo: 1, hi: 2}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    printed = capsys.readouterr()
    assert "failed" not in printed.err
    cap = pd.read_csv(out / "capacity.csv").iloc[0]
    assert (cap["status"], cap["hi"], cap["bound_by"]) == ("below_range", 1, "stopped")
    assert pd.isna(cap["capacity"]) and cap["evaluations"] == 1
    lines = printed.out.splitlines()
    row = next(x for x in lines if x.startswith("p000"))
    assert row.split()[2:5] == ["-", "<", "1"] and row.endswith("below range")
    assert "stopped early" in row
    assert (
        "p000 fcfs: below range: trace.rate_scale 1, the lowest value tried, already failed "
        "the target (a lower search.lo may find it)" in lines
    )
    assert (
        "p000 fcfs: at trace.rate_scale 1: stopped early: deadlock: made up for the test" in lines
    )
    assert "| < 1 |" in (out / "report.md").read_text()


def test_a_latency_search_whose_every_probe_has_no_latency_writes_its_results(tmp_path, capsys):
    # One block holds no 64-token prompt: every request is rejected, so the probe at lo has
    # no TTFT (a miss, below range); the capacity plot has no point to draw on its log axis.
    # The notes say the probe's TTFT is missing because no request finished, and that
    # nothing lower than 1 block can be tried (not "a lower search.lo may find it").
    path = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\nsearch: {metric: p99_ttft_ms, target: 1000, "
        "over: kv_cache.num_gpu_blocks, lo: 1, hi: 64}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    cap = pd.read_csv(out / "capacity.csv").iloc[0]
    assert (cap["status"], cap["hi"], cap["evaluations"]) == ("below_range", 1, 1)
    assert pd.read_csv(out / "curve.csv")["rejected"].tolist() == [12]
    assert "capacity.png" not in {p.name for p in out.iterdir()}
    lines = capsys.readouterr().out.splitlines()
    assert (
        "p000 fcfs: below range: kv_cache.num_gpu_blocks 1, the lowest value tried, already "
        "failed the target (the key holds whole numbers from 1: nothing lower to try)" in lines
    )
    assert (
        "p000 fcfs: at kv_cache.num_gpu_blocks 1: no request finished (12 of 12 rejected)" in lines
    )


def test_capacity_in_whole_numbers_and_the_bound_as_a_condition():
    from sched_lab.sweeps.terminal import capacity_text

    spec = parse_search(
        {"metric": "p99_ttft_ms", "target": 500, "over": "kv_cache.num_gpu_blocks"}, "x"
    )
    capacity = pd.DataFrame([
        {"point": "p000", "status": "found", "policy": "fcfs", "capacity": 131072.0,
         "capacity_request_rate": 7.5, "bound_by": "p99_ttft_ms", "bound_value": 612.25,
         "lo": 131072.0, "hi": 133120.0, "evaluations": 9},
        {"point": "p001", "status": "above_range", "policy": "fcfs", "capacity": 262144.0,
         "capacity_request_rate": 7.5, "bound_by": None, "bound_value": None,
         "lo": 262144.0, "hi": None, "evaluations": 2},
    ])  # fmt: skip
    lines = capacity_text(capacity, [], spec).splitlines()
    assert lines[0].startswith(
        "capacity: the largest kv_cache.num_gpu_blocks with p99_ttft_ms <= 500"
    )
    assert lines[4].split() == [
        "p000", "fcfs", "7.50", "131072", "[131072,", "133120)", "p99_ttft_ms", "<=", "500",
        "(got", "612.2)", "9", "found",
    ]  # fmt: skip
    assert lines[5].split() == [
        "p001", "fcfs", "7.50", ">=", "262144", "[262144,", "-)", "-", "2", "above", "range",
    ]  # fmt: skip


def test_an_attainment_just_below_its_target_never_reads_as_the_target():
    # capacity_8b's fcfs: the TPOT SLO met by 89.988% of requests against a 90% target
    # printed as "met by 90%"; the share is rounded down to 0.1%.
    from sched_lab.sweeps.report import bound_text

    spec = parse_search({"metric": "slo_attainment", "target": 0.9, "over": "rate_scale"}, "x")
    slo = {"ttft_s": 2.0, "tpot_s": 0.05}
    row = {"bound_by": "tpot", "bound_value": 0.89988}
    assert bound_text(row, spec, slo) == "tpot <= 50 ms (met by 89.9%)"
    assert bound_text({"bound_by": "ttft", "bound_value": 0.62}, spec, slo) == (
        "ttft <= 2 s (met by 62%)"
    )


def test_whole_number_columns_are_written_as_integers(tmp_path):
    from sched_lab.sweeps.report import whole_numbers

    df = pd.DataFrame({"capacity": [131072.0, float("nan")], "rate": [1.5, 2.0]})
    whole_numbers(df, ["capacity", "rate"]).to_csv(tmp_path / "c.csv", index=False)
    assert (tmp_path / "c.csv").read_text().splitlines() == ["capacity,rate", "131072,1.5", ",2.0"]


def test_metric_percentiles_reach_every_point_and_the_sweep_table(tmp_path, capsys):
    # --metric-percentiles 50,75: the table prints TTFT/TPOT/E2E at p50/p75, and a search
    # may target p75 (refused without the flag: the summary would not hold it).
    sweep = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\nsweep: {grid: {trace.rate_scale: [1, 2]}}\n",
    )
    # --no-plots: the printed and written tables are checked, not the figures
    argv = [str(sweep), "--out", str(tmp_path / "o"), "--no-progress", "--jobs", "1", "--no-plots"]
    assert run_experiment.main([*argv, "--metric-percentiles", "50,75"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:7] == ["x", "req/s", "req/s", "p50/p75", "s", "p50/p75", "ms"]
    table = pd.read_csv(tmp_path / "o" / "sweep.csv")
    ttft = [f"{a / 1e3:.2f}/{b / 1e3:.2f}" for a, b in zip(table.p50_ttft_ms, table.p75_ttft_ms)]
    assert [x.split()[5] for x in lines[3:5]] == ttft
    search = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\nsearch: {metric: p75_ttft_ms, target: 500, lo: 1, hi: 2}\n",
        "search.yaml",
    )
    argv = [str(search), "--out", str(tmp_path / "s"), "--no-progress", "--jobs", "1"]
    assert run_experiment.main(argv) == 2
    assert "p75_ttft_ms needs 75 in report.metric_percentiles" in capsys.readouterr().err
    assert run_experiment.main([*argv, "--metric-percentiles", "50,75"]) == 0
    assert pd.read_csv(tmp_path / "s" / "capacity.csv")["metric"][0] == "p75_ttft_ms"
    assert run_experiment.main([*argv, "--metric-percentiles", "0,75"]) == 2
    assert "--metric-percentiles: expected numbers in (0, 100]" in capsys.readouterr().err


def test_the_sweep_table_in_the_terminal():
    from sched_lab.sweeps.terminal import sweep_text

    table = pd.DataFrame([
        {"point": "p000", "status": "ok", "kv_cache.num_gpu_blocks": 1024, "policy": "fcfs",
         "rate_scale": 2.0, "request_rate": 7.123, "request_throughput": 5.27,
         "p50_ttft_ms": 4940.0, "p99_ttft_ms": 12130.0, "p50_tpot_ms": 7.14, "p99_tpot_ms": 11.0,
         "p50_e2el_ms": 7500.0, "p99_e2el_ms": 14800.0, "request_goodput": 2.11,
         "slo_attainment": 0.404, "num_preemptions": 37},
        {"point": "p001", "status": "failed", "error": "no room", "kv_cache.num_gpu_blocks": 16,
         "policy": "fcfs"},
    ])  # fmt: skip
    lines = sweep_text(table, ["kv_cache.num_gpu_blocks", "trace.rate_scale"]).splitlines()
    assert lines[0].split() == [
        "point", "gpu_blocks", "policy", "scale", "offered", "achieved", "TTFT", "TPOT", "E2E",
        "goodput", "SLO", "preempt",
    ]  # fmt: skip
    assert lines[1].split() == [
        "x", "req/s", "req/s", "p50/p99", "s", "p50/p99", "ms", "p50/p99", "s", "req/s", "%",
        "met",
    ]  # fmt: skip
    assert lines[3].split() == [
        "p000", "1024", "fcfs", "2", "7.12", "5.27", "4.94/12.13", "7.1/11.0", "7.5/14.8",
        "2.11", "40", "37",
    ]  # fmt: skip
    assert lines[4].split()[:4] == ["p001", "16", "fcfs", "failed"]
    assert lines[5] == "p001 failed: no room"
    assert max(len(x) for x in lines) <= 120
    wide = sweep_text(table, ["kv_cache.num_gpu_blocks"], (50, 90, 99)).splitlines()
    assert wide[1].split()[3:5] == ["p50/p90/p99", "s"]
    assert wide[3].split()[6] == "4.94/-/12.13"  # the table has no p90 column here


# ---------------------------------------------------------------------------- executors
def small_sweep(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        SYNTH + "policies: [fcfs, chunked_prefill]\n"
        "sweep:\n  grid:\n    rate_scale: [1, 8]\n    kv_cache.num_gpu_blocks: [16, 256]\n",
    )


def files_of(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "timing.json"
    }


SWEEP_DATE_EPOCH = "1764633600"  # SOURCE_DATE_EPOCH: the vLLM files' date, the same in every run


@pytest.fixture(scope="module")
def serial_sweep(tmp_path_factory) -> tuple[Path, Path]:
    """small_sweep's YAML and its folder from a serial run without plots (``--jobs 1
    --no-plots``, the vLLM files dated by SWEEP_DATE_EPOCH), run once for the two tests that
    compare other runs of the same YAML with it. Read only: copy it before writing into it."""
    tmp = tmp_path_factory.mktemp("serial_sweep")
    path, out = small_sweep(tmp), tmp / "serial"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", SWEEP_DATE_EPOCH)
        args = [str(path), "--out", str(out), "--no-progress", "--no-plots", "--jobs", "1"]
        assert run_experiment.main(args) == 0
    return path, out


def test_sweep_files_are_identical_on_every_executor(serial_sweep, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", SWEEP_DATE_EPOCH)
    path, serial_out = serial_sweep  # the serial run (--jobs 1), as the others without plots
    outs = {"serial": serial_out}
    modes = {"pool": ["--jobs", "2"]}
    if importlib.util.find_spec("ray") is not None:
        modes["ray"] = ["--ray", "--jobs", "2"]
    for mode, flags in modes.items():
        outs[mode] = tmp_path / mode
        # --no-plots: every other file of the folders compared (the PNGs, drawn by the same
        # code in every worker, are not)
        args = [str(path), "--out", str(outs[mode]), "--no-progress", "--no-plots", *flags]
        assert run_experiment.main(args) == 0, mode
    serial = files_of(outs["serial"])
    assert "points/p003/requests.csv" in serial and "sweep.csv" in serial
    for mode in modes:
        assert files_of(outs[mode]) == serial, mode
    table = pd.read_csv(outs["serial"] / "sweep.csv")
    assert list(table.columns[:7]) == [
        "point", "status", "error", "trace.rate_scale", "kv_cache.num_gpu_blocks", "policy",
        "rate_scale",
    ]  # fmt: skip
    assert table["point"].tolist() == [
        "p000",
        "p000",
        "p001",
        "p001",
        "p002",
        "p002",
        "p003",
        "p003",
    ]
    assert table["policy"].tolist() == ["fcfs", "chunked_prefill"] * 4
    assert (table["rate_scale"] == table["trace.rate_scale"]).all()
    assert (table["num_gpu_blocks"] == table["kv_cache.num_gpu_blocks"]).all()
    point = json.loads((outs["serial"] / "points/p003/summary.json").read_text())
    row = table.iloc[7]
    assert row["p99_ttft_ms"] == point["chunked_prefill"]["p99_ttft_ms"]
    assert row["request_goodput"] == point["chunked_prefill"]["request_goodput"]
    if "ray" not in modes:
        pytest.skip("ray is not installed (pip install -e '.[ray]'): compared serial and pool")


def test_limits_that_do_not_fit_refuse_the_sweep_before_any_point_runs(tmp_path, capsys):
    # fcfs needs max_num_batched_tokens >= max_model_len: 512 is refused, though 4096 runs.
    path = write(
        tmp_path,
        SYNTH + "policies: [fcfs]\nscheduler: {max_model_len: 1024}\n"
        "sweep: {grid: {scheduler.max_num_batched_tokens: [4096, 512]}}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {path}: sweep point p001 (scheduler.max_num_batched_tokens=512): "
        "policies[fcfs]: max_num_batched_tokens 512 is below max_model_len 1024: without "
        "chunked prefill a long prompt could never be scheduled"
    )
    assert not out.exists()


def test_a_failed_point_is_reported_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    # What only a run finds (here a trace error raised by p000's replay) fails that point.
    import sched_lab.sweeps.run
    from sched_lab.core.errors import TraceError

    def run(cfg, progress=True):
        if cfg.name == "sw-p000":
            raise TraceError("trace.path: changed while it was read; run again")
        return real(cfg, progress)

    real = sched_lab.sweeps.run.run_experiment
    monkeypatch.setattr(sched_lab.sweeps.run, "run_experiment", run)
    path = write(
        tmp_path,
        SYNTH
        + "policies: [fcfs]\nsweep: {grid: {scheduler.max_num_batched_tokens: [4096, 8192]}}\n",
    )
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 1
    assert "1 of 2 failed or stopped early" in capsys.readouterr().err
    table = pd.read_csv(out / "sweep.csv")
    assert table["status"].tolist() == ["failed", "ok"]
    assert table["error"][0] == "trace.path: changed while it was read; run again"
    assert table["completed"][1] == 12 and sorted(p.name for p in (out / "points").iterdir()) == [
        ".sched-lab-manifest.json",
        "p001",
    ]
    assert "**Point p000 failed**: trace.path" in (out / "report.md").read_text()


def test_rerun_replaces_a_sweep_folder_but_not_a_foreign_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764633600")  # the vLLM files' date
    path = write(tmp_path, SYNTH + "policies: [fcfs]\nsweep: {grid: {seed: [1, 2]}}\n")
    out = tmp_path / "out"
    args = [str(path), "--out", str(out), "--no-progress", "--jobs", "1"]
    assert run_experiment.main(args) == 0
    first = files_of(out)
    assert run_experiment.main(args) == 0
    assert files_of(out) == first  # a rerun is byte-identical
    (out / "points" / "p001" / "notes.txt").write_text("mine")
    assert run_experiment.main(args) == 2
    assert "holds points, not written by sched-lab" in capsys.readouterr().err
    assert (out / "points" / "p001" / "notes.txt").read_text() == "mine"


def test_a_swept_integer_beyond_int64_is_written_as_text(tmp_path):
    # The seed has no upper bound; sweep.parquet cannot hold 10**30 as an int64 (an
    # OverflowError after every point had run, before).
    path = write(tmp_path, SYNTH + "policies: [fcfs]\nsweep: {grid: {seed: [1, 1000000000000000000000000000000]}}\n")  # fmt: skip
    out = tmp_path / "out"
    args = [str(path), "--out", str(out), "--no-progress", "--jobs", "1", "--no-plots"]
    assert run_experiment.main(args) == 0  # the tables are checked, not the figures
    csv = pd.read_csv(out / "sweep.csv", dtype={"seed": str})
    assert csv["seed"].tolist() == ["1", "1000000000000000000000000000000"]
    if importlib.util.find_spec("pyarrow") is not None:
        assert pd.read_parquet(out / "sweep.parquet")["seed"].tolist() == csv["seed"].tolist()


@pytest.mark.parametrize("pyarrow", [False, True])
def test_report_names_only_the_tables_written(tmp_path, monkeypatch, pyarrow):
    if pyarrow and importlib.util.find_spec("pyarrow") is None:
        pytest.skip("needs pyarrow")
    monkeypatch.setattr(sched_lab.sweeps.report, "has_pyarrow", lambda: pyarrow)
    path = write(tmp_path, SYNTH + "policies: [fcfs]\nsweep: {grid: {seed: [1]}}\n")
    out = tmp_path / "out"
    assert run_experiment.main([str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    assert (out / "sweep.parquet").exists() == pyarrow
    named = "`sweep.csv` / `.parquet` (one row" if pyarrow else "`sweep.csv` (one row"
    assert f"Files: {named} per point x run x class)" in (out / "report.md").read_text()


def test_engine_points_run_here_after_the_simulator_points(tmp_path, monkeypatch):
    import sched_lab.sweeps.executors
    import sched_lab.sweeps.run
    from sched_lab.sweeps.run import TaskResult, run_sweep

    model = tmp_path / "model"
    model.mkdir()
    path = write(
        tmp_path,
        SYNTH + f"policies: [fcfs]\nengine: {{model_path: {model}}}\n"
        "sweep: {points: [{backend: sim}, {backend: engine}, {backend: sim}, {backend: engine}]}\n",
    )
    order: list[tuple[str, str]] = []

    def pool(fn, tasks, on_error, **kw):
        for t in tasks:
            order.append(("executor", t.point.name))
            yield TaskResult(t.index, error="not run")

    def here(task):
        order.append(("driver", task.point.name))
        return TaskResult(task.index, error="not run")

    monkeypatch.setattr(sched_lab.sweeps.executors, "run_tasks", pool)
    monkeypatch.setattr(sched_lab.sweeps.run, "run_task", here)
    run_sweep(load_sweep(path), tmp_path / "out", jobs=2, progress=False)
    assert order == [
        ("executor", "p000"),
        ("executor", "p002"),
        ("driver", "p001"),
        ("driver", "p003"),
    ]


def test_a_classes_run_gives_one_row_per_class():
    """experiments/two_classes.yaml, cut short: each run's table rows are the run ("all"),
    then one per class from requests' ``class`` column, judged by the class's own SLOs."""
    import yaml

    from sched_lab.config import validate
    from sched_lab.run.experiment import run_experiment
    from sched_lab.sweeps.run import run_rows

    raw = yaml.safe_load((ROOT / "experiments" / "two_classes.yaml").read_text())
    raw["trace"][0] |= {"limit": 40, "slo": {"ttft_s": 0.05}}  # met by some chat requests
    raw["trace"][1]["num_requests"] = 20
    raw["policies"] = raw["policies"][:1] + raw["policies"][2:3]  # fcfs, priority
    cfg = validate(raw, "two_classes.yaml", ROOT)
    for run in run_experiment(cfg, progress=False):
        rows = run_rows(run, cfg.slo.to_dict())
        assert [r["class"] for r in rows] == ["all", "batch", "chat"]
        assert rows[0]["num_prompts"] == 60 and rows[0]["policy"] == run.policy
        for row in rows[1:]:
            summary = run.summary["classes"][row["class"]]
            assert (row["policy"], row["rate_scale"]) == (run.policy, run.rate_scale)
            assert row["num_prompts"] == summary["num_prompts"] == (40, 20)[row["class"] == "batch"]
            assert row["completed"] == summary["completed"] > 0
            assert row["p50_ttft_ms"] == summary["p50_ttft_ms"] > 0
            assert row["slo_attainment"] == pytest.approx(summary["slo_attainment"])
            assert row["request_goodput"] == pytest.approx(summary["request_goodput"])
        assert 0 < rows[2]["slo_attainment"] < 1  # chat's own SLO, not the top-level (none)


def sweep_examples() -> list[Path]:
    import yaml

    from sched_lab.sweeps.sweep import is_sweep

    return [p for p in sorted((ROOT / "experiments").glob("*.yaml"))
            if is_sweep(yaml.safe_load(p.read_text()))]  # fmt: skip


@pytest.mark.parametrize("path", sweep_examples(), ids=lambda p: p.stem)
def test_sweep_example_runs(path, tmp_path):
    out = tmp_path / "out"
    # --no-plots: most of a point's time on 40 requests is its plots; points' plots drawn by
    # pool workers: test_a_sweep_without_plots_writes_points_as_run_no_plots_does
    args = [str(path), "--limit", "40", "--out", str(out), "--no-progress", "--no-plots"]
    assert run_experiment.main(args) == 0
    sweep = load_sweep(path, limit=40)
    if sweep.search is None:
        table = pd.read_csv(out / "sweep.csv")
        runs = sum(len(c.policies) * len(c.rate_scales) for c in sweep.configs.values())
        assert len(table) == runs and (table["status"] == "ok").all()
        assert (out / "pareto.png").exists() and (out / "points" / "p000" / "requests.csv").exists()
    else:
        cap = pd.read_csv(out / "capacity.csv")
        assert len(cap) == sum(len(c.policies) for c in sweep.configs.values())
        assert (out / "capacity.png").exists() and (out / "curve.csv").exists()


def test_a_sweep_without_plots_writes_points_as_run_no_plots_does(serial_sweep, tmp_path,
                                                                  capsys):  # fmt: skip
    """--no-plots of a sweep: every point's folder without PNG or interactive timeline, the
    same CSVs as with plots; the sweep's own figure is drawn; `sched-lab report` draws a
    point's plots later."""
    import shutil

    from sched_lab.cli import main

    path, no_plots = serial_sweep  # --jobs 1 --no-plots; copied below before report writes
    outs = {"plots": tmp_path / "plots", "no_plots": tmp_path / "no_plots"}
    # with plots on the process pool: the points' figures drawn in its workers
    args = [str(path), "--out", str(outs["plots"]), "--no-progress", "--jobs", "2"]
    assert run_experiment.main(args) == 0
    shutil.copytree(no_plots, outs["no_plots"])
    with_plots, without = files_of(outs["plots"]), files_of(outs["no_plots"])
    assert "points/p000/timeline_fcfs.png" in with_plots
    assert not any(f.startswith("points/") and f.endswith(".png") for f in without)
    assert "pareto.png" in without and "points/p003/plot_data.npz" in without
    for name in ("sweep.csv", "points/p003/requests.csv", "points/p003/steps.csv"):
        assert without[name] == with_plots[name], name
    report = (outs["no_plots"] / "points/p000/report.md").read_text()
    assert "**No plots**: this run was made with `sched-lab run --no-plots`" in report
    assert main(["report", str(outs["no_plots"] / "points/p000")]) == 0
    capsys.readouterr()
    assert (outs["no_plots"] / "points/p000/timeline_fcfs.png").exists()
    for folder in (outs["no_plots"], outs["no_plots"] / "points"):  # the sweep's: one line
        assert main(["report", str(folder)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {folder}: a sweep's folder: its points' plots are drawn one point at a "
            f"time, e.g. sched-lab report {outs['no_plots'] / 'points' / 'p000'}"
        )


def test_an_unreachable_ray_address_is_one_line_not_a_wait():
    from sched_lab.core.errors import UserError
    from sched_lab.sweeps.executors import _check_reachable

    with pytest.raises(UserError, match=r"^--ray-address 127.0.0.1:1: cannot connect \("):
        _check_reachable("127.0.0.1:1")
    _check_reachable("auto")  # left to Ray


def test_a_sweep_over_workload_classes_runs_every_point(tmp_path):
    # trace: a list of classes (traces/classes.py), swept like a single trace
    classes = (
        "trace:\n"
        "  - {name: chat, priority: 0, format: synthetic, num_requests: 6, prompt_len: 32,\n"
        "     output_len: 4, arrival: {process: poisson, rate: 4}}\n"
        "  - {name: batch, priority: 1, format: synthetic, num_requests: 4, prompt_len: 128,\n"
        "     output_len: 8, arrival: {process: poisson, rate: 2}}\n"
        "slo: {ttft_s: 0.5}\npolicies: [fcfs, priority]\n"
        "sweep: {grid: {kv_cache.num_gpu_blocks: [64, 256]}}\n"
    )
    path = write(tmp_path, classes)
    out = tmp_path / "out"
    args = [str(path), "--out", str(out), "--no-progress", "--jobs", "1", "--no-plots"]
    assert run_experiment.main(args) == 0  # the tables are checked, not the figures
    rows = pd.read_csv(out / "sweep.csv")
    # one row per point and policy for all requests, then one per class (6 chat, 4 batch)
    assert rows["class"].tolist() == ["all", "batch", "chat"] * 4
    assert rows["completed"].tolist() == [10, 4, 6] * 4
    table = rows[rows["class"] == "all"].reset_index(drop=True)
    assert table["point"].tolist() == ["p000", "p000", "p001", "p001"]
    assert (table["status"] == "ok").all()
    assert table["kv_cache.num_gpu_blocks"].tolist() == [64, 64, 256, 256]
    point = json.loads((out / "points/p001/summary.json").read_text())
    row = table.iloc[3]
    assert row["policy"] == "priority" and row["p99_ttft_ms"] == point["priority"]["p99_ttft_ms"]
    assert set(point["priority"]["classes"]) == {"chat", "batch"}
    # --limit is shared among the classes, as ExperimentConfig.with_trace shares it
    sweep = load_sweep(path, limit=4)
    assert [c["limit"] for c in sweep.configs["p000"].trace.classes] == [2, 2]


def test_trace_keys_over_workload_classes_apply_to_every_class(tmp_path):
    """``trace.rate_scale`` scales every class by the value (each keeps its own share);
    ``trace.limit`` is shared among the classes; another ``trace.KEY`` is set in each; a
    class's name still picks that class."""
    raw = {"trace": [{"name": "chat", "rate_scale": 0.5}, {"name": "batch"}]}
    set_path(raw, "trace.rate_scale", 4, "f")
    set_path(raw, "trace.limit", 9, "f")
    set_path(raw, "trace.seed", 7, "f")
    set_path(raw, "trace.chat.prompt_len", 5, "f")
    assert raw["trace"] == [
        {"name": "chat", "rate_scale": 2.0, "limit": 4, "seed": 7, "prompt_len": 5},
        {"name": "batch", "rate_scale": 4, "limit": 4, "seed": 7},
    ]
    # a grid over trace.rate_scale of a classes experiment runs every point
    classes = (
        "trace:\n"
        "  - {name: chat, format: synthetic, num_requests: 6, prompt_len: 32, output_len: 4,\n"
        "     arrival: {process: poisson, rate: 4}, rate_scale: 0.5}\n"
        "  - {name: batch, format: synthetic, num_requests: 4, prompt_len: 128, output_len: 8,\n"
        "     arrival: {process: poisson, rate: 2}}\n"
        "policies: [fcfs]\nsweep: {grid: {trace.rate_scale: [1, 3]}}\n"
    )
    path = write(tmp_path, classes)
    sweep = load_sweep(path)
    scales = [[c["rate_scale"] for c in cfg.trace.classes] for cfg in sweep.configs.values()]
    assert scales == [[0.5, 1], [1.5, 3]]
    out = tmp_path / "out"
    args = [str(path), "--out", str(out), "--no-progress", "--jobs", "1", "--no-plots"]
    assert run_experiment.main(args) == 0  # the table is checked, not the figures
    rows = pd.read_csv(out / "sweep.csv")
    assert (rows["status"] == "ok").all()
    assert rows[rows["class"] == "all"]["completed"].tolist() == [10, 10]


def test_sweep_plots_read_either_latency_name_and_the_offered_rate():
    from sched_lab.sweeps.report import latency_s, offered_x

    old = pd.DataFrame({"ttft_s_p99": [0.5, 2.0], "rate_scale": [1.0, 2.0]})
    vllm = pd.DataFrame({"p99_ttft_ms": [500.0, 2000.0], "rate_scale": [1.0, 2.0],
                         "request_rate": [3.5, 7.0]})  # fmt: skip
    assert latency_s(old, "ttft").tolist() == [0.5, 2.0]
    assert latency_s(vllm, "ttft").tolist() == [0.5, 2.0]
    assert latency_s(old, "itl").isna().all()  # a column the table lacks: no line
    assert offered_x(vllm)[0].tolist() == [3.5, 7.0] and offered_x(vllm)[1].startswith("offered")
    assert offered_x(old)[0].tolist() == [1.0, 2.0] and offered_x(old)[1].startswith("rate_scale")


def test_sweep_lines_keep_one_colour_per_policy_and_a_dash_per_configuration():
    from types import SimpleNamespace

    from sched_lab.report.plots import COLOURS
    from sched_lab.sweeps.report import DASHES, _lines

    df = pd.DataFrame({
        "policy": ["fcfs", "swap"] * 4, "kv_cache.num_gpu_blocks": [1024] * 4 + [4096] * 4,
        "trace.rate_scale": [1, 1, 2, 2] * 2, "rate_scale": [1.0, 1.0, 2.0, 2.0] * 2,
        "_x": [3.5, 3.5, 7.0, 7.0] * 2,
    })  # fmt: skip
    sweep = SimpleNamespace(keys=["kv_cache.num_gpu_blocks", "trace.rate_scale"], search=None)
    lines, legend = _lines(sweep, df, "_x")
    assert [(s["color"], s["ls"]) for s, _ in lines] == [
        (COLOURS[0], DASHES[0]), (COLOURS[1], DASHES[0]),
        (COLOURS[0], DASHES[1]), (COLOURS[1], DASHES[1]),
    ]  # fmt: skip
    assert [g["_x"].tolist() for _, g in lines] == [[3.5, 7.0]] * 4  # the load is the x
    assert list(legend["configs"]) == ["kv_cache.num_gpu_blocks=1024",
                                       "kv_cache.num_gpu_blocks=4096"]  # fmt: skip
    assert lines[0][0]["lw"] > lines[1][0]["lw"]  # swap drawn inside fcfs where they agree


def test_log_axes_are_labelled_in_plain_numbers_and_the_rate_scale_axis():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sched_lab.report.plots import log_axis, rate_scale_axis

    fig, ax = plt.subplots()
    ax.plot([3.5, 7.0, 14.0], [0.2, 2.0, 15.0])  # two decades: ticks at 1, 2 and 5
    log_axis(ax)
    rate_scale_axis(ax, [3.5, 7.0, 14.0], [1.0, 2.0, 4.0])
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
    assert {"0.2", "0.5", "1", "2", "5", "10"} <= set(shown), shown
    assert not any("$" in t or "10^" in t for t in shown)
    assert len(ax.child_axes) == 1  # rate_scale on top: offered = 3.5 x rate_scale
    fig2, ax2 = plt.subplots()
    rate_scale_axis(ax2, [3.5, 9.0], [1.0, 2.0])  # two traces' rates: no single multiple
    assert ax2.child_axes == []
    plt.close(fig)
    plt.close(fig2)
