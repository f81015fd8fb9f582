"""Does a step take longer when it feeds varied token ids, or over scattered KV blocks?

    python benchmarks/token_ids_probe.py --out $OUT/token_ids_probe.csv      # Qwen3-0.6B, GPU
    python benchmarks/token_ids_probe.py --preset llama-3.1-8b --out $OUT/token_ids_8b.csv
    python benchmarks/token_ids_probe.py --dry-run --out /tmp/tp.csv        # CPU, tiny model

The profile grid (backend/profile.py ``step_inputs``) feeds token id 7 in every row, each
sequence over consecutive blocks; an engine replay feeds each prompt's random ids
(backend/engine.py, ``prompt_token_ids`` drawn uniformly from the vocabulary) over the
blocks the allocator hands out. On the Llama-3.1-8B held-out windows a replayed prompt of
~1,024 tokens over no prefix takes 1.13x the grid row of that very shape (Qwen3-0.6B's:
1.00x; BENCHMARKS.md, "Step-level error on the long windows"); the 8B's prompt steps run
near the H200's bf16 peak, where a matmul's time can depend on the values it multiplies.
This probe times the same shapes three ways on one runner, as the profile times a row
(launch to device sync): ``constant`` (the grid: id 7, consecutive blocks), ``random``
(random ids, consecutive blocks) and ``scattered`` (random ids over blocks drawn at random
from the cache).

Shapes (``SHAPES``): one prompt of 512-8192 tokens over no prefix (in the CUDA graphs),
one of 12,288 (eager, above the largest graph), a 1,024-token chunk beside 32 decodes,
and decode batches of 16 and 128 at context 1,024; shapes whose blocks do not fit the
cache are left out. For each pass, each shape runs ``--repeat`` times per variant after a
warm-up, the variants' order reversed every other pass, so a slow spell of the host falls
on all of them. Where ``nvidia-smi`` exists, the SM clock and power draw are sampled every
100 ms during a busy loop of the 8,192-token prompt in each variant.

The CSV has one row per (shape, variant, pass): the median seconds of its repeats. The
table printed gives per shape the median over passes of each variant, and their ratios.
"""

from __future__ import annotations

import argparse
import csv
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import checkpoint, tiny_qwen3

from sched_lab.backend.profile import execute_launched
from sched_lab.backend.runner import ModelRunner, SeqInput

# name -> (prompt tokens of one prompt over no prefix, decodes at CONTEXT)
SHAPES = {
    "prefill_512": (512, 0),
    "prefill_2048": (2048, 0),
    "prefill_4096": (4096, 0),
    "prefill_8192": (8192, 0),
    "prefill_12288_eager": (12288, 0),
    "mixed_1024+32": (1024, 32),
    "decode_16": (0, 16),
    "decode_128": (0, 128),
}
DRY_SHAPES = {"prefill_64": (64, 0), "mixed_32+4": (32, 4), "decode_4": (0, 4)}
CONTEXT = 1024
VARIANTS = ("constant", "random", "scattered")
CONSTANT_ID = 7  # backend/profile.py's token


