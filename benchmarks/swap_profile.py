"""Swap cost by block size and run length: the data for the simulator's swap term.

    python benchmarks/swap_profile.py --out swap_profile.csv          # GPU, Llama-3.1-8B shape
    python benchmarks/swap_profile.py --tiny --device cpu --out x.csv  # CPU smoke run

For each block size (8-128 tokens) and run length (1-64 blocks), swaps ``--blocks`` KV blocks
out of the engine's paged cache and back in (backend/kv_cache.py, the code
``ModelRunner.swap_out`` / ``swap_in`` call; no weights are needed, so none are loaded): GPU
ids shuffled, CPU ids in runs of that length with one free id between runs, so the engine
makes ``blocks / run length`` host <-> device copies each way. Times swap_out + synchronize
and swap_in + synchronize apart (median of ``--repeat`` after ``--warmup``), writes one CSV
row per direction and case, and fits per direction, by least squares on relative error,

    time = copies * latency + bytes / bandwidth          (the simulator's swap term)
    time = call + copies * latency + bytes / bandwidth   (plus a fixed cost per swap call)

printing each fit with its largest relative residual. The first fit's latency and bandwidth
are the analytic preset's ``host_link_latency_s`` and ``host_link_bandwidth``
(lab/sim/hardware.py). Each case moves at most ``--blocks`` blocks (4 GiB at block size 128
for Llama-3.1-8B; about 80 ms a copy on PCIe Gen5), so the run stays within a few minutes.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import GIB, device_line, tiny_qwen3

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.dtypes import DTYPES
from sched_lab.backend.kv_cache import KVCache
from sched_lab.core.kv import num_swap_runs
from sched_lab.core.model_presets import PRESETS

COLUMNS = ("direction", "block_size", "run_length", "num_blocks", "num_runs", "bytes",
           "time_s", "min_s", "max_s")  # fmt: skip


def cpu_ids(num_blocks: int, run_length: int) -> list[int]:
    """``num_blocks`` CPU ids in runs of ``run_length`` consecutive ids, one id apart."""
    return [i + i // run_length for i in range(num_blocks)]


def time_case(cache: KVCache, run_length: int, repeat: int, warmup: int, sync) -> dict:
    """Median seconds of swap_out + sync and of swap_in + sync for one arrangement."""
    n = cache.num_gpu_blocks
    gpu = random.Random(run_length).sample(range(n), n)
    out = list(zip(gpu, cpu_ids(n, run_length)))
    back = [(c, g) for g, c in out]
    times: dict[str, list[float]] = {"out": [], "in": []}
    for i in range(warmup + repeat):
        sync()
        t0 = time.perf_counter()
        cache.swap_out(out)
        sync()
        t1 = time.perf_counter()
        cache.swap_in(back)
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            times["out"].append(t1 - t0)
            times["in"].append(t2 - t1)
    runs = {"out": num_swap_runs(out, []), "in": num_swap_runs([], back)}
    return {d: (runs[d], times[d]) for d in ("out", "in")}


def fit(rows: list[dict], call: bool) -> tuple[np.ndarray, float]:
    """Least squares on relative error of time = [call +] runs * latency + bytes / bandwidth:
    (coefficients [call,] latency_s, s_per_byte; largest relative residual)."""
    y = np.array([r["time_s"] for r in rows])
    cols = [
        np.array([r["num_runs"] for r in rows], float),
        np.array([r["bytes"] for r in rows], float),
    ]
    x = np.stack(([np.ones(len(rows))] if call else []) + cols, axis=1)
    coef = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)[0]
    return coef, float(np.max(np.abs(x @ coef - y) / y))


def print_fit(direction: str, rows: list[dict]) -> None:
    for call in (False, True):
        coef, worst = fit(rows, call)
        lat, per_byte = coef[-2], coef[-1]
        bw = f"{1 / per_byte / 1e9:.1f} GB/s" if per_byte > 0 else f"{per_byte:.3g} s/B (<= 0)"
        head = f"call {coef[0] * 1e6:8.1f} us + " if call else ""
        print(f"fit swap_{direction}: {head}{lat * 1e6:7.2f} us per copy + bytes / {bw}; "
              f"max relative residual {worst:.1%}")  # fmt: skip


class TimedSwaps:
    """An executor that runs each plan's swaps on ``cache`` (timed, synchronized) and adds up
    the predictions of :func:`check`; every step lasts 10 ms of simulated time."""

    wall_clock = False

    def __init__(self, cache: KVCache, coef, flat, hw, sync) -> None:
        self.cache, self.coef, self.flat, self.hw, self.sync = cache, coef, flat, hw, sync
        self.measured: list[float] = []
        self.ratios: list[float] = []
        self.pred = {"a": 0.0, "b": 0.0, "c": 0.0}
        self.blocks = self.runs = 0

    def execute(self, plan):
        from sched_lab.core.plan import StepResult

        if not (plan.swap_out or plan.swap_in):
            return StepResult(0.01)
        t = p = 0.0
        for d, mapping in (("out", list(plan.swap_out)), ("in", list(plan.swap_in))):
            if not mapping:
                continue
            self.sync()
            t0 = time.perf_counter()
            (self.cache.swap_out if d == "out" else self.cache.swap_in)(mapping)
            self.sync()
            t += time.perf_counter() - t0
            runs = num_swap_runs(mapping, []) if d == "out" else num_swap_runs([], mapping)
            nbytes = len(mapping) * self.cache.block_bytes
            p += runs * self.coef[d][0] + nbytes * self.coef[d][1]
            self.pred["b"] += len(mapping) * self.flat[d]
            self.pred["c"] += (
                runs * self.hw.host_link_latency_s + nbytes / self.hw.host_link_bandwidth
            )
            self.blocks += len(mapping)
            self.runs += runs
        self.measured.append(t)
        self.pred["a"] += p
        self.ratios.append(p / t)
        return StepResult(0.01)


def check(config, device, dtype, sync, rows: list[dict], block_sizes, num_requests: int) -> None:
    """The swap policy's own swaps under memory pressure, timed on the device cache and
    predicted from ``rows`` (data the check never fed the fit: the fit saw arranged cases,
    this sees a scheduler's maps). Per block size: swap steps, blocks, copies, measured
    time, and the predictions of (a) copies x latency + bytes / bandwidth (this run's fit
    without a call cost, as the simulator charges), (b) a flat time per block fitted at block
    size 16 (the old calibrated term), (c) the analytic preset (10 us a copy, its bandwidth)."""
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.sim.hardware import HARDWARE
    from sched_lab.sim.replay import replay

    coef = {d: fit([r for r in rows if r["direction"] == d], False)[0] for d in ("out", "in")}
    flat = {}
    for d in ("out", "in"):  # time = c * blocks at block size 16, least squares on relative error
        r16 = [r for r in rows if r["direction"] == d and r["block_size"] == 16]
        x = np.array([r["num_blocks"] / r["time_s"] for r in r16])
        flat[d] = float(x.sum() / (x * x).sum()) if len(x) else float("nan")
    hw = HARDWARE["h200-sxm"]
    print("| block size | swap steps | blocks | copies | measured ms | fit ms (a) | "
          "flat/block ms (b) | analytic ms (c) | step ratio (a) p50 / p90 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for bs in block_sizes:
        gpu_blocks, cpu_blocks = 96, 1024
        cache = KVCache(config, bs, gpu_blocks, cpu_blocks, dtype, device)
        timed = TimedSwaps(cache, coef, flat, hw, sync)
        bm = make_block_manager(gpu_blocks, cpu_blocks, bs, 0.0, False)
        scheduler = get_policy("swap")(SchedulerLimits(256, 1_000_000, 1_000_000), bm)
        reqs = [Request(str(i), i * 0.002, bs * (2 + i % 5) + 3, bs * (3 + i % 4))
                for i in range(num_requests)]  # fmt: skip
        result = replay(reqs, scheduler, timed)
        measured, pred = timed.measured, timed.pred
        warm = measured[1:] or measured  # the first swap pays one-time setup
        total = sum(warm) * len(measured) / max(len(warm), 1)
        r = np.array(timed.ratios)
        print(f"| {bs} | {len(measured)} | {timed.blocks} | {timed.runs} | {total * 1e3:.2f} | "
              f"{pred['a'] * 1e3:.2f} | {pred['b'] * 1e3:.2f} | {pred['c'] * 1e3:.2f} | "
              + (f"{np.median(r):.2f} / {np.quantile(r, 0.9):.2f} |" if len(r) else "- |")
              + ("" if result.failure is None else f" failure: {result.failure}"),
              flush=True)  # fmt: skip
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model's KV (smoke runs)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--run-lengths", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--blocks", type=int, default=256, help="blocks swapped per case")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", help="CSV to write (default: $OUT/swap_profile.csv, else ./)")
    ap.add_argument("--check", type=int, default=0, metavar="N",
                    help="then replay N requests under the swap policy short of GPU blocks at "
                         "each block size, timing its swaps against the fitted model")  # fmt: skip
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device (use --device cpu for a smoke run)",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "swap_profile.csv")
    config = ModelConfig.from_dict(tiny_qwen3(4096) if args.tiny else PRESETS[args.preset])
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    name = "tiny" if args.tiny else args.preset
    print(f"# swap profile, {name}, {args.dtype}, "
          f"{device_line() if device.type == 'cuda' else 'cpu'}", flush=True)  # fmt: skip
    rows = []
    for bs in args.block_sizes:
        # CPU ids of runs of length 1 need 2n - 1 ids (one free id after each run)
        cache = KVCache(config, bs, args.blocks, 2 * args.blocks, dtype, device)
        t0 = time.perf_counter()
        for length in args.run_lengths:
            for direction, (runs, times) in time_case(
                cache, length, args.repeat, args.warmup, sync
            ).items():
                row = dict(direction=direction, block_size=bs, run_length=length,
                           num_blocks=args.blocks, num_runs=runs,
                           bytes=args.blocks * cache.block_bytes,
                           time_s=statistics.median(times), min_s=min(times), max_s=max(times))  # fmt: skip
                rows.append(row)
                print(f"block_size {bs:4d} run {length:3d} ({runs:4d} copies, "
                      f"{row['bytes'] / GIB:6.3f} GiB) swap_{direction:3s} "
                      f"{row['time_s'] * 1e3:9.3f} ms", flush=True)  # fmt: skip
        print(f"block_size {bs}: {time.perf_counter() - t0:.1f} s", flush=True)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    for direction in ("out", "in"):
        print_fit(direction, [r for r in rows if r["direction"] == direction])
    if args.check:
        check(config, device, dtype, sync, rows, args.block_sizes, args.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
