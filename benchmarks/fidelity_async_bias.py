"""Where the asynchronous fidelity run's step bias comes from, from the archives alone.

    python benchmarks/fidelity_async_bias.py

Data (all development data: the async archive's window starts at 1800 s, as the
development windows do; the held-out async protocol replays windows from 3000 s):

* docs/fidelity_async/async_dev_engine.tar.gz: profile grid (with ``host_s``) and engine steps
  of one conv window at loads 0.5 and 1.1 under asynchronous scheduling, whose durations
  are the async clock (the wall time between consecutive waits, lab/sim/replay.py);
* docs/fidelity/dev_engine.tar.gz: the same conv window at load 1.1 replayed synchronously
  (another engine commit and machine, same GPU model);
* docs/fidelity/heldout_run1_engine.tar.gz: a synchronous protocol's profile and calibration
  replays (synthetic workloads), to measure what calibration replays change.

Per engine step n of a run, with a cost model m: ``S`` = m's step time (host + device,
what a synchronous step costs), ``H`` = its host time, and the simulator's async clock
``A`` = max(S_n - H_n, H_{n+1}) (H_{n+1} only where step n+1 was already planned, i.e.
starts where step n ends). Printed: median signed error (prediction / measured - 1) by
step kind of

1. the grid-only model's S (what fidelity --sim's step table reports) and A (what the
   simulator runs) against the async durations;
2. the host split: A with the host time scaled by 0.5 and 1.5, and the host fit's own
   error on the grid;
3. calibration replays: the grid-only model's S on the sync calibration steps (held-out
   archive) and on the sync engine steps of the same window (dev archive);
4. the candidates: (a) sync calibration rows fitted beside the grid, async clock from
   them (here the dev archive's sync conv_1.1 steps stand in for sync calibration
   replays); (b) async rows fitted as device time (duration + the grid's host time), one
   async run's steps as calibration, the other run evaluated (cross-fitted both ways).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.fidelity import engine_config as _engine_config  # noqa: E402
from sched_lab.fidelity import predicted_durations, unpack  # noqa: E402
from sched_lab.fidelity import step_kind as _step_kind  # noqa: E402
from sched_lab.results.names import upgrade_summary  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402
from sched_lab.sim.calibrated import (  # noqa: E402
    CalibratedCostModel,
    host_design,
    read_profile,
    steps_as_profile,
)

ASYNC = ROOT / "docs" / "fidelity_async" / "async_dev_engine.tar.gz"
DEV = ROOT / "docs" / "fidelity" / "dev_engine.tar.gz"
HELDOUT = ROOT / "docs" / "fidelity" / "heldout_run1_engine.tar.gz"
KINDS = ("decode", "mixed", "prefill")


def runs(src: Path, side: str = "engine") -> dict[str, pd.DataFrame]:
    """Each (folder, policy) run's steps in step order."""
    out = {}
    for steps in sorted((src / side).glob("*/steps.csv")):
        df = pd.read_csv(steps)
        for policy, st in df.groupby("policy", sort=False):
            out[f"{steps.parent.name} {policy}"] = st.sort_values("time_s").reset_index(drop=True)
    return out


def predict(model: CalibratedCostModel, st: pd.DataFrame, host_scale: float = 1.0):
    """(S, A) of every step of one run (module doc), the host time scaled by host_scale."""
    if host_scale != 1.0:
        model = copy.copy(model)
        model.host_coef = model.host_coef * host_scale
    return predicted_durations(model, st), predicted_durations(model, st, True)


def host(model: CalibratedCostModel, st: pd.DataFrame) -> np.ndarray:
    """The model's host seconds H of every step, in [0, S]."""
    s = predicted_durations(model, st)
    return np.clip(host_design(steps_as_profile(st)) @ model.host_coef, 0.0, s)


