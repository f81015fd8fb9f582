"""The bad-input corpus (tests/data/bad_inputs/): every malformed YAML or trace is refused
with exit status 2 and one line ``error: ...`` naming what is wrong, no traceback, and no
results folder. The manifest ``cases.yaml`` maps each case file to the expected text.

Cases run in-process through ``run_experiment.main`` (fast), except those marked
``subprocess`` in the manifest, which run the real command line in a child process.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import run_experiment

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().parent / "data" / "bad_inputs"
CASES: dict = yaml.safe_load((CORPUS / "cases.yaml").read_text())["cases"]
ADDRESS_SPACE_LIMIT_BYTES = 4 << 30  # for subprocess cases: a runaway allocation fails fast


def spec(case: str) -> dict:
    """The manifest entry of ``case`` in its long form."""
    value = CASES[case]
    if not isinstance(value, dict):
        value = {"error": value}
    errors = value["error"]
    return {**value, "error": errors if isinstance(errors, list) else [errors]}


def error_lines(stderr: str) -> list[str]:
    """stderr without the INFO log lines the run may print before it fails."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("INFO ")]


def check_one_error_line(case: str, rc: int, stderr: str) -> None:
    s = spec(case)
    lines = error_lines(stderr)
    known = f" [known bug: {s['bug']}]" if s.get("bug") else ""
    assert "Traceback" not in stderr, f"{case}: traceback{known}\n{stderr[-2000:]}"
    assert rc == 2, f"{case}: exit status {rc}, expected 2{known}; stderr: {lines[-5:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: stderr {lines[:5]}"
    for text in s["error"]:
        assert text in lines[0], f"{case}: {text!r} not in {lines[0]!r}"
    # The message names the experiment file, once.
    assert lines[0].count(case) == 1, lines[0]


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT_BYTES, ADDRESS_SPACE_LIMIT_BYTES))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_error(case, tmp_path, capsys, monkeypatch):
    s = spec(case)
    path = str(CORPUS / case)
    args = [*s.get("args", []), "--no-progress"]
    if s.get("default_out"):
        # results/<name> under a scratch cwd that already holds a result and a package.
        monkeypatch.chdir(tmp_path)
        (tmp_path / "results" / "earlier").mkdir(parents=True)
        (tmp_path / "results" / "earlier" / "summary.json").write_text("{}")
        (tmp_path / "sched_lab").mkdir()
        (tmp_path / "sched_lab" / "__init__.py").write_text("")
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    else:
        args += ["--out", str(tmp_path / "out")]
        before = []
    if s.get("subprocess"):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "run_experiment.py"), path, *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
            preexec_fn=_limit_address_space,
        )
        rc, stderr = proc.returncode, proc.stderr
    else:
        try:
            rc = run_experiment.main([path, *args])
        except Exception as e:  # what the user would see as a traceback
            known = f" [known bug: {s['bug']}]" if s.get("bug") else ""
            pytest.fail(f"{case}: raised {type(e).__name__}: {str(e)[:300]}{known}")
        stderr = capsys.readouterr().err
    check_one_error_line(case, rc, stderr)
    # Nothing written: no results folder, no temporary folder, nothing replaced.
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_manifest_covers_the_corpus():
    files = {p.name for p in CORPUS.glob("*.yaml")} - {"cases.yaml"}
    assert files == set(CASES), (
        f"not in cases.yaml: {files - set(CASES)}; missing files: {set(CASES) - files}"
    )
    # Every trace file of the corpus is used by some case.
    texts = "".join((CORPUS / c).read_text(errors="replace") for c in CASES)  # not_utf8.yaml
    unused = [p.name for p in (CORPUS / "traces").iterdir() if p.name not in texts]
    assert not unused, f"trace files no case uses: {unused}"
    for case in CASES:
        s = spec(case)
        assert s["error"] and all(isinstance(t, str) and t for t in s["error"]), case
        assert set(s) <= {"error", "args", "subprocess", "default_out", "bug"}, case


def test_python_tags_are_refused_by_safe_load():
    # safe_load refuses the tag, so os.getpid is never called: had it been, the seed would
    # be a valid integer and the run would go on (exit 0) instead of failing at line 3.
    text = (CORPUS / "python_object_apply.yaml").read_text()
    assert "!!python/object/apply:os.getpid" in text
    with pytest.raises(yaml.constructor.ConstructorError, match="python/object/apply"):
        yaml.safe_load(text)
