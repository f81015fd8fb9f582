"""Where does a replay step's time go, and is a step slower the first time it runs?

    python benchmarks/replay_parts.py --protocol benchmarks/fidelity_dev.yaml --slice conv \
        --rate-scale 3.6 --out /tmp/parts.csv

Runs one engine replay (fcfs, the protocol's engine config and one of its trace windows)
with the executor instrumented: for each step, the seconds of the whole
``EngineExecutor.execute`` and of ``runner.execute`` inside it; then the very same inputs
run twice more at once (``rerun_s``, ``rerun2_s``: greedy sampling, so the KV written and
the tokens sampled are the same again and the replay goes on unchanged, only later). A
first run slower than its reruns is a cost of the step being new (a new request's rows,
other blocks, another graph than the step before), which a profile that repeats one step
never sees. Prints the medians by step kind and prompt-token bin; the CSV has every step.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from sched_lab.backend.engine import EngineExecutor, StepResult  # noqa: E402
from sched_lab.config import validate  # noqa: E402
from sched_lab.run.experiment import run_experiment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", required=True)
    ap.add_argument("--slice", required=True)
    ap.add_argument("--rate-scale", type=float, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    protocol = yaml.safe_load(Path(args.protocol).read_text())
    raw = copy.deepcopy(protocol["experiment"])
    raw.update(name="replay_parts", trace={**protocol["slices"][args.slice],
               "rate_scale": args.rate_scale}, policies=["fcfs"])  # fmt: skip
    cfg = validate(raw, args.protocol, ROOT)
    rows = []

    real_execute = EngineExecutor.execute
    last: dict = {}  # the runner call inside the step being executed: its inputs and time

    def execute(self, plan) -> StepResult:
        """The executor's own execute, timed whole and around its runner call; then the
        same runner inputs twice more."""
        runner = self.runner
        if "_untimed_execute" not in vars(runner):  # wrap this runner's execute once
            run = runner.execute

            def timed(seqs):
                t = time.perf_counter()
                out = run(seqs)
                last.update(seqs=seqs, s=time.perf_counter() - t)
                return out

            runner.execute, runner._untimed_execute = timed, run
        t0 = time.perf_counter()
        result = real_execute(self, plan)
        execute_s = time.perf_counter() - t0
        again = []
        if plan.prefills or len(rows) % 10 == 0:
            for _ in range(2):
                ta = time.perf_counter()
                runner._untimed_execute(last["seqs"])
                again.append(time.perf_counter() - ta)
        f = plan.features()
        rows.append({"num_prefill_tokens": f.num_prefill_tokens, "num_prefills": f.num_prefills,
                     "num_decodes": f.num_decodes, "prefill_context_tokens":
                     f.prefill_context_tokens, "execute_s": execute_s, "runner_s": last["s"],
                     "rerun_s": again[0] if again else None,
                     "rerun2_s": again[1] if again else None})  # fmt: skip
        return result

    EngineExecutor.execute = execute
    run_experiment(cfg, progress=False)
    df = pd.DataFrame(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    df["kind"] = "decode"
    df.loc[df.num_prefills > 0, "kind"] = "prefill"
    df.loc[(df.num_prefills > 0) & (df.num_decodes > 0), "kind"] = "mixed"
    bins = [-1, 0, 256, 512, 1024, 2048, 4096, 8192, 1 << 20]
    df["tokens"] = pd.cut(df.num_prefill_tokens, bins)
    g = df.dropna(subset=["rerun_s"]).groupby(["kind", "tokens"], observed=True)
    table = pd.DataFrame({"steps": g.size(), "runner_ms": g.runner_s.median() * 1e3,
                          "rerun_ms": g.rerun_s.median() * 1e3,
                          "rerun2_ms": g.rerun2_s.median() * 1e3,
                          "first/rerun2": (g.runner_s.median() / g.rerun2_s.median()),
                          "executor_extra_us": (g.execute_s.median() - g.runner_s.median()) * 1e6})  # fmt: skip
    print(table.round(3).to_string())


if __name__ == "__main__":
    main()