def signed(pred: np.ndarray, st: pd.DataFrame) -> dict[str, float]:
    err = pred / st.duration_s.to_numpy() - 1
    kind = np.array(_step_kind(st))
    out = {k: float(np.median(err[kind == k])) for k in KINDS if (kind == k).any()}
    out["all"] = float(np.median(err))
    out["sum"] = float(pred.sum() / st.duration_s.sum() - 1)  # the run's busy time
    return out


def show(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"  {'run':28s} " + " ".join(f"{k:>8s}" for k in (*KINDS, "all", "sum")))
    for name, r in rows.items():
        cells = " ".join(
            f"{r[k]:+8.1%}" if k in r else f"{'-':>8s}" for k in (*KINDS, "all", "sum")
        )
        print(f"  {name:28s} {cells}")


def simulated(src: Path, folder: str, cost_model: dict) -> dict[str, dict[str, float]]:
    """Signed errors of the simulator's TTFT, TPOT and E2E p50 against engine run
    ``folder`` of ``src``, each policy, under ``cost_model``."""
    real_dir = src / "engine" / folder
    raw = yaml.safe_load((real_dir / "config.yaml").read_text())
    real = json.loads((real_dir / "summary.json").read_text())
    out = {}
    for run in run_experiment(
        _engine_config({**raw, "backend": "sim", "cost_model": cost_model}), progress=False
    ):
        r = upgrade_summary(real[run.label])  # recorded under older names too
        out[f"{folder} {run.label}"] = {
            f"{m}_s": run.summary[f"p50_{name}_ms"] / r[f"p50_{name}_ms"] - 1
            for m, name in (("ttft", "ttft"), ("tpot", "tpot"), ("e2e", "e2el"))
        }
    return out


def with_rows(profile: Path, extra: list[pd.DataFrame], tmp: Path) -> CalibratedCostModel:
    """The calibrated model of ``profile`` with ``extra`` steps.csv frames as replay_steps."""
    paths = []
    for i, df in enumerate(extra):
        p = tmp / f"extra_{i}.csv"
        df.to_csv(p, index=False)
        paths.append(p)
    return CalibratedCostModel(profile, tuple(paths))


