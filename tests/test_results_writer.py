"""The results folder written run by run (lab/report/folder.py ResultsWriter): the same
files as writing every run at the end, and each run's steps, requests and request table
freed once written (lab/run/experiment.py keeps no run's requests alive after it)."""

from __future__ import annotations

import gc
from pathlib import Path

import pandas as pd

from sched_lab.config import load_config
from sched_lab.core.request import Request
from sched_lab.report import folder, timeline
from sched_lab.report.folder import ResultsWriter, write_results
from sched_lab.run import experiment
from sched_lab.run.experiment import iter_runs, run_experiment

ROOT = Path(__file__).resolve().parent.parent
SAME = ("requests.csv", "steps.csv", "events.csv", "summary.json", "config.yaml", "report.md")


def test_run_by_run_writes_the_files_of_all_at_once_and_frees_the_steps(tmp_path):
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml").with_trace(limit=60)
    whole = write_results(tmp_path / "whole", cfg, run_experiment(cfg, progress=False), date="d")
    writer = ResultsWriter(tmp_path / "streamed", cfg, bars=False)
    runs = []
    for run in run_experiment(cfg, progress=False):
        steps = len(run.result.steps["time_s"])
        writer.add(run)
        runs.append(run)
        assert steps > 0 and len(run.result.steps["time_s"]) == 0  # freed
        assert run.result.requests == [] and run.plot_series["num_steps"] == steps
        assert list(run.requests.columns) == ["status", "reason", "ttft_s", "tpot_s", "e2e_s"]
    assert len(list(writer.folder.glob(".requests-*.pkl"))) == 3  # the tables set aside
    streamed = writer.finish(runs, date="d")
    for name in SAME:
        assert (streamed / name).read_bytes() == (whole / name).read_bytes(), name
    assert not list(streamed.glob(".requests-*"))
    pngs = sorted(p.name for p in streamed.glob("*.png"))
    assert pngs == sorted(p.name for p in whole.glob("*.png"))
    assert "timeline_fcfs.png" in pngs and "over_time.png" in pngs


def test_an_aborted_writer_leaves_no_temporary_folder(tmp_path):
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml").with_trace(limit=20)
    writer = ResultsWriter(tmp_path / "out", cfg, bars=False)
    writer.add(run_experiment(cfg, progress=False)[0])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_events_written_in_parts_without_plots_are_the_whole_frames(tmp_path, monkeypatch):
    """Without pictures events.csv is made and written EVENT_ROWS rows at a time: 7 here
    (every run's events in several parts, the header once), the bytes of the whole frames."""
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml").with_trace(limit=30)
    runs = run_experiment(cfg, progress=False)
    whole = write_results(tmp_path / "whole", cfg, runs, date="d")
    monkeypatch.setattr(folder, "EVENT_ROWS", 7)
    writer = ResultsWriter(tmp_path / "parts", cfg, bars=False, plots=False)
    for run in runs:
        assert len(timeline.events_frame(run)) > 2 * 7
        writer.add(run, release=False)
    parts = writer.finish(runs, date="d")
    text = (parts / "events.csv").read_bytes()
    assert text == (whole / "events.csv").read_bytes() and text.count(b"request_id") == 1


def test_request_tables_of_other_columns_are_concatenated_as_all_at_once(tmp_path):
    """Speculative runs add columns (float where a request verified nothing): requests.csv
    is then the concatenation of every run's table, as when written all at once."""
    cfg = load_config(ROOT / "experiments" / "spec_ngram.yaml").with_trace(limit=40)
    whole = write_results(tmp_path / "whole", cfg, run_experiment(cfg, progress=False), date="d")
    writer = ResultsWriter(tmp_path / "streamed", cfg, bars=False, plots=False)
    runs = []
    for run in run_experiment(cfg, progress=False):
        writer.add(run)
        runs.append(run)
    streamed = writer.finish(runs, date="d")
    text = (streamed / "requests.csv").read_bytes()
    assert text == (whole / "requests.csv").read_bytes()
    req = pd.read_csv(streamed / "requests.csv")
    drafts = req.groupby("policy", sort=False)["num_drafts"].count()  # rows with a value
    assert drafts.to_dict() == {"fcfs_off": 0, "fcfs_ngram": 40, "chunked_off": 0,
                                "chunked_ngram": 40}  # fmt: skip


def test_each_replay_holds_only_its_own_requests(tmp_path, monkeypatch):
    """Every run replays requests made for it from the trace table; once the run before is
    written, none of its requests (nor the trace's) is alive when the next replay starts."""
    cfg = load_config(ROOT / "experiments" / "quickstart.yaml").with_trace(limit=50)
    alive = []
    replay = experiment._replay

    def counted(ex, run, run_requests, seed=None):
        alive.append(sum(type(o) is Request for o in gc.get_objects()))
        return replay(ex, run, run_requests, seed)

    monkeypatch.setattr(experiment, "_replay", counted)
    writer = ResultsWriter(tmp_path / "out", cfg, bars=False, plots=False)
    runs = []
    gc.collect()  # what earlier tests left
    gc.disable()  # a replay's objects must go by reference counts alone: no reference cycle
    try:  # may hold them (replay() freezes what is alive, garbage in cycles too)
        for run in iter_runs(cfg, progress=False):
            writer.add(run)
            runs.append(run)
    finally:
        gc.enable()
    writer.finish(runs, date="d")
    assert [r.summary["num_prompts"] for r in runs] == [50, 50, 50]
    assert alive == [50, 50, 50]
    assert [r.requests.shape for r in runs] == [(0, 2)] * 3  # no dropped row, no plots
