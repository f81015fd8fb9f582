"""The results folder: config.yaml, requests.csv, steps.csv, summary.json, report.md + PNGs,
events.csv (what the scheduler did to each request: lab/report/timeline.py), one vLLM-format result
JSON per run (lab/results/vllm_result.py), report.html (lab/report/html.py).

The folder is written under a temporary name next to its destination and renamed into
place at the end, so a crashed or interrupted run never leaves a folder that looks
complete. Its manifest (``.sched-lab-manifest.json``) names the files the lab wrote; a rerun
replaces a folder whole only when it holds nothing else.
"""

from __future__ import annotations

import html
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from lab import __version__
from lab.config import ExperimentConfig
from lab.core.errors import UserError
from lab.report import html as html_report
from lab.report import plots, timeline
from lab.report.progress import Phase
from lab.results import fairness, spec_metrics, vllm_result
from lab.run.experiment import Run
from lab.sim.records import STEP_COLUMNS

MANIFEST = ".sched-lab-manifest.json"  # the names of the files the lab wrote in a folder
FORMATS = ("csv", "parquet")  # of requests and steps
_TEMP_SUFFIX_BYTES = 14  # ".{name}.XXXXXXXX" then ".old": what a temporary name adds


class ResultsNotPlaced(Exception):
    """The results were written but could not be renamed into place; the message says where
    they are."""


def write_results(
    out_dir: Path,
    cfg: ExperimentConfig,
    runs: list[Run],
    decode: Callable[[list[int]], str] | None = None,
    *,
    partial: str | None = None,
    fmt: str = "csv",
    bars: bool = True,
) -> Path:
    """Write every file of the run folder ``out_dir`` atomically; returns ``out_dir``.

    The files go into a temporary folder next to ``out_dir``, with a manifest
    (:data:`MANIFEST`) naming them, which is then renamed into place; an earlier results
    folder there is replaced only if it holds nothing but the files its manifest names.
    Engine runs also get ``tokens.jsonl``: the generated token ids of every request (and
    their text when ``decode`` is given).

    Args:
        partial: why only some of the experiment's runs are here (e.g. interrupted); said
            in report.md and in every run's summary (key ``partial``).
        fmt: ``csv`` or ``parquet`` (needs pyarrow) for requests and steps.
        bars: False: no progress bar while writing (a sweep's workers).

    Raises:
        UserError: ``out_dir`` cannot become a results folder (nothing is written).
        ResultsNotPlaced: the final rename failed; the results are kept in another folder,
            named in the message.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    out_dir = check_out_dir(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot write the results ({e})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; results are for sharing
    phase = Phase("writing results", 5, "file", bars).start()  # 5 advances below
    try:
        _write_files(tmp, cfg, runs, decode, partial, fmt, phase)
    except OSError as e:
        phase.close(ok=False)
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--out {out_dir}: cannot write the results ({e})") from None
    except BaseException:  # interrupted too: no temporary folder left behind
        phase.close(ok=False)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _put_in_place(tmp, out_dir)
    finally:
        phase.close()
    return out_dir


def _write_files(
    tmp: Path,
    cfg: ExperimentConfig,
    runs: list[Run],
    decode,
    partial: str | None,
    fmt: str,
    phase: Phase,
) -> None:
    (tmp / "config.yaml").write_text(config_yaml(cfg, runs))
    phase.advance()
    requests = concat_requests([r.requests for r in runs])
    if fmt == "parquet":
        requests.to_parquet(tmp / "requests.parquet", index=False)
        _steps_frame(runs).to_parquet(tmp / "steps.parquet", index=False)
    else:
        requests.to_csv(tmp / "requests.csv", index=False)
        _write_steps_csv(tmp / "steps.csv", runs)
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
    for r in runs:  # vLLM's `--save-result` file of each run ("date" empty: reproducible)
        vllm = r.vllm
        name = vllm_result.result_filename(r.label, vllm["request_rate"], vllm["model_id"])
        (tmp / name).write_text(json.dumps(_json_safe(vllm), indent=2))
    plots = _plots(tmp, runs, cfg) + fairness.plots(tmp, runs, _save)  # per class / tenant
    stories, figures = _timelines(tmp, cfg, runs, fmt)
    phase.advance()
    report = _markdown(cfg, runs, plots + stories)
    if partial:  # right under the title
        title, _, rest = report.partition("\n")
        report = f"{title}\n\n**Partial results**: {partial}.\n{rest}"
    (tmp / "report.md").write_text(report)
    _html(tmp, cfg, runs, plots + stories, figures, partial)
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / MANIFEST).write_text(
        json.dumps({"written_by": f"sched-lab {__version__}", "files": files}, indent=2) + "\n"
    )


def _put_in_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out_dir``, replacing an earlier results folder
    there (checked again: it may have changed during the runs)."""
    try:
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
    """Make sure ``out_dir`` can become a results folder, before any run: a folder can be
    made where it goes, its temporary name fits, and ``out_dir`` is absent, empty, or an
    earlier results folder that can be replaced (it holds only the files of its manifest,
    and its entries can be deleted). Creates nothing.

    Returns:
        ``out_dir`` made absolute, with symlinks and ``..`` resolved (a link to a results
        folder updates the folder it points to).

    Raises:
        UserError: one line naming ``out_dir`` and what is in the way.
    """
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
    """Whether ``folder`` is what write_results makes: a manifest, and no entry beyond the
    files it names (so a hand-written note or a kept trace file is never replaced)."""
    return _foreign_entries(folder) == []


