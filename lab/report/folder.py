"""The results folder: config.yaml, requests.csv, steps.csv, summary.json, report.md + PNGs,
events.csv (lab/report/timeline.py), one vLLM-format result JSON per run
(lab/results/vllm_result.py), report.html (lab/report/html.py).

The folder is written under a temporary name and renamed into place, so an interrupted run
never leaves a folder that looks complete; its manifest (:data:`MANIFEST`) names the files
the lab wrote, and a rerun replaces a folder only when it holds nothing else.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sched_lab import __version__
from sched_lab.config import ExperimentConfig
from sched_lab.core.errors import UserError
from sched_lab.core.outputs import MANIFEST  # the names of the files the lab wrote in a folder
from sched_lab.report import csv_text, plot_data, plots, staging, timeline
from sched_lab.report import html as html_report
from sched_lab.report.markdown import config_yaml, report_markdown
from sched_lab.report.progress import Phase
from sched_lab.results import fairness, vllm_result
from sched_lab.results.run import Run
from sched_lab.sim.records import STEP_COLUMNS

log = logging.getLogger(__name__)

FORMATS = ("csv", "parquet")  # of requests and steps
STEPS_FLOAT_FORMAT = "%.9g"  # steps.csv's floats: 9 significant digits
EVENT_ROWS = 1 << 18  # events.csv rows made and written at a time (without pictures)
# What the report reads of a run's request table once its rows are set aside, with plots
# (report.md's dropped rows, the latency CDFs of lab/report/plots.py, the per-class CDFs of
# lab/results/fairness.py): a run keeps those columns it has (:func:`report_view`).
REPORT_COLUMNS = ("status", "reason", "class", "ttft_s", "tpot_s", "e2e_s")
_TEMP_SUFFIX_BYTES = 14  # ".{name}.XXXXXXXX" then ".old": what a temporary name adds


class ResultsNotPlaced(Exception):
    """Written but not renamed into place; the message says where the results are."""


def write_results(
    out_dir: Path,
    cfg: ExperimentConfig,
    runs: list[Run],
    decode: Callable[[list[int]], str] | None = None,
    *,
    partial: str | None = None,
    fmt: str = "csv",
    bars: bool = True,
    date: str | None = None,
    plots: bool = True,
) -> Path:
    """Write every file of the run folder ``out_dir`` atomically; returns ``out_dir``.
    Engine runs also get ``tokens.jsonl`` (token ids, and text when ``decode`` is given).
    The runs are left whole (:class:`ResultsWriter` frees each as it is added).

    Args:
        partial: why only some of the experiment's runs are here; said in report.md and in
            every run's summary (key ``partial``).
        fmt: ``csv`` or ``parquet`` (needs pyarrow) for requests and steps.
        bars: False: no progress bar while writing.
        date: the vLLM-format files' ``date`` (default: now, or ``SOURCE_DATE_EPOCH``;
            :func:`sched_lab.results.vllm_result.result_date`).
        plots: False: no PNG and no interactive timeline (report.md and report.html say
            so); the tables, events and summaries are the same.

    Raises:
        UserError: ``out_dir`` cannot become a results folder (nothing is written).
        ResultsNotPlaced: the final rename failed; the message names where the results are.
    """
    writer = ResultsWriter(out_dir, cfg, fmt=fmt, bars=bars, plots=plots)
    for run in runs:
        writer.add(run, release=False)
    return writer.finish(runs, decode, partial=partial, date=date)


class ResultsWriter:
    """A results folder written run by run, in a temporary folder until :meth:`finish`.

    :meth:`add` writes a run's rows of steps.csv and events.csv (CSV only; parquet files
    are written whole at the end) and its timeline pictures as soon as it ends, then frees
    its steps, events and request objects (:meth:`~sched_lab.results.run.Run.release`) and
    sets its request table aside in the temporary folder (the run keeps its
    :func:`report_view`), so runs one after another need the memory of one.
    :meth:`finish` writes everything else (requests.csv from the tables set aside, one at a
    time where every run's columns and types are the same) and puts the folder in place;
    :meth:`abort` removes the temporary folder.

    Raises (constructor): UserError if ``out_dir`` cannot become a results folder;
    ValueError for an unknown ``fmt``.
    """

    def __init__(
        self, out_dir: Path, cfg: ExperimentConfig, *, fmt: str = "csv", bars: bool = True,
        plots: bool = True,
    ) -> None:  # fmt: skip
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
        self.out_dir = check_out_dir(out_dir)
        self.cfg, self.fmt, self.bars, self.draw = cfg, fmt, bars, plots
        self._tmp: Path | None = None
        self._added: list[Run] = []
        self._aside: dict[int, _Aside] = {}  # id(run) -> its request table set aside
        self._steps_header = True  # steps.csv has no header yet
        self._events: list[pd.DataFrame] = []  # parquet: every run's, written at the end
        self._pngs: list[tuple[str, str]] = []
        self._figures: list[dict] = []
        self._with_plotly = plots and html_report.plotly_available()
        self._plot_data: list[dict] = []  # without plots: what drawing them later needs

    @property
    def folder(self) -> Path:
        """The temporary folder (made on first use)."""
        if self._tmp is None:
            self._tmp = temp_folder(self.out_dir)
        return self._tmp

    def add(self, run: Run, release: bool = True) -> None:
        """Write ``run``'s rows and timeline; with ``release`` (and CSV), free them after.

        Raises:
            UserError: a file cannot be written (the temporary folder is removed).
        """
        try:
            with Phase(f"{run.label}: rows and timeline written", bars=False):
                self._add(run, release)
        except OSError as e:
            self.abort()
            raise UserError(f"--out {self.out_dir}: cannot write the results ({e})") from None
        except BaseException:
            self.abort()
            raise

    def _add(self, run: Run, release: bool) -> None:
        tmp = self.folder
        events = series = None
        aside = release and self.fmt == "csv"  # the request table goes to a file, freed here
        if self.fmt == "csv":
            with (tmp / "steps.csv").open("ab") as f:
                self._steps_header = _write_run_steps(f, run, self._steps_header)
            if self.draw:  # the pictures read the whole frame
                events = timeline.events_frame(run)
                _append_csv(tmp / "events.csv", events, header=not self._added)
            else:  # the plots' series read the table: taken before it is set aside, which
                series = plot_data.plot_data(run)  # frees it before events.csv is written
                if aside:
                    self._put_aside(run)
                for i, part in enumerate(timeline.events_frames(run, EVENT_ROWS)):
                    _append_csv(tmp / "events.csv", part, header=not (self._added or i))
        else:
            events = timeline.events_frame(run)
            self._events.append(events)
        if self.draw:
            with _drawing():
                pngs, figures = _timeline(tmp, self.cfg, run, events, self._with_plotly)
            self._pngs += pngs
            self._figures += figures
        else:
            series = plot_data.plot_data(run) if series is None else series
            self._plot_data.append(series)
        del events
        self._added.append(run)
        if aside:
            run.plot_series = plots.run_series(run) if series is None else series
            run.release()
            if self.draw:  # (without plots, set aside before events.csv above)
                self._put_aside(run)

    def _put_aside(self, run: Run) -> None:
        path = self.folder / f".requests-{len(self._aside) + 1}.pkl"
        self._aside[id(run)] = _Aside.put(path, run, self.draw)

    def finish(
        self,
        runs: list[Run],
        decode: Callable[[list[int]], str] | None = None,
        *,
        partial: str | None = None,
        date: str | None = None,
    ) -> Path:
        """Write the rest for ``runs`` (those added, in order) and put the folder in place;
        returns ``out_dir``. Raises UserError, or ResultsNotPlaced (see
        :func:`write_results`)."""
        if [id(r) for r in runs] != [id(r) for r in self._added]:
            raise ValueError("finish: runs must be the runs added, in the order added")
        tmp = self.folder
        phase = Phase("writing results", 5, "file", self.bars).start()  # 5 advances below
        try:
            self._finish(tmp, runs, decode, partial, phase, date)
        except OSError as e:
            phase.close(ok=False)
            self.abort()
            raise UserError(f"--out {self.out_dir}: cannot write the results ({e})") from None
        except BaseException:  # interrupted too: no temporary folder left behind
            phase.close(ok=False)
            self.abort()
            raise
        try:
            self._tmp = None  # placed, or kept where ResultsNotPlaced says
            put_in_place(tmp, self.out_dir)
        finally:
            phase.close()
        return self.out_dir

    def abort(self) -> None:
        """Remove the temporary folder, if any (nothing else was written)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _finish(self, tmp: Path, runs: list[Run], decode, partial, phase: Phase, date) -> None:
        cfg, fmt, draw = self.cfg, self.fmt, self.draw
        (tmp / "config.yaml").write_text(config_yaml(cfg, runs))
        phase.advance()
        if fmt == "parquet":
            concat_requests([r.requests for r in runs]).to_parquet(
                tmp / "requests.parquet", index=False
            )
            _steps_frame(runs).to_parquet(tmp / "steps.parquet", index=False)
        else:
            self._write_requests(tmp / "requests.csv", runs)
            if self._steps_header:  # no run has a step: the header alone, as pandas writes
                extra = _columns(runs[0])[len(STEP_COLUMNS) :] if runs else []
                names = ["policy", "rate_scale", *STEP_COLUMNS, *extra]
                with (tmp / "steps.csv").open("ab") as f:
                    f.write(csv_text.pack([], names))
        phase.advance()
        extra = {"partial": partial} if partial else {}
        summary = {r.label: {**r.summary, **extra} for r in runs}
        (tmp / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2))
        # Wall-clock seconds live apart, so the other files depend on the inputs alone.
        timing = {r.label: {"replay_wall_s": r.result.wall_s} for r in runs}
        (tmp / "timing.json").write_text(json.dumps(timing, indent=2))
        phase.advance()
        if any(r.output_token_ids for run in runs for r in run.result.requests):
            _write_tokens(tmp / "tokens.jsonl", runs, decode)
        date = vllm_result.result_date() if date is None else date
        for r in runs:  # vLLM's `--save-result` file of each run
            vllm = {**r.vllm, "date": date}
            name = vllm_result.result_filename(r.label, vllm["request_rate"], vllm["model_id"])
            (tmp / name).write_text(json.dumps(_json_safe(vllm), indent=2))
        if draw:
            with _drawing():
                pngs = _plots(tmp, runs, cfg) + fairness.plots(tmp, runs, save_png)
        else:  # for sched-lab report: the plots drawn later
            pngs = []
            plot_data.write_plot_data(tmp / plot_data.PLOT_DATA, cfg, runs, self._plot_data)
        if fmt == "parquet":
            events = pd.concat(self._events, ignore_index=True) if self._events else pd.DataFrame()
            events.to_parquet(tmp / "events.parquet", index=False)
        elif not runs:
            write_csv(tmp / "events.csv", pd.DataFrame())
        phase.advance()
        report = report_markdown(cfg, runs, pngs + self._pngs, fmt, plots_drawn=draw)
        if partial:  # right under the title
            title, _, rest = report.partition("\n")
            report = f"{title}\n\n**Partial results**: {partial}.\n{rest}"
        (tmp / "report.md").write_text(report)
        _html(tmp, cfg, runs, report, self._figures, draw)
        files = sorted(p.name for p in tmp.iterdir() if p.name != staging.MARKER)
        (tmp / MANIFEST).write_text(
            json.dumps({"written_by": f"sched-lab {__version__}", "files": files}, indent=2) + "\n"
        )

    def _write_requests(self, path: Path, runs: list[Run]) -> None:
        """requests.csv: :func:`write_csv` of :func:`concat_requests` of the runs' tables;
        made one table at a time when every table was set aside and all have the same
        columns and types (concatenating them changes no type), else all at once."""
        aside = [self._aside.get(id(r)) for r in runs]
        if runs and all(aside) and len({a.schema for a in aside}) == 1:
            with path.open("wb") as f:
                for i, a in enumerate(aside):
                    _write_csv_rows(f, a.take(), header=i == 0)
            return
        tables = [r.requests if a is None else a.take() for r, a in zip(runs, aside)]
        write_csv(path, concat_requests(tables))


