"""The engine served over HTTP vs the same trace replayed in-process (issue #32, item 7).

On the H200, from the repo root with ``sched_lab`` importable (about 3 minutes; every step
is under a time limit and the whole run under ``--budget-s``, 540 s by default):

    python benchmarks/serve_vs_inprocess.py --out results/serve_vs_inprocess --device cuda

CPU dry run (a tiny random model, a few small requests; checks the script, measures nothing;
under 2 minutes):

    python benchmarks/serve_vs_inprocess.py --out /tmp/svi --device cpu --tiny

Both sides run one engine YAML (chunked_prefill with async scheduling, prefix caching off,
block size 16, 256 sequences, 8,192 tokens a step) written to a temporary folder with its
traces (BurstGPT-format CSVs: arrival, prompt and output lengths):

* **in-process**: one process runs ``sched-lab run`` three times (the model loaded once):
  a short warm-up trace (CUDA graphs, Triton compiles), part 1, part 2.
* **served**: ``sched-lab serve`` of the same YAML on 127.0.0.1 (a free port), then
  ``sched-lab bench`` of the warm-up trace, part 1 and part 2 against it.

Part 1 is nano-vllm's offline workload (benchmarks/engine_throughput.py: 256 requests,
prompt and output lengths U[100, 1024] drawn as it draws them, all at t = 0, outputs pinned
with ``ignore_eos``), sent by bench with ``--request-rate inf``: output tok/s of each side
(summary.json's ``output_throughput``) and their ratio (target >= 0.90). Part 2 is low load:
30 requests of 512 prompt / 32 output tokens, Poisson arrivals at 2 req/s (seed 0), replayed
at the trace's times by both: TTFT p50 / p99 of each and the HTTP path's addition (target
<= 2 ms at p50). In-process TTFT runs from arrival in the replay loop to the step that gave
the first token; bench's from sending the request to the first streamed chunk.

The prompts differ: in-process, the lab's random token ids; served, bench's text
(``hello hello ...``) tokenized by the server. A random checkpoint has no tokenizer, so the
served model folder is a copy of links to the checkpoint's files plus a word-level tokenizer
over the model's whole vocabulary (``hello`` one token, no BOS, every id decodable). The
report checks bench's ``server_prompt_tokens`` against the trace's prompt lengths.

Writes ``OUT/serve_vs_inprocess.json`` (after each step, so a run cut short keeps what it
measured) and ``OUT/serve_vs_inprocess.md``, and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLI = "from sched_lab.cli import main; raise SystemExit(main())"
PROMPT_WORD = "hello"  # the word sched-lab bench repeats (lab/client/http.py PROMPT_WORD)
LABEL = "chunked_prefill-async"


# -- workloads ------------------------------------------------------------------------------------


def throughput_workload(n: int, tiny: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Part 1: (arrival s, prompt lengths, output lengths); engine_throughput.py's draws
    (seed 0: prompt lengths, then output lengths, U[100, 1024]); all at t = 0."""
    rng = np.random.default_rng(0)
    lo, hi = (10, 60) if tiny else (100, 1025)
    prompt, output = rng.integers(lo, hi, n), rng.integers(lo, hi, n)
    return np.zeros(n), prompt, output


def ttft_workload(n: int, prompt: int, output: int, rate: float) -> tuple[np.ndarray, ...]:
    """Part 2: ``n`` requests of fixed lengths, Poisson arrivals at ``rate`` req/s (seed 0),
    the first at t = 0."""
    gaps = np.random.default_rng(0).exponential(1.0 / rate, n - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    return arrivals, np.full(n, prompt), np.full(n, output)


def write_trace(path: Path, arrival_s, prompt_len, output_len) -> None:
    """A BurstGPT-format CSV (``Timestamp`` in seconds, ``Request tokens``, ``Response
    tokens``; traces/loaders.py load_burstgpt)."""
    lines = ["Timestamp,Request tokens,Response tokens"]
    lines += [f"{t:.6f},{p},{o}" for t, p, o in zip(arrival_s, prompt_len, output_len)]
    path.write_text("\n".join(lines) + "\n")


def experiment_yaml(path: Path, name: str, trace: Path, model_dir: Path, args) -> None:
    """The engine YAML both sides run (module docstring)."""
    if args.tiny or args.device == "cpu":
        engine = {"device": "cpu", "dtype": "float32", "attention_backend": "torch",
                  "num_threads": 1}  # fmt: skip
        kv = {"block_size": 16, "num_gpu_blocks": 2048, "swap_space_gib": 0}
    else:
        engine = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "triton"}
        kv = {"block_size": 16, "gpu_memory_utilization": 0.9}
    raw = {
        "name": name,
        "backend": "engine",
        "seed": 0,
        "trace": {"format": "burstgpt", "path": str(trace)},
        "engine": {"model_path": str(model_dir), **engine},
        "kv_cache": {**kv, "enable_prefix_caching": False},
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "policies": [{"name": "chunked_prefill", "label": LABEL, "async_scheduling": True}],
    }
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


