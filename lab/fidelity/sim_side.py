"""The simulator side (``--sim``, CPU): every engine run of an archive replayed twice, with
the cost model calibrated from the archive alone (latency and throughput errors, policy
rankings) and with the engine's measured durations (plan match); each engine step's
duration is also predicted from its exact batch (:mod:`sched_lab.fidelity.compare`)."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

from sched_lab.core.errors import short_repr
from sched_lab.fidelity.archive import notes_path, unpack
from sched_lab.fidelity.compare import (
    missing_number,
    predicted_durations,
    rank_agreement,
    run_row,
    step_kind,
    step_noise,
)
from sched_lab.fidelity.markdown import first_pass, write_doc
from sched_lab.fidelity.plots import plots
from sched_lab.fidelity.protocol import engine_config

FIGURES = ("heldout_step_error.png", "heldout_cdfs.png")  # :func:`sched_lab.fidelity.plots.plots`


def side_files(doc: Path) -> list[Path]:
    """What ``--doc DIR/NAME.md`` writes beside the doc: DIR/NAME/heldout.csv and the plots."""
    folder = doc.parent / doc.stem
    return [folder / "heldout.csv", *(folder / name for name in FIGURES)]


def sim(archive: Path, doc: Path, seeds: int | None = None) -> dict[str, Any]:
    """Every comparison of the simulator side; writes the markdown ``doc`` (DIR/NAME.md) and
    :func:`side_files` (DIR/NAME/heldout.csv and plots); returns the numbers (``table``,
    ``steps``, ``rankings``, ``plans``). Each file is replaced only if sched-lab wrote it
    (lab/core/outputs.py). ``seeds``: simulated runs get that many seeded replicas, and
    the table the coverage of their bands (lab/fidelity/compare.py ``band_cells``).

    Raises:
        SystemExit: one line, before any replay, if ``doc`` or a side file cannot be
            written, or the archive is missing or not an engine side's."""
    from sched_lab.core.errors import UserError
    from sched_lab.core.outputs import check_output

    if doc.is_dir() or doc.suffix.lower() != ".md":
        raise SystemExit(f"error: --doc {doc}: expected a markdown file path (NAME.md)")
    try:
        for path in (doc, *side_files(doc)):
            check_output(path, "--doc")
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    src = unpack(archive)
    try:
        return _sim(archive, src, doc, seeds)
    finally:
        if src != archive:
            shutil.rmtree(src, ignore_errors=True)


def read_record(archive: Path, src: Path) -> dict[str, Any]:
    """The unpacked archive's ``engine.json``, checked (each folder holds a steps.csv and is
    named ``WINDOW_LOAD``); SystemExit naming ``archive`` otherwise."""
    if not (src / "engine.json").exists() or not (src / "profile.csv").exists():
        raise SystemExit(
            f"error: {archive}: no engine.json or profile.csv (not an engine side's archive)"
        )
    record = json.loads((src / "engine.json").read_text())
    if not isinstance(record, dict):
        raise SystemExit(f"error: {archive}: engine.json: expected a mapping")
    again = src / "engine_repeat" / "engine.json"  # a repeat made in a call of its own
    if again.is_file():
        later = json.loads(again.read_text())
        if isinstance(later, dict) and isinstance(later.get("skipped"), list):
            record["skipped"] = list(dict.fromkeys([*record.get("skipped", []),
                                                    *map(str, later["skipped"])]))  # fmt: skip
    if not record.get("folders"):
        raise SystemExit(
            f"error: {archive}: no engine runs (skipped: {', '.join(record.get('skipped', [])) or '-'})"
        )
    for key, side in (("folders", "engine"), ("calibration", "calibration")):
        names = record.get(key) or []
        if not isinstance(names, list) or not all(
            isinstance(n, str) and "/" not in n and n not in ("", ".", "..")
            and (src / side / n / "steps.csv").is_file()
            for n in names
        ):  # fmt: skip
            raise SystemExit(
                f"error: {archive}: engine.json: {key}: expected names of folders under "
                f"{side}/ that hold a steps.csv, got {short_repr(names, 60)}"
            )
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:  # a calibration run fitted twice is never held out from itself
            raise SystemExit(
                f"error: {archive}: engine.json: {key}: {twice!r} is listed twice; expected "
                "each run once"
            )
    bad = [f for f in record["folders"] if "_" not in f]
    if bad:
        raise SystemExit(
            f"error: {archive}: engine.json: folders: expected WINDOW_LOAD names, got {bad[0]!r}"
        )
    return record