@dataclass(frozen=True)
class _Aside:
    """A run's request table set aside in a file (a pickle: its types kept exactly)."""

    path: Path
    schema: tuple[tuple[str, object], ...]  # (column, dtype) in order

    @classmethod
    def put(cls, path: Path, run: Run, plots: bool) -> _Aside:
        """Write ``run.requests`` to ``path``; the run keeps its :func:`report_view`."""
        df = run.requests
        df.to_pickle(path)
        run.requests = report_view(df, plots)
        return cls(path, tuple(df.dtypes.items()))

    def take(self) -> pd.DataFrame:
        """The table, its file removed."""
        df = pd.read_pickle(self.path)
        self.path.unlink()
        return df


def report_view(requests: pd.DataFrame, plots: bool) -> pd.DataFrame:
    """What the report reads of a run's request table (a copy): with ``plots``, its
    :data:`REPORT_COLUMNS`; without, the status and reason of its dropped rows (report.md)."""
    if plots:
        return requests[[c for c in REPORT_COLUMNS if c in requests.columns]].copy()
    return requests.loc[requests["status"] == "dropped", ["status", "reason"]].copy()


def temp_folder(out_dir: Path) -> Path:
    """A new folder beside ``out_dir``, ``.<name>.XXXXXXXX``, to write its results into
    before :func:`put_in_place`; readable as the umask allows (mkdtemp makes it private).
    It holds only the marker of this process (lab/report/staging.py) until then. Such
    folders left by a killed run of this host are removed first (logged).

    Raises:
        UserError: it cannot be made.
    """
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.remove_stale(out_dir.parent, f".{out_dir.name}.")
        tmp = staging.make_marked(out_dir.parent, f".{out_dir.name}.")
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot write the results ({e})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def put_in_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out_dir``, replacing an earlier results folder
    there (checked again). Raises ResultsNotPlaced."""
    try:
        staging.unmark(tmp)
        if out_dir.exists():
            check_out_dir(out_dir)
            old = tmp.with_name(tmp.name + ".old")
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                os.rename(old, out_dir)  # the earlier results back where they were
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except (OSError, UserError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e).removeprefix(f"--out {out_dir}: ")
        kept = out_dir.with_name(f"{out_dir.name}.unplaced-{tmp.name.rsplit('.', 1)[-1]}")
        try:
            os.rename(tmp, kept)
        except OSError:
            kept = tmp
        raise ResultsNotPlaced(
            f"--out {out_dir}: cannot put the results in place ({why}); they are in {kept}"
        ) from None


def check_out_dir(out_dir: Path) -> Path:
    """Check, creating nothing, that ``out_dir`` can become a results folder: absent, empty, or
    a replaceable earlier results folder. Returns ``out_dir`` resolved (absolute, symlinks
    followed). Raises UserError: one line naming ``out_dir`` and what is in the way."""
    given = out_dir
    try:
        out_dir = Path(out_dir).resolve()
        _check_out_dir(out_dir)
    except RuntimeError as e:  # Python < 3.13: a symlink loop
        raise UserError(f"--out {given}: {e}") from None
    except OSError as e:  # a loop (ELOOP), a name too long for the file system...
        raise UserError(f"--out {given}: {e.strerror or e}") from None
    return out_dir


def _check_out_dir(out_dir: Path) -> None:
    if out_dir == out_dir.parent:
        raise UserError(f"--out {out_dir}: the file-system root cannot be a results folder")
    above = next(p for p in out_dir.parents if p.exists())  # the root always exists
    if not above.is_dir():
        raise UserError(f"--out {out_dir}: {above} is a file, not a folder")
    try:
        name_max = os.pathconf(above, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    size = len(os.fsencode(out_dir.name))  # longer than name_max: resolve() said so already
    if size + _TEMP_SUFFIX_BYTES > name_max:
        raise UserError(
            f"--out {out_dir}: the name is {size} bytes long; at most "
            f"{name_max - _TEMP_SUFFIX_BYTES} fit (its temporary name adds "
            f"{_TEMP_SUFFIX_BYTES})"
        )
    try:  # what write_results will do there: make a folder
        os.rmdir(tempfile.mkdtemp(prefix=".write-test.", dir=above))
    except OSError as e:
        raise UserError(
            f"--out {out_dir}: cannot make a folder in {above} ({e.strerror})"
        ) from None
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: exists and is not a folder")
    foreign = _foreign_entries(out_dir) if any(out_dir.iterdir()) else []
    if foreign is None:
        if (
            (out_dir / "summary.json").is_file()
            and (out_dir / "report.md").is_file()
            and not any(p.is_dir() for p in out_dir.iterdir())
        ):  # made before manifests
            raise UserError(
                f"--out {out_dir}: a results folder without {MANIFEST} (from "
                "before manifests, or made by hand); refusing to replace it: delete "
                "it yourself, or choose another --out"
            )
        raise UserError(
            f"--out {out_dir}: the folder exists and is not a results folder (no "
            f"{MANIFEST}); refusing to replace it"
        )
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UserError(
            f"--out {out_dir}: holds {foreign[0]}{more}, not written by sched-lab "
            f"(not in {MANIFEST}); refusing to replace it (move it out, or choose "
            "another --out)"
        )
    _check_replaceable(out_dir)


def _check_replaceable(out_dir: Path) -> None:
    """What replacing ``out_dir`` needs: renaming it in its parent and deleting its files."""
    parent = out_dir.parent
    if os.path.ismount(out_dir):
        raise UserError(
            f"--out {out_dir}: is a mount point; it cannot be replaced (use a folder inside it)"
        )
    st, parent_st, uid = out_dir.stat(), parent.stat(), os.geteuid()
    if parent_st.st_mode & stat.S_ISVTX and uid not in (0, st.st_uid, parent_st.st_uid):
        raise UserError(
            f"--out {out_dir}: {parent} is sticky and the folder is not yours; "
            "it cannot be replaced"
        )
    for folder, why in ((parent, "rename it"), (out_dir, "delete its files")):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".write-test.", dir=folder))
        except OSError as e:
            raise UserError(
                f"--out {out_dir}: the earlier results cannot be replaced: cannot "
                f"{why} ({e.strerror})"
            ) from None


def is_results_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest and no entry beyond the files it names."""
    return _foreign_entries(folder) == []


