"""Is an engine step slower right after the device idled?

    python benchmarks/idle_warmup.py --model-dir checkpoints/qwen3-0.6b --out /tmp/iw.csv

On the held-out fidelity runs, decode steps within 5 ms of an idle gap took ~11% longer
than the calibrated model predicts, and 2% longer after 0.5 s of steps
(docs/fidelity/heldout_engine_notes.md). The grid times each row in a busy loop. This probe runs
a few step shapes in a busy loop for ``--busy-s``, sleeps ``gap`` seconds (the device
idles), then times the next ``--after`` steps one by one, as the profile times a step
(launch to device sync). Each (shape, gap) is repeated ``--passes`` times.

The CSV has one row per (shape, gap, step after the gap): the median seconds over passes.
The table printed gives steps 1, 2-5 and 6-``--after`` over the same shape's median with
no gap (gap 0: the busy loop runs on). ``nvidia-smi``'s SM clock is read where it exists,
before the busy loop and after the last pass.
"""

from __future__ import annotations

import argparse
import csv
import gc
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sched_lab.backend.profile import execute_launched  # noqa: E402
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402

SHAPES = {  # name -> (decodes of context 1024, prompt tokens of one prefill over no prefix)
    "decode_1": (1, 0),
    "decode_8": (8, 0),
    "decode_32": (32, 0),
    "prefill_512": (0, 512),
}
GAPS_S = (0.0, 0.001, 0.01, 0.1, 1.0)
CONTEXT = 1024


def sm_clock() -> str:
    """The SM clock nvidia-smi reports now, or '' where it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def step_inputs(decodes: int, prompt: int, bs: int) -> list[SeqInput]:
    per = -(-(CONTEXT + 1) // bs)
    seqs = [
        SeqInput([7], CONTEXT - 1, list(range(i * per, (i + 1) * per)), True)
        for i in range(decodes)
    ]
    if prompt:
        base = decodes * per
        seqs.append(
            SeqInput([7] * prompt, 0, list(range(base, base + -(-(prompt + 1) // bs))), True)
        )
    return seqs


def timed(runner, seqs) -> float:
    t0 = time.perf_counter()
    execute_launched(runner, seqs)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--after", type=int, default=20, help="steps timed after each gap")
    ap.add_argument("--busy-s", type=float, default=0.3, help="busy loop before each gap")
    ap.add_argument("--gaps", type=float, nargs="+", default=list(GAPS_S))
    args = ap.parse_args()
    if 0.0 not in args.gaps or args.after < 6 or args.passes < 1:
        ap.error("--gaps must include 0 (the baseline), --after must be >= 6, --passes >= 1")
    if not all(0.0 <= g < float("inf") for g in args.gaps) or not args.busy_s >= 0:
        ap.error("--gaps and --busy-s take seconds >= 0")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: no config.json (a checkpoint folder)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    attention = "triton" if device == "cuda" else "torch"  # the CPU: a smoke run only
    runner = ModelRunner(args.model_dir, device=device, dtype="bfloat16",
                         attention_backend=attention, block_size=16,
                         gpu_memory_utilization=0.9)  # fmt: skip
    gc.collect()
    gc.freeze()
    clock_before = sm_clock()
    samples: dict[tuple[str, float], list[list[float]]] = {}
    for _ in range(args.passes):
        for name, (decodes, prompt) in SHAPES.items():
            seqs = step_inputs(decodes, prompt, runner.block_size)
            for gap in args.gaps:
                end = time.perf_counter() + args.busy_s
                while time.perf_counter() < end:
                    execute_launched(runner, seqs)
                if gap:
                    time.sleep(gap)
                samples.setdefault((name, gap), []).append(
                    [timed(runner, seqs) for _ in range(args.after)]
                )
    clock_after = sm_clock()
    rows = []
    for (name, gap), runs in samples.items():
        med = np.median(np.array(runs), axis=0)
        rows += [{"shape": name, "gap_s": gap, "step": i + 1, "median_s": float(t)}
                 for i, t in enumerate(med)]  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"SM clock before the busy loops: {clock_before or 'not read'}; "
          f"after the last pass: {clock_after or 'not read'}")  # fmt: skip
    print(f"{'shape':12s} {'gap_s':>6s} {'step 1':>7s} {'2-5':>6s} {'6+':>6s}  (/ gap 0)")
    for name in SHAPES:
        base = float(np.median([r["median_s"] for r in rows
                                if r["shape"] == name and r["gap_s"] == 0.0]))  # fmt: skip
        for gap in args.gaps:
            t = [r["median_s"] for r in rows if r["shape"] == name and r["gap_s"] == gap]
            print(f"{name:12s} {gap:6.3f} {t[0] / base:7.3f} {np.median(t[1:5]) / base:6.3f} "
                  f"{np.median(t[5:]) / base:6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
