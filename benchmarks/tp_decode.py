"""Tensor parallelism on two GPUs: decode step time, offline throughput and all-reduce time at
TP=1 vs TP=2, and a TP=2 profile for the calibrated cost model.

    timeout 480 python benchmarks/tp_decode.py --out "$OUT"             # nvidia-h200-x2
    python benchmarks/tp_decode.py --tiny --out /tmp/tp_bench           # CPU, gloo: the logic

Each phase is a child process under its own ``timeout`` (``--phase-timeout`` seconds), so a
hung rank cannot eat the budget: the checkpoint (Llama-3.1-8B shape, random bf16 weights, in
``--work``, not under --out), then per TP size: decode steps of ``--batches`` sequences at
``--context`` tokens (mean wall of ``--steps`` runs, CUDA graphs as the engine runs them) and
an offline run (``--requests`` requests, prompt and output lengths uniform in [100, 1024],
all at t = 0, chunked_prefill, through the lab's replay loop: output tokens / wall s); the
all-reduce time of one decode step (2 per layer + the embedding's, of (batch, hidden) bf16,
NCCL, median of 20 timed steps); and ``python -m sched_lab.backend.profile --tensor-parallel-size 2``
(one pass). Results: ``$OUT/tp_decode.json`` (one record per phase, with a status) and
``$OUT/profile_tp2.csv``. ``--tiny``: a 2-layer random model on the CPU with gloo and torch
attention, small sizes, no profile: it tests this script's logic, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 2048}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results folder ($OUT)")
    ap.add_argument("--work", default="/tmp/tp_decode", help="checkpoint folder (not --out)")
    ap.add_argument("--tiny", action="store_true", help="CPU / gloo logic test at tiny size")
    ap.add_argument("--tp", default="1,2", help="TP sizes, comma-separated (default 1,2)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32,128)")
    ap.add_argument("--context", type=int, default=None, help="decode context (default 1024)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20)")
    ap.add_argument("--requests", type=int, default=None, help="offline requests (default 256)")
    ap.add_argument("--phase-timeout", type=int, default=150, help="seconds per phase")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--phase", help=argparse.SUPPRESS
    )  # a child: checkpoint|decode|offline|allreduce
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    d = (
        {"batches": "1,4", "context": 24, "steps": 3, "requests": 6}
        if args.tiny
        else {"batches": "1,8,32,128", "context": 1024, "steps": 20, "requests": 256}
    )
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.tp_sizes = [int(x) for x in args.tp.split(",")]
        args.batch_sizes = [int(x) for x in args.batches.split(",")]
    except ValueError:
        ap.error(
            f"--tp and --batches take comma-separated integers, got {args.tp!r}, {args.batches!r}"
        )
    if any(n < 1 for n in args.tp_sizes + args.batch_sizes) or args.context < 1 or args.steps < 1:
        ap.error("--tp, --batches, --context and --steps must be >= 1")
    return args


def engine_kwargs(args) -> dict:
    if args.tiny:
        return {"device": "cpu", "dtype": "float32", "attention_backend": "torch",
                "block_size": 16, "num_gpu_blocks": 64, "num_threads": 1}  # fmt: skip
    return {"device": "cuda", "dtype": "bfloat16", "attention_backend": "triton",
            "block_size": 16, "gpu_memory_utilization": 0.9}  # fmt: skip


def model_dir(args) -> Path:
    return Path(args.work) / ("tiny" if args.tiny else "llama-3.1-8b")


def make_runner(args, size: int):
    from sched_lab.backend.runner import ModelRunner
    from sched_lab.backend.tp_engine import TensorParallelRunner

    if size == 1:
        return ModelRunner(model_dir(args), **engine_kwargs(args))
    return TensorParallelRunner(model_dir(args), size, **engine_kwargs(args))


def phase_checkpoint(args) -> dict:
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.core.model_presets import PRESETS

    out = model_dir(args)
    if not (out / "config.json").exists():
        cfg, dtype = (TINY, "float32") if args.tiny else (PRESETS["llama-3.1-8b"], "bfloat16")
        write_random_checkpoint(cfg, out, dtype, name=out.name)
    return {"model_dir": str(out)}


def phase_decode(args) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import decode_inputs

    runner = make_runner(args, args.size)
    rows = {}
    for b in args.batch_sizes:
        seqs = decode_inputs(b, args.context)
        if sum(len(s.block_table) for s in seqs) > runner.num_gpu_blocks:
            rows[b] = None  # does not fit the KV cache
            continue
        for _ in range(3):
            runner.execute(seqs)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            runner.execute(seqs)  # returns after the device is done
        rows[b] = (time.perf_counter() - t0) / args.steps
    out = {"decode_step_s": rows, "num_gpu_blocks": runner.num_gpu_blocks}
    if args.size > 1:
        runner.close()
    return out


def phase_offline(args) -> dict:
    import numpy as np

    from sched_lab.config import validate
    from sched_lab.core.request import Request
    from sched_lab.run.experiment import run_experiment

    eng = {k: v for k, v in engine_kwargs(args).items() if k not in ("block_size", "num_gpu_blocks",
                                                                      "gpu_memory_utilization")}  # fmt: skip
    kv = {"block_size": 16, **({"num_gpu_blocks": 64} if args.tiny else {})}
    cfg = validate(
        {
            "name": "tp_offline",
            "backend": "engine",
            "trace": {
                "format": "synthetic",
                "num_requests": 1,
                "arrival": {"process": "poisson", "rate": 1.0},
                "prompt_len": 1,
                "output_len": 1,
            },  # fmt: skip
            "engine": {
                "model_path": str(model_dir(args)),
                **eng,
                "tensor_parallel_size": args.size,
            },  # fmt: skip
            "kv_cache": kv,
            "scheduler": {
                "max_num_seqs": 8 if args.tiny else 256,
                "max_num_batched_tokens": 64 if args.tiny else 8192,
            },  # fmt: skip
            "policies": ["chunked_prefill"],
        },
        "tp_decode",
        ROOT,
    )
    rng = np.random.default_rng(0)
    lo, hi = (4, 17) if args.tiny else (100, 1025)
    prompts = [rng.integers(0, 200, rng.integers(lo, hi)).tolist() for _ in range(args.requests)]
    outputs = rng.integers(lo, hi, args.requests).tolist()
    reqs = [Request(str(i), 0.0, len(p), int(o), prompt_token_ids=p)
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]  # fmt: skip
    run = run_experiment(cfg, progress=False, requests=reqs)[0]
    tokens = int(run.requests["num_generated_tokens"].sum())
    finished = int((run.requests["status"] == "finished").sum())
    return {"output_tokens": tokens, "run_wall_s": run.result.wall_s, "finished": finished,
            "output_tok_per_s": tokens / run.result.wall_s}  # fmt: skip


def _allreduce_rank(rank: int, size: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from sched_lab.backend.config import ModelConfig

    cuda = not args.tiny
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)  # fmt: skip
    c = ModelConfig.from_dir(model_dir(args))
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    per_step = 2 * c.num_layers + 1  # o_proj and down_proj per layer, and the embedding
    out = {}
    for b in args.batch_sizes:
        x = torch.ones(b, c.hidden_size, dtype=dtype, device=dev)
        times = []
        for i in range(25):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(per_step):
                dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        out[b] = sorted(times)[len(times) // 2]
    if rank == 0:
        queue.put({"allreduce_per_decode_step_s": out, "all_reduces_per_step": per_step,
                   "bytes_each": {b: b * c.hidden_size * (2 if cuda else 4) for b in out}})  # fmt: skip
    dist.destroy_process_group()


def phase_allreduce(args) -> dict:
    import torch.multiprocessing as mp

    from sched_lab.backend.tp_engine import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, args.size, port, args, queue))
             for r in range(args.size)]  # fmt: skip
    for p in procs:
        p.start()
    result = queue.get(timeout=args.phase_timeout)
    for p in procs:
        p.join(timeout=30)
    return result


PHASES = {"checkpoint": phase_checkpoint, "decode": phase_decode, "offline": phase_offline,
          "allreduce": phase_allreduce}  # fmt: skip


def child(args, phase: str, size: int, result: Path) -> dict:
    """Run one phase in a child process under ``timeout``; its record, with a status."""
    argv = [sys.executable, __file__, "--phase", phase, "--size", str(size), "--out", str(result),
            "--work", args.work, "--tp", args.tp, "--batches", args.batches,
            "--context", str(args.context), "--steps", str(args.steps),
            "--requests", str(args.requests), "--phase-timeout", str(args.phase_timeout)]  # fmt: skip
    if args.tiny:
        argv.append("--tiny")
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.tiny else None
    cmd = ["timeout", "-k", "10", str(args.phase_timeout), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    record = {"phase": phase, "tensor_parallel_size": size, "wall_s": time.perf_counter() - t0}
    if proc.returncode == 0 and result.exists():
        record.update(status="ok", **json.loads(result.read_text()))
    else:
        status = "timeout" if proc.returncode in (124, 137) else f"failed (rc {proc.returncode})"
        record.update(status=status, stderr_tail=proc.stderr[-2000:])
    print(json.dumps(record), flush=True)
    log = (
        result.parent / "tp_decode.json"
    )  # rewritten after every phase: a cut run keeps its records
    done = json.loads(log.read_text()) if log.exists() else []
    log.write_text(json.dumps([*done, record], indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.phase:  # a child: one phase, its record to --out (a JSON file)
        Path(args.out).write_text(json.dumps(PHASES[args.phase](args)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".phase.json"
    (out / "tp_decode.json").unlink(missing_ok=True)
    records = [child(args, "checkpoint", 1, tmp)]
    if records[0]["status"] == "ok":
        for size in args.tp_sizes:
            for phase in ("decode", "offline"):
                tmp.unlink(missing_ok=True)
                records.append(child(args, phase, size, tmp))
        for size in (s for s in args.tp_sizes if s > 1):
            tmp.unlink(missing_ok=True)
            records.append(child(args, "allreduce", size, tmp))
        if not args.tiny and not args.no_profile and 2 in args.tp_sizes:
            cmd = ["timeout", "-k", "10", str(args.phase_timeout), sys.executable, "-m",
                   "sched_lab.backend.profile", "--model-dir", str(model_dir(args)), "--out",
                   str(out / "profile_tp2.csv"), "--tensor-parallel-size", "2", "--passes", "1",
                   "--repeat", "1"]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            records.append({"phase": "profile", "tensor_parallel_size": 2,
                            "status": "ok" if proc.returncode == 0 else f"rc {proc.returncode}",
                            "stderr_tail": proc.stderr[-2000:]})  # fmt: skip
    tmp.unlink(missing_ok=True)
    (out / "tp_decode.json").write_text(json.dumps(records, indent=2) + "\n")
    ok = all(r["status"] == "ok" for r in records)
    print(f"wrote {out / 'tp_decode.json'} ({'all phases ok' if ok else 'some phases failed'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