@dataclass
class Comparison:
    """What the replays of an archive's engine runs collect, one entry per run (policy)."""

    rows: list[dict[str, Any]] = field(default_factory=list)  # the per-run table
    steps_err: list[Any] = field(default_factory=list)  # per-step frames: kind, err, noise, pass
    cdfs: dict[tuple, dict] = field(default_factory=dict)  # (window, load, policy) -> samples
    plan: list[dict[str, Any]] = field(default_factory=list)  # plan_match per run
    stale: dict[str, tuple] = field(default_factory=dict)  # folder -> (stale, why)
    equivalent: list[tuple] = field(default_factory=list)  # (window, load, a, b) alike


def _sim(archive: Path, src: Path, doc: Path, seeds: int | None = None) -> dict[str, Any]:
    import pandas as pd

    from sched_lab.sim.calibrated import CalibratedCostModel

    record = read_record(archive, src)
    profile = src / "profile.csv"
    calibration = [
        str(src / "calibration" / n / "steps.csv") for n in record.get("calibration") or []
    ]
    model = CalibratedCostModel(profile, tuple(calibration))
    cost_model = {"profile": str(profile), **({"replay_steps": calibration} if calibration else {})}
    c = Comparison()
    for folder in record["folders"]:
        _compare_folder(src, folder, model, cost_model, c, archive, seeds,
                        record.get("rate_scales") or {})  # fmt: skip
    table = pd.DataFrame(c.rows)
    steps = pd.concat(c.steps_err, ignore_index=True)
    rankings = rank_agreement(table, frozenset(c.equivalent))
    plans = pd.DataFrame(c.plan)
    protocol = (
        _member(archive, src, "protocol.yaml", yaml.safe_load)
        if (src / "protocol.yaml").exists()
        else {}
    )
    text = write_doc(table, steps, rankings, plans, record, c.stale, profile, archive, protocol,
                     c.equivalent, figures=doc.stem,
                     noise=model.noise if seeds is not None else None)  # fmt: skip
    notes = notes_path(archive)
    if notes.exists():
        text += "\n" + notes.read_text()
    _write(doc, text, table, first_pass(steps), c.cdfs)
    print(f"wrote {doc} (and its table and plots in {side_files(doc)[0].parent})")
    print("\nfor docs/simulator.md's fidelity paragraph:\n" + text.split("\n\n")[1], flush=True)
    return {"table": table, "steps": steps, "rankings": rankings, "plans": plans}


def _write(doc: Path, text: str, table, steps, cdfs) -> None:
    """The doc, its table and its plots (:func:`side_files`), each through
    :func:`sched_lab.core.outputs.write_output`; SystemExit (one line) if one cannot be written."""
    from sched_lab.core.errors import UserError
    from sched_lab.core.outputs import write_output

    table_path, *figures = side_files(doc)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            plots(steps, cdfs, Path(tmp))
            for path in figures:
                write_output(path, (Path(tmp) / path.name).read_bytes())
        write_output(table_path, lambda p: table.to_csv(p, index=False, float_format="%.6g"))
        write_output(doc, text)
    except UserError as e:
        raise SystemExit(f"error: --doc {e}") from None


