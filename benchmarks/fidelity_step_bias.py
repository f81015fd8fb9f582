"""The figures docs/fidelity/heldout_engine_notes.md quotes, from the archives in docs/fidelity/.

    python benchmarks/fidelity_step_bias.py

1. The development windows (dev_engine.tar.gz): the calibrated model fitted to the grid
   alone, and to the grid plus one window's engine steps, predicting the other window's
   (median signed step error by kind); and the cost of a sequence joining the decode batch,
   a coefficient fitted beside the model's features. A joining sequence is approximated
   from steps.csv as one of the previous step's prompt chunks (fcfs: whole prompts).
2. The first held-out run (heldout_run1_engine.tar.gz, whose profile had no row above
   8,192 tokens), which the eager rows were chosen from: the signed error of its prompt
   steps above 8,192 tokens. Then the held-out archive (heldout_engine.tar.gz), whose
   profile has them: the same steps with the eager slope as fitted and left out; the grid
   alone against the grid plus the calibration replays (the fit fidelity --sim uses), by
   step kind; the decode steps' median signed error by batch size.
3. docs/fidelity/heldout.csv: how far each missed cell is above its limit.
4. The held-out archive again, then the first run's: what a count of joining decodes (approximated as in 1),
   fitted beside the features on the grid plus the calibration replays, does to the
   held-out step error; the decode steps' signed error by the time since the engine was
   last idle (a gap of > 1 ms between one step's end and the next step's start); and the
   spread of batch-1 decode steps within each run (10th-90th percentile around the median).
5. Drift within a run (both archives): the median of the decode steps of 1-2 sequences in
   each fifth of a run (by start time), for the BurstGPT 0.5x runs of both passes, where
   fcfs and sjf plan alike. Also each archive's count of calibration steps.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.fidelity import error_target as _target  # noqa: E402
from sched_lab.fidelity import unpack as _unpack  # noqa: E402
from sched_lab.sim.calibrated import (  # noqa: E402
    EAGER_KNOT,
    REPLAY_KIND,
    CalibratedCostModel,
    design,
    fit,
    read_profile,
    read_replay_steps,
    steps_as_profile,
)

DOCS = ROOT / "docs" / "fidelity"
_UNPACKED: dict[Path, Path] = {}


def unpack(archive: Path) -> Path:
    """sched_lab.fidelity.unpack, once per archive; the folders are removed at exit."""
    if archive not in _UNPACKED:
        _UNPACKED[archive] = _unpack(archive)
    return _UNPACKED[archive]


@atexit.register
def _clean() -> None:
    for folder in _UNPACKED.values():
        shutil.rmtree(folder, ignore_errors=True)


def engine_steps(src: Path) -> pd.DataFrame:
    """Every engine run's steps.csv of an unpacked archive, in step order, with its run."""
    frames = []
    for f in sorted((src / "engine").glob("*/steps.csv")):
        d = pd.read_csv(f)
        d["run"] = f.parent.name
        frames.append(d)
    return pd.concat(frames, ignore_index=True)


def kinds(st: pd.DataFrame) -> np.ndarray:
    return np.where(st.num_prefills == 0, "decode",
                    np.where(st.num_decode_tokens == 0, "prefill", "mixed"))  # fmt: skip


def signed(pred: np.ndarray, st: pd.DataFrame, kind: np.ndarray) -> str:
    e = (pred - st.duration_s.to_numpy()) / st.duration_s.to_numpy()
    return ", ".join(f"{k} {np.median(e[kind == k]) * 100:+.1f}%"
                     for k in ("decode", "prefill", "mixed"))  # fmt: skip


def joins(st: pd.DataFrame) -> np.ndarray:
    """Per step: decodes that joined the batch since the previous step (approximated by the
    previous step's prompt chunks), 0 for steps with prompt tokens."""
    out = np.zeros(len(st))
    for _, g in st.groupby(["run", "policy"], sort=False):
        prev = g.num_prefills.shift(1).fillna(0).to_numpy()
        j = np.minimum(prev, g.num_decode_tokens.to_numpy())
        out[g.index.to_numpy()] = np.where(g.num_prefills.to_numpy() == 0, j, 0)
    return out


def calibration_steps(src: Path) -> tuple[str, ...]:
    return tuple(sorted(str(p) for p in (src / "calibration").glob("*/steps.csv")))


