"""Why do eager steps (steps with prompt tokens) take longer in some engine replays?

    python benchmarks/eager_step_drift.py [--load 0.95] [--limit 200]

docs/fidelity.md found that, within one load of the conversation slice, the first policy's
steps with prompt tokens ran as fast as the profile grid (~11 ms) and the later policies'
ran ~20 ms. This replays the same slice and load with the policies in two orders, then once
more with Python's garbage collector frozen (``gc.freeze()`` after the warm-up), printing
the median duration of steps with fewer than 600 prompt tokens per run, so the slowdown can
be pinned on the policy, on the process's history, or on the collector.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", type=float, default=0.95)
    ap.add_argument("--limit", type=int, default=200)
    args = ap.parse_args()
    from sched_lab.config import load_config
    from sched_lab.run.experiment import run_experiment

    base = load_config(ROOT / "experiments/sim_vs_real.yaml")
    capacity = json.loads((ROOT / "docs/fidelity/engine/capacity.json").read_text())["conv"]
    base = base.with_trace(
        limit=args.limit,
        rate_scale=args.load * capacity["capacity_req_s"] / capacity["native_req_s"],
    )
    policies = {p.name: p for p in base.policies}
    orders = [["fcfs", "swap", "chunked_prefill"], ["chunked_prefill", "swap", "fcfs"]]
    for label, order, freeze in [
        ("order A", orders[0], False),
        ("order B", orders[1], False),
        ("order A, gc frozen", orders[0], True),
    ]:
        cfg = dataclasses.replace(base, policies=tuple(policies[n] for n in order))
        if freeze:
            gc.collect()
            gc.freeze()
        runs = run_experiment(cfg, progress=False)
        if freeze:
            gc.unfreeze()
        cells = []
        for run in runs:
            s = run.result.steps
            small = (s["num_prefill_tokens"] > 0) & (s["num_prefill_tokens"] < 600)
            dec = s["num_prefill_tokens"] == 0
            cells.append(
                f"{run.label}: small prefill steps {np.median(s['duration_s'][small]) * 1e3:.1f} ms "
                f"(n={int(small.sum())}), decode {np.median(s['duration_s'][dec]) * 1e3:.2f} ms, "
                f"preemptions {int(s['num_preempted'].sum())}"
            )
        print(f"{label}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