def _member(archive: Path, src: Path, name: str, parse) -> dict[str, Any]:
    """The mapping in member ``name`` of the unpacked archive ``src``; SystemExit (one line
    naming ``archive`` and the member) if it does not parse or is not a mapping."""
    try:
        value = parse((src / name).read_text())
    except (ValueError, yaml.YAMLError) as e:
        raise SystemExit(
            f"error: {archive}: {name}: cannot be read ({e})".splitlines()[0]
        ) from None
    if not isinstance(value, dict):
        raise SystemExit(f"error: {archive}: {name}: expected a mapping, got {short_repr(value)}")
    return value


def _steps_member(archive: Path, src: Path, name: str):
    """The steps.csv member ``name`` of the unpacked archive ``src`` as a frame; SystemExit
    (one line naming ``archive`` and the member) if it does not parse or lacks a column the
    step table reads (an engine run's steps.csv, :data:`STEPS_COLUMNS` and ``policy``)."""
    import pandas as pd

    from sched_lab.sim.calibrated import STEPS_COLUMNS

    try:
        st = pd.read_csv(src / name)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(
            f"error: {archive}: {name}: cannot be read ({short_repr(why, 120)})"
        ) from None
    missing = [c for c in ("policy", "time_s", *STEPS_COLUMNS) if c not in st.columns]
    if missing:
        raise SystemExit(
            f"error: {archive}: {name}: missing column(s) {', '.join(missing)} (expected an "
            "engine run's steps.csv)"
        )
    return st


def _compare_folder(
    src: Path,
    folder: str,
    model,
    cost_model: dict,
    c: Comparison,
    archive: Path,
    seeds: int | None = None,
    scales: dict[str, Any] | None = None,
) -> None:
    """Replay one engine folder (a window at a load or a rate scale, every policy),
    calibrated and with the engine's durations; add its comparisons to ``c``. A rate-scale
    folder (``scales``: engine.json's ``rate_scales``) is tabled at its offered load (rate
    scale x own rate / capacity, to 2 decimals) with its ``rate_scale``."""
    import pandas as pd

    from sched_lab.run.experiment import run_experiment
    from sched_lab.sim.calibrated import read_fingerprint, staleness

    real_dir, again_dir = src / "engine" / folder, src / "engine_repeat" / folder
    raw = yaml.safe_load((real_dir / "config.yaml").read_text())
    real = _member(archive, src, f"engine/{folder}/summary.json", json.loads)
    again = (
        _member(archive, src, f"engine_repeat/{folder}/summary.json", json.loads)
        if (again_dir / "summary.json").exists()
        else None
    )
    sim_raw = {**raw, "backend": "sim", "cost_model": cost_model}
    sims = run_experiment(engine_config(sim_raw), progress=False)  # the point prediction
    banded = (  # the bands: seeded replicas of the same runs
        run_experiment(engine_config({**sim_raw, "seeds": seeds}), progress=False)
        if seeds is not None
        else [None] * len(sims)
    )
    rep_raw = {**raw, "backend": "sim",
               "cost_model": {"durations_from": str(real_dir / "steps.csv")}}  # fmt: skip
    replays = run_experiment(engine_config(rep_raw), progress=False)
    real_req = pd.read_csv(real_dir / "requests.csv")
    real_steps = _steps_member(archive, src, f"engine/{folder}/steps.csv")
    again_steps = (  # the repeat pass's steps, predicted too (the step table's repeat rows)
        _steps_member(archive, src, f"engine_repeat/{folder}/steps.csv")
        if (again_dir / "steps.csv").is_file()
        else None
    )
    slice_name, load = folder.rsplit("_", 1)
    scale = None
    if load.startswith("x"):
        entry = (scales or {}).get(folder)
        if not isinstance(entry, dict) or not isinstance(entry.get("offered_load"), (int, float)):
            raise SystemExit(
                f"error: {archive}: engine.json: rate_scales: expected an offered_load for "
                f"{folder!r}, got {short_repr(entry)}"
            )
        scale, load = entry.get("rate_scale"), round(entry["offered_load"], 2)
    async_ = bool((raw.get("scheduler") or {}).get("async_scheduling"))
    for s, rp, b in zip(sims, replays, banded, strict=True):
        r = real.get(s.label)
        if not isinstance(r, dict):
            raise SystemExit(
                f"error: {archive}: engine/{folder}/summary.json: expected a mapping under "
                f"{s.label!r}, got {short_repr(r)}"
            )
        for part, summary in (("engine", r), ("engine_repeat", (again or {}).get(s.label))):
            key = missing_number(summary) if isinstance(summary, dict) else None
            if key is not None:
                raise SystemExit(
                    f"error: {archive}: {part}/{folder}/summary.json: {s.label}: {key}: "
                    f"expected a number, got {short_repr(summary.get(key))}"
                )
        fp = (r.get("cost_model") or {}).get("fingerprint")
        profile = src / "profile.csv"
        c.stale[folder] = staleness(read_fingerprint(profile), fp) if fp else (None, "")
        row = run_row(slice_name, float(load), s, r, again, b.summary if b else None)
        if scale is not None:
            row["rate_scale"] = scale
        pm = rp.summary["plan_match"]
        c.plan.append({"run": f"{folder} {s.label}", **pm})
        row["plans_identical"] = pm["fraction_identical"]
        c.rows.append(row)
        for pass_, frame in (("first", real_steps), ("repeat", again_steps)):
            if frame is not None:
                c.steps_err.append(steps_error(model, frame[frame.policy == s.label],
                                               async_, float(load) > 1.0, pass_))  # fmt: skip
        rq = real_req[real_req.policy == s.label]
        c.cdfs[(slice_name, float(load), s.label)] = {
            m: (rq[m].dropna().to_numpy(), s.requests[m].dropna().to_numpy())
            for m in ("ttft_s", "e2e_s")
        }
    labels = [x.label for x in sims]
    c.equivalent += [(slice_name, float(load), a, b)
                     for a, b in combinations(labels, 2)
                     if plans_alike(raw, real_steps, a, b)]  # fmt: skip