def idle_age(st: pd.DataFrame, gap_s: float = 1e-3) -> np.ndarray:
    """Per step: seconds from the start of the run's first step after its latest idle gap
    (> ``gap_s`` between a step's end and the next one's start) to this step's start."""
    out = np.zeros(len(st))
    for _, g in st.groupby(["run", "policy"], sort=False):
        t = g.time_s.to_numpy()
        gap = t - np.r_[-np.inf, t[:-1] + g.duration_s.to_numpy()[:-1]]
        start = np.maximum.accumulate(np.where(gap > gap_s, t, -np.inf))
        out[g.index.to_numpy()] = t - start
    return out


def joins_and_idle(archive: str) -> None:
    print(f"{archive}:")
    src = unpack(DOCS / archive)
    grid = read_profile(src / "profile.csv")
    cal = pd.concat([pd.read_csv(p).assign(run=Path(p).parent.name)
                     for p in calibration_steps(src)], ignore_index=True)  # fmt: skip
    st = engine_steps(src)
    rows = pd.concat([grid, steps_as_profile(cal)], ignore_index=True)
    y, xe = st.duration_s.to_numpy(), design(steps_as_profile(st))
    e_fitted = (xe @ fit(rows) - y) / y  # the model fidelity --sim fits
    c = fit(rows, extra=np.r_[np.zeros(len(grid)), joins(cal)])
    e_joins = (xe @ c[:-1] + joins(st) * c[-1] - y) / y
    for label, e in (("as fitted", e_fitted),
                     (f"with a joining count ({c[-1] * 1e6:.0f} us each)", e_joins)):  # fmt: skip
        print(f"held-out step error {label}: median {np.median(abs(e)) * 100:.2f}%, "
              f"P90 {np.percentile(abs(e), 90) * 100:.2f}%")  # fmt: skip
    d = kinds(st) == "decode"
    age = pd.cut(idle_age(st)[d], [-1, 0.005, 0.02, 0.1, 0.5, 2, 1e9])
    table = pd.Series(e_fitted[d]).groupby(age, observed=True).agg(["size", "median"])
    print("held-out decode steps, median signed error by time since the engine was idle:")
    for b, r in table.iterrows():
        print(f"  {b}: {int(r['size']):6d} steps, {r['median'] * 100:+.1f}%")
    one = st[d & (st.num_decode_tokens == 1).to_numpy()]
    one = one.assign(band=one.decode_context_tokens // 64)  # 64 positions: one decode tile
    med = one.groupby(["run", "band"]).duration_s.transform("median")
    r = (one.duration_s / med - 1).to_numpy() * 100
    print(f"batch-1 decode steps against the median of their run and 64-position context "
          f"band: 10th / 90th percentile {np.percentile(r, 10):+.1f}% / "
          f"{np.percentile(r, 90):+.1f}% ({len(r)} steps)")  # fmt: skip


def development() -> None:
    src = unpack(DOCS / "dev_engine.tar.gz")
    grid = read_profile(src / "profile.csv")
    st = engine_steps(src)
    rows, kind, joined = steps_as_profile(st), kinds(st), joins(st)
    print("development windows, median signed step error by kind:")
    print(f"  grid alone -> all: {signed(design(rows) @ fit(grid), st, kind)}")
    for train, test in (("conv", "code"), ("code", "conv")):
        tr = st.run.str.startswith(train).to_numpy()
        coef = fit(pd.concat([grid, rows[tr]], ignore_index=True))
        te = ~tr
        print(f"  grid + {train} -> {test}: "
              f"{signed(design(rows[te]) @ coef, st[te], kind[te])}")  # fmt: skip
        c = fit(pd.concat([grid, rows[tr]], ignore_index=True),
                extra=np.r_[np.zeros(len(grid)), joined[tr]])  # fmt: skip
        print(f"    a joining sequence, fitted on grid + {train}: {c[-1] * 1e6:.0f} us")


def by_kind(e: np.ndarray, kind: np.ndarray) -> str:
    """median abs / P90 abs / median signed, all steps then each kind."""
    out = []
    for k in ("all", "decode", "prefill", "mixed"):
        x = e if k == "all" else e[kind == k]
        out.append(f"{k} {np.median(abs(x)) * 100:.1f}% / {np.percentile(abs(x), 90) * 100:.1f}%"
                   f" / {np.median(x) * 100:+.1f}%")  # fmt: skip
    return "; ".join(out)


def eager() -> None:
    src = unpack(DOCS / "heldout_run1_engine.tar.gz")
    st = engine_steps(src)
    model = CalibratedCostModel(src / "profile.csv", calibration_steps(src))
    big = (st.num_prefill_tokens > EAGER_KNOT).to_numpy()
    e = (design(steps_as_profile(st)) @ model.coef - st.duration_s) / st.duration_s
    print(f"first held-out run, its {big.sum()} steps above {EAGER_KNOT} prompt tokens "
          f"(no profile row there): median signed error {np.median(e[big]) * 100:+.1f}%")  # fmt: skip
    src = unpack(DOCS / "heldout_engine.tar.gz")
    st = engine_steps(src)
    rows = pd.concat([read_profile(src / "profile.csv")]
                     + [read_replay_steps(p) for p in calibration_steps(src)], ignore_index=True)  # fmt: skip
    y = st.duration_s.to_numpy()
    big = (st.num_prefill_tokens > EAGER_KNOT).to_numpy()
    x = design(steps_as_profile(st))
    coef = fit(rows)
    without = fit(rows.assign(kind=REPLAY_KIND))  # no profile row counts: the slope is left out
    for label, c in (("fitted", coef), ("left out", without)):
        e = (x @ c - y) / y
        print(f"held-out steps above {EAGER_KNOT} tokens ({big.sum()}), eager slope {label} "
              f"({c[-1] * 1e6:+.2f} us/token): median signed {np.median(e[big]) * 100:+.1f}%, "
              f"all steps median {np.median(abs(e)) * 100:.2f}%")  # fmt: skip


def held_out() -> None:
    src = unpack(DOCS / "heldout_engine.tar.gz")
    cal = calibration_steps(src)
    model = CalibratedCostModel(src / "profile.csv", cal)
    st = engine_steps(src)
    kind = kinds(st)
    x, y = design(steps_as_profile(st)), st.duration_s.to_numpy()
    grid_only = (x @ fit(read_profile(src / "profile.csv")) - y) / y
    print(f"held-out steps, grid only (median abs / P90 abs / median signed): "
          f"{by_kind(grid_only, kind)}")  # fmt: skip
    e = (x @ model.coef - y) / y
    print(f"held-out steps, grid + calibration replays: {by_kind(e, kind)}")
    e = pd.Series(e, index=st.index)
    d = kinds(st) == "decode"
    bins = pd.cut(st.num_decode_tokens[d], [0, 1, 4, 8, 16, 32, 64, 256])
    table = e[d].groupby(bins, observed=True).agg(["size", "median"])
    print("held-out decode steps, median signed error by batch size:")
    for b, r in table.iterrows():
        print(f"  batch {b}: {int(r['size']):6d} steps, {r['median'] * 100:+.1f}%")


def missed_cells() -> None:
    t = pd.read_csv(DOCS / "heldout.csv")
    excess = []
    for m in ("ttft", "tpot", "itl", "e2el"):
        for p in ("p50", "p90", "p99"):
            err, spread = t[f"err_{p}_{m}_ms"], t.get(f"spread_{p}_{m}_ms")
            limit = np.maximum(_target(p), spread.fillna(0) if spread is not None else 0)
            excess += list((err - limit)[err > limit] * 100)
    err, spread = t["err_throughput"], t.get("spread_throughput")
    limit = np.maximum(0.03, spread.fillna(0) if spread is not None else 0)
    excess += list((err - limit)[err > limit] * 100)
    x = np.array(excess)
    print(f"missed cells: {len(x)}; points above the limit: median {np.median(x):.1f}, "
          f"<= 3 points {int((x <= 3).sum())}, > 10 points {int((x > 10).sum())}")  # fmt: skip


def drift(archive: str) -> None:
    print(f"{archive}: decode steps of 1-2 sequences, median ms in each fifth of the run "
          "(BurstGPT 0.5x):")  # fmt: skip
    src = unpack(DOCS / archive)  # with its repeat archive's runs
    n = sum(len(pd.read_csv(f)) for f in calibration_steps(src))
    print(f"  ({n:,} calibration steps in this archive)")
    for name in ("engine", "engine_repeat"):
        st = pd.read_csv(src / name / "burstgpt_0.5" / "steps.csv")
        st = st[(st.num_prefills == 0) & (st.num_decode_tokens <= 2)]
        for policy, g in st.groupby("policy", sort=False):
            fifth = pd.qcut(g.time_s, 5, labels=False)
            ms = g.groupby(fifth).duration_s.median() * 1e3
            print(f"  {name} {policy}: " + " ".join(f"{v:.2f}" for v in ms))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options
    development()
    eager()
    held_out()
    missed_cells()
    for name in ("heldout_engine.tar.gz", "heldout_run1_engine.tar.gz"):
        joins_and_idle(name)
        drift(name)