# -- the model folders ----------------------------------------------------------------------------


def make_checkpoint(args, work: Path, budget: Budget) -> Path:
    """The checkpoint: ``--model-dir``, written by make-random-checkpoint when missing; with
    ``--tiny`` a tiny random Qwen3 in the work folder."""
    if args.tiny:
        from common import tiny_qwen3  # imports torch: only here

        from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

        config = tiny_qwen3(4096)
        return write_random_checkpoint(config, work / "tiny_ckpt", dtype="float32", std=0.2)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        cmd = [sys.executable, "-c", CLI, "tools", "make-random-checkpoint",
               "--preset", args.preset, "--out", str(model_dir)]  # fmt: skip
        run_step("make-random-checkpoint", cmd, budget.limit(300), work / "checkpoint.log")
    return model_dir


def served_model_dir(model_dir: Path, work: Path) -> Path:
    """``model_dir`` itself when it has a tokenizer; else a folder of links to its files and
    a word-level tokenizer over its vocabulary: id i is the word ``<i>``, except ``hello``
    (one token per word of bench's prompts, no BOS added) and ``<unk>`` (id 0)."""
    if (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists():
        return model_dir
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    hello = min(9707, vocab_size - 1)  # any id but 0
    words = {i: f"<{i}>" for i in range(vocab_size)}
    words[0], words[hello] = "<unk>", PROMPT_WORD
    tok = Tokenizer(models.WordLevel({w: i for i, w in words.items()}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = work / f"{model_dir.name}_served"
    out.mkdir()
    for f in model_dir.iterdir():
        (out / f.name).symlink_to(f.resolve())
    tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


# -- steps under time limits ----------------------------------------------------------------------


class Budget:
    """The run's wall-clock budget: each step's limit is its own cap or what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def limit(self, cap: float) -> float:
        left = self.end - time.monotonic() - 5.0  # keep a few seconds to write the results
        if left < 1.0:
            raise StepFailed("the run's --budget-s is spent")
        return min(cap, left)


class StepFailed(Exception):
    """A step that failed or ran out of time; its message is one line."""


def run_step(name: str, cmd: list[str], timeout_s: float, log: Path) -> None:
    """Run ``cmd`` to its end within ``timeout_s``, its output to ``log``."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=child_env())  # fmt: skip
        except subprocess.TimeoutExpired:
            raise StepFailed(f"{name}: timed out after {timeout_s:.0f} s") from None
    took = time.perf_counter() - t0
    print(f"== {name}: {took:.1f} s", flush=True)
    if proc.returncode != 0:
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise StepFailed(f"{name}: exit status {proc.returncode} after {took:.0f} s. {tail}")


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Server:
    """``sched-lab serve CONFIG`` on 127.0.0.1, a free port; killed by :meth:`close`."""

    def __init__(self, config: Path, log: Path, timeout_s: float) -> None:
        cmd = [sys.executable, "-c", CLI, "serve", str(config), "--host", "127.0.0.1",
               "--port", "0"]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=child_env())  # fmt: skip
        self.lines: list[str] = []
        self.url: str | None = None
        started = threading.Event()
        threading.Thread(target=self._read, args=(started,), daemon=True).start()
        t0 = time.monotonic()
        started.wait(timeout_s)
        if self.url is None:
            self.close()
            raise StepFailed(f"serve: no address within {timeout_s:.0f} s. {self.tail()}")
        while not self.healthy():  # /health answers 200 once the loop runs
            if time.monotonic() - t0 > timeout_s or self.proc.poll() is not None:
                self.close()
                raise StepFailed(f"serve: /health not 200 within {timeout_s:.0f} s. {self.tail()}")
            time.sleep(0.2)
        print(f"== serve: up at {self.url} in {time.monotonic() - t0:.1f} s", flush=True)

    def _read(self, started: threading.Event) -> None:
        with open(self.log, "w") as f:
            for line in self.proc.stdout:
                self.lines.append(line)
                f.write(line)
                f.flush()
                if line.startswith("serving ") and self.url is None:
                    self.url = line.split()[-1]
                    started.set()
        started.set()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        return " | ".join(x.strip() for x in self.lines[-3:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- reading the results folders ------------------------------------------------------------------


def summary_of(folder: Path) -> dict[str, Any]:
    """The figures of a results folder's one run (summary.json: {run label: summary}; the
    names of lab/results/names.py)."""
    (run,) = json.loads((folder / "summary.json").read_text()).values()
    keys = ("num_prompts", "completed", "failed", "duration", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")  # fmt: skip
    return {k: run.get(k) for k in keys}


def prompt_check(folder: Path) -> dict[str, Any]:
    """bench's ``server_prompt_tokens`` (the server's count) against the trace's lengths."""
    import pandas as pd

    req = pd.read_csv(folder / "requests.csv")
    diff = req["server_prompt_tokens"] - req["prompt_tokens"]
    return {
        "requests": len(req),
        "mismatched": int((diff != 0).sum()),
        "max_abs_diff_tokens": int(diff.abs().max()),
        "outputs_as_asked": bool((req["num_generated_tokens"] == req["output_tokens"]).all()),
    }


# -- driver ---------------------------------------------------------------------------------------


def in_process(configs: list[Path], outs: list[Path]) -> int:
    """Hidden ``--in-process``: ``sched-lab run`` of each config in this one process (the
    engine keeps its model between runs: lab/setup/engine.py ``_runner``)."""
    from sched_lab.cli import main

    for cfg, out in zip(configs, outs, strict=True):
        t0 = time.perf_counter()
        status = main(["run", str(cfg), "--out", str(out), "--no-progress"])
        print(f"sched-lab run {cfg.name}: exit {status} in {time.perf_counter() - t0:.1f} s")
        if status != 0:
            return status
    return 0


def benchmark(args, res: dict[str, Any], save) -> None:
    budget = Budget(args.budget_s)
    work = Path(tempfile.mkdtemp(prefix="serve_vs_inprocess_"))
    res["work_dir"] = str(work)
    try:
        model_dir = make_checkpoint(args, work, budget)
        served_dir = served_model_dir(model_dir, work)
        n1 = 8 if args.tiny else args.num_requests
        n2, p2, o2 = (6, 32, 8) if args.tiny else (args.ttft_requests, 512, 32)
        workloads = {
            "warmup": throughput_workload(4 if args.tiny else 16, args.tiny),
            "throughput": throughput_workload(n1, args.tiny),
            "ttft": ttft_workload(n2, p2, o2, args.ttft_rate),
        }
        configs = {}
        for name, (arr, p, o) in workloads.items():
            write_trace(work / f"{name}.csv", arr, p, o)
            configs[name] = work / f"{name}.yaml"
            experiment_yaml(configs[name], name, work / f"{name}.csv", served_dir, args)
        res["workloads"] = {
            k: {"requests": len(a), "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
                "last_arrival_s": float(a[-1])}
            for k, (a, p, o) in workloads.items()
        }  # fmt: skip
        save()
        # in-process: one process, three sched-lab runs
        outs = [work / f"inprocess_{k}" for k in configs]
        cmd = [sys.executable, __file__, "--in-process", *map(str, configs.values()), "--outs",
               *map(str, outs)]  # fmt: skip
        try:
            run_step("in-process (3 sched-lab runs)", cmd,
                     budget.limit(60 if args.tiny else 240), work / "inprocess.log")  # fmt: skip
            res["inprocess"] = {k: summary_of(o) for k, o in zip(configs, outs)}
        except StepFailed as e:
            res["inprocess"] = {"error": str(e)}
        print(json.dumps(res["inprocess"]), flush=True)
        save()
        # served: one server, three sched-lab bench runs
        res["served"] = {}
        server = Server(
            configs["warmup"], work / "serve.log", budget.limit(60 if args.tiny else 180)
        )
        try:
            for name, cfg in configs.items():
                out = work / f"served_{name}"
                cmd = [sys.executable, "-c", CLI, "bench", str(cfg), "--base-url", server.url,
                       "--out", str(out), "--no-progress", "--timeout", "120"]  # fmt: skip
                if name != "ttft":
                    cmd += ["--request-rate", "inf"]
                cap = 30 if args.tiny else 120 if name != "ttft" else 90
                try:
                    run_step(f"bench {name}", cmd, budget.limit(cap), work / f"bench_{name}.log")
                    res["served"][name] = {**summary_of(out), "prompts": prompt_check(out)}
                except StepFailed as e:
                    res["served"][name] = {"error": str(e)}
                print(json.dumps(res["served"][name]), flush=True)
                save()
        finally:
            server.close()
            res["server_log_tail"] = [x.rstrip() for x in server.lines[-5:]]
    except StepFailed as e:
        res["error"] = str(e)
    finally:
        res["log_tails"] = {f.name: f.read_text().strip().splitlines()[-12:]
                            for f in sorted(work.glob("*.log"))}  # fmt: skip
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def derive(res: dict[str, Any]) -> None:
    """Ratio and differences, where both sides measured."""
    ins, srv = res.get("inprocess", {}), res.get("served", {})
    a, b = ins.get("throughput", {}), srv.get("throughput", {})
    if a.get("output_throughput") and b.get("output_throughput"):
        res["throughput_ratio"] = b["output_throughput"] / a["output_throughput"]
    a, b = ins.get("ttft", {}), srv.get("ttft", {})
    for stat in ("median_ttft_ms", "p99_ttft_ms"):
        if a.get(stat) is not None and b.get(stat) is not None:
            res[f"added_{stat}"] = b[stat] - a[stat]


def markdown(res: dict[str, Any]) -> str:
    def num(v, fmt=",.1f"):
        return "-" if v is None else format(v, fmt)

    ins, srv = res.get("inprocess", {}), res.get("served", {})
    lines = [f"# Served vs in-process engine ({res['device']})", ""]
    lines += [
        "| workload | side | finished | duration (s) | output tok/s | TTFT p50 (ms) "
        "| TTFT p99 (ms) | TPOT p50 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("warmup", "throughput", "ttft"):
        for side, d in (("in-process", ins), ("served", srv)):
            r = d.get(name) if isinstance(d, dict) else None
            if not r:
                continue
            if "error" in r:
                lines.append(f"| {name} | {side} | {r['error']} | | | | | |")
                continue
            lines.append(
                f"| {name} | {side} | {r['completed']}/{r['num_prompts']} | "
                f"{num(r['duration'], '.2f')} | {num(r['output_throughput'], ',.0f')} | "
                f"{num(r['median_ttft_ms'], '.2f')} | {num(r['p99_ttft_ms'], '.2f')} | "
                f"{num(r['median_tpot_ms'], '.2f')} |"
            )
    if "error" in ins:
        lines.append(f"\nin-process: {ins['error']}")
    lines.append("")
    ratio = res.get("throughput_ratio")
    lines.append(
        f"* throughput served / in-process: {num(ratio, '.3f')} (target >= 0.90)"
        + ("" if ratio is None else " ✓" if ratio >= 0.9 else " ✗")
    )
    add = res.get("added_median_ttft_ms")
    lines.append(
        f"* TTFT added by HTTP at low load: p50 {num(add, '+.2f')} ms (target <= 2), "
        f"p99 {num(res.get('added_p99_ttft_ms'), '+.2f')} ms"
        + ("" if add is None else " ✓" if add <= 2.0 else " ✗")
    )
    for name, r in srv.items():
        pc = r.get("prompts") if isinstance(r, dict) else None
        if pc:
            lines.append(
                f"* {name}: server_prompt_tokens differ from the trace's in {pc['mismatched']} "
                f"of {pc['requests']} requests (max {pc['max_abs_diff_tokens']} tokens); "
                f"outputs as asked: {pc['outputs_as_asked']}"
            )
    if res.get("error"):
        lines.append(f"* stopped: {res['error']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for serve_vs_inprocess.json and .md")
    ap.add_argument("--model-dir", default=str(ROOT / "checkpoints" / "qwen3-0.6b"),
                    help="checkpoint (made with make-random-checkpoint when missing)")  # fmt: skip
    ap.add_argument("--preset", default="qwen3-0.6b", help="the preset of a missing checkpoint")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, few requests")
    ap.add_argument("--num-requests", type=int, default=256, help="part 1 requests")
    ap.add_argument("--ttft-requests", type=int, default=30, help="part 2 requests")
    ap.add_argument("--ttft-rate", type=float, default=2.0, help="part 2 Poisson rate (req/s)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time limit")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (results, logs)")
    ap.add_argument("--in-process", nargs="+", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--outs", nargs="+", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.in_process:
        raise SystemExit(in_process(args.in_process, args.outs))
    if not args.out:
        ap.error("--out is required")
    if args.tiny:
        args.device = "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device_line(args),
    }

    def save() -> None:
        derive(res)
        (out / "serve_vs_inprocess.json").write_text(json.dumps(res, indent=1))

    def stop(signum, frame):  # SIGTERM: unwind, so that the server is killed
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    t0 = time.perf_counter()
    try:
        benchmark(args, res, save)
    finally:
        res["wall_s"] = time.perf_counter() - t0
        save()
        md = markdown(res)
        (out / "serve_vs_inprocess.md").write_text(md)
        print(md)


def device_line(args) -> str:
    """The GPU from nvidia-smi (this process leaves CUDA alone: the children size their KV
    cache from the free memory)."""
    if args.tiny:
        return "CPU, tiny random Qwen3 (a dry run: measures nothing)"
    if args.device == "cpu":
        return "CPU"
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cuda (nvidia-smi: {e})"


if __name__ == "__main__":
    main()