def seqs_of(prompt: int, decodes: int, context: int, bs: int, ids, blocks) -> list[SeqInput]:
    """The step's SeqInputs, each over its own blocks, taken in order from the list
    ``blocks``; ``ids(n)`` gives n token ids."""
    seqs, nxt = [], 0
    if prompt:
        n = -(-(prompt + 1) // bs)
        seqs.append(SeqInput(ids(prompt), 0, blocks[nxt : nxt + n], True))
        nxt += n
    per = -(-(context + 1) // bs)
    for _ in range(decodes):
        seqs.append(SeqInput(ids(1), context - 1, blocks[nxt : nxt + per], True))
        nxt += per
    return seqs


def timed(runner, seqs) -> float:
    t0 = time.perf_counter()
    execute_launched(runner, seqs)
    return time.perf_counter() - t0


def sample_gpu(runner, seqs, seconds: float) -> str:
    """Run ``seqs`` in a busy loop for ``seconds`` while nvidia-smi samples the SM clock and
    power every 100 ms; their medians as text, or '' where nvidia-smi cannot run."""
    try:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
    except OSError:
        return ""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        execute_launched(runner, seqs)
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    vals = []
    for line in out.splitlines():
        try:
            vals.append([float(v) for v in line.split(",")])
        except ValueError:
            continue
    if not vals:
        return ""
    clock, power = np.median(np.array(vals), axis=0)
    return f"SM clock {clock:.0f} MHz, power {power:.0f} W ({len(vals)} samples)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--preset", default="qwen3-0.6b",
                    help="model shape (lab/core/model_presets.py); its random-weight checkpoint "
                    "checkpoints/PRESET is made when missing")  # fmt: skip
    ap.add_argument("--model-dir", help="a checkpoint folder instead of --preset's")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per shape and variant")
    ap.add_argument("--busy-s", type=float, default=2.0, help="busy loop of the clock sample")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, small shapes")
    args = ap.parse_args()
    if args.passes < 1 or args.repeat < 1 or not args.busy_s >= 0:
        ap.error("--passes and --repeat must be >= 1, --busy-s >= 0")
    shapes, context = SHAPES, CONTEXT
    if args.dry_run:
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        model_dir = Path(tempfile.mkdtemp()) / "tiny"
        write_random_checkpoint(tiny_qwen3(512), model_dir, dtype="float32", std=0.2)
        kwargs = dict(device="cpu", dtype="float32", attention_backend="torch")
        shapes, context = DRY_SHAPES, 64
    elif not torch.cuda.is_available():
        sys.exit("token_ids_probe.py: needs a CUDA GPU (or --dry-run)")
    else:
        model_dir = Path(args.model_dir) if args.model_dir else checkpoint(args.preset)
        kwargs = dict(device="cuda", dtype="bfloat16", attention_backend="triton",
                      gpu_memory_utilization=0.9)  # fmt: skip
    runner = ModelRunner(model_dir, block_size=16, **kwargs)
    bs = runner.block_size
    shapes = {name: (p, d) for name, (p, d) in shapes.items()
              if -(-(p + 1) // bs) + d * -(-(context + 1) // bs) <= runner.num_gpu_blocks}  # fmt: skip
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(0)
    const, rand = (lambda n: [CONSTANT_ID] * n), (lambda n: rng.integers(0, vocab, n).tolist())
    ordered = list(range(runner.num_gpu_blocks))
    shuffled = rng.permutation(runner.num_gpu_blocks).tolist()
    how = {"constant": (const, ordered), "random": (rand, ordered),
           "scattered": (rand, shuffled)}  # fmt: skip
    gc.collect()
    gc.freeze()
    t_start = time.perf_counter()
    rows = []
    for p in range(args.passes):
        for name, (prompt, decodes) in shapes.items():
            for variant in VARIANTS if p % 2 == 0 else VARIANTS[::-1]:
                seqs = seqs_of(prompt, decodes, context, runner.block_size, *how[variant])
                execute_launched(runner, seqs)  # warm-up
                t = [timed(runner, seqs) for _ in range(args.repeat)]
                rows.append({"shape": name, "variant": variant, "pass": p,
                             "median_s": float(np.median(t))})  # fmt: skip
    clocks = {}
    if not args.dry_run:
        big = "prefill_8192"  # the largest prompt in a CUDA graph
        for variant in VARIANTS if big in shapes else ():
            seqs = seqs_of(*shapes[big], context, runner.block_size, *how[variant])
            clocks[variant] = sample_gpu(runner, seqs, args.busy_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} rows in {time.perf_counter() - t_start:.1f} s -> {args.out}")
    print(f"{'shape':20s} {'constant ms':>12s} {'random ms':>10s} {'scattered ms':>13s} "
          f"{'random/constant':>16s} {'scattered/constant':>19s}")  # fmt: skip
    for name in shapes:
        med = {v: np.median([r["median_s"] for r in rows
                             if r["shape"] == name and r["variant"] == v]) for v in VARIANTS}  # fmt: skip
        print(f"{name:20s} {med['constant'] * 1e3:12.3f} {med['random'] * 1e3:10.3f} "
              f"{med['scattered'] * 1e3:13.3f} {med['random'] / med['constant']:16.3f} "
              f"{med['scattered'] / med['constant']:19.3f}")  # fmt: skip
    for variant, text in clocks.items():
        print(f"busy loop of the largest prompt, {variant} ids: {text or 'nvidia-smi not read'}")


if __name__ == "__main__":
    main()
