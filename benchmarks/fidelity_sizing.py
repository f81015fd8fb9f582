"""Predict the wall time of each step of ``sched-lab fidelity --engine`` with the simulator.

    python benchmarks/fidelity_sizing.py --protocol benchmarks/fidelity_heldout_8b.yaml \
        --profile profiles/h200_llama-3.1-8b.csv --load-s 3 --process-s 28 \
        --checkpoint-s 45 --profile-s 60

Every engine run of the protocol (calibration workloads, each window's capacity run, each
(window, load) folder through every policy, and the repeat) is replayed in the simulator
with the calibrated cost model of ``--profile`` (plus ``--replay-steps``, engine steps.csv
files fitted beside it, as ``fidelity --sim`` does with the calibration replays). An engine
run lasts about its simulated makespan (``duration_s``: the engine's replay wall time is its
makespan, the replay loop waiting for arrivals). Beyond that, each pass is a process of its
own (``--process-s``: imports, CUDA context, the model's load and CUDA-graph capture, which
happen once a process: lab/setup/engine.py keeps the runner) and each experiment in it costs
``--load-s`` (its trace, its results folder). The checkpoint and the profile steps are
given (``--checkpoint-s``, ``--profile-s``). The time limits and the skipping of folders
follow lab/fidelity.py: the first pass gets 52% of what is left after the profile and the
calibration, and a folder is skipped when the pass's own estimate
(``sched_lab.fidelity.pass_estimate_s``) would end past its deadline.

Prints one line per run and the predicted steps against ``time_limits_s``. A prediction,
not a measurement: the calibrated model's error on the engine's steps (docs/fidelity.md)
and the overheads given on the command line carry into it. On the 0.6B protocol
(benchmarks/fidelity_heldout.yaml) with the profile of its H200 run and the overheads fitted
from that run's three passes (``--process-s 18.5 --load-s 2.5``), it predicts the passes at
214 s and 197 s; they took 238 s and 192 s (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.config import validate  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402
from sched_lab.fidelity import (  # noqa: E402
    calibration_config,
    capacity_run,
    folder_name,
    load_config,
    load_protocol,
    pass_estimate_s,
    scale_folder_name,
    slice_config,
    window_loads,
    window_rate_scales,
)
from sched_lab.run.experiment import run_experiment  # noqa: E402


def as_sim(raw: dict, cost_model: dict, protocol_path: Path):
    """An engine run's raw config as a simulator run on ``cost_model``."""
    raw = {**copy.deepcopy(raw), "backend": "sim", "cost_model": cost_model}
    return validate(raw, str(protocol_path), ROOT)


def durations(cfg, requests=None) -> dict[str, float]:
    """Simulated makespan (s) of each policy's run of ``cfg``; prints the runs' preemptions
    and rejections when there are any."""
    runs = run_experiment(cfg, progress=False, requests=requests)
    for r in runs:
        if r.summary["num_preemptions"] or r.summary["rejected"]:
            print(f"    {cfg.name} {r.label}: {r.summary['num_preemptions']} preemptions, "
                  f"{r.summary['rejected']} rejected")  # fmt: skip
    return {r.label: r.summary["duration"] for r in runs}


