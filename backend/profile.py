"""Profile the engine over a grid of step shapes; the data the calibrated cost model fits.

    python -m sched_lab.backend.profile --model-dir checkpoints/qwen3-0.6b --out profiles/h200_qwen3-0.6b.csv

Each row is one step shape, timed as the engine executor times a step (input preparation,
forward, sampling, device sync; swaps for the swap rows): ``duration_s``, and ``host_s``, the
seconds from the step's start until it is launched (swaps, input preparation and the launch
of its kernels or CUDA graph and of sampling; no device sync): the host part of the step,
which asynchronous scheduling overlaps with the device's previous step
(lab/sim/calibrated.py). On CUDA that is the host time until the launch calls return; on a
CPU, whose operations run as they are called, it is nearly the whole step. Both are the
median of ``--passes`` passes
over the whole grid, ``--repeat`` runs per row each after a warm-up run. Passes, not
back-to-back repeats, because the host slows down now and then for a second or more, over
several consecutive rows: a slow spell must fall in one pass, not on every run of a row.
Columns are the
:class:`sched_lab.core.plan.StepFeatures` fields plus ``duration_s`` and ``host_s`` (left out for a
tensor-parallel runner, whose steps run in other processes); the header lines (``#``) record
the date, device, engine commit, model shape and the engine fingerprint
(:mod:`sched_lab.core.fingerprint`: a hash of backend/**/*.py, torch/triton versions, GPU, dtype,
attention backend, engine options) as one JSON line.

Grid: decode-only batches (1-256 sequences, contexts 128-4096; and 8-64 sequences of uneven,
log-normal contexts), prefill chunks (16-8192 tokens over cached prefixes of 0-4096; 16-1024 over 16k-32k),
several prompts at once, steps of 12k and 16k prompt tokens (one prompt to 16; eager, above
the largest CUDA graph), eager steps of 12k-24k prompt tokens over cached prefixes of 512-4096
(one prompt to 4; they run the paged Triton kernel where chunks from position 0 run
FlashAttention varlen), prefill chunks mixed with decodes, and swap-out + swap-in of 1-256
blocks alongside 8 or 64 decodes. Rows whose blocks, length or sequences do not fit the
runner are left out (:func:`fits_runner`). ``--grid small`` keeps a few points of each kind
(no eager or long-prefix rows), for a profile of a large model in a few minutes.

LoRA (``--lora-dir DIR``: PEFT adapters ``lora-0 .. lora-{N-1}``, as ``sched-lab tools
make-random-lora`` writes them): the runner gets them all, with ``--max-loras`` GPU slots, for
every row (so the rows without adapters time a LoRA-enabled engine with none in the batch,
as an engine run with a ``lora:`` section runs them), and the grid gains rows with adapters:
decode batches of 8-128 sequences at two contexts spread round-robin over 1, 4, 16 or 32
distinct adapters (at most N, ``--max-loras`` and the batch), and prefill and mixed steps
with adapters. Their ``num_loras`` and ``num_lora_tokens`` are set (0 in the other rows); a
``# lora: rank R, ...`` header line names the adapters' rank. The calibrated model fits the
LoRA terms from them (lab/sim/calibrated.py). Each row's adapters are loaded into their
slots by its warm-up run, so no timed run pays a load.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sched_lab.backend.sources import sources_fingerprint
from sched_lab.core.errors import UserError
from sched_lab.core.fingerprint import HEADER_PREFIX
from sched_lab.core.outputs import check_output, write_output
from sched_lab.core.plan import StepFeatures

if TYPE_CHECKING:  # torch and the runner load in the functions: --help works without torch
    from sched_lab.backend.runner import ModelRunner, SeqInput

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096)
PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_PREFIXES = (0, 1024, 4096)
# Short chunks over long cached prefixes: the shapes prefix caching makes (a prompt whose
# first 16k-32k tokens are cached prefills only its tail); rows whose blocks do not fit
# the device cache are left out.
LONG_PREFIX_CHUNKS = [(c, n) for c in (16384, 32768) for n in (16, 256, 1024)]
MIXED = [(d, n) for d in (8, 32, 128) for n in (256, 512, 1024, 2048)]
# Steps above 8,192 tokens (the largest CUDA graph, backend/cuda_graphs.py) run eagerly:
# (prompts, tokens each) of 12k and 16k tokens, one long prompt or many short ones, so the
# fit sees the eager slope apart from the attention pairs (lab/sim/calibrated.py). All start
# at position 0: FlashAttention varlen runs their pairs (but 16 x 768's: chunks under 1,024).
EAGER_PREFILLS = [(1, 12288), (2, 6144), (4, 3072), (8, 1536), (16, 768),
                  (1, 16384), (4, 4096), (8, 2048), (16, 1024)]  # fmt: skip
# Eager steps whose chunks read a cached prefix, as prefix caching makes them (a hit of one
# or more blocks, then the prompt's tail): the paged Triton kernel runs their pairs, not
# FlashAttention varlen (backend/attention/flash_varlen.py), so the fit sees that kernel's
# surcharge at eager sizes (c12, lab/sim/calibrated.py), not only inside the CUDA graphs.
# (prompts, cached tokens each, new tokens each): 12k-24k new tokens in all, 31-314 million
# pairs; the 16k- and 24k-token prompts fit only a runner with max_model_len above 16,384.
EAGER_PREFIX_PREFILLS = [(1, 512, 12288), (2, 512, 6144), (4, 1024, 3072),
                         (1, 4096, 12288), (1, 2048, 16384), (1, 512, 24576)]  # fmt: skip
EAGER_KINDS = ("prefill_eager", "prefill_eager_prefix")
EAGER_MIN_ROWS = (
    3  # sched_lab.sim.calibrated.MIN_EAGER_ROWS (backend does not import sched_lab.sim)
)
SWAP_BLOCKS = (1, 4, 16, 64, 256)
# StepFeatures fields the profile leaves out. num_swap_runs: every swap row copies one run of
# CPU blocks each way, so a runs column would only alias the fixed cost of a swap step; the
# calibrated fit then charges swaps per byte (lab/sim/calibrated.py), and the per-transfer
# latency comes from benchmarks/swap_profile.py.
LEFT_OUT = ("num_swap_runs",)
UNEVEN_BATCHES = (8, 32, 64)  # decode batches of log-normal contexts (median 1k, sigma 1)
# --grid small: a few points of each kind, enough rows for every coefficient but the eager one
SMALL_DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
SMALL_DECODE_CONTEXTS = (256, 1024, 4096)
SMALL_PREFILL_LENGTHS = (16, 128, 512, 1024, 2048, 4096)
SMALL_PREFILL_PREFIXES = (0, 1024)
SMALL_MIXED = [(d, n) for d in (8, 32) for n in (512, 2048)]
# LoRA rows (--lora-dir): decode batches x contexts x distinct adapters in the batch (capped
# by the adapters, --max-loras and the batch); (prompts, tokens each) of prefill steps, one
# adapter per prompt; (decodes, chunk tokens, adapters) of mixed steps (decodes at
# LORA_MIXED_CONTEXT, the chunk over LORA_MIXED_CACHED cached tokens)
LORA_DECODE_BATCHES = (8, 32, 64, 128)
LORA_DECODE_CONTEXTS = (512, 2048)
LORA_COUNTS = (1, 4, 16, 32)
LORA_PREFILLS = [(1, 256), (1, 1024), (4, 256), (4, 1024)]
LORA_MIXED = [(32, 512, 4), (32, 512, 16)]
LORA_MIXED_CONTEXT, LORA_MIXED_CACHED = 1024, 512
SMALL_LORA_DECODE_CONTEXTS = (1024,)
MAX_PROFILE_LORAS = 32  # --max-loras default: the adapters found, at most this


def shapes(small: bool = False) -> list[tuple[str, list[tuple[int, int]], list[int], int]]:
    """(kind, prefill chunks as (cached, new), decode contexts, swap blocks) per grid point;
    ``small``: the ``--grid small`` points."""
    if small:
        return small_shapes()
    grid = []
    for b in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            grid.append(("decode", [], [ctx] * b, 0))
    for b in UNEVEN_BATCHES:  # the decode kernel's time should follow the sum of contexts
        ctx = np.random.default_rng(b).lognormal(np.log(1024), 1.0, b)
        grid.append(("decode_uneven", [], np.clip(ctx, 64, 8192).astype(int).tolist(), 0))
    for n in PREFILL_LENGTHS:
        for c in PREFILL_PREFIXES:
            grid.append(("prefill", [(c, n)], [], 0))
    for c, n in LONG_PREFIX_CHUNKS:
        grid.append(("prefill_long_prefix", [(c, n)], [], 0))
    for k in (2, 4, 8):
        for n in (256, 1024):
            grid.append(("prefill", [(0, n)] * k, [], 0))
    for k, n in EAGER_PREFILLS:
        grid.append(("prefill_eager", [(0, n)] * k, [], 0))
    for k, c, n in EAGER_PREFIX_PREFILLS:
        grid.append(("prefill_eager_prefix", [(c, n)] * k, [], 0))
    for d, n in MIXED:
        grid.append(("mixed", [(512, n)], [1024] * d, 0))
    for d in (8, 64):  # two batch sizes, so a held-out swap row has neighbours in the fit
        for s in SWAP_BLOCKS:
            grid.append(("swap", [], [1024] * d, s))
    return grid


def small_shapes() -> list[tuple[str, list[tuple[int, int]], list[int], int]]:
    """:func:`shapes` of ``--grid small``."""
    grid = []
    for b in SMALL_DECODE_BATCHES:
        for ctx in SMALL_DECODE_CONTEXTS:
            grid.append(("decode", [], [ctx] * b, 0))
    ctx = np.random.default_rng(32).lognormal(np.log(1024), 1.0, 32)
    grid.append(("decode_uneven", [], np.clip(ctx, 64, 8192).astype(int).tolist(), 0))
    for n in SMALL_PREFILL_LENGTHS:
        for c in SMALL_PREFILL_PREFIXES:
            grid.append(("prefill", [(c, n)], [], 0))
    for n in (256, 1024):
        grid.append(("prefill", [(0, n)] * 4, [], 0))
    for d, n in SMALL_MIXED:
        grid.append(("mixed", [(512, n)], [1024] * d, 0))
    for s in (4, 64):
        grid.append(("swap", [], [1024] * 8, s))
    return grid


def lora_shapes(
    max_adapters: int, small: bool = False
) -> list[tuple[str, list[tuple[int, int]], list[int], int, list[str]]]:
    """The LoRA rows: :func:`shapes`' tuples plus each sequence's adapter (prefill chunks
    first, then decodes), round-robin over ``lora-0 .. lora-{k-1}`` for k distinct adapters
    (k <= ``max_adapters``)."""

    def names(num_seqs: int, k: int) -> list[str]:
        return [f"lora-{i % k}" for i in range(num_seqs)]

    grid = []
    contexts = SMALL_LORA_DECODE_CONTEXTS if small else LORA_DECODE_CONTEXTS
    for b in LORA_DECODE_BATCHES:
        counts = sorted({min(k, max_adapters, b) for k in LORA_COUNTS})
        for ctx in contexts:
            for k in counts:
                grid.append(("lora_decode", [], [ctx] * b, 0, names(b, k)))
    for p, n in LORA_PREFILLS[1::2] if small else LORA_PREFILLS:
        grid.append(("lora_prefill", [(0, n)] * p, [], 0, names(p, min(p, max_adapters))))
    for d, n, k in LORA_MIXED[:1] if small else LORA_MIXED:
        chunk, decodes = [(LORA_MIXED_CACHED, n)], [LORA_MIXED_CONTEXT] * d
        grid.append(("lora_mixed", chunk, decodes, 0, names(d + 1, min(k, max_adapters))))
    return grid


def features(chunks, decodes, swap_blocks, lora_names=()) -> StepFeatures:
    """The StepFeatures of a grid point; ``lora_names``: each sequence's adapter ("" = none),
    chunks first, as :func:`step_inputs` orders them."""
    fed = [n for _, n in chunks] + [1] * len(decodes)
    with_lora = [(name, t) for name, t in zip(lora_names, fed) if name]
    return StepFeatures(
        num_prefill_tokens=sum(n for _, n in chunks),
        num_prefills=len(chunks),
        prefill_context_tokens=sum(c for c, _ in chunks),
        prefill_attention_pairs=float(sum(n * c + n * (n + 1) / 2 for c, n in chunks)),
        num_decodes=len(decodes),
        decode_context_tokens=sum(decodes),
        num_samples=len(chunks) + len(decodes),
        num_swap_blocks=2 * swap_blocks,
        num_loras=len({name for name, _ in with_lora}),
        num_lora_tokens=sum(t for _, t in with_lora),
    )


def step_inputs(
    chunks, decodes, block_size, lora_names=(), vocab_size: int | None = None, seed: int = 0
) -> list[SeqInput]:
    """The step's SeqInputs, each over its own blocks; ``lora_names`` as in :func:`features`.
    Token ids: drawn uniformly from ``[0, vocab_size)`` (seeded by ``seed``), as an engine
    replay draws a trace prompt's (backend/engine.py ``assign_prompt_tokens``); id 7
    everywhere when ``vocab_size`` is None. The ids matter on a large model: its prefill
    matmuls draw more power with varied inputs, and the GPU lowers its clock (Llama-3.1-8B
    on an H200: prompts of 2k-4k tokens 1.15x the time of constant ids, BENCHMARKS.md)."""
    import numpy as np

    from sched_lab.backend.runner import SeqInput

    rng = np.random.default_rng(seed) if vocab_size else None

    def ids(n: int) -> list[int]:
        return [7] * n if rng is None else rng.integers(0, vocab_size, n).tolist()

    names = iter(lora_names)
    seqs, next_block = [], 0
    for c, n in chunks:
        blocks = -(-(c + n + 1) // block_size)
        table = list(range(next_block, next_block + blocks))
        seqs.append(SeqInput(ids(n), c, table, True, lora_name=next(names, "")))
        next_block += blocks
    for ctx in decodes:
        blocks = -(-(ctx + 1) // block_size)
        table = list(range(next_block, next_block + blocks))
        seqs.append(SeqInput(ids(1), ctx - 1, table, True, lora_name=next(names, "")))
        next_block += blocks
    return seqs


def fits_runner(
    seqs: list[SeqInput], num_gpu_blocks: int, max_model_len: int, max_num_seqs: int
) -> bool:
    """Whether a grid point's sequences (:func:`step_inputs`) fit a runner: their blocks in
    its cache, each sequence within ``max_model_len`` tokens, at most ``max_num_seqs`` of
    them. The profile leaves out a point that does not."""
    return (
        sum(len(s.block_table) for s in seqs) <= num_gpu_blocks
        and max(s.start_pos + len(s.token_ids) for s in seqs) <= max_model_len
        and len(seqs) <= max_num_seqs
    )


def execute_launched(runner: ModelRunner, seqs: list[SeqInput]) -> float:
    """``runner.execute(seqs)`` in its parts; ``time.perf_counter()`` at launch, or NaN for a
    tensor-parallel runner."""
    import torch

    from sched_lab.backend.runner import ModelRunner
    from sched_lab.backend.sampler import sample_seqs

    if not isinstance(runner, ModelRunner):
        runner.execute(seqs)
        return float("nan")
    with torch.inference_mode():
        sampled_seqs, rows, logits = runner._forward(seqs, runner.kv_cache)
        tokens = sample_seqs(logits, rows, runner.generator) if sampled_seqs else None
        launched = time.perf_counter()
        if tokens is not None:
            tokens.tolist()  # syncs, as execute does
        runner.synchronize()
    return launched


def time_step(
    runner: ModelRunner, seqs, swap_blocks: int, repeat: int
) -> list[tuple[float, float]]:
    """(duration_s, host_s) medians of ``repeat`` runs after a warm-up (host_s may be NaN)."""
    mapping_out = [(i, i) for i in range(swap_blocks)]
    mapping_in = [(i, i) for i in range(swap_blocks)]

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        if swap_blocks:
            runner.swap_out(mapping_out)
            runner.swap_in(mapping_in)
        launched = execute_launched(runner, seqs)
        return time.perf_counter() - t0, launched - t0

    once()
    return [once() for _ in range(repeat)]


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None, prog: str = "python -m sched_lab.backend.profile") -> int:
    """Profile the grid and write the CSV (``sched-lab profile``); returns the exit status."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example (on the GPU):\n  sched-lab profile "
        "--model-dir checkpoints/qwen3-0.6b --out profiles/h200_qwen3-0.6b.csv\n"
        "  sched-lab fit profiles/h200_qwen3-0.6b.csv\n\nexit status: 0 ok, 2 bad input "
        "(one line: error: ...)",
    )
    ap.add_argument(
        "--model-dir",
        required=True,
        help="checkpoint folder (config.json + "
        "safetensors), e.g. from `sched-lab tools make-random-checkpoint`",
    )
    ap.add_argument(
        "--out", required=True, help="profile CSV to write (replaces only a file sched-lab wrote)"
    )
    ap.add_argument("--attention", default="triton", help="attention backend (default: triton)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--triton-prefill-kernel",
        default="base",
        choices=("base", "exp2"),
        help="the triton backend's paged prefill kernel (engine.triton_prefill_kernel); "
        "exp2 is named in the fingerprint",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="KV cache dtype (kv_cache.dtype); fp8 is named in the header, and the "
        "calibrated model then fits that profile's KV bytes as they are",
    )
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument(
        "--max-model-len",
        type=positive_int,
        help="the runner's max_model_len (default: the checkpoint's); give the engine runs' "
        "value (scheduler.max_model_len) so its block tables and graphs have their width",
    )
    ap.add_argument("--max-num-seqs", type=positive_int, default=256,
                    help="the runner's max_num_seqs (scheduler.max_num_seqs; default 256)")  # fmt: skip
    ap.add_argument(
        "--num-gpu-blocks",
        type=positive_int,
        help="KV blocks (kv_cache.num_gpu_blocks; default: 90%% of free GPU memory); rows "
        "whose blocks do not fit are left out",
    )
    ap.add_argument(
        "--grid",
        choices=("full", "small"),
        default="full",
        help="full (default) or small: a few points of each kind, no eager or long-prefix rows "
        "(a large model's profile in minutes; steps above 8,192 tokens are then extrapolated)",
    )
    ap.add_argument(
        "--lora-dir",
        help="folder of PEFT adapters lora-0 .. lora-{N-1} (`sched-lab tools "
        "make-random-lora`): every row runs with them attached, plus rows with adapters "
        "(num_loras, num_lora_tokens) for the calibrated model's LoRA terms",
    )
    ap.add_argument(
        "--max-loras",
        type=positive_int,
        help=f"with --lora-dir: GPU adapter slots (lora.max_loras; default: the adapters "
        f"found, at most {MAX_PROFILE_LORAS})",
    )
    ap.add_argument(
        "--max-lora-rank",
        type=positive_int,
        help="with --lora-dir: lora.max_lora_rank (default: the adapters' largest rank)",
    )
    ap.add_argument("--repeat", type=positive_int, default=2, help="timed runs per row and pass")
    ap.add_argument("--passes", type=positive_int, default=3, help="passes over the whole grid")
    ap.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks (one GPU each; gloo processes on the CPU): the profile of a tensor-parallel "
        "engine, all-reduces included (backend/tp_engine.py)",
    )
    ap.add_argument(
        "--engine-commit",
        help="what the header names as the engine's commit "
        "(default: `git describe --always --dirty` of the working tree; name it "
        "when the tree is a copy whose .git is not its own)",
    )
    args = ap.parse_args(argv)
    frozen_by_caller = gc.get_freeze_count() > 0
    try:
        _profile(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        # _profile freezes the collector; called in-process (tests), a freeze left behind
        # would make every later replay's freeze count walk the whole heap and keep garbage
        if not frozen_by_caller:
            gc.unfreeze()
    return 0


def _profile(args: argparse.Namespace) -> None:
    import torch

    from sched_lab.backend.runner import ModelRunner

    args.out = check_output(args.out, "--out")  # before the GPU work: a user's file stays
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = dict(device=device, dtype=args.dtype, attention_backend=args.attention,
                  block_size=args.block_size, gpu_memory_utilization=0.9,
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  num_gpu_blocks=args.num_gpu_blocks, kv_cache_dtype=args.kv_cache_dtype,
                  triton_prefill_kernel=args.triton_prefill_kernel)  # fmt: skip
    lora = lora_setup(args)
    if lora is not None:
        if args.tensor_parallel_size > 1:
            raise UserError("--lora-dir: adapters with tensor parallelism are not implemented")
        kwargs.update(lora_adapters=lora["adapters"], max_loras=lora["max_loras"],
                      max_lora_rank=lora["max_lora_rank"])  # fmt: skip
    if args.tensor_parallel_size == 1:
        runner = ModelRunner(args.model_dir, **kwargs)
    else:
        from sched_lab.backend.tp_engine import TensorParallelRunner

        runner = TensorParallelRunner(args.model_dir, args.tensor_parallel_size, **kwargs)
    gc.collect()
    gc.freeze()  # as the replay loop does (lab/sim/replay.py): full collections skip the model
    small = args.grid == "small"
    points = [(*g, []) for g in (shapes(small=True) if small else shapes())]
    if lora is not None:
        points += lora_shapes(min(len(lora["adapters"]), lora["max_loras"]), small)
    vocab = runner.config.vocab_size
    grid = [
        (kind, chunks, decodes, swap,
         step_inputs(chunks, decodes, args.block_size, names, vocab, seed=i), names)
        for i, (kind, chunks, decodes, swap, names) in enumerate(points)
    ]  # fmt: skip
    limits = (runner.num_gpu_blocks, runner.max_model_len, args.max_num_seqs)
    grid = [g for g in grid if fits_runner(g[4], *limits)]
    kinds = {g[0] for g in points}
    missing = sorted(kinds - {g[0] for g in grid})
    if not any(g[0] == "decode" for g in grid) or not any(g[0] == "prefill" for g in grid):
        raise UserError(
            f"no decode or no prefill row fits the runner ({runner.num_gpu_blocks} blocks, "
            f"max_model_len {runner.max_model_len}, max_num_seqs {args.max_num_seqs}): "
            "the fit needs both; give more blocks or a longer max_model_len"
        )
    if missing:
        print(f"note: no {', '.join(missing)} row fits the runner (blocks, max_model_len, "
              "max_num_seqs): the fit prices those steps by extrapolation", flush=True)  # fmt: skip
    eager = sum(g[0] in EAGER_KINDS for g in grid)
    if 0 < eager < EAGER_MIN_ROWS:
        print(f"note: only {eager} eager row(s) fit the runner: the fit needs "
              f"{EAGER_MIN_ROWS} to give steps above 8,192 tokens their own slope, so it "
              "extrapolates there", flush=True)  # fmt: skip
    samples: list[list[tuple[float, float]]] = [[] for _ in grid]
    for p in range(args.passes):
        for runs, (_, _, _, swap, seqs, _) in zip(samples, grid, strict=True):
            runs += time_step(runner, seqs, swap, args.repeat)
        print(f"pass {p + 1}/{args.passes} done", flush=True)
    rows = []
    for runs, (kind, chunks, decodes, swap, _, names) in zip(samples, grid, strict=True):
        times, hosts = [d for d, _ in runs], [h for _, h in runs]
        t, host = float(np.median(times)), float(np.median(hosts))
        feats = {k: v for k, v in asdict(features(chunks, decodes, swap, names)).items()
                 if k not in LEFT_OUT}  # fmt: skip
        row = {"kind": kind, **feats, "duration_s": t}
        if not np.isnan(host):
            row["host_s"] = min(host, t)  # medians of separate samples: at most the step
        rows.append(row)
        print(
            f"{kind:8s} prefill {rows[-1]['num_prefill_tokens']:5d} decodes "
            f"{len(decodes):3d} ctx {sum(decodes):7d} swap {2 * swap:3d} loras "
            f"{feats['num_loras']:2d}: {t * 1e3:8.3f} ms "
            f"(spread {min(times) * 1e3:.3f}-{max(times) * 1e3:.3f}; host {host * 1e3:.3f})",
            flush=True,
        )
    write(Path(args.out), rows, runner, args, lora)
    if args.tensor_parallel_size > 1:
        runner.close()


def lora_setup(args: argparse.Namespace) -> dict | None:
    """The runner's LoRA arguments from ``--lora-dir`` (None without it): ``adapters`` (name
    -> folder, ``lora-0 ..`` as long as they run on), ``max_loras``, ``max_lora_rank``,
    ``rank`` and ``targets`` (of the adapters, from their adapter_config.json). Raises
    UserError (one line) for a folder without ``lora-0`` or an unreadable config."""
    if args.lora_dir is None:
        if args.max_loras is not None or args.max_lora_rank is not None:
            raise UserError("--max-loras and --max-lora-rank need --lora-dir")
        return None
    root = Path(args.lora_dir).expanduser()
    adapters = {}
    while (root / f"lora-{len(adapters)}").is_dir():
        adapters[f"lora-{len(adapters)}"] = root / f"lora-{len(adapters)}"
    if not adapters:
        raise UserError(
            f"--lora-dir {root}: no adapter folder lora-0 (expected PEFT adapters lora-0, "
            "lora-1, ...; `sched-lab tools make-random-lora` writes them)"
        )
    ranks, targets = set(), set()
    for folder in adapters.values():
        path = folder / "adapter_config.json"
        try:
            config = json.loads(path.read_text())
            ranks.add(int(config["r"]))
            targets.update(config.get("target_modules") or ())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--lora-dir: {path}: expected a PEFT adapter config with an "
                            f"integer r ({type(e).__name__}: {e})") from None  # fmt: skip
    return {
        "adapters": adapters,
        "max_loras": args.max_loras or min(len(adapters), MAX_PROFILE_LORAS),
        "max_lora_rank": args.max_lora_rank or max(ranks),
        "rank": max(ranks),
        "ranks": sorted(ranks),
        "targets": sorted(targets),
    }