def steps_error(model, st, async_: bool, saturated: bool, pass_: str = "first"):
    """One run's per-step frame (one policy's steps.csv rows ``st``): each step's ``kind``,
    relative ``err`` of the duration ``model`` predicts from its batch, same-shape engine
    ``noise``, ``saturated`` and the engine ``pass`` (``first`` or ``repeat``) it came from."""
    import pandas as pd

    pred = predicted_durations(model, st, async_)
    return pd.DataFrame(
        {
            "kind": step_kind(st),
            "err": (pred - st.duration_s) / st.duration_s,
            "noise": step_noise(st),
            "saturated": saturated,
            "pass": pass_,
        }
    )


def plan_alike_replay(raw: dict, real_steps, a: str, b: str):
    """plan_match of policy ``b`` replayed with policy ``a``'s measured step durations."""
    import logging

    from sched_lab.run.experiment import run_experiment

    quiet = logging.getLogger("sched_lab.run.experiment")
    level, quiet.level = quiet.level, logging.CRITICAL  # b running out of a's steps is news
    try:  # to no one: it only means the two do not plan alike
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "steps.csv"
            real_steps[real_steps.policy == a].assign(policy=b).to_csv(path, index=False)
            cross = {**raw, "backend": "sim", "cost_model": {"durations_from": str(path)},
                     "policies": [p for p in raw["policies"] if _label(p) == b]}  # fmt: skip
            runs = run_experiment(engine_config(cross), progress=False)
    finally:
        quiet.level = level
    return runs[0].summary["plan_match"]


def plans_alike(raw: dict, real_steps, a: str, b: str) -> bool:
    """Whether ``b`` fed ``a``'s engine step durations makes ``a``'s plan on every step."""
    from sched_lab.core.errors import UserError

    try:
        pm = plan_alike_replay(raw, real_steps, a, b)
    except UserError:  # b asked for more steps than a ran: not alike
        return False
    return pm["steps_matched"] == pm["steps_recorded"] == pm["steps_simulated"]


def _label(p) -> str:
    return p if isinstance(p, str) else p.get("label") or p["name"]