def predict(protocol_path: Path, cost_model: dict, load_s: float, process_s: float,
            checkpoint_s: float, profile_s: float, split: bool = False) -> dict[str, float]:  # fmt: skip
    """Predicted seconds of each step of the engine side; prints each run. ``split``: the
    engine side in two calls (``--split first`` / ``repeat``): the first pass gets all
    that is left of the total limit, and the repeat a call of its own (its own checkpoint
    and total limit)."""
    protocol = load_protocol(protocol_path)
    limits = protocol["time_limits_s"]
    steps = {"checkpoint": checkpoint_s, "profile": min(profile_s, limits["profile"])}
    cal = (protocol.get("calibration") or {}).get("workloads", {})
    t = process_s
    for name in cal:
        d = durations(as_sim(calibration_config(protocol, name), cost_model, protocol_path))
        t += load_s + sum(d.values())
        print(f"calibration {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in d.items()))
    if cal:
        steps["calibration"] = min(t, limits["calibration"])
    left = limits["total"] - sum(steps.values())
    first_limit = left - 5 if split else 0.52 * left
    deadline = first_limit - 10  # seconds into the pass (sched_lab.fidelity.engine)
    t, done = process_s, []
    for name in protocol["slices"]:
        cfg = as_sim(slice_config(protocol, name), cost_model, protocol_path)
        reqs, native, offline = capacity_run(cfg)
        if t + 10 > deadline:
            print(f"{name}: skipped (no time for its capacity run)")
            continue
        cap_run = durations(offline, requests=reqs)["fcfs"]
        t += load_s + cap_run
        capacity = len(reqs) / cap_run
        prompt = sum(r.prompt_len for r in reqs) / len(reqs)
        print(f"{name}: {len(reqs)} requests (mean prompt {prompt:,.0f} tokens), capacity "
              f"{capacity:.2f} req/s, run {cap_run:.1f} s, own rate {native:.3f} req/s")  # fmt: skip
        points = [
            (folder_name(name, x), x, x * capacity / native) for x in window_loads(protocol, name)
        ]
        points += [(scale_folder_name(name, x), x * native / capacity, x)
                   for x in window_rate_scales(protocol, name)]  # fmt: skip
        for folder, load, scale in points:
            est = pass_estimate_s(cfg, len(reqs), load, capacity)
            if t + est > deadline:
                print(f"  {folder}: skipped (pass estimate {est:.0f} s)")
                continue
            cfg_l = load_config(cfg, folder, scale)
            d = durations(cfg_l)
            t += load_s + sum(d.values())
            done.append((folder, load_s + sum(d.values()), est))
            print(f"  {folder} (load {load:.2f}): "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in d.items())
                  + f" (pass estimate {est:.0f} s)")  # fmt: skip
    steps["first"] = t
    left = limits["total"] - checkpoint_s if split else left - t
    t = process_s
    for folder, secs, est in done:  # the repeat pass: the same folders, where they fit
        if t + est > left - 15:
            print(f"  {folder} repeat: skipped (pass estimate {est:.0f} s)")
            continue
        t += secs
    if split:
        steps["repeat_checkpoint"] = checkpoint_s
    steps["repeat"] = t
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", type=Path, required=True)
    ap.add_argument("--profile", type=Path, required=True, help="engine profile CSV")
    ap.add_argument("--replay-steps", nargs="*", default=[],
                    help="engine steps.csv files fitted beside the profile")  # fmt: skip
    ap.add_argument("--load-s", type=float, default=4.0,
                    help="seconds an experiment costs beyond its replays (default 4)")  # fmt: skip
    ap.add_argument("--process-s", type=float, default=5.0,
                    help="seconds a pass's process spends starting, model load included (default 5)")  # fmt: skip
    ap.add_argument("--checkpoint-s", type=float, default=0.0, help="checkpoint step (s)")
    ap.add_argument("--profile-s", type=float, default=30.0, help="profile step (s)")
    ap.add_argument("--split", action="store_true",
                    help="two device calls (fidelity --engine --split first / repeat)")  # fmt: skip
    args = ap.parse_args(argv)
    cost_model = {"profile": str(args.profile.resolve())}
    if args.replay_steps:
        cost_model["replay_steps"] = [str(Path(p).resolve()) for p in args.replay_steps]
    try:
        steps = predict(args.protocol, cost_model, args.load_s, args.process_s,
                        args.checkpoint_s, args.profile_s, args.split)  # fmt: skip
    except ConfigError as e:  # a bad --profile or --replay-steps file: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    limits = load_protocol(args.protocol)["time_limits_s"]
    if args.split:
        one = sum(v for k, v in steps.items() if not k.startswith("repeat"))
        two = steps["repeat_checkpoint"] + steps["repeat"]
        print(f"predicted calls (s): first {one:.0f}, repeat {two:.0f}; each of "
              f"time_limits_s.total {limits['total']}")  # fmt: skip
    print("predicted steps (s): " + ", ".join(f"{k} {v:.0f}" for k, v in steps.items())
          + f"; total {sum(steps.values()):.0f} of time_limits_s.total {limits['total']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
