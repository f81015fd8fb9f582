"""README.md and docs/*.md as a reader uses them, so that none rots: every relative link
points to a file (and heading) that exists; every YAML block loads and validates as an
experiment (a fragment on top of a small synthetic one); every shell command parses with the
CLI's own argument parsers and names files and experiments that exist and validate; every
Python block is run by a test; the README starts with the two commands, the second being the
one CI runs. Page examples too long to run here (the quickstart, sweeps, engine runs) are
parsed and validated, not run; one small experiment from docs/configuration.md is run."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from sched_lab import cli
from sched_lab.config import load_config, validate
from sched_lab.run.experiment import _resolve_policies, run_experiment
from sched_lab.setup import setup_for
from sched_lab.sweeps.sweep import is_sweep, load_sweep, read_yaml
from sched_lab.traces.readers import parse_yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# A YAML block without a trace is a fragment of an experiment: it is checked on top of this.
BASE = {
    "trace": {
        "format": "synthetic",
        "num_requests": 20,
        "arrival": {"process": "poisson", "rate": 4.0},
        "prompt_len": {"uniform": [16, 64]},
        "output_len": {"uniform": [4, 16]},
    },
    "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
}
# The Python blocks, by page and first line, and the test that runs each.
PYTHON_BLOCKS = {
    ("docs/policies.md", "# policies/shortest_prompt.py"): "test_readme_examples.py, "
    "test_policy_from_readme.py",
    ("docs/policies.md", "# policies/short_first.py"): "test_policy_from_readme.py",
    ("docs/python_api.md", "import pandas as pd"): "test_readme_examples.py",
    (
        "README.md",
        "# the official openai client (pip install openai) against the server started above",
    ): "test_serve.py",
}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(lang: str) -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                line = text.count("\n", 0, m.start()) + 1
                out.append(Block(str(page.relative_to(ROOT)), line, lang, m.group(2)))
    return out


def ids(items: list[Block]) -> list[str]:
    return [b.where for b in items]


# ---------------------------------------------------------------------------- links
def prose(text: str) -> str:
    """The text without fenced blocks and inline code (no links are read from them)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *$", FENCE.sub("", page.read_text()), re.M):
        s, n = slug(m.group(1)), 0
        while (f"{s}-{n}" if n else s) in out:
            n += 1
        out.add(f"{s}-{n}" if n else s)
    return out


def test_slug_is_githubs():
    assert slug("The quickstart's output") == "the-quickstarts-output"
    assert slug("Timelines and `sched-lab explain`") == "timelines-and-sched-lab-explain"
    assert slug("Traces with shared prefixes (hash ids)") == "traces-with-shared-prefixes-hash-ids"
    assert slug("Executors: processes and Ray") == "executors-processes-and-ray"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings(page):
    bad = []
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(page.read_text())):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_readme_links_every_concept_page():
    """Each page of docs/ (but the generated fidelity doc, linked from the simulator page)
    is one link away from the README."""
    linked = set(re.findall(r"\]\(docs/([\w.]+\.md)\)", README.read_text()))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()


# ---------------------------------------------------------------------------- the README
def test_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    text = README.read_text()
    first = FENCE.search(text)
    assert text[: first.start()].strip().count("\n") == 0, "only the title comes before them"
    install_and_run, tests = first.group(2).strip().splitlines()
    assert install_and_run == "pip install . && sched-lab run experiments/quickstart.yaml"
    assert tests.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, ".ci/run must run the README's test command as written"
    assert "pip() { python -m pip" in "\n".join(ci)  # its `pip` is this interpreter's


# ---------------------------------------------------------------------------- YAML
@pytest.mark.parametrize("block", blocks("yaml"), ids=ids(blocks("yaml")))
def test_yaml_block_validates(block):
    raw = parse_yaml(block.text)
    assert isinstance(raw, dict), f"{block.where}: not a mapping"
    if "trace" not in raw:
        raw = {**BASE, **raw}
    if is_sweep(raw):
        sweep = load_sweep(ROOT / "docs" / "example.yaml", raw=raw, check_traces=False)
        assert sweep.points
    else:
        cfg = validate(raw, block.where, ROOT / "docs")
        setup = setup_for(cfg)  # what a run checks before its first replay
        setup.check()
        setup.prepare()
        _resolve_policies(cfg, setup)