def engine_fingerprint(
    runner: ModelRunner, kn_weights: bool = False, options: Iterable[str] = ()
) -> dict:
    """The engine fingerprint of ``runner`` (:mod:`sched_lab.core.fingerprint`). Its sources
    keys (:func:`sched_lab.backend.sources.sources_fingerprint`) cover the options ``runner``
    runs (quantized weights, LoRA adapters) and ``options`` (``"tensor_parallel"``,
    ``"speculative"``: what the caller runs around it)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = runner.device.type == "cuda"
    options = set(options)
    if getattr(runner, "quantization", None) is not None:
        options.add("quantization")
    if getattr(runner, "lora", None) is not None:
        options.add("lora")
    prefill_kernel = getattr(runner.attn_backend, "prefill_kernel", "base")
    if prefill_kernel == "exp2":
        options.add("prefill_exp2")
    fingerprint = {
        **sources_fingerprint(options),
        "torch": torch.__version__,
        "triton": triton_version,
        "gpu": torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        "dtype": str(runner.dtype).removeprefix("torch."),
        "attention": runner.attn_backend.name,
        "options": {
            "block_size": runner.block_size,
            "cuda_graphs": runner.graphs is not None,
            "mixed_graphs": bool(runner.graphs is not None and runner.graphs.token_sizes),
            "kn_weights": kn_weights and cuda,
        },
    }
    quant = getattr(runner, "quantization", None)
    if quant is not None:  # absent when unquantized: earlier profiles' fingerprints hold
        fingerprint["options"]["quantization"] = quant.method
    if prefill_kernel != "base":  # absent for the base kernel, as above
        fingerprint["options"]["triton_prefill_kernel"] = prefill_kernel
    return fingerprint


def write(
    path: Path, rows: list[dict], runner: ModelRunner, args, lora: dict | None = None
) -> None:
    """The profile CSV at ``path`` (checked by :func:`sched_lab.core.outputs.check_output`)."""
    commit = args.engine_commit
    if commit is None:
        try:
            # --dirty: a tree copied onto an older checkout (as the device tool does) says so
            # instead of naming a commit it does not match
            commit = (
                subprocess.run(
                    ["git", "describe", "--always", "--dirty"], capture_output=True, text=True
                ).stdout.strip()
                or "unknown"
            )
        except OSError:
            commit = "unknown"
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tp = getattr(args, "tensor_parallel_size", 1) > 1
    # rank 0's runner under TP, as lab/setup/engine.py's engine_info reads it
    fingerprint = engine_fingerprint(
        getattr(runner, "runner", runner), options=["tensor_parallel"] if tp else []
    )
    if tp:
        fingerprint["tensor_parallel_size"] = args.tensor_parallel_size
    print(f"engine fingerprint: {json.dumps(fingerprint, sort_keys=True)}")
    write_output(path, lambda tmp: _write_csv(tmp, rows, runner, args, device, commit,
                                              fingerprint, lora))  # fmt: skip
    print(f"wrote {len(rows)} rows to {path}")


def _write_csv(path: Path, rows: list[dict], runner, args, device: str, commit: str,
               fingerprint: dict, lora: dict | None = None) -> None:  # fmt: skip
    import torch

    c = runner.config
    with path.open("w", newline="") as f:
        f.write(
            f"# engine profile, {time.strftime('%Y-%m-%d')}, {device}, torch {torch.__version__}, "
            f"engine commit {commit}\n"
        )
        f.write(
            f"# model {Path(args.model_dir).name}: {c.architecture}, {c.num_layers} layers, "
            f"hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}, head_dim "
            f"{c.head_dim}, {args.dtype}, {args.attention} attention, block_size "
            f"{args.block_size}"
            + (", kv_cache_dtype fp8" if args.kv_cache_dtype != "auto" else "")
            + (
                f", tensor_parallel_size {args.tensor_parallel_size} (heads per rank)"
                if args.tensor_parallel_size > 1
                else ""
            )
            + "\n"
        )
        f.write(HEADER_PREFIX + json.dumps(fingerprint, sort_keys=True) + "\n")
        if lora is not None:  # read by sched_lab.sim.calibrated.profile_lora_rank
            f.write(
                f"# lora: rank {lora['rank']} (ranks {','.join(map(str, lora['ranks']))}), "
                f"{len(lora['adapters'])} adapters from {Path(args.lora_dir).name}, max_loras "
                f"{lora['max_loras']}, max_lora_rank {lora['max_lora_rank']}, targets "
                f"{','.join(lora['targets'])}; every row ran with them attached\n"
            )
        names = ["kind", *(fl.name for fl in fields(StepFeatures) if fl.name not in LEFT_OUT)]
        names += ["duration_s"]
        names += ["host_s"] if rows and "host_s" in rows[0] else []
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
