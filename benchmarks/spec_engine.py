"""Speculative decoding on the engine: TPOT and throughput speedup vs no speculation.

    timeout 420 python benchmarks/spec_engine.py --out "$OUT/spec_engine"   # H200, < 7 min
    python benchmarks/spec_engine.py --tiny --out /tmp/spec_engine          # CPU: the logic

A random-weight Qwen3-0.6B shape (bf16, triton attention, CUDA graphs as the engine runs
them). Each point (run twice, the second timed) is a static batch: ``batch`` requests of
``--prompt`` tokens prefilled together (chunks of at most ``--max-tokens`` tokens a step),
then decoded to ``--output`` tokens each; the driver plays the scheduler as the rule of
lab/core/scheduler.py does (a decode with d
proposals feeds 1 + d' tokens, d' cut to the output left; the request gains accepted + 1).
Per point: TPOT (mean over requests of (last token - first token) / (output - 1), seconds
from the engine's measured step durations), output throughput (batch * output / all
steps' seconds, prefill included), mean acceptance length (1 + accepted / spec steps) and
the speedups vs the same batch without speculation.

Parts, each a child process under its own ``timeout`` (``--part-timeout`` s):

* ``synthetic``: random prompts; the synthetic proposer (a timing device: drafts accepted
  with per-position probability 0.6 or 0.8, backend/spec_decode.py) at k in (1, 2, 4).
* ``ngram``: a repetitive workload (a 16-token phrase repeated over the prompt), prompt
  lookup (n in [1, 4]) at k in (1, 2, 4); the acceptance is whatever the random model's
  greedy output gives.

Results: ``--out``/spec_engine.json (every point, with its part's status) and
spec_engine.md (the tables). ``--tiny``: a 2-layer random model on the CPU, torch
attention, small sizes: it tests this script's logic, not the numbers.
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

TINY = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 1024,
        "tie_word_embeddings": True}  # fmt: skip
PARTS = ("synthetic", "ngram")
RATES = (0.6, 0.8)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--tiny", action="store_true", help="CPU logic test (tiny model)")
    ap.add_argument("--part", choices=PARTS, help="run one part here (the driver's child)")
    ap.add_argument("--part-timeout", type=int, default=200, help="seconds per part")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=None)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens")
    ap.add_argument("--output", type=int, default=None, help="output tokens per request")
    ap.add_argument("--max-tokens", type=int, default=1024, help="tokens per step at most")
    a = ap.parse_args(argv)
    tiny = a.tiny
    a.batches = a.batches or ([1, 2] if tiny else [1, 8, 32, 128])
    a.ks = a.ks or ([1, 2] if tiny else [1, 2, 4])
    a.prompt = a.prompt or (16 if tiny else 128)
    a.output = a.output or (8 if tiny else 128)
    return a


# ---------------------------------------------------------------------------------- a part


def make_runner(args):
    from sched_lab.backend.runner import ModelRunner

    out = Path(args.out)
    if args.tiny:
        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        path = out / "ckpt_tiny"
        if not (path / "config.json").exists():
            write_random_checkpoint(TINY, path, "float32", std=0.2)
        kw = dict(device="cpu", dtype="float32", attention_backend="torch")
    else:
        from common import checkpoint  # benchmarks/common.py

        path = checkpoint("qwen3-0.6b")
        kw = dict(device="cuda", dtype="bfloat16", attention_backend="triton")
    bs = 16
    per = -(-(args.prompt + args.output + max(args.ks) + 2) // bs)
    return ModelRunner(path, block_size=bs, num_gpu_blocks=per * max(args.batches) + 8,
                       swap_space_bytes=0, max_model_len=args.prompt + args.output + 16,
                       max_num_batched_tokens=args.max_tokens, max_num_seqs=max(args.batches),
                       **kw)  # fmt: skip


def prompts(kind: str, batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng([seed, batch])
    if kind == "synthetic":
        return rng.integers(0, vocab, (batch, length)).tolist()
    phrase = rng.integers(0, vocab, (batch, 16))  # repeated: prompt lookup finds it
    return np.tile(phrase, (1, -(-length // 16)))[:, :length].tolist()


def run_point(runner, spec, toks: list[list[int]], out_len: int, max_tokens: int) -> dict:
    """One static batch through hand-made plans; figures from the measured step times."""
    from sched_lab.backend.engine import EngineExecutor
    from sched_lab.backend.spec_decode import SpecExecutor
    from sched_lab.core.plan import SchedulerOutput
    from sched_lab.core.request import Request, RequestStatus

    bs, n = runner.block_size, len(toks)
    per = -(-(len(toks[0]) + out_len + 8) // bs)
    reqs = []
    for i, p in enumerate(toks):
        r = Request(str(i), 0.0, len(p), out_len, list(p))
        r.block_table, r.status = list(range(i * per, (i + 1) * per)), RequestStatus.RUNNING
        reqs.append(r)
    executor = EngineExecutor(runner) if spec is None else SpecExecutor(spec)
    clock, times = 0.0, {r: [] for r in reqs}
    steps = spec_steps = accepted = 0
    while any(r.status is RequestStatus.RUNNING for r in reqs):
        plan, budget = SchedulerOutput(decode_tick=1), max_tokens
        for r in reqs:
            if r.status is not RequestStatus.RUNNING:
                continue
            if r.num_computed_tokens < r.prompt_len:
                if budget > 0:
                    plan.prefills[r] = min(budget, r.prompt_len - r.num_computed_tokens)
                    budget -= plan.prefills[r]
                continue
            r.join_tick, r.join_num_output = 0, len(r.output_token_ids) - 1
            plan.decodes.append(r)
            d = min(len(r.spec_token_ids), out_len - len(r.output_token_ids) - 1)
            if d > 0:
                plan.spec_decodes[r] = d
        result = executor.execute(plan)
        clock += result.duration_s
        steps += 1
        for r, c in plan.prefills.items():
            r.num_computed_tokens += c
        for r, tok in result.sampled_token_ids.items():
            a = result.num_accepted.get(r, 0)
            spec_steps += r in plan.spec_decodes
            accepted += a
            r.output_token_ids += r.spec_token_ids[:a] + [tok]
            r.spec_token_ids = result.draft_token_ids.get(r, [])
            r.num_output_tokens = len(r.output_token_ids)
            times[r] += [clock] * (a + 1)
            if r.num_output_tokens >= out_len:
                r.status = RequestStatus.FINISHED
    tpot = sum((t[-1] - t[0]) / (len(t) - 1) for t in times.values()) / n
    return {
        "steps": steps,
        "total_s": clock,
        "tpot_ms": 1e3 * tpot,
        "throughput_tok_s": n * out_len / clock,
        "mean_acceptance_length": 1 + accepted / spec_steps if spec_steps else None,
    }


def run_part(args, save) -> list[dict]:
    """The part's points; ``save(rows)`` after each (a part cut by its timeout keeps them)."""
    import torch

    from sched_lab.backend.spec_decode import make_spec_decoder

    runner = make_runner(args)
    vocab = runner.config.vocab_size
    kind = args.part
    methods = [(f"synthetic {p}", "synthetic", {"acceptance_rates": [p] * max(args.ks)})
               for p in RATES] if kind == "synthetic" else [
               ("ngram", "ngram", {"prompt_lookup_min": 1, "prompt_lookup_max": 4})]  # fmt: skip
    # warm-up: every step shape's kernels compile before the timed points
    warm = prompts(kind, 2, args.prompt, vocab, 0)
    run_point(runner, make_spec_decoder(runner, methods[0][1], max(args.ks), **methods[0][2]),
              warm, 4, args.max_tokens)  # fmt: skip
    rows = []
    for batch in args.batches:
        toks = prompts(kind, batch, args.prompt, vocab, 1)
        # Every point runs twice and the second is kept: the first captures the CUDA graphs
        # of step shapes not seen before (a capture inside a timed point doubled its TPOT).
        run_point(runner, None, toks, args.output, args.max_tokens)
        base = run_point(runner, None, toks, args.output, args.max_tokens)
        rows.append({"part": kind, "method": "none", "k": 0, "batch": batch, **base})
        for label, method, kw in methods:
            for k in args.ks:
                for _ in range(2):  # the second run is kept (see above)
                    spec = make_spec_decoder(runner, method, k, seed=batch, **kw)
                    point = run_point(runner, spec, toks, args.output, args.max_tokens)
                point["tpot_speedup"] = base["tpot_ms"] / point["tpot_ms"]
                point["throughput_speedup"] = point["throughput_tok_s"] / base["throughput_tok_s"]
                rows.append({"part": kind, "method": label, "k": k, "batch": batch, **point})
                print(json.dumps(rows[-1]), flush=True)
                save(rows)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
    return rows