def _foreign_entries(folder: Path) -> list[str] | None:
    """The entries of ``folder`` its manifest does not name as files, or as ``folders``
    that are results folders themselves (a sweep's points), sorted; None without a
    readable manifest."""
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


def _write_steps_csv(path: Path, runs: list[Run], rows: int = 1 << 20) -> None:
    """steps.csv run by run, ``rows`` at a time: the same text as one concatenated frame
    (:func:`_steps_frame`), without a copy of every run's steps in memory at once."""
    with path.open("w") as f:
        header = True
        for r in runs:
            n = len(r.result.steps["time_s"])
            for start in range(0, n, rows):
                cols = {"policy": r.policy, "rate_scale": r.rate_scale}
                cols.update({c: r.result.steps[c][start : start + rows] for c in _columns(r)})
                pd.DataFrame(cols).to_csv(f, index=False, header=header, float_format="%.9g")
                header = False
        if header:  # no run has a step: the header alone, as the concatenated frame writes
            extra = _columns(runs[0])[len(STEP_COLUMNS) :] if runs else []
            f.write(",".join(["policy", "rate_scale", *STEP_COLUMNS, *extra]) + "\n")


def concat_requests(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """The runs' requests tables as one (requests.csv). A column some runs lack (the
    speculative counts of an experiment that turns speculation off for a policy) is empty
    in their rows; one that is integer wherever present stays integer (pandas' nullable
    Int64), not float (12, not 12.0)."""
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
    """A run's step columns: STEP_COLUMNS, then any its result adds (a cluster's
    ``replica``)."""
    return [*STEP_COLUMNS, *(c for c in run.result.steps if c not in STEP_COLUMNS)]


def _json_safe(x):
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ---------------------------------------------------------------------------- plots
def _plots(folder: Path, runs: list[Run], cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """The PNG plots (lab/report/plots.py); returns (file name, caption) pairs."""
    return plots.plots(folder, runs, cfg)


def _timelines(folder: Path, cfg: ExperimentConfig, runs: list[Run], fmt: str):
    """events.csv (or .parquet) of every run, and per run a Gantt PNG of its chosen requests
    (``report:`` keys) and the same as a plotly figure for report.html (None without
    plotly). Returns ([(png, caption)], [figures])."""
    frames, pngs, figures = [], [], []
    with_plotly = html_report.plotly_available()
    for r in runs:
        events = timeline.events_frame(r)
        frames.append(events)
        steps = pd.DataFrame(
            {k: r.result.steps[k] for k in ("time_s", "duration_s", "num_decode_tokens")}
        )
        if r.result.events is None:  # a cluster: replicas step apart, no events (yet)
            continue
        ids = timeline.choose(r.requests, cfg.report)
        stories = timeline.stories_for(ids, r.requests, events, steps)
        if not stories:
            continue
        which = _which(cfg.report)
        name = f"timeline_{_safe(r.label)}.png"
        title = f"{r.label}: {which}"
        timeline.gantt_png(folder / name, stories, steps, title)
        pngs.append((name, f"Timeline of {r.label}: {which}"))
        if with_plotly:
            figures.append(html_report.timeline_figure(stories, steps, title))
    events = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if fmt == "parquet":
        events.to_parquet(folder / "events.parquet", index=False)
    else:
        events.to_csv(folder / "events.csv", index=False)
    return pngs, figures


def _which(rc) -> str:
    if rc.timeline_ids:
        return f"requests {', '.join(rc.timeline_ids[:8])}"
    if rc.timeline_window_s is not None:
        return f"requests in flight in {rc.timeline_window_s[0]:g}-{rc.timeline_window_s[1]:g} s"
    return f"the {rc.timeline_slowest} slowest finished requests by {rc.timeline_by.upper()}"


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def _html(folder: Path, cfg, runs, pictures, figures, partial) -> None:
    from lab.report.terminal import rows, slo_text

    intro = html.escape(
        f"Backend {cfg.backend}; {_model_line(cfg)}; "
        f"{runs[0].summary['num_gpu_blocks']} GPU KV blocks of {cfg.kv_cache.block_size} "
        "tokens." + (f" Partial results: {partial}." if partial else "")
    )
    table = pd.DataFrame(
        dict(rows(runs, cfg.report.metric_percentiles)), index=[r.label for r in runs]
    ).T
    slo = runs[0].summary.get("slo") or {}
    caption = "Summary" + (f" (SLOs: {slo_text(slo)})" if slo else "")
    tables = [(caption, table.to_html(border=0))]
    html_report.write_html(
        folder / "report.html",
        cfg.name,
        intro,
        tables,
        [(folder / name, caption) for name, caption in pictures],
        figures,
    )


def _save(fig, folder: Path, name: str, caption: str) -> tuple[str, str]:
    fig.tight_layout()
    fig.savefig(folder / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name, caption


# ---------------------------------------------------------------------------- markdown
def summary_table(runs: list[Run]) -> str:
    """A markdown table of the headline numbers of every run."""
    head = (
        "| run | finished | rejected | aborted | req/s | out tok/s | TTFT p50 / p99 (s) "
        "| TPOT p50 / p99 (ms) | ITL p99 / p99.9 / max (ms) | E2E p50 / p99 (s) "
        "| preempt (rec / swap) | KV mean % |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in runs:
        s = r.summary
        lines.append(
            f"| {r.label} | {s['finished']} | {s['rejected']} | {s['aborted']} "
            f"| {s['request_throughput']:.2f} | {s['output_throughput']:.0f} "
            f"| {s['ttft_s']['p50']:.3f} / {s['ttft_s']['p99']:.3f} "
            f"| {s['tpot_s']['p50'] * 1e3:.1f} / {s['tpot_s']['p99'] * 1e3:.1f} "
            f"| {s['itl_s']['p99'] * 1e3:.1f} / {_ms(r.vllm, 'p99.9_itl_ms')} "
            f"/ {_ms(r.vllm, 'max_itl_ms')} "
            f"| {s['e2e_s']['p50']:.2f} / {s['e2e_s']['p99']:.2f} "
            f"| {s['preemptions']['recompute']} / {s['preemptions']['swap']} "
            f"| {s['kv_used_fraction']['mean'] * 100:.0f} |"
        )
    return "\n".join(lines)


def _ms(vllm: dict, key: str) -> str:
    v = vllm.get(key)
    return "-" if v is None else f"{v:.1f}"


def _trace_options(trace: Mapping[str, Any]) -> str:
    keys = ("limit", "start_s", "end_s", "rate_scale", "num_requests")
    opts = ", ".join(f"{k} {trace[k]}" for k in keys if trace.get(k) is not None)
    return f" ({opts})" if opts else ""


def _model_line(cfg: ExperimentConfig) -> str:
    if cfg.backend == "engine":
        e = cfg.engine
        return (
            f"real engine: model `{e.model_path}` on `{e.device}` ({e.dtype}, "
            f"{e.attention_backend} attention), measured step times"
        )
    line = f"simulated `{cfg.model}` on `{cfg.hardware}` (cost model step times)"
    c = cfg.cluster
    if c is None:
        return line
    if c.pool is not None:
        return f"{line}, {c.pool.replicas} replicas behind router `{c.pool.router}`"
    return (
        f"{line}, {c.prefill.replicas} prefill replicas (router `{c.prefill.router}`) and "
        f"{c.decode.replicas} decode replicas (router `{c.decode.router}`), KV over "
        f"`{c.link.name}` ({c.link.bandwidth * 8 / 1e9:g} Gb/s)"
    )


def config_yaml(cfg: ExperimentConfig, runs: list[Run]) -> str:
    """config.yaml: the resolved config, with ``trace_file`` (path, sha256, rows) of the
    trace the runs replayed, so that replaying this file checks the trace is the same."""
    d = cfg.to_dict()
    info = runs[0].summary.get("trace") if runs else None
    if info is not None and info.get("path") is not None:
        d["trace_file"] = dict(info)
    return yaml.safe_dump(d, sort_keys=False)


def _prefix_cache_lines(runs: list[Run]) -> list[str]:
    """Whether runs cached prefixes; with caching on, a table of its numbers."""
    if not any(r.summary.get("prefix_caching") for r in runs):
        return ["Prefix caching: off.", ""]
    out = [
        "Prefix caching (`kv_cache.enable_prefix_caching`; hit rate = prompt tokens found "
        "cached at first admission / prompt tokens admitted):",
        "",
        "| run | caching | hit rate | cached tokens | found again after preemption "
        "| blocks evicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary
        on = s.get("prefix_caching")
        out.append(
            f"| {r.label} | {'on' if on else 'off'} | "
            + (
                f"{s['prefix_cache_hit_rate']:.1%} | {s['prefix_cache_cached_tokens']:,} "
                f"| {s['prefix_cache_resumed_tokens']:,} | {s['prefix_cache_evicted_blocks']:,} |"
                if on
                else "- | - | - | - |"
            )
        )
    return [*out, ""]


def _cost_model_lines(cm: dict | None) -> list[str]:
    """report.md's lines on what made the step times (summary key ``cost_model``): the
    model, its profile and the engine fingerprint; a stale profile and the analytic model
    in bold."""
    if not cm:
        return []
    fp = cm.get("fingerprint")
    fp_text = (
        "engine fingerprint " + ", ".join(f"{k} `{v}`" for k, v in sorted(fp.items()))
        if fp
        else "no engine fingerprint"
    )
    if cm["kind"] == "measured":
        return [f"Step times measured on the engine; {fp_text}.", ""]
    lines = [f"Cost model: {cm['kind']}"]
    if cm.get("profile"):
        lines[0] += f", from `{cm['profile']}`; {fp_text}"
    lines[0] += "."
    if cm["kind"] == "analytic":
        v = cm.get("values")
        used = (
            f" (flops_efficiency {v['flops_efficiency']:g}, bandwidth_efficiency "
            f"{v['bandwidth_efficiency']:g}, step_overhead_s {v['step_overhead_s']:g})"
            if v
            else ""
        )
        lines += ["", f"**Analytic cost model**: {cm['why']}; {_efficiency_text(cm)}{used}."]
    elif cm.get("stale"):
        lines += ["", f"**Stale profile**: {cm['why']}."]
    return [*lines, ""]


def _efficiency_text(cm: dict) -> str:
    """Where an analytic run's efficiencies came from and their known error (summary keys
    of lab.run.experiment.analytic_source; absent in results made before them)."""
    src, own = cm.get("efficiencies"), cm.get("efficiencies_from_yaml") or []
    if src is None:
        return "its efficiencies' source was not recorded"
    if src == "yaml":
        return "its efficiencies were set in the YAML: their error is unknown"
    text = (
        "its efficiencies are datasheet guesses (no profile of this hardware): their error "
        "is unknown"
        if src == "guess"
        else "its efficiencies are measured: fitted to "
        + ", ".join(f"`{p}`" for p in cm["efficiency_profiles"])
    )
    if own:
        return text + f", except {', '.join(own)} (set in the YAML: error unknown)"
    if src == "profile":
        if len(cm["efficiency_profiles"]) > 1:
            text += " (a joint fit: this model has no profile of its own)"
        text += f", median step-time error {cm['efficiency_error']:.1%} on the profile rows"
    return text


def _scheduling_lines(runs: list[Run]) -> list[str]:
    """report.md's line on the scheduling mode of the runs (summary key
    ``async_scheduling``, false when missing), and a warning when async runs were priced
    by a cost model without host time (summary key ``cost_model.host_note``)."""
    on = [r.label for r in runs if r.summary.get("async_scheduling")]
    off = [r.label for r in runs if not r.summary.get("async_scheduling")]
    what = (
        "asynchronous (vLLM V1's async scheduler: step N+1 is planned while step N runs; a "
        "request's last step is followed by one wasted slot, its blocks freed a step late)"
    )
    if not on:
        lines = ["Scheduling: synchronous (each step is planned after the previous one ended)."]
    elif not off:
        lines = [f"Scheduling: {what}."]
    else:
        lines = [f"Scheduling: {what} for {', '.join(on)}; synchronous for {', '.join(off)}."]
    note = (runs[0].summary.get("cost_model") or {}).get("host_note")
    if on and note:
        lines += ["", f"**No host time**: {note}."]
    return [*lines, ""]


def _markdown(cfg: ExperimentConfig, runs: list[Run], plots: list[tuple[str, str]]) -> str:
    from lab.report.terminal import slo_text

    trace = cfg.trace.spec
    what = f"trace `{trace.get('format')}` {trace.get('path', '')}{_trace_options(trace)}"
    if cfg.trace.classes:
        what = "workload classes " + ", ".join(
            f"`{c['name']}` ({c['format']}{_trace_options(c)})" for c in cfg.trace.classes
        )
    lines = [
        f"# {cfg.name}",
        "",
        f"Backend `{cfg.backend}`; {what}; {_model_line(cfg)}; "
        f"{runs[0].summary['num_gpu_blocks']} GPU KV blocks of {cfg.kv_cache.block_size} tokens"
        f"{' per replica' if cfg.cluster is not None else ''}.",
        "",
        *_cost_model_lines(runs[0].summary.get("cost_model")),
        *_scheduling_lines(runs),
        summary_table(runs),
        "",
    ]
    lines += _prefix_cache_lines(runs)
    lines += spec_metrics.markdown(runs)  # speculative runs only
    wasted = [
        f"{r.label} {r.summary['num_wasted_tokens']}"
        for r in runs
        if r.summary.get("async_scheduling")
    ]
    if wasted:  # async scheduling: the slot after each request's last token
        lines += ["Wasted decode slots (async scheduling): " + ", ".join(wasted) + ".", ""]
    dropped = runs[0].summary.get("dropped", 0)  # the same trace rows in every run
    if dropped:
        reasons = runs[0].requests.loc[runs[0].requests["status"] == "dropped", "reason"]
        why = "; ".join(sorted({x.removeprefix("not replayed: ") for x in reasons}))
        lines += [
            f"Trace rows not replayed: {dropped} (status `dropped` in requests.csv): {why}.",
            "",
        ]
    for r in runs:
        if r.result.failure:
            lines += [
                f"**Run {r.label} stopped early**: {r.result.failure}. Its unfinished "
                "requests are listed as aborted with this reason.",
                "",
            ]
    slo = runs[0].summary["slo"]
    if slo:
        lines += [
            "SLOs: " + slo_text(slo),
            "",
            "| run | goodput (req/s) | SLO attainment |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r.label} | {r.summary['goodput']:.2f} | {r.summary['slo_attainment']:.1%} |"
            for r in runs
        ]
        lines.append("")
    lines += fairness.markdown(runs)  # workload classes only
    for name, caption in plots:
        lines += [f"## {caption}", "", f"![{caption}]({name})", ""]
    tokens = (
        "`tokens.jsonl` (generated token ids, and text), "
        if any(r.output_token_ids for run in runs for r in run.result.requests)
        else ""
    )
    lines += [
        "Files: `requests.csv` (one row per trace request per run), `steps.csv` "
        "(one row per engine step), `summary.json` (aggregates per run), "
        f"{tokens}`timing.json` (wall time of each replay), `config.yaml` (the resolved "
        "config), `events.csv` (what the scheduler did to each request and why it waited), "
        "one `{run}-{rate}qps-{model}.json` per run (the format of `vllm bench serve "
        "--save-result`), `report.html` (this report with interactive timelines).",
        "",
        "A request's life: `sched-lab explain RESULTS --run "
        f"{runs[0].label} --request ID`; a timeline of chosen requests: `sched-lab timeline "
        "RESULTS --run RUN --requests ID,ID`.",
        "",
    ]
    return "\n".join(lines)
