"""The side commands (fit, fidelity, explain, timeline, profile, tools) write only where the
user said, replace only files sched-lab wrote (lab/core/outputs.py), read bundled data by
name, and turn a damaged results folder into one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from sched_lab.cli import main
from sched_lab.core.errors import MAX_MESSAGE_CHARS, ConfigError, UserError, short_repr
from sched_lab.core.outputs import MANIFEST, check_output, write_output, written_here

ROOT = Path(__file__).resolve().parents[1]
TINY = """name: tiny
trace: {format: synthetic, num_requests: 6, arrival: {process: poisson, rate: 1},
        prompt_len: 10, output_len: 5}
policies: [fcfs]
"""


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- lab/core/outputs.py
def test_a_file_is_replaced_only_if_the_lab_wrote_it(tmp_path):
    out = tmp_path / "a" / "fit.json"
    assert check_output(out, "--out") == out  # absent, its folder not made yet
    assert not (tmp_path / "a").exists()
    write_output(out, "one\n")
    assert written_here(tmp_path / "a") == {"fit.json"}
    write_output(check_output(out, "--out"), "two\n")  # its own: replaced
    assert out.read_text() == "two\n"
    mine = tmp_path / "a" / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(UserError, match=r"^--out .*notes.txt: exists and was not written by "):
        check_output(mine, "--out")
    with pytest.raises(UserError, match="a folder, expected a file path"):
        check_output(tmp_path, "--out")
    write_output(tmp_path / "a" / "b.png", b"\x89PNG")  # the manifest keeps both names
    assert written_here(tmp_path / "a") == {"fit.json", "b.png"}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        MANIFEST,
        "b.png",
        "fit.json",
        "notes.txt",
    ]  # no temporary file left


def test_error_messages_are_one_bounded_line():
    e = ConfigError("x" * 3_000_000 + "\nsecond line")
    text = str(e)
    assert len(text) <= MAX_MESSAGE_CHARS and "\n" not in text
    assert text.endswith(f"... ({3_000_000 + 12 - MAX_MESSAGE_CHARS + 40:,} characters cut)")
    assert short_repr(16**5000) == "<an integer of 6,021 digits>"  # repr() would raise
    assert short_repr(-(10**20)) == "-100000000000000000000"


# ---------------------------------------------------------------- fit
@pytest.mark.parametrize(
    "name",
    ["h200_qwen3-0.6b", "h200_qwen3-0.6b.csv", "profiles/h200_qwen3-0.6b.csv", "h200_qwen3_0.6b"],
)
def test_fit_reads_a_bundled_profile_by_name_and_writes_nothing(
    name, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # no profiles/ here: the bundled one is found
    assert main(["fit", name]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.index("\n}\n") + 2])["rows"] == 124
    assert list(tmp_path.iterdir()) == []


def test_fit_names_the_bundled_profiles_for_an_unknown_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "h200_qwen3-0.7b"]) == 2
    assert one_error_line(capsys) == (
        "error: h200_qwen3-0.7b does not exist, and no bundled profile has that name (did you "
        "mean h200_qwen3-0.6b?) (bundled: h200_llama-3.1-8b, h200_qwen3-0.6b)"
    )


def test_fit_out_replaces_only_its_own_file(tmp_path, capsys):
    mine = tmp_path / "fit.json"
    mine.write_text("my notes")
    assert main(["fit", "h200_qwen3-0.6b", "--out", str(mine)]) == 2
    assert "exists and was not written by sched-lab" in one_error_line(capsys)
    assert mine.read_text() == "my notes"
    out = tmp_path / "fits" / "q.fit.json"
    for _ in range(2):  # the second run replaces the first's file
        assert main(["fit", "h200_qwen3-0.6b", "--out", str(out)]) == 0
        assert json.loads(out.read_text())["rows"] == 124
    assert written_here(out.parent) == {"q.fit.json"}


# ---------------------------------------------------------------- fidelity --sim
def test_fidelity_sim_refuses_a_users_file_before_any_replay(tmp_path):
    from sched_lab.fidelity import ARCHIVE, sim

    (tmp_path / "x.md").write_text("my doc")
    with pytest.raises(SystemExit, match=r"--doc .*x\.md: exists and was not written by"):
        sim(ARCHIVE, tmp_path / "x.md")
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "heldout.csv").write_text("my table")
    with pytest.raises(SystemExit, match=r"--doc .*y/heldout\.csv: exists and was not written"):
        sim(ARCHIVE, tmp_path / "y.md")
    assert tree(tmp_path) == {"x.md": b"my doc", "y/heldout.csv": b"my table"}


def test_fidelity_sim_writes_its_table_and_plots_in_a_folder_named_after_the_doc(tmp_path):
    from sched_lab.fidelity.sim_side import _write

    (tmp_path / "fidelity").mkdir()
    (tmp_path / "fidelity" / "heldout.csv").write_text("another doc's table")
    table = pd.DataFrame({"window": ["w"], "load": [1.0]})
    steps = pd.DataFrame({"kind": ["decode"] * 3, "err": [0.01, -0.02, 0.0]})
    cdfs = {("w", 1.0, "fcfs"): {m: ([0.1, 0.2], [0.1, 0.3]) for m in ("ttft_s", "e2e_s")}}
    for _ in range(2):  # written, then replaced
        _write(tmp_path / "x.md", "# doc\n", table, steps, cdfs)
    files = tree(tmp_path)
    assert sorted(files) == sorted([
        MANIFEST, "fidelity/heldout.csv", f"x/{MANIFEST}", "x.md", "x/heldout.csv",
        "x/heldout_cdfs.png", "x/heldout_step_error.png",
    ])  # fmt: skip
    assert files["fidelity/heldout.csv"] == b"another doc's table"
    assert files["x/heldout.csv"] == b"window,load\nw,1\n"
    assert written_here(tmp_path) == {"x.md"}


def test_fidelity_doc_links_its_plots_in_the_folder_named_after_it():
    from sched_lab.fidelity.markdown import TEMPLATE

    assert TEMPLATE.count("]({figures}/heldout_") == 2 and "](fidelity/" not in TEMPLATE


def test_fidelity_sim_outside_a_checkout_makes_no_folder(tmp_path, monkeypatch, capsys):
    import sched_lab.fidelity as fidelity

    site = tmp_path / "site-packages"
    monkeypatch.setattr(fidelity, "DOC", site / "docs" / "fidelity.md")
    assert fidelity.main(["--sim", "--archive", str(tmp_path / "none.tar.gz")]) == 2
    assert one_error_line(capsys).startswith("error: --doc: expected the markdown file to write")
    doc = tmp_path / "new" / "x.md"  # a missing archive: said before any folder is made
    assert (
        fidelity.main(["--sim", "--archive", str(tmp_path / "none.tar.gz"), "--doc", str(doc)]) == 2
    )
    assert "no such archive" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_fidelity_engine_side_keeps_a_users_folder_and_archive(tmp_path, capsys):
    from sched_lab.fidelity import main as fidelity_main

    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("mine")
    (work / "engine").mkdir()
    assert fidelity_main(["--engine", "--out", str(work)]) == 2
    assert "holds thesis.tex, not an engine side's working folder" in one_error_line(capsys)
    archive = tmp_path / "a.tar.gz"
    archive.write_text("mine")
    assert (
        fidelity_main(["--engine", "--out", str(tmp_path / "w2"), "--archive", str(archive)]) == 2
    )
    assert "--archive" in one_error_line(capsys)
    assert tree(tmp_path) == {"work/thesis.tex": b"mine", "a.tar.gz": b"mine"}


# ---------------------------------------------------------------- explain and timeline
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    import run_experiment

    folder = tmp_path_factory.mktemp("side")
    (folder / "tiny.yaml").write_text(TINY)
    assert run_experiment.main([str(folder / "tiny.yaml"), "--out", str(folder / "res"),
                                "--no-progress", "-q"]) == 0  # fmt: skip
    return folder / "res"


def _drop(name: str, column: str):
    def damage(f: Path) -> None:
        pd.read_csv(f / name).drop(columns=[column]).to_csv(f / name, index=False)

    return damage


def _extra_field(f: Path) -> None:
    lines = (f / "requests.csv").read_text().splitlines()
    lines[2] += ",1,2"
    (f / "requests.csv").write_text("\n".join(lines) + "\n")


def _text_in_numbers(f: Path) -> None:
    text = (
        (f / "requests.csv")
        .read_text()
        .replace("fcfs,1.0,0,finished,,0.0,", "fcfs,1.0,0,finished,,abc,")
    )
    (f / "requests.csv").write_text(text)


def _header_only(name: str):
    def damage(f: Path) -> None:
        (f / name).write_text((f / name).read_text().splitlines()[0] + "\n")

    return damage


def _cut(name: str, line: int, chars: int = 0, rest: bool = False):
    """Cut line ``line`` (1: the header) of ``name`` to its first ``chars`` characters; the
    lines after it go (``rest``: they stay, so a row in the middle is short)."""

    def damage(f: Path) -> None:
        text = (f / name).read_text().splitlines(keepends=True)
        short = text[line - 1][:chars]
        after = ["\n", *text[line:]] if rest else []
        (f / name).write_text("".join([*text[: line - 1], short, *after]))

    return damage


def _bad_parquet(f: Path) -> None:
    (f / "requests.csv").unlink()
    (f / "requests.parquet").write_text("not parquet")


DAMAGE = {
    "summary_list": (lambda f: (f / "summary.json").write_text("[1, 2]"),
                     "summary.json: expected a mapping of run labels to summaries with 'policy' "
                     "and 'rate_scale', got [1, 2]"),
    "summary_without_rate_scale": (lambda f: (f / "summary.json").write_text('{"fcfs": {"policy": "fcfs"}}'),
                                   "got {'fcfs': {'policy': 'fcfs'}}"),
    "summary_not_json": (lambda f: (f / "summary.json").write_text("{"),
                         "not a results folder (summary.json: "),
    "bad_parquet": (_bad_parquet, "requests.parquet: damaged, cannot be read ("),
    "missing_column": (_drop("requests.csv", "arrival_s"), "requests.csv: damaged, no column 'arrival_s'"),
    "missing_event_column": (_drop("events.csv", "event"), "events.csv: damaged, no column 'event'"),
    "missing_step_column": (_drop("steps.csv", "duration_s"), "steps.csv: damaged, no column 'duration_s'"),
    "field_count": (_extra_field, "requests.csv: damaged, cannot be read (Error tokenizing data. "
                    "C error: Expected 20 fields in line 3, saw 22"),
    "text_in_numbers": (_text_in_numbers, "requests.csv: damaged, column 'arrival_s' holds text where "
                        "numbers belong"),
    # Cut short (issue 39): an IndexError of the timeline before.
    "steps_header_only": (_header_only("steps.csv"),
                          "steps.csv: damaged, 0 rows of run fcfs, but summary.json counts "),
    "steps_cut_at_a_line": (_cut("steps.csv", 4), "steps.csv: damaged, 2 rows of run fcfs, "
                            "but summary.json counts "),
    "steps_cut_mid_line": (_cut("steps.csv", 4, 12), "steps.csv: damaged, line 4 ends without "
                           "a line break (the lab ends every line with one); was the file cut "
                           "short?"),
    "requests_header_only": (_header_only("requests.csv"), "requests.csv: damaged, 0 rows of "
                             "run fcfs, but summary.json counts 6 (num_prompts + dropped)"),
    "requests_cut_mid_line": (_cut("requests.csv", 7, 25), "requests.csv: damaged, line 7 "
                              "ends without a line break"),
    "requests_short_row": (_cut("requests.csv", 2, 20, rest=True),
                           "requests.csv: damaged, line 2 has no value in column 'arrival_s' "
                           "(every row has one; was the file cut short?)"),
    "events_short_row": (_cut("events.csv", 3, 14, rest=True),
                         "events.csv: damaged, line 3 has no value in column 'step'"),
    "binary": (lambda f: (f / "requests.csv").write_bytes(b"\xf0\x28\x8c\x28" * 50),
               "requests.csv: damaged, cannot be read ('utf-8' codec can't decode"),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("command", ["explain", "timeline"])
def test_a_damaged_results_folder_is_one_line(damage, command, results, tmp_path, capsys):
    import shutil

    if damage == "bad_parquet":  # reading parquet needs the parquet extra
        pytest.importorskip("pyarrow")
    folder = tmp_path / "res"
    shutil.copytree(results, folder)
    spoil, expected = DAMAGE[damage]
    spoil(folder)
    args = ["--request", "0"] if command == "explain" else ["--out", str(tmp_path / "t.png")]
    assert main([command, str(folder), *args]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {folder}") and expected in line, line
    assert not (tmp_path / "t.png").exists()


def test_timeline_out_keeps_a_users_file_and_the_results_folder_replaceable(
    results, tmp_path, capsys
):
    from sched_lab.report.folder import is_results_folder

    mine = tmp_path / "t.png"
    mine.write_bytes(b"mine")
    assert main(["timeline", str(results), "--out", str(mine)]) == 2
    assert "exists and was not written by sched-lab" in one_error_line(capsys)
    assert mine.read_bytes() == b"mine"
    inside = results / "slowest.png"  # into the results folder: its manifest lists it
    assert main(["timeline", str(results), "--slowest", "2", "--out", str(inside)]) == 0
    assert capsys.readouterr().out == f"wrote {inside}: 2 requests of run fcfs\n"
    assert inside.read_bytes()[:4] == b"\x89PNG" and is_results_folder(results)


def test_timeline_without_out_writes_in_the_results_folder_not_the_cwd(
    results, tmp_path, capsys, monkeypatch
):
    import shutil

    from sched_lab.report.folder import is_results_folder

    folder = tmp_path / "res"
    shutil.copytree(results, folder)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["timeline", str(folder), "--slowest", "2", "--by", "ttft"]) == 0
    png = folder / "timeline_fcfs_slowest2_ttft.png"
    assert capsys.readouterr().out == f"wrote {png}: 2 requests of run fcfs\n"
    assert png.read_bytes()[:4] == b"\x89PNG" and is_results_folder(folder)
    assert list(cwd.iterdir()) == []
    assert (folder / "timeline_fcfs.png").read_bytes() == (
        results / "timeline_fcfs.png"
    ).read_bytes()
    mine = folder / "timeline_fcfs_requests.png"  # a user's file of the default name stays
    mine.write_bytes(b"mine")
    assert main(["timeline", str(folder), "--requests", "1,2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: timeline (no --out): {mine}: exists and was not written by")
    assert mine.read_bytes() == b"mine" and list(cwd.iterdir()) == []


# ---------------------------------------------------------------- profile and tools
def test_profile_and_tools_keep_a_users_files(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    mine = tmp_path / "p.csv"
    mine.write_text("mine")
    assert main(["profile", "--model-dir", str(tmp_path), "--out", str(mine)]) == 2
    assert "--out" in one_error_line(capsys)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("my model")
    args = ["tools", "make-random-checkpoint", "--preset", "smollm2-135m", "--out", str(ckpt)]
    assert main(args) == 2
    assert "is not a random checkpoint (no random_weights.json)" in one_error_line(capsys)
    if "transformers" in sys.modules or __import__("importlib").util.find_spec("transformers"):
        assert main(["tools", "convert-smollm2", "--out", str(ckpt), "--force"]) == 2
        assert "is not a converted checkpoint" in one_error_line(capsys)
    assert tree(tmp_path) == {"p.csv": b"mine", "ckpt/config.json": b"my model"}


def test_a_tool_stopped_by_a_signal_is_one_line_and_its_status(tmp_path, capsys, monkeypatch):
    """SIGTERM (or Ctrl-C) while a tool writes raises where it was, so its cleanup runs (the
    quantizer's temporary folder); then one line and 128 + the signal number."""
    pytest.importorskip("torch")
    import os
    import signal

    from sched_lab.backend.tools import quantize

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in the main thread
        raise AssertionError("not stopped")

    monkeypatch.setattr(quantize, "quantize_checkpoint", stopped)
    args = ["tools", "quantize", "--method", "int8", "--model-dir", str(tmp_path), "--out",
            str(tmp_path / "q")]  # fmt: skip
    assert main(args) == 128 + signal.SIGTERM
    assert one_error_line(capsys) == "error: sched-lab tools quantize: interrupted by SIGTERM"