def _foreign_entries(folder: Path) -> list[str] | None:
    """The entries of ``folder`` its manifest names neither as files nor as results
    ``folders``, sorted; None without a readable manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = set(manifest["files"])
        folders = set(manifest.get("folders", ()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None

    def ours(p: Path) -> bool:
        if p.is_symlink():
            return False
        if p.name in files and p.is_file():
            return True
        return p.name in folders and p.is_dir() and is_results_folder(p)

    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST and not ours(p))


def _write_tokens(path: Path, runs: list[Run], decode) -> None:
    with path.open("w") as f:
        for run in runs:
            for r in run.result.requests:
                row = {
                    "policy": run.policy,
                    "rate_scale": run.rate_scale,
                    "request_id": r.request_id,
                    "status": r.status.value,
                    "output_token_ids": r.output_token_ids,
                }
                if decode is not None:
                    row["text"] = decode(r.output_token_ids)
                f.write(json.dumps(row) + "\n")


def write_csv(
    path: Path, df: pd.DataFrame, float_format: str | None = None, rows: int = 1 << 17
) -> None:
    """``df.to_csv(path, index=False, float_format=...)``'s bytes, made column-wise
    (lab/report/csv_text.py) ``rows`` rows at a time (a value's text depends on it alone);
    pandas writes a part holding a type that module lacks."""
    with path.open("wb") as f:
        _write_csv_rows(f, df, float_format, rows)


def _write_csv_rows(
    f, df: pd.DataFrame, float_format: str | None = None, rows: int = 1 << 17, header: bool = True
) -> None:
    """:func:`write_csv`'s bytes to the open file ``f``, the header only with ``header``."""
    for start in range(0, max(len(df), 1), rows):  # once for an empty frame: the header
        part, first = df.iloc[start : start + rows], header and start == 0
        data = csv_text.frame_csv(part, float_format or "repr", header=first)
        if data is None:
            text = part.to_csv(index=False, header=first, float_format=float_format)
            data = text.encode()
        f.write(data)


def _write_steps_csv(path: Path, runs: list[Run], rows: int = 1 << 17) -> None:
    """steps.csv of ``runs`` at once (:class:`ResultsWriter` writes it run by run)."""
    with path.open("wb") as f:
        header = True
        for r in runs:
            header = _write_run_steps(f, r, header, rows)
        if header:  # no run has a step: the header alone, as the concatenated frame writes
            extra = _columns(runs[0])[len(STEP_COLUMNS) :] if runs else []
            f.write(csv_text.pack([], ["policy", "rate_scale", *STEP_COLUMNS, *extra]))


def _write_run_steps(f, run: Run, header: bool, rows: int = 1 << 17) -> bool:
    """Append a run's rows of steps.csv to ``f``, ``rows`` at a time, with the header first
    when ``header``; returns whether the header is still to come (the run had no step).
    Run after run, the same bytes as :func:`_steps_frame`'s ``to_csv(index=False,
    float_format=STEPS_FLOAT_FORMAT)``."""
    n = run.result.num_steps
    names = ["policy", "rate_scale", *_columns(run)]
    for start in range(0, n, rows):
        step_rows = run.result.step_rows(start, min(start + rows, n))
        cells = _steps_cells(run, step_rows)
        if cells is None:  # a column type csv_text lacks: pandas writes the chunk
            cols = {"policy": run.policy, "rate_scale": run.rate_scale}
            cols.update({c: step_rows[c] for c in _columns(run)})
            text = pd.DataFrame(cols).to_csv(
                index=False, header=header, float_format=STEPS_FLOAT_FORMAT
            )
            f.write(text.encode())
        else:
            f.write(csv_text.pack(cells, names if header else None))
        header = False
    return header


def _append_csv(path: Path, df: pd.DataFrame, header: bool) -> None:
    """Append ``df``'s rows (with ``header``: its header first) to ``path``: the bytes
    :func:`write_csv` writes, frame after frame, for the frames concatenated."""
    data = csv_text.frame_csv(df, "repr", header=header)
    if data is None:
        data = df.to_csv(index=False, header=header).encode()
    with path.open("ab") as f:
        f.write(data)


def _steps_cells(run: Run, step_rows: dict[str, np.ndarray]) -> list | None:
    """The csv_text cells of ``step_rows`` (some rows of a run's step columns), the run's
    policy and rate_scale first (each one value, as pandas broadcasts it); None if a
    column's type is not known."""
    n = len(step_rows["time_s"])
    cells = []
    for value in (np.array([run.policy], dtype=object), np.array([run.rate_scale])):
        one = csv_text.column_cells(value, STEPS_FLOAT_FORMAT)
        if one is None:
            return None
        cells.append((np.broadcast_to(one[0], (n, one[0].shape[1])), np.repeat(one[1], n)))
    for c in _columns(run):
        col = csv_text.column_cells(step_rows[c], STEPS_FLOAT_FORMAT)
        if col is None:
            return None
        cells.append(col)
    return cells


def concat_requests(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The runs' requests tables as one (requests.csv); a column some runs lack is empty in
    their rows and stays integer (nullable Int64) where it is integer wherever present."""
    out = pd.concat(frames)
    for c in out.columns:
        have = [f[c] for f in frames if c in f.columns]
        if len(have) < len(frames) and all(pd.api.types.is_integer_dtype(x) for x in have):
            out[c] = out[c].astype("Int64")
    return out


def _steps_frame(runs: list[Run]) -> pd.DataFrame:
    frames = []
    for r in runs:
        cols = {"policy": r.policy, "rate_scale": r.rate_scale}
        cols.update({c: r.result.steps[c] for c in _columns(r)})
        frames.append(pd.DataFrame(cols))
    return pd.concat(frames, ignore_index=True)


def _columns(run: Run) -> list[str]:
    """A run's step columns: STEP_COLUMNS, then any its result adds (``replica``)."""
    return [*STEP_COLUMNS, *(c for c in run.result.steps if c not in STEP_COLUMNS)]


def _json_safe(x):
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ---------------------------------------------------------------------------- plots
@contextlib.contextmanager
def _drawing():
    """While drawing, the objects that exist before are frozen (:func:`gc.freeze`, undone
    after): matplotlib's imports and text parsers make many objects, and each full
    collection they set off would otherwise traverse the runs' tables too. No effect where
    something else has frozen objects."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _plots(folder: Path, runs: list[Run], cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """The PNG plots (lab/report/plots.py); returns (file name, caption) pairs."""
    return plots.plots(folder, runs, cfg)


def _timeline(folder: Path, cfg: ExperimentConfig, run: Run, events: pd.DataFrame, with_plotly):
    """A run's Gantt PNG of its chosen requests and its plotly figure (``with_plotly``);
    none for a run without events (a cluster's). Returns ([(png, caption)], [figures])."""
    if run.result.events is None:  # a cluster: replicas step apart, no events (yet)
        return [], []
    steps = pd.DataFrame(
        {k: run.result.steps[k] for k in ("time_s", "duration_s", "num_decode_tokens")}
    )
    return _timeline_pictures(folder, cfg.report, run.label, run.requests, events, steps,
                              with_plotly)  # fmt: skip


def _timeline_pictures(
    folder: Path, report_cfg, label: str, requests: pd.DataFrame, events: pd.DataFrame,
    steps: pd.DataFrame, with_plotly: bool,
) -> tuple[list[tuple[str, str]], list[dict]]:  # fmt: skip
    """:func:`_timeline` from a run's tables (events.csv rows, steps with ``time_s``,
    ``duration_s`` and ``num_decode_tokens``), as a run writes them or as read back."""
    ids = timeline.choose(requests, report_cfg)
    stories = timeline.stories_for(ids, requests, events, steps)
    if not stories:
        if report_cfg.timeline_ids or report_cfg.timeline_window_s is not None:
            log.warning("no timeline of run %s: none of its requests is among the %s "
                        "(report:)", label, _which(report_cfg))  # fmt: skip
        return [], []
    which = _which(report_cfg)
    name = f"timeline_{timeline.file_label(label)}.png"
    title = f"{label}: {which}"
    timeline.gantt_png(folder / name, stories, steps, title)
    figures = [html_report.timeline_figure(stories, steps, title)] if with_plotly else []
    return [(name, f"Timeline of {label}: {which}")], figures


def _which(rc) -> str:
    if rc.timeline_ids:
        return f"requests {', '.join(rc.timeline_ids[:8])}"
    if rc.timeline_window_s is not None:
        return f"requests in flight in {rc.timeline_window_s[0]:g}-{rc.timeline_window_s[1]:g} s"
    return f"the {rc.timeline_slowest} slowest finished requests by {rc.timeline_by.upper()}"


def _html(folder: Path, cfg, runs, report: str, figures, draw: bool = True) -> None:
    """report.html: report.md rendered, the table of every statistic, the timelines."""
    from sched_lab.report.terminal import rows, slo_text

    table_rows = rows(runs, cfg.report.metric_percentiles)  # names repeat across classes
    table = pd.DataFrame(
        [cells for _, cells in table_rows],
        index=[name for name, _ in table_rows],
        columns=[r.label for r in runs],
    )
    slo = runs[0].summary.get("slo") or {}
    caption = "Every statistic" + (f" (SLOs: {slo_text(slo)})" if slo else "")
    html_report.write_html(
        folder / "report.html",
        cfg.name,
        report,
        [(caption, table.to_html(border=0))],
        figures,
        timelines_expected=draw and any(r.result.events is not None for r in runs),
    )


def save_png(fig, folder: Path, name: str, caption: str) -> tuple[str, str]:
    fig.tight_layout()
    fig.savefig(folder / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name, caption
