"""Speculative decoding in the simulator: TPOT and throughput speedup vs k and batch size.

    python benchmarks/spec_sim.py                       # the table of BENCHMARKS.md / docs/speculative_decoding.md
    python benchmarks/spec_sim.py --out /tmp/spec_sim.json --batches 1 8 32 128
    python benchmarks/spec_sim.py --prompt 128 --output 128 --static   # the engine's workload

The simulator half of issue 18's table. Workload: one wave of max(B, 8) requests arriving at
once, prompt 512 and output 256 tokens each, ``max_num_seqs`` B (the decode batch), fcfs;
Qwen3-0.6B with step times from the calibrated H200 profile (profiles/h200_qwen3-0.6b.csv).
Each (k, p) runs ``synthetic`` speculation with p at every position against the same
workload without speculation; speedup = TPOT(off) / TPOT(on) (mean over requests) and
output throughput(on) / throughput(off). Three verify prices (lab/sim/spec_executor.py
``verify_time``): ``prefill`` (each verify a prompt chunk of 1 + d' tokens over its
context, the default), ``decode`` (decode rows of 1 + d' queries reading the context once)
and the analytic roofline (H200 preset, default efficiencies). The crossover is the
smallest batch of the grid where TPOT speedup < 1 (speculation hurts). ``--prompt``,
``--output`` and ``--static`` (exactly B requests, as benchmarks/spec_engine.py's static
batches) set the workload the engine half ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sched_lab.core.kv import make_block_manager  # noqa: E402
from sched_lab.core.request import Request  # noqa: E402
from sched_lab.core.scheduler import SchedulerLimits  # noqa: E402
from sched_lab.core.spec import SpeculativeConfig  # noqa: E402
from sched_lab.policies import get_policy  # noqa: E402
from sched_lab.results import metrics  # noqa: E402
from sched_lab.sim.calibrated import CalibratedCostModel  # noqa: E402
from sched_lab.sim.cost_model import AnalyticCostModel, CostModelExecutor  # noqa: E402
from sched_lab.sim.hardware import HARDWARE  # noqa: E402
from sched_lab.sim.models import MODELS  # noqa: E402
from sched_lab.sim.replay import replay  # noqa: E402
from sched_lab.sim.spec_executor import SpecExecutor  # noqa: E402

PROFILE = ROOT / "profiles" / "h200_qwen3-0.6b.csv"
BLOCK_SIZE = 16
PROMPT, OUTPUT = 512, 256


def workload(batch: int) -> list[Request]:
    n = batch if STATIC else max(batch, 8)
    return [Request(str(i), 0.0, PROMPT, OUTPUT) for i in range(n)]


STATIC = False  # exactly ``batch`` requests (--static)


def run(cost_model, batch: int, k: int = 0, p: float = 0.0, pricing: str = "prefill") -> dict:
    """One replay: mean TPOT (s), output throughput (tokens/s), mean acceptance length."""
    spec = SpeculativeConfig("synthetic", k, acceptance_rates=(p,) * k) if k else None
    limits = SchedulerLimits(batch, max(batch * (PROMPT + k + 1), 8192), 4096)
    bm = make_block_manager(65536, 0, BLOCK_SIZE, 0.0, False)
    scheduler = get_policy("fcfs")(limits, bm, speculative=spec)
    executor = CostModelExecutor(cost_model, BLOCK_SIZE)
    if spec is not None:
        executor = SpecExecutor(executor, cost_model, BLOCK_SIZE, k, spec.acceptance_rates,
                                0, None, pricing)  # fmt: skip
    result = replay(workload(batch), scheduler, executor)
    assert result.failure is None, result.failure
    df, itl = metrics.request_table(result, "fcfs", 1.0, split_itl=spec is not None)
    s = metrics.summarize(df, itl, result, {})
    steps = [x for r in result.requests for x in r.spec_steps]
    mal = 1 + sum(a for *_, a in steps) / len(steps) if steps else 1.0
    return {"tpot_s": s["mean_tpot_ms"] / 1e3, "throughput": s["output_throughput"], "mal": mal}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.6, 0.8])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=256, help="output tokens per request")
    ap.add_argument("--static", action="store_true", help="exactly B requests per batch B")
    args = ap.parse_args(argv)
    globals().update(PROMPT=args.prompt, OUTPUT=args.output, STATIC=args.static)
    t0 = time.perf_counter()
    models = {
        "prefill": CalibratedCostModel(PROFILE),
        "decode": CalibratedCostModel(PROFILE),
        "analytic": AnalyticCostModel(MODELS["qwen3-0.6b"], HARDWARE["h200-sxm"]),
    }
    rows = []
    for variant, cm in models.items():
        pricing = "decode" if variant == "decode" else "prefill"
        for b in args.batches:
            base = run(cm, b)
            for k in args.ks:
                for p in args.rates:
                    on = run(cm, b, k, p, pricing)
                    rows.append({
                        "pricing": variant, "batch": b, "k": k, "p": p,
                        "tpot_off_ms": base["tpot_s"] * 1e3, "tpot_on_ms": on["tpot_s"] * 1e3,
                        "tpot_speedup": base["tpot_s"] / on["tpot_s"],
                        "throughput_speedup": on["throughput"] / base["throughput"],
                        "mean_acceptance_length": on["mal"],
                    })  # fmt: skip
    print("| verify priced as | k | p | " + " | ".join(f"B={b}" for b in args.batches)
          + " | crossover B |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(args.batches) + "---|")
    for variant in models:
        for k in args.ks:
            for p in args.rates:
                cells = [r for r in rows if (r["pricing"], r["k"], r["p"]) == (variant, k, p)]
                hurt = [r["batch"] for r in cells if r["tpot_speedup"] < 1]
                text = [f"{r['tpot_speedup']:.2f} / {r['throughput_speedup']:.2f}" for r in cells]
                print(f"| {variant} | {k} | {p} | " + " | ".join(text)
                      + f" | {hurt[0] if hurt else '> ' + str(args.batches[-1])} |")  # fmt: skip
    print(f"\n(cells: TPOT speedup / throughput speedup; {time.perf_counter() - t0:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