# ------------------------------------------------------------------------------ the driver


def markdown(rows: list[dict], status: dict, args) -> str:
    out = [f"# Speculative decoding on the engine ({time.strftime('%Y-%m-%d')})", "",
           f"prompt {args.prompt} tokens, output {args.output} tokens, static batches; "
           f"part status: {status}", ""]  # fmt: skip
    for part in PARTS:
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        out += [f"## {part}", "",
                "| method | k | batch | TPOT ms | tok/s | accept len | TPOT speedup | tput speedup |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in sel:
            acc = r.get("mean_acceptance_length")
            out.append(
                f"| {r['method']} | {r['k']} | {r['batch']} | {r['tpot_ms']:.2f} | "
                f"{r['throughput_tok_s']:.0f} | {'-' if acc is None else f'{acc:.2f}'} | "
                f"{r.get('tpot_speedup', 1.0):.2f} | {r.get('throughput_speedup', 1.0):.2f} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        path = out / f"part_{args.part}.json"
        run_part(args, lambda rows: path.write_text(json.dumps(rows, indent=1)))
        return 0
    rows, status = [], {}
    for part in PARTS:
        argv2 = [sys.executable, __file__, "--out", str(out), "--part", part,
                 "--prompt", str(args.prompt), "--output", str(args.output),
                 "--max-tokens", str(args.max_tokens), "--batches", *map(str, args.batches),
                 "--ks", *map(str, args.ks)] + (["--tiny"] if args.tiny else [])  # fmt: skip
        t0, t0_wall = time.perf_counter(), time.time()
        proc = subprocess.run(["timeout", "-k", "10", str(args.part_timeout), *argv2],
                              capture_output=True, text=True, env=dict(os.environ))  # fmt: skip
        (out / f"part_{part}.log").write_text(proc.stdout + proc.stderr)
        status[part] = {0: "ok", 124: "timeout", 137: "timeout"}.get(proc.returncode,
                                                                     f"exit {proc.returncode}")  # fmt: skip
        print(f"{part}: {status[part]} in {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
        path = out / f"part_{part}.json"
        if path.exists() and path.stat().st_mtime >= t0_wall:
            rows += json.loads(path.read_text())
    (out / "spec_engine.json").write_text(json.dumps({"status": status, "rows": rows}, indent=1))
    md = markdown(rows, status, args)
    (out / "spec_engine.md").write_text(md)
    print(md)
    return 0 if all(s == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