def test_the_small_experiment_runs():
    """docs/configuration.md's complete experiment, its first 40 requests."""
    (block,) = [b for b in blocks("yaml") if b.text.startswith("name: small\n")]
    cfg = validate(parse_yaml(block.text), block.where, ROOT / "docs").with_trace(limit=40)
    runs = run_experiment(cfg, progress=False)
    assert [r.label for r in runs] == ["fcfs", "swap", "chunked_prefill"]
    for r in runs:
        assert len(r.requests) == 40 and (r.requests["status"] == "finished").all()


# ---------------------------------------------------------------------------- shell
def sketch(m: re.Match) -> str:
    """An optional part of a usage line, ``[--limit N]``, as an option given: ``--limit 1``
    (a placeholder in capitals becomes 1, which every option given one takes)."""
    return re.sub(r"\b[A-Z][A-Z_]*\b", "1", m.group(1))


def commands() -> list[tuple[str, list[str]]]:
    """Each command of the bash blocks (continued lines joined, comments dropped, optional
    ``[...]`` parts given, ``&&`` chains split), with where it is."""
    out = []
    for b in blocks("bash"):
        for line in b.text.replace("\\\n", " ").splitlines():
            line = re.sub(r"\[([^\]|]*)\]", sketch, line)  # [--out DIR]: --out 1
            words: list[str] = []
            for w in [*shlex.split(line, comments=True), "&&"]:
                if w != "&&":
                    words.append(w)
                elif words:
                    out.append((b.where, words))
                    words = []
    return out


class Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parse_cli(argv: list[str], monkeypatch) -> argparse.Namespace:
    """``sched-lab ARGV`` through the CLI's own parsers (delegated subcommands too), stopped
    right after parsing."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    try:
        code = cli.main(argv)
    except Parsed as p:
        return p.namespace
    finally:
        monkeypatch.undo()
    raise AssertionError(f"sched-lab {' '.join(argv)}: exit {code} before parsing its options")


def check_experiment(config: str) -> None:
    """The experiment a ``run`` names exists and validates (an engine experiment needs its
    model folder, so it is only read)."""
    path, raw = read_yaml(config)
    if is_sweep(raw):
        load_sweep(path, raw=raw, check_traces=False)
    elif raw.get("backend") != "engine":
        load_config(path)


def check_command(where: str, words: list[str], monkeypatch) -> None:
    while "=" in words[0]:  # VAR=value before the command
        words = words[1:]
    if words[:3] == ["python", "-m", "sched_lab.cli"]:
        words = ["sched-lab", *words[3:]]
    head = words[0]
    if head == "sched-lab":
        args = parse_cli(words[1:], monkeypatch)
        if words[1] == "run":
            check_experiment(args.config)
    elif words[:3] == ["python", "-m", "pytest"]:
        for w in words[3:]:
            if not w.startswith("-"):
                assert (ROOT / w).is_file(), f"{where}: {w}: no such test file"
    elif head == "python" and words[1].endswith(".py"):
        assert (ROOT / words[1]).is_file(), f"{where}: {words[1]}: no such script"
    elif head == "ray" and "--" in words:  # ray job submit ... -- COMMAND
        check_command(where, words[words.index("--") + 1 :], monkeypatch)
    elif head in ("pip", "ray"):  # pip: the README's, which CI runs; ray: a cluster's
        pass
    else:
        raise AssertionError(f"{where}: {' '.join(words)}: no rule to check this command")


def test_shell_commands_parse(monkeypatch):
    found = commands()
    assert len(found) > 30
    for where, words in found:
        check_command(where, words, monkeypatch)


def test_a_wrong_flag_is_caught(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_cli(["run", "experiments/quickstart.yaml", "--limt", "5"], monkeypatch)
    assert "unrecognized arguments: --limt" in capsys.readouterr().err


# ---------------------------------------------------------------------------- Python
def test_every_python_block_is_run_by_a_test():
    found = {(b.page, b.text.splitlines()[0]) for b in blocks("python")}
    assert found == set(PYTHON_BLOCKS)
