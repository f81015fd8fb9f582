"""Asynchronous vs synchronous engine steps: host gap per decode step, step time, throughput.

    python benchmarks/async_engine.py --out DIR [--preset qwen3-0.6b] [--batches 32 64 128]
        [--context 1024] [--steps 100] [--num-requests 256] [--skip-hf] [--tiny]

Three parts, each its own process under ``timeout`` (a part that fails or runs out of time
is reported as such and the others still run); results in ``DIR/async_engine.json`` and
``DIR/async_engine.md``:

* ``decode``: batches of one-token decodes at ``--context`` tokens (random bf16 weights of
  ``--preset``, triton attention, block size 16, CUDA graphs), ``--steps`` steps each way
  after a warm-up. Sync: ``ModelRunner.execute`` per step (stage, replay, sample, sync).
  Async: ``launch`` step N+1 (its tokens fed from N's sampled ids on the device) before
  ``wait``-ing for N. Per step: wall time, the host time of staging and enqueueing
  (``launch``), and the GPU busy time of the same step (its graph + sampling replayed back
  to back, timed with CUDA events); host gap = wall - GPU busy, also as % of the wall.
* ``throughput``: nano-vllm's offline workload (benchmarks/engine_throughput.py: 256
  requests, prompt and output U[100, 1024], all at t = 0, ignore_eos) through the lab's
  replay loop, chunked_prefill with ``scheduler.async_scheduling`` off and on, in the order
  sync, async, async, sync (one model, one process); output tok/s of each run, and where
  the last async run's wall time goes (``time_by_kind``: steps with prompt tokens, decode-only
  steps by batch size against their HBM roofline, time outside steps). Then, per
  batch, that many requests of ``--context`` prompt tokens and 128 output tokens through
  the replay loop (chunked_prefill) sync and async: the median step that decodes all of
  them.
* ``hf``: transformers' continuous batching (``generate_batch``, paged SDPA) on the same
  prompts, 128 new tokens each, as engine_throughput.py runs it; the ratio uses the mean of
  each mode's runs.

``--tiny``: a tiny random Qwen3 on the CPU (torch attention, no graphs, float32), small
batches and workload, no transformers part: checks the script, measures nothing useful.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import ROOT, checkpoint, tiny_qwen3

PARTS = {"decode": 140, "throughput": 200, "hf": 110}  # seconds each part may take
TINY = tiny_qwen3(16384)  # above the 8192-token budget, as Qwen3-0.6B's 40960


def model_dir(args) -> Path:
    if not args.tiny:
        return checkpoint(args.preset)
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    out = Path(args.out).resolve() / "tiny_ckpt"
    if not (out / "config.json").exists():
        write_random_checkpoint(TINY, out, dtype="float32", std=0.2)
    return out


def engine_kwargs(args) -> dict:
    if args.tiny:
        return dict(device="cpu", dtype="float32", attention_backend="torch", block_size=16)
    return dict(device="cuda", dtype="bfloat16", attention_backend="triton", block_size=16)


# -- decode loops -------------------------------------------------------------------------------


def decode_loop(runner, batch: int, context: int, steps: int, warmup: int, asynchronous: bool):
    """(wall s per step, host s per launch or None, the last step's SeqInputs)."""
    import torch

    from sched_lab.backend.inputs import DeviceFeed
    from sched_lab.backend.runner import SeqInput

    bs = runner.block_size
    free = iter(range(runner.num_gpu_blocks))
    # Append-only block tables, a block added when a position crosses into it (as the
    # lab's BlockManager grows them), each sequence over its own blocks.
    tables = [[next(free) for _ in range(context // bs + 1)] for _ in range(batch)]
    pos = [context] * batch
    tokens = [1] * batch
    rows = np.arange(batch)
    pending, host_s, cuda = None, 0.0, runner.device.type == "cuda"
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0, host_s = time.perf_counter(), 0.0
        for t in tables:
            if len(t) * bs <= pos[0]:
                t.append(next(free))
        if not asynchronous:
            seqs = [SeqInput([tokens[i]], pos[i], tables[i], True) for i in range(batch)]
            tokens = runner.execute(seqs)
        else:
            seqs = [SeqInput([0], pos[i], tables[i], True) for i in range(batch)]
            feed = None if pending is None else DeviceFeed(rows, pending.sampled, rows)
            if pending is None:
                seqs = [SeqInput([tokens[i]], pos[i], tables[i], True) for i in range(batch)]
            th = time.perf_counter()
            nxt = runner.launch(seqs, feed)
            host_s += time.perf_counter() - th
            if pending is not None:
                tokens = runner.wait(pending)
            pending = nxt
        pos = [p + 1 for p in pos]
    if pending is not None:
        tokens = runner.wait(pending)
    wall = (time.perf_counter() - t0) / steps
    return wall, (host_s / steps if asynchronous else None), seqs


def gpu_busy(runner, seqs, replays: int = 50) -> float | None:
    """GPU seconds of one decode step (its CUDA graph + greedy sampling), replayed back to
    back with no host work between, timed with CUDA events. None without captured graphs."""
    import torch

    graphs = runner.graphs
    if runner.device.type != "cuda" or graphs is None or not graphs.capture:
        return None
    size = graphs.size_for(seqs)
    if size is None:
        return None
    key = ("decode", size, size)
    graphs.stage(seqs, size)
    graph, logits = graphs.graphs[key], graphs.outputs[key]
    n = len(seqs)
    for _ in range(3):
        graph.replay()
        logits[:n].argmax(dim=-1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
        logits[:n].argmax(dim=-1)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def host_parts(runner, seqs, reps: int = 30) -> dict | None:
    """Median host seconds of the parts of a decode step that run before the GPU can start
    it: building the SeqInputs (as the executor does), staging them into the graph's static
    buffers (validation, block tables, slots, the copies issued), and the graph's launch
    call. Each timed alone, the device synchronized between repetitions. None without
    captured graphs."""
    import torch

    from sched_lab.backend.runner import SeqInput

    graphs = runner.graphs
    if runner.device.type != "cuda" or graphs is None or not graphs.capture:
        return None
    size = graphs.size_for(seqs)
    if size is None:
        return None
    graph = graphs.graphs[("decode", size, size)]
    parts: dict[str, list[float]] = {"build_s": [], "stage_s": [], "replay_launch_s": []}
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        built = [SeqInput([0], s.start_pos, s.block_table, True) for s in seqs]
        t1 = time.perf_counter()
        graphs.stage(built, size)
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        parts["build_s"].append(t1 - t0)
        parts["stage_s"].append(t2 - t1)
        parts["replay_launch_s"].append(t3 - t2)
    torch.cuda.synchronize()
    return {k: float(np.median(v)) for k, v in parts.items()}


def part_decode(args) -> dict:
    from sched_lab.backend.runner import ModelRunner

    kw = engine_kwargs(args)
    extra = {} if args.tiny else dict(gpu_memory_utilization=0.9, mixed_graphs=False)
    runner = ModelRunner(model_dir(args), max_num_seqs=max(args.batches),
                         max_model_len=args.context + args.steps + 64, **kw, **extra)  # fmt: skip
    out = {}
    for b in args.batches:
        row = {}
        for mode in ("sync", "async", "sync", "async"):  # twice each, interleaved
            wall, host, seqs = decode_loop(runner, b, args.context, args.steps, 10, mode == "async")
            row.setdefault(mode, []).append({"wall_s": wall, "host_s": host})
        busy = gpu_busy(runner, seqs)
        row["host_parts"] = host_parts(runner, seqs)
        for mode in ("sync", "async"):
            best = min(row[mode], key=lambda r: r["wall_s"])
            best["runs_wall_s"] = [r["wall_s"] for r in row[mode]]
            if busy is not None:
                best["gap_s"] = best["wall_s"] - busy
                best["gap_pct"] = 100 * best["gap_s"] / best["wall_s"]
            row[mode] = best
        row["gpu_busy_s"] = busy
        out[str(b)] = row
        print(f"batch {b}: {json.dumps(row)}", flush=True)
    return {"context": args.context, "steps": args.steps, "batches": out}


# -- offline throughput ---------------------------------------------------------------------------


def workload(n: int, tiny: bool) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(0)
    lo, hi, vocab = (10, 60, 256) if tiny else (100, 1025, 10000)
    prompt_lens = rng.integers(lo, hi, n)
    output_lens = rng.integers(lo, hi, n)
    return [rng.integers(0, vocab, p).tolist() for p in prompt_lens], output_lens.tolist()


def step_bytes(config_path: Path) -> tuple[int, int]:
    """(weight bytes a decode step reads, K/V bytes per token of context) of a checkpoint's
    config.json, bf16: every projection and the LM head (tied or not), no embedding lookup."""
    c = json.loads(config_path.read_text())
    h, n_layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    per_layer = h * heads * d * 2 + 2 * h * kv_heads * d + 3 * h * inter
    return 2 * (n_layers * per_layer + c["vocab_size"] * h), 2 * 2 * n_layers * kv_heads * d


#: Batch-size bins of the decode-only steps in the offline breakdown (lower bounds).
DECODE_BINS = (128, 32, 8, 1)


def time_by_kind(steps, wall_s: float, weight_bytes: int, kv_per_token: int, rate: float | None):
    """Where an offline run's wall time goes: steps with prompt tokens, decode-only steps by
    batch bin (``DECODE_BINS``; each with its HBM roofline at ``rate`` bytes/s: the weights
    plus every context token's K/V read once), and wall time outside any step."""
    dur = np.asarray(steps["duration_s"], dtype=float)
    prefill = np.asarray(steps["num_prefill_tokens"]) > 0
    batch = np.asarray(steps["num_decode_tokens"])
    ctx = np.asarray(steps["decode_context_tokens"], dtype=float)
    rows = {"prompt": {"steps": int(prefill.sum()), "s": float(dur[prefill].sum())}}
    upper = None
    for lo in DECODE_BINS:
        sel = ~prefill & (batch >= lo) & (True if upper is None else batch < upper)
        ideal = (weight_bytes * sel.sum() + kv_per_token * ctx[sel].sum()) / rate if rate else None
        name = f"decode {lo}+" if upper is None else f"decode {lo}-{upper - 1}"
        rows[name] = {"steps": int(sel.sum()), "s": float(dur[sel].sum()), "roofline_s": ideal}
        upper = lo
    rows["outside steps"] = {"steps": 0, "s": float(wall_s - dur.sum())}
    return rows


def part_throughput(args) -> dict:
    from sched_lab.config import validate
    from sched_lab.core.errors import UserError
    from sched_lab.core.request import Request
    from sched_lab.run.experiment import run_experiment

    prompts, outputs = workload(args.num_requests, args.tiny)
    kw = engine_kwargs(args)
    modes = ["sync", "async", "async", "sync"]

    def cfg(policies):
        return validate(
            {
                "name": "async_throughput",
                "backend": "engine",
                "trace": {"format": "synthetic", "num_requests": 1},  # replaced by requests=
                "engine": {
                    "model_path": str(model_dir(args)),
                    "device": kw["device"],
                    "dtype": kw["dtype"],
                    "attention_backend": kw["attention_backend"],
                },  # fmt: skip
                "kv_cache": {"block_size": 16, "gpu_memory_utilization": 0.9},
                "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
                "policies": policies,
            },
            "async_engine",
            ROOT,
        )

    policies = [
        {"name": "chunked_prefill", "label": f"{m}{i}", "async_scheduling": m == "async"}
        for i, m in enumerate(modes)
    ]
    note = None
    try:
        config = cfg(policies)
    except UserError as e:  # a tree without the async_scheduling option: sync only
        note = f"async_scheduling not available: {e}"
        modes = ["sync", "sync"]
        config = cfg([{"name": "chunked_prefill", "label": f"sync{i}"} for i in range(2)])
    reqs = [
        Request(str(i), 0.0, len(p), o, prompt_token_ids=p)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    out: dict = {"note": note, "runs": []}
    weight_bytes, kv_per_token = step_bytes(model_dir(args) / "config.json")
    rate = None
    if not args.tiny:
        from common import copy_bandwidth

        rate = out["copy_rate"] = copy_bandwidth()
    for mode, run in zip(modes, run_experiment(config, progress=False, requests=reqs)):
        steps = run.result.steps
        dur, prefill = steps["duration_s"], steps["num_prefill_tokens"]
        decode_only = prefill == 0
        tokens = int(run.requests["num_generated_tokens"].sum())
        entry = {
            "mode": mode,
            "label": run.label,
            "output_tokens": tokens,
            "wall_s": run.result.wall_s,
            "tok_s": tokens / run.result.wall_s,
            "steps": len(dur),
            "median_decode_step_s": float(np.median(dur[decode_only]))
            if decode_only.any()
            else None,
            "num_wasted_tokens": run.summary.get("num_wasted_tokens"),
            "finished": run.summary.get("completed"),
            "time_by_kind": time_by_kind(
                steps, run.result.wall_s, weight_bytes, kv_per_token, rate
            ),
        }
        out["runs"].append(entry)
        print(json.dumps(entry), flush=True)
    for mode in ("sync", "async"):
        rates = [r["tok_s"] for r in out["runs"] if r["mode"] == mode]
        if rates:
            out[f"{mode}_tok_s"] = float(np.mean(rates))
    # Decode steps through the whole stack (scheduler, replay loop, executor): ``batch``
    # requests of --context prompt tokens and 128 output tokens, all at t = 0
    # (chunked_prefill); the median duration of the steps that decode all of them.
    rng = np.random.default_rng(1)
    out["replay_decode"] = {}
    for b in args.batches:
        reqs = [
            Request(f"d{i}", 0.0, args.context, 128, rng.integers(0, 200, args.context).tolist())
            for i in range(b)
        ]
        pols = [{"name": "chunked_prefill", "label": f"{m}-b{b}", "async_scheduling": m == "async"}
                for m in modes[:2]]  # fmt: skip
        if note is not None:
            pols = [{"name": "chunked_prefill", "label": f"sync-b{b}"}]
        row = {}
        for run in run_experiment(cfg(pols), progress=False, requests=reqs):
            steps = run.result.steps
            full = (steps["num_prefill_tokens"] == 0) & (steps["num_decode_tokens"] == b)
            row[run.label.split("-")[0]] = float(np.median(steps["duration_s"][full]))
        out["replay_decode"][str(b)] = row
        print(f"replay decode, batch {b}: {row}", flush=True)
    return out


def part_hf(args) -> dict:
    from engine_throughput import run_hf

    prompts, _ = workload(args.num_requests, args.tiny)
    wall, tokens = run_hf(model_dir(args), prompts, 128)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "new_tokens": 128}


# -- driver ---------------------------------------------------------------------------------------


def markdown(res: dict, device: str) -> str:
    lines = [f"# Async vs sync engine ({device})", ""]
    dec = res.get("decode", {})
    if "batches" in dec:
        lines += [
            f"Decode steps at {dec['context']} tokens of context, {dec['steps']} steps, the "
            "better of two runs per mode (ms; gap = wall - GPU busy, % of the wall):",
            "",
            "| batch | GPU busy | sync wall | sync gap | async wall | async host (launch) "
            "| async gap |",
            "|---|---|---|---|---|---|---|",
        ]

        def ms(v):
            return "-" if v is None else f"{v * 1e3:.3f}"

        for b, row in dec["batches"].items():
            s, a = row["sync"], row["async"]

            def gap(r):
                return "-" if "gap_s" not in r else f"{ms(r['gap_s'])} ({r['gap_pct']:.1f}%)"

            lines.append(
                f"| {b} | {ms(row['gpu_busy_s'])} | {ms(s['wall_s'])} | {gap(s)} | "
                f"{ms(a['wall_s'])} | {ms(a['host_s'])} | {gap(a)} |"
            )
        parts = {b: row.get("host_parts") for b, row in dec["batches"].items()}
        if any(parts.values()):
            lines += [
                "",
                "Host parts of one decode step, each timed alone (median, ms):",
                "",
                "| batch | build SeqInputs | stage (validate, tables, slots, copies) "
                "| graph launch call |",
                "|---|---|---|---|",
            ]
            for b, p in parts.items():
                if p:
                    lines.append(
                        f"| {b} | {ms(p['build_s'])} | {ms(p['stage_s'])} | "
                        f"{ms(p['replay_launch_s'])} |"
                    )
        lines.append("")
    elif dec:
        lines += [f"decode: {dec.get('error')}", ""]
    thr = res.get("throughput", {})
    if "runs" in thr:
        lines += [
            "Offline throughput (nano-vllm's workload, chunked_prefill), in run order:",
            "",
            "| run | mode | output tokens | wall (s) | tok/s | median decode-only step (ms) "
            "| wasted tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in thr["runs"]:
            med = r["median_decode_step_s"]
            lines.append(
                f"| {r['label']} | {r['mode']} | {r['output_tokens']} | {r['wall_s']:.2f} | "
                f"{r['tok_s']:,.0f} | {'-' if med is None else f'{med * 1e3:.3f}'} | "
                f"{r['num_wasted_tokens']} |"
            )
        if thr.get("note"):
            lines += ["", thr["note"]]
        shown = [r for r in thr["runs"] if r["mode"] == "async"] or thr["runs"]
        last = shown[-1] if shown else {}
        if last.get("time_by_kind"):
            rate = thr.get("copy_rate")
            at = f" at the {rate / 1e12:.2f} TB/s copy rate measured" if rate else ""
            lines += [
                "",
                f"Where run {last['label']}'s {last['wall_s']:.2f} s go (roofline: weights plus "
                f"every context token's K/V read once per step{at}):",
                "",
                "| part | steps | s | roofline s | ratio |",
                "|---|---|---|---|---|",
            ]
            for name, row in last["time_by_kind"].items():
                ideal = row.get("roofline_s")
                ratio = f"{row['s'] / ideal:.2f}" if ideal else "-"
                lines.append(
                    f"| {name} | {row['steps']} | {row['s']:.3f} | "
                    f"{'-' if ideal is None else f'{ideal:.3f}'} | {ratio} |"
                )
        rd = thr.get("replay_decode") or {}
        if rd:
            lines += [
                "",
                f"Decode steps through the replay loop (scheduler + executor; each batch's "
                f"requests at {res.get('decode', {}).get('context', '?')} prompt tokens, 128 "
                "out), median step (ms):",
                "",
                "| batch | sync | async |",
                "|---|---|---|",
            ]
            for b, row in rd.items():
                cells = [f"{row[m] * 1e3:.3f}" if m in row else "-" for m in ("sync", "async")]
                lines.append(f"| {b} | {' | '.join(cells)} |")
        hf = res.get("hf", {})
        if "tok_s" in hf:
            lines += ["", f"transformers generate_batch: {hf['tok_s']:,.0f} tok/s "
                      f"({hf['output_tokens']} tokens, {hf['new_tokens']} new each)"]  # fmt: skip
            for mode in ("sync", "async"):
                if f"{mode}_tok_s" in thr:
                    lines.append(
                        f"* {mode}: {thr[f'{mode}_tok_s']:,.0f} tok/s = "
                        f"{thr[f'{mode}_tok_s'] / hf['tok_s']:.1f}x transformers"
                    )
        elif hf:
            lines += ["", f"transformers: {hf.get('error')}"]
        lines.append("")
    elif thr:
        lines += [f"throughput: {thr.get('error')}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a check)")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.skip_hf = True
        if args.batches == [32, 64, 128]:
            args.batches = [4, 8]
        if args.context == 1024:
            args.context = 64
        if args.num_requests == 256:
            args.num_requests = 8
    if args.part is not None:  # one part, in its own process
        fn = {"decode": part_decode, "throughput": part_throughput, "hf": part_hf}[args.part]
        (out / f"part_{args.part}.json").write_text(json.dumps(fn(args), indent=1))
        return
    parts = [p for p in PARTS if not (p == "hf" and args.skip_hf)]
    res: dict = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    passthrough = sys.argv[1:]
    for part in parts:
        path = out / f"part_{part}.json"
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        cmd = ["timeout", str(PARTS[part]), sys.executable, __file__, *passthrough, "--part", part]
        proc = subprocess.run(cmd)  # same cwd: a relative --out names the same folder
        took = time.perf_counter() - t0
        if proc.returncode == 0 and path.exists():
            res[part] = json.loads(path.read_text())
        else:
            why = "timed out" if proc.returncode == 124 else f"exit status {proc.returncode}"
            res[part] = {"error": f"{why} after {took:.0f} s (limit {PARTS[part]} s)"}
        res[part]["seconds"] = took
        print(f"== {part}: {took:.0f} s", flush=True)
    device = "CPU (tiny)"
    if not args.tiny:
        from common import device_line

        device = device_line()
    res["device"] = device
    (out / "async_engine.json").write_text(json.dumps(res, indent=1))
    md = markdown(res, device)
    (out / "async_engine.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
