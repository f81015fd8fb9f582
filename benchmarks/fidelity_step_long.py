"""Step-level error of the calibrated model on the long held-out windows, by step feature.

    python benchmarks/fidelity_step_long.py                       # docs/fidelity_long archive
    python benchmarks/fidelity_step_long.py --archive docs/fidelity/heldout_engine.tar.gz

Each engine step (both passes: engine/ and engine_repeat/) is predicted from its own batch
by the model ``sched-lab fidelity --sim`` fits (the archive's profile.csv plus its
calibration replays) and by the profile grid alone. Printed:

1. |error| median / P90 per pass, and the median signed error by step kind;
2. decode steps: signed error by batch size, mean context, queue length, the previous
   step's kind, the change in sequences and in used KV blocks since the previous step, and
   the position in the run (fifths); each against the grid-only fit too;
3. prompt steps (prefill, mixed): the time the engine spends above the grid-only fit, in ms
   and in % of the step, by prompt tokens (calibration replays beside the windows), and by
   the local decode level of section 4; then the same steps against the grid row of their
   own shape (one prompt over no prefix, at most 3% fewer tokens than the row: the same
   CUDA graph), and the grid-only fit against its own prompt rows by kind of row;
4. steady decode steps (previous step a decode of the same sequences): the histogram of
   measured / grid-only prediction, and its median in each fifth of every run;
5. the fits compared on the windows: as fitted today (grid + calibration replays), the
   grid alone, and the grid with one factor on its compute terms (tokens, the hinge, the
   attention pairs, the eager slope) measured on the calibration replays' prompt steps;
6. what the features can reach at best: the model's features fitted to each pass's own
   steps (in-sample, so not a prediction), and that fit with each step scaled by its run's
   local level (the median of measured / fitted over the 101 steps around it: the slow
   and fast spells of section 4, known to an oracle).

The windows are never fitted; the calibration replays are synthetic (protocol header).
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

from sched_lab.fidelity import unpack  # noqa: E402
from sched_lab.sim.calibrated import (  # noqa: E402
    FEATURES,
    RUNS_COLUMN,
    CalibratedCostModel,
    design,
    fit,
    nnls,
    read_profile,
    steps_as_profile,
)

ARCHIVE = ROOT / "docs" / "fidelity_long" / "heldout_long_engine.tar.gz"
COMPUTE = [3, 4, 8, 10]  # FEATURES columns that scale with arithmetic: tokens, hinge, pairs, eager
_FOLDERS: list[Path] = []


@atexit.register
def _clean() -> None:
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def runs(src: Path, sides: tuple[str, ...]) -> pd.DataFrame:
    """Every steps.csv under ``src/SIDE/*/``, one frame, with its side, run, the step kind,
    its index in the run and the previous step's kind, sequences and used blocks."""
    frames = []
    for side in sides:
        for f in sorted((src / side).glob("*/steps.csv")):
            d = pd.read_csv(f)
            d["side"], d["run"] = side, f.parent.name
            frames.append(d)
    st = pd.concat(frames, ignore_index=True)
    st["kind"] = np.where(st.num_prefills == 0, "decode",
                          np.where(st.num_decode_tokens == 0, "prefill", "mixed"))  # fmt: skip
    g = st.groupby(["side", "run", "policy"], sort=False)
    st["prev_kind"] = g.kind.shift(1).fillna("none")
    st["d_seqs"] = st.num_seqs - g.num_seqs.shift(1)
    st["d_blocks"] = st.kv_used_blocks - g.kv_used_blocks.shift(1)
    st["fifth"] = g.cumcount() * 5 // g.time_s.transform("size")
    return st


