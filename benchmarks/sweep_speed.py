"""Wall time of one 64-point sweep serially, on the local process pool and on a local Ray.

    python benchmarks/sweep_speed.py [--jobs 2] [--rounds 1] [--no-ray] [--limit 200]

The sweep (written to a temporary folder): the first ``--limit`` requests of the Azure
2023 conversation trace, fcfs and chunked_prefill, over a 4 x 4 x 4 grid of rate_scale,
KV blocks and max_num_seqs. Each executor runs it as ``sched-lab run`` does, in a
subprocess (interpreter start, Ray start-up and writing the results included), in turns
(serial, pool, ray, then the reverse order; ``--rounds`` times), so that a machine shared with other work loads
all of them alike; the ratios within one round are the result. Last, the time ``ray.init`` takes to start a
local Ray, twice. Every executor's results
folder is compared with the serial one, file by file (timing.json aside).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SWEEP = """name: sweep_64
trace: {{format: azure2023, path: traces/data/azure2023_conv.csv, limit: {limit}}}
model: llama-3.1-8b
hardware: h200-sxm
policies: [fcfs, {{name: chunked_prefill, max_num_batched_tokens: 2048}}]
slo: {{ttft_s: 2.0, tpot_s: 0.05}}
sweep:
  grid:
    trace.rate_scale: [1, 2, 4, 8]
    kv_cache.num_gpu_blocks: [512, 1024, 2048, 4096]
    scheduler.max_num_seqs: [32, 64, 128, 256]
"""


def files_of(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "timing.json"
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args(argv)
    modes = {"serial": ["--jobs", "1"], "pool": ["--jobs", str(args.jobs)]}
    if not args.no_ray and importlib.util.find_spec("ray") is not None:
        modes["ray"] = ["--ray", "--jobs", str(args.jobs)]
    with tempfile.TemporaryDirectory() as tmp:
        yaml = Path(tmp) / "sweep_64.yaml"
        yaml.write_text(SWEEP.format(limit=args.limit))
        for rnd in range(args.rounds):
            walls, files = {}, {}
            order = list(modes) if rnd % 2 == 0 else list(reversed(modes))  # drift cancels
            for mode in order:
                out = Path(tmp) / f"{mode}{rnd}"
                cmd = [sys.executable, str(ROOT / "run_experiment.py"), str(yaml), "--out",
                       str(out), "--no-progress", *modes[mode]]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
                walls[mode] = time.perf_counter() - t0
                inner = json.loads((out / "timing.json").read_text())["wall_s"]
                files[mode] = files_of(out)
                print(
                    f"round {rnd} {mode:6s}: {walls[mode]:6.1f} s wall ({inner:6.1f} s "
                    f"running the points), {len(files[mode])} files"
                )
            for mode in modes:
                same = "identical" if files[mode] == files["serial"] else "DIFFERENT"
                print(f"round {rnd} {mode:6s}: {same} to serial, "
                      f"{walls['serial'] / walls[mode]:.2f}x serial's speed")  # fmt: skip
        if "ray" in modes:
            code = (
                "import time, ray; t = time.perf_counter(); ray.init(num_cpus=2, "
                "include_dashboard=False); print(time.perf_counter() - t); ray.shutdown()"
            )
            for _ in range(2):
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                print(f"local ray.init: {float(r.stdout.split()[-1]):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