def main() -> None:
    a_src, d_src, h_src = unpack(ASYNC), unpack(DEV), unpack(HELDOUT)
    tmp = Path(a_src) / "_bias"
    tmp.mkdir()
    try:
        grid = CalibratedCostModel(a_src / "profile.csv")
        arun = runs(a_src)

        show("1. grid-only model vs async durations: S (sync step time)",
             {n: signed(predict(grid, st)[0], st) for n, st in arun.items()})  # fmt: skip
        show("   A = max(S - H, H_next) (the simulator's async clock)",
             {n: signed(predict(grid, st)[1], st) for n, st in arun.items()})  # fmt: skip
        host_bound = {}
        for n, st in arun.items():
            (s, a), h = predict(grid, st), host(grid, st)
            host_bound[n] = float(np.mean(a > s - h + 1e-12))
        print("   share of steps the model calls host-bound (H_next > S - H): "
              + ", ".join(f"{n} {v:.1%}" for n, v in host_bound.items()))  # fmt: skip

        prof = read_profile(a_src / "profile.csv")
        hp = np.clip(host_design(prof) @ grid.host_coef, 0, None)
        rel = hp / prof.host_s.to_numpy() - 1
        dec = (prof.num_prefills == 0).to_numpy()
        print(f"\n2. host fit on the grid: median signed error {np.median(rel):+.1%} "
              f"(decode rows {np.median(rel[dec]):+.1%}); host share of a decode row "
              f"{np.median(prof.host_s[dec] / prof.duration_s[dec]):.1%}")  # fmt: skip
        for scale in (0.5, 1.5):
            show(f"   A with host time x {scale}",
                 {n: signed(predict(grid, st, scale)[1], st) for n, st in arun.items()})  # fmt: skip

        h_grid = CalibratedCostModel(h_src / "profile.csv")
        show("3. grid-only S vs sync calibration replays (held-out archive, its own grid)",
             {n: signed(predict(h_grid, st)[0], st)
              for n, st in runs(h_src, "calibration").items()})  # fmt: skip
        d_grid = CalibratedCostModel(d_src / "profile.csv")
        d_runs = {n: st for n, st in runs(d_src).items() if n.startswith("conv_1.1")}
        show("   grid-only S vs sync engine steps, same conv window at 1.1 (dev archive)",
             {n: signed(predict(d_grid, st)[0], st) for n, st in d_runs.items()})  # fmt: skip
        show("   async grid's S vs the same sync engine steps (dev archive)",
             {n: signed(predict(grid, st)[0], st) for n, st in d_runs.items()})  # fmt: skip

        cand_a = with_rows(a_src / "profile.csv", list(d_runs.values()), tmp)
        show("4a. sync rows (dev conv_1.1) beside the async grid: A vs async durations",
             {n: signed(predict(cand_a, st)[1], st) for n, st in arun.items()})  # fmt: skip
        synth_rows = [pd.read_csv(p) for p in sorted((h_src / "calibration").glob("*/steps.csv"))]
        cand_a2 = with_rows(a_src / "profile.csv", synth_rows, tmp)
        show("4a'. sync synthetic calibration rows (held-out archive) beside the async grid",
             {n: signed(predict(cand_a2, st)[1], st) for n, st in arun.items()})  # fmt: skip

        rows_b = {}
        for cal_folder, eval_folder in (("conv_0.5", "conv_1.1"), ("conv_1.1", "conv_0.5")):
            cal = []
            for n, st in arun.items():
                if n.startswith(cal_folder + " "):
                    h = host(grid, st)
                    cal.append(st.assign(duration_s=st.duration_s + h))  # device + host
            model = with_rows(a_src / "profile.csv", cal, tmp)
            for n, st in arun.items():
                if n.startswith(eval_folder + " "):
                    rows_b[f"{n} (cal {cal_folder})"] = signed(predict(model, st)[1], st)
        show("4b. async rows as device time beside the grid: A vs async durations", rows_b)

        print("\n5. the simulator's p50 signed errors (TTFT, TPOT, E2E) against the engine")
        profile = str(a_src / "profile.csv")
        dev_steps = [str(d_src / "engine" / "conv_1.1" / "steps.csv")]
        synth = [str(p) for p in sorted((h_src / "calibration").glob("*/steps.csv"))]
        for title, cm in (
            ("grid only (the archived doc's model)", {"profile": profile}),
            ("4a: + sync dev conv_1.1 rows", {"profile": profile, "replay_steps": dev_steps}),
            (
                "4a': + the sync protocol's synthetic calibration rows (held-out archive)",
                {"profile": profile, "replay_steps": synth},
            ),
        ):
            print(f"  {title}")
            for folder in ("conv_0.5", "conv_1.1"):
                for n, e in simulated(a_src, folder, cm).items():
                    print(f"    {n:28s} " + " ".join(f"{k[:-2]} {v:+6.1%}" for k, v in e.items()))
        print("  4b: + the other load's async rows as device time")
        for cal_folder, eval_folder in (("conv_0.5", "conv_1.1"), ("conv_1.1", "conv_0.5")):
            st = pd.read_csv(a_src / "engine" / cal_folder / "steps.csv")
            parts = [g.sort_values("time_s") for _, g in st.groupby("policy", sort=False)]
            conv = pd.concat([g.assign(duration_s=g.duration_s + host(grid, g)) for g in parts])
            path = tmp / f"device_{cal_folder}.csv"
            conv.to_csv(path, index=False)
            cm = {"profile": profile, "replay_steps": [str(path)]}
            for n, e in simulated(a_src, eval_folder, cm).items():
                print(f"    {n:28s} " + " ".join(f"{k[:-2]} {v:+6.1%}" for k, v in e.items()))
    finally:
        for src in (a_src, d_src, h_src):
            shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options
    main()