def split(x: np.ndarray, coef: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(seconds outside the compute terms, seconds of the compute terms) of design rows."""
    comp = x[:, COMPUTE] @ coef[COMPUTE]
    return x @ coef - comp, comp


def compute_factor(cal: pd.DataFrame, grid_coef: np.ndarray) -> float:
    """k minimizing the squared relative error of (rest + (1 + k) * compute) on the
    calibration replays' prompt steps, with the grid fit's parts."""
    p = cal[cal.kind != "decode"]
    rest, comp = split(design(steps_as_profile(p)), grid_coef)
    y = p.duration_s.to_numpy()
    return float(np.sum(comp / y * (y - rest - comp) / y) / np.sum((comp / y) ** 2))


def summary(label: str, e: pd.Series, st: pd.DataFrame) -> None:
    parts = []
    for side in sorted(st.side.unique()) + ["both"]:
        m = np.ones(len(st), bool) if side == "both" else (st.side == side).to_numpy()
        kinds = e[m].groupby(st.kind[m]).median() * 100
        parts.append(f"{side} {e[m].abs().median() * 100:.2f}% / "
                     f"{e[m].abs().quantile(0.9) * 100:.2f}% ("
                     + ", ".join(f"{k} {v:+.1f}%" for k, v in kinds.items()) + ")")  # fmt: skip
    print(f"  {label}: " + "; ".join(parts))


def table(title: str, st: pd.DataFrame, by, cols: dict[str, pd.Series]) -> None:
    print(f"  {title}")
    t = pd.DataFrame(cols).groupby(by, observed=True).agg(["size", "median"])
    for key, row in t.iterrows():
        n = int(row.iloc[0])
        if n < 30:
            continue
        vals = "  ".join(f"{c} {row[(c, 'median')] * 100:+5.1f}%" for c in cols)
        print(f"    {key!s:>24}: {n:6d} steps  {vals}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", type=Path, default=ARCHIVE)
    args = ap.parse_args()
    src = unpack(args.archive)
    if src != args.archive:
        _FOLDERS.append(src)
    cal_files = tuple(sorted(str(p) for p in (src / "calibration").glob("*/steps.csv")))
    model = CalibratedCostModel(src / "profile.csv", cal_files)
    grid_coef = fit(read_profile(src / "profile.csv"))
    st = runs(src, ("engine", "engine_repeat"))
    cal = runs(src, ("calibration",))
    x, y = design(steps_as_profile(st)), st.duration_s
    e_model = (x @ model.coef - y) / y
    e_grid = (x @ grid_coef - y) / y
    print(f"{args.archive.name}: {len(st):,} window steps, {len(cal):,} calibration steps")
    print("1. |error| median / P90 (median signed by kind)")
    summary("grid + calibration (as fitted today)", e_model, st)
    summary("grid alone", e_grid, st)

    print("2. decode steps, median signed error (today's fit, the grid alone)")
    d = (st.kind == "decode").to_numpy()
    sd, cols = st[d], {"today": e_model[d], "grid": e_grid[d]}
    mean_ctx = sd.decode_context_tokens / sd.num_decode_tokens
    for title, by in (
        ("batch size", pd.cut(sd.num_decode_tokens, [0, 1, 4, 8, 16, 32, 64, 256])),
        ("mean context", pd.cut(mean_ctx, [0, 512, 1024, 2048, 4096, 1e9])),
        ("waiting requests", pd.cut(sd.num_waiting, [-1, 0, 4, 16, 64, 1e9])),
        ("previous step", sd.prev_kind),
        ("sequences joined (+) or left (-)", pd.cut(sd.d_seqs, [-1e9, -2, -1, 0, 1, 1e9])),
        ("KV blocks allocated since the previous step", pd.cut(sd.d_blocks, [-1e9, -1, 0, 1, 4, 1e9])),
        ("fifth of the run", sd.fifth),
        ("pass", sd.side),
    ):  # fmt: skip
        table(title, sd, by, cols)

    print("3. prompt steps: the engine above the grid-only fit, median ms (% of the step)")
    for name, frame in (("windows", st), ("calibration", cal)):
        p = frame[frame.kind != "decode"]
        pred = design(steps_as_profile(p)) @ grid_coef
        extra = pd.DataFrame({"ms": (p.duration_s - pred) * 1e3,
                              "pct": (p.duration_s - pred) / p.duration_s * 100})  # fmt: skip
        bins = pd.cut(p.num_prefill_tokens, [0, 256, 512, 1024, 2048, 4096, 8192, 1e6])
        t = extra.groupby(bins, observed=True).agg(["size", "median"])
        print(f"  {name}: " + "; ".join(
            f"{k} {int(r[('ms', 'size')])} steps {r[('ms', 'median')]:+.2f} ms "
            f"({r[('pct', 'median')]:+.1f}%)" for k, r in t.iterrows()))  # fmt: skip

    both = pd.concat([st, cal], ignore_index=True)
    ratio = both.duration_s / (design(steps_as_profile(both)) @ grid_coef)
    steady = ((both.kind == "decode") & (both.prev_kind == "decode")
              & (both.d_seqs == 0)).to_numpy()  # fmt: skip
    level = (ratio.where(steady).groupby([both.side, both.run, both.policy], sort=False)
             .transform(lambda r: r.rolling(201, center=True, min_periods=20).median()))  # fmt: skip
    spell = np.where(level > 1.07, "slow", np.where(level < 1.0, "fast", "between"))
    p = (both.kind != "decode").to_numpy()
    t = ratio[p].groupby([spell[p], pd.cut(both.num_prefill_tokens[p],
                                            [0, 512, 1024, 2048, 4096, 8192, 1e6])],
                         observed=True).agg(["size", "median"])  # fmt: skip
    print(
        "  all prompt steps, measured / grid-only prediction by the local decode level "
        "(fast < 1.0 <= between <= 1.07 < slow; rolling median of 201 steady decodes):"
    )
    for s in ("fast", "between", "slow"):
        print(f"    {s}: " + "; ".join(f"{k} {int(r['size'])} steps {r['median']:.3f}"
                                     for k, r in t.loc[s].iterrows()))  # fmt: skip

    grid = read_profile(src / "profile.csv")
    one = both[(both.kind == "prefill") & (both.num_prefills == 1)
               & (both.prefill_context_tokens == 0)]  # fmt: skip
    rows = grid[(grid.kind == "prefill") & (grid.num_prefills == 1)
                & (grid.prefill_context_tokens == 0)]  # fmt: skip
    print("  one prompt over no prefix, measured / the grid row of that shape "
          "(p10 / median / p90):")  # fmt: skip
    for n, row_s in zip(rows.num_prefill_tokens, rows.duration_s):
        same = one[(one.num_prefill_tokens <= n) & (one.num_prefill_tokens >= 0.97 * n)]
        if len(same) >= 5:
            r = same.duration_s / row_s
            print(f"    {int(n):5d} tokens ({row_s * 1e3:.2f} ms): {len(same):4d} steps "
                  f"{r.quantile(0.1):.3f} / {r.median():.3f} / {r.quantile(0.9):.3f}")  # fmt: skip
    resid = (design(grid) @ grid_coef - grid.duration_s) / grid.duration_s
    single = (grid.num_prefills == 1) & (grid.prefill_context_tokens == 0)
    groups = {
        "one prompt, no prefix, < 2048 tokens": single & (grid.num_prefill_tokens < 2048),
        "one prompt, no prefix, 2048-8192 tokens": single & grid.num_prefill_tokens.between(2048, 8192),
        "one prompt over a cached prefix": (grid.num_prefills == 1) & (grid.prefill_context_tokens > 0),
        "2-16 prompts": grid.num_prefills > 1,
        "mixed rows": grid.kind == "mixed",
    }  # fmt: skip
    print("  the grid-only fit on its own prompt rows, predicted / measured - 1 (median, range):")
    for name, m in groups.items():
        r = resid[(m & (grid.kind != "mixed") if name != "mixed rows" else m).to_numpy()]
        if len(r):
            print(f"    {name}: {len(r)} rows, {r.median() * 100:+.1f}% "
                  f"({r.min() * 100:+.1f}% to {r.max() * 100:+.1f}%)")  # fmt: skip

    print("4. steady decode steps (same sequences as the previous decode step): "
          "measured / grid-only prediction")  # fmt: skip
    counts, edges = np.histogram(ratio[steady], bins=np.arange(0.84, 1.32, 0.04))
    print("  " + "  ".join(f"{a:.2f}-{a + 0.04:.2f}: {c}" for a, c in zip(edges, counts)))
    fifths = ratio[steady].groupby([both.side[steady], both.run[steady], both.policy[steady],
                                    both.fifth[steady]]).median().unstack()  # fmt: skip
    for key, row in fifths.iterrows():
        print(f"    {' '.join(key):>40}: " + " ".join(f"{v:.2f}" for v in row))

    print("5. fits compared on the windows")
    k = compute_factor(cal, grid_coef)
    rest, comp = split(x, grid_coef)
    summary("grid + calibration (today)", e_model, st)
    summary("grid alone", e_grid, st)
    summary(f"grid, compute x {1 + k:.3f} (from the calibration prompt steps)",
            (rest + (1 + k) * comp - y) / y, st)  # fmt: skip

    print("6. the features fitted to each pass's own steps (in-sample), |error| median / P90")
    xs = np.delete(x, FEATURES.index(RUNS_COLUMN), axis=1)  # no swap runs in steps.csv
    for side in sorted(st.side.unique()):
        m = (st.side == side).to_numpy()
        ym, scale = y[m].to_numpy(), xs[m].max(axis=0)
        scale[scale == 0] = 1.0
        fitted = xs[m] @ (nnls(xs[m] / scale / ym[:, None], np.ones(m.sum())) / scale)
        e = np.abs(fitted - ym) / ym
        level = (pd.Series(ym / fitted, index=st.index[m])
                 .groupby([st.run[m], st.policy[m]], sort=False)
                 .transform(lambda r: r.rolling(101, center=True, min_periods=10).median()))  # fmt: skip
        e_level = np.abs(fitted * level.to_numpy() - ym) / ym
        print(f"  {side}: {np.median(e) * 100:.2f}% / {np.percentile(e, 90) * 100:.2f}%; "
              f"scaled by the local level: {np.nanmedian(e_level) * 100:.2f}% / "
              f"{np.nanpercentile(e_level, 90) * 100:.2f}%")  # fmt: skip


if __name__ == "__main__":
    main()
