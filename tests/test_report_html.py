"""report.html renders in a real browser (headless Chromium, Debian's `chromium` package;
.ci/run installs it) with no console errors, and needs no network."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("plotly", reason="report.html's timeline needs plotly (a dependency)")

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's chromium)"
)


def render(page: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the console messages Chromium logged)."""
    proc = subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=15000", "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


def errors(console: list[str]) -> list[str]:
    return [line for line in console if re.search(r"error|uncaught", line, re.IGNORECASE)]


@needs_chromium
def test_the_console_check_catches_a_script_error(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>no_such_function();</script></body></html>")
    _, console = render(page, tmp_path)
    assert errors(console), console  # the check below can fail


@needs_chromium
def test_report_html_renders_with_no_console_errors(tmp_path):
    import run_experiment

    out = tmp_path / "q"
    args = [str(ROOT / "experiments/quickstart.yaml"), "--limit", "60", "--out", str(out)]
    assert run_experiment.main([*args, "--no-progress"]) == 0
    page = out / "report.html"
    text = page.read_text()
    # nothing loaded from the network (plotly's inline bundle names URLs in its strings)
    assert not re.search(r"""<(script|link|img|iframe)[^>]*(src|href)=["']?(https?:)?//""", text)
    assert text.count("data:image/png;base64,") >= 5  # CDFs, over time, 3 timelines
    dom, console = render(page, tmp_path)
    assert not errors(console), console
    assert dom.count('class="plot-container plotly"') == 3  # a timeline per run, drawn
    assert "main-svg" in dom and "fcfs" in dom and "decode" in dom  # drawn: the lane legend


def test_report_html_renders_report_md_and_stays_small(tmp_path):
    import run_experiment

    out = tmp_path / "q"
    args = [str(ROOT / "experiments/quickstart.yaml"), "--limit", "60", "--out", str(out)]
    assert run_experiment.main([*args, "--no-progress"]) == 0
    text = (out / "report.html").read_text()
    body = re.sub(r"<script.*?</script>", "", text, flags=re.S)
    assert "`" not in body  # report.md's code spans are rendered, not shown as backticks
    assert "<code>sim</code>" in body and "<h1>quickstart</h1>" in body
    assert "<table>" in body and "<th>TTFT p50 / p99 (s)</th>" in body  # report.md's table
    assert 'src="latency_cdf.png"' not in body and body.count("data:image/png;base64,") >= 5
    assert text.count("id='plotly-gz'") == 1  # plotly's bundle once, packed
    assert (out / "report.html").stat().st_size < 3_000_000


def test_step_groups_merge_consecutive_steps_past_the_cap():
    from sched_lab.report.html import step_groups

    assert step_groups(3, most=4) == [(0, 0), (1, 1), (2, 2)]
    assert step_groups(7, most=3) == [(0, 2), (3, 5), (6, 6)]  # runs of ceil(7 / 3) = 3
    assert step_groups(0) == []
