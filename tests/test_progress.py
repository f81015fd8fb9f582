"""lab/report/progress.py: without a terminal, one log line per phase that ends well."""

from __future__ import annotations

import logging

import pytest

from sched_lab.report.progress import Phase, seconds_text


def test_phase_logs_one_line_when_stderr_is_not_a_terminal(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    times = iter([10.0, 13.14])
    monkeypatch.setattr("sched_lab.report.progress.time.perf_counter", lambda: next(times))
    with caplog.at_level(logging.INFO, logger="sched_lab.report.progress"):
        with Phase("fcfs: replay 19,366 requests", 19_366, "req") as phase:
            phase.replay_callback(100, 2.0)  # no bar: nothing to show
            phase.advance()
    assert caplog.messages == ["fcfs: replay 19,366 requests in 3.1 s"]
    assert phase.bar is None


def test_failed_phase_logs_nothing_and_close_is_idempotent(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="sched_lab.report.progress"):
        with pytest.raises(ValueError), Phase("metrics"):
            raise ValueError("boom")
        phase = Phase("writing results", 5, "file").start()
        phase.close()
        phase.close(ok=False)  # as in a finally: after the close, nothing
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("writing results in ")


def test_bar_on_a_terminal_and_none_when_turned_off(monkeypatch, capsys):
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    with Phase("fcfs: metrics", 10, "req") as phase:
        assert phase.bar is not None
        phase.set(4)
    assert phase.bar.n == 10  # filled at a good end
    with Phase("fcfs: metrics", 10, "req", bars=False) as phase:
        assert phase.bar is None


def test_seconds_text_keeps_short_times_visible():
    # 0.1 s and up in tenths of a second; below, in ms, so that 40 ms does not read "0.0 s"
    assert [seconds_text(s) for s in (3.14, 0.1, 0.04, 0.0004)] == [
        "3.1 s",
        "0.1 s",
        "40 ms",
        "< 1 ms",
    ]
