"""Does a step shape take the same time in the profile grid as inside a replay?

    python benchmarks/profile_conditions.py --model-dir checkpoints/qwen3-0.6b --out /tmp/pc.csv

The profile (backend/profile.py) times each grid row by running the very same step again
and again: the same block-table lists (the host mirror converts nothing), the same token
ids (7 everywhere), the same CUDA graph as the step before. Inside a replay every prefill
is a new request (new block-table lists, new blocks, real token ids) and usually follows a
decode step run by another graph; a decode's lists grow in place and its positions move on
by one each step. This times a few step shapes under each condition, alone and together:

* ``grid``: as the profile does now;
* ``fresh``: new block-table lists over other blocks and random token ids at every run;
* ``after_decode``: an untimed 8-sequence decode step right before each timed run;
* ``fresh_after``: both;
* ``advancing`` (decode rows): positions +1 per run, the block lists grown in place.

Each (shape, condition) is the median of ``--passes`` passes x ``--repeat`` runs, timed as
the profile times a step (launch to device sync). The CSV has one row per (shape,
condition); the table printed gives each condition's time over ``grid``'s.
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sched_lab.backend.profile import execute_launched  # noqa: E402
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402

PREFILLS = [(0, n) for n in (128, 512, 1024, 1536, 2048, 3072, 4096, 8192)] + [(1024, 1024)]
MIXED = [(1024, 8), (512, 32)]  # (prefill tokens over no prefix, decodes of context 1024)
DECODES = [(1, 1024), (8, 1024), (32, 1024), (128, 1024)]
SIDE = (8, 1024)  # the untimed decode step before each timed run (``after_decode``)


class Blocks:
    """Hands out fresh, never-reused runs of block ids (wrapping around the cache)."""

    def __init__(self, num_blocks: int, start: int = 0) -> None:
        self.num_blocks, self.next = num_blocks, start

    def take(self, n: int) -> list[int]:
        if self.next + n > self.num_blocks:
            self.next = 0
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def prompt_seq(cached: int, n: int, blocks: Blocks, bs: int, rng, fresh: bool,
               vocab: int) -> SeqInput:  # fmt: skip
    tokens = rng.integers(0, vocab, n).tolist() if fresh else [7] * n
    return SeqInput(tokens, cached, blocks.take(-(-(cached + n + 1) // bs)), True)


def decode_seqs(b: int, ctx: int, blocks: Blocks, bs: int) -> list[SeqInput]:
    return [SeqInput([7], ctx - 1, blocks.take(-(-(ctx + 1) // bs)), True) for _ in range(b)]


def time_shape(runner, shape, cond, repeat, rng, bs) -> list[float]:
    kind, spec = shape
    half = runner.num_gpu_blocks // 2
    blocks, side = Blocks(half), Blocks(runner.num_gpu_blocks, half)  # timed / side steps
    fresh = cond in ("fresh", "fresh_after")
    after = cond in ("after_decode", "fresh_after")
    side_step = decode_seqs(*SIDE, side, bs)
    vocab = runner.config.vocab_size

    def build() -> list[SeqInput]:
        if kind == "prefill":
            return [prompt_seq(*spec, blocks, bs, rng, fresh, vocab)]
        if kind == "mixed":
            n, d = spec
            return [prompt_seq(0, n, blocks, bs, rng, fresh, vocab),
                    *decode_seqs(d, SIDE[1], blocks, bs)]  # fmt: skip
        return decode_seqs(*spec, blocks, bs)

    seqs = build()
    times = []
    for i in range(repeat + 1):  # the first run warms up
        if fresh and kind != "decode":
            seqs = build()
        if cond == "advancing":  # each decode one position on, its list grown in place
            for s in seqs:
                s.start_pos += 1
                if s.start_pos + 2 > len(s.block_table) * bs:
                    s.block_table.append(blocks.take(1)[0])
        if after:
            runner.execute(side_step)
        t0 = time.perf_counter()
        execute_launched(runner, seqs)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = ModelRunner(args.model_dir, device=device, dtype="bfloat16",
                         attention_backend="triton", block_size=16,
                         gpu_memory_utilization=0.9)  # fmt: skip
    bs = runner.block_size
    gc.collect()
    gc.freeze()
    shapes = [("prefill", p) for p in PREFILLS] + [("mixed", m) for m in MIXED]
    shapes += [("decode", d) for d in DECODES]
    conds = {k: ("grid", "fresh", "after_decode", "fresh_after") for k in ("prefill", "mixed")}
    conds["decode"] = ("grid", "after_decode", "advancing")
    rng = np.random.default_rng(0)
    samples: dict[tuple, list[float]] = {}
    for p in range(args.passes):
        for shape in shapes:
            for cond in conds[shape[0]]:
                runs = time_shape(runner, shape, cond, args.repeat, rng, bs)
                samples.setdefault((shape, cond), []).extend(runs)
        print(f"pass {p + 1}/{args.passes} done", flush=True)
    rows = []
    for (shape, cond), runs in samples.items():
        rows.append({"kind": shape[0], "shape": "x".join(map(str, shape[1])), "condition": cond,
                     "median_s": float(np.median(runs)), "min_s": float(np.min(runs)),
                     "max_s": float(np.max(runs))})  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    grid = {(r["kind"], r["shape"]): r["median_s"] for r in rows if r["condition"] == "grid"}
    print(f"{'kind':8s} {'shape':10s} {'condition':12s} {'ms':>9s} {'/grid':>7s}")
    for r in rows:
        ratio = r["median_s"] / grid[(r["kind"], r["shape"])]
        print(f"{r['kind']:8s} {r['shape']:10s} {r['condition']:12s} "
              f"{r['median_s'] * 1e3:9.3f} {ratio:7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
