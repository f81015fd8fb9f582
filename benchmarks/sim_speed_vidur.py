"""The lab's simulator beside Vidur's on the same trace, each run as a whole process.

    python benchmarks/sim_speed_vidur.py [--repeat 3] [--limit N] [--vidur-python PATH]
    python benchmarks/sim_speed_vidur.py --scaling [--max-requests 1000000] [--policy fcfs]

Comparison (default): for each pair of policies (the lab's fcfs with Vidur's vLLM scheduler,
the lab's chunked_prefill with Vidur's Sarathi scheduler) it runs, alternating, best of
``--repeat``: ``sched-lab run`` of a one-policy YAML made from
benchmarks/sim_speed_conv2x.yaml (plus ``--no-plots`` when the CLI has it), and Vidur on the
same requests with its metrics and plots as by default, then with its metric writing off.
For each process: wall seconds, CPU seconds (user + system of the child and of what it
waited for, from ``os.wait4``) and peak RSS; the simulation loop apart (the lab: its
``replay`` call; Vidur: ``Simulator.run`` up to ``_write_output``), wall and CPU, and the
number of steps (Vidur: batches). The ratios printed are Vidur's CPU seconds over the lab's:
the machine may be shared, and CPU time moves less with other load than wall time does.
Both sides import from cached bytecode, as an installed package does: the children run
without ``PYTHONDONTWRITEBYTECODE`` (set on some machines, where the lab's editable sources
were then compiled again by every run: ~0.5 CPU s of a ~3 s one-policy run on 2026-12-07),
and an untimed first run of the lab writes its caches, as Vidur's untimed warm-up does.

Without the Vidur interpreter (``--vidur-python``, default ``$VIDUR_PYTHON`` or
/work/vidur-venv/bin/python) only the lab's figures are printed.

Vidur's side (BENCHMARKS.md has the setup, versions and the exact command line): Vidur
0.0.26 from PyPI, its linear-regression execution-time predictor, model
``meta-llama/Llama-3-8B`` on ``h100`` (TP 1, PP 1). Vidur 0.0.26 downloads its profiles
from Hugging Face; offline, this script builds them (once, under ``--work``) from the public
microsoft/vidur CSVs in ``--anchor-data`` and places them as an offline Hugging Face cache:
the MLP table of Llama-2-7B on H100 (TP 1) with the 8B's shape written in and its
up/down/activation and QKV-projection times scaled by the weights' ratios (14336/11008,
6144/12288), and the attention table of Llama-2-70B at TP 2 on A100 (per GPU 32 query heads
of 128, as the 8B at TP 1) relabelled to the 8B's shape. The first Vidur run trains and
caches the predictor (untimed warm-up). Vidur 0.0.26 needs two small patches to run here
(``--patch-vidur`` applies them in its site-packages, idempotent):
  * LinearRegressionExecutionTimePredictor lacks ``_get_kv_parallel_communication_time``
    (abstract: the class cannot be instantiated); the RandomForrest one's body is added;
  * ``Request.restart()`` (recompute preemption) leaves ``_num_stage_processed_tokens`` and
    ``_is_prefill_stage_complete`` set, so the first preempted request fails an assertion.

Scaling (``--scaling``): the lab alone, one policy, on the trace repeated back to back (each
copy shifted by the trace's span plus one mean gap, at its rate_scale) and cut to 19,366,
77,464, 250,000 and 1,000,000 requests (``--sizes``); sizes above ``--max-requests`` are
skipped and listed. Each size is one process, once: wall, CPU, the replay loop, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "benchmarks" / "sim_speed_conv2x.yaml"
DEFAULT_VIDUR_PYTHON = os.environ.get("VIDUR_PYTHON", "/work/vidur-venv/bin/python")
DEFAULT_ANCHOR = ROOT.parent / "shared" / "anchor-data" / "vidur"
PAIRS = (("fcfs", "vllm"), ("chunked_prefill", "sarathi"))  # lab policy, Vidur scheduler
SCALING_SIZES = (19_366, 77_464, 250_000, 1_000_000)
MIB = 1024  # ru_maxrss is in KiB on Linux

# The lab's CLI, with its replay call timed (wall and CPU) and reported on stderr.
LAB_DRIVER = """
import json, sys, time
import sched_lab.run.experiment as ex
from sched_lab.cli import main
laps = []
replay = ex.replay
def timed(*args, **kwargs):
    w, c = time.perf_counter(), time.process_time()
    try:
        return replay(*args, **kwargs)
    finally:
        laps.append((time.perf_counter() - w, time.process_time() - c))
ex.replay = timed
try:
    code = main(sys.argv[1:])
finally:
    print("LAB_TIMES " + json.dumps(laps), file=sys.stderr)
sys.exit(code)
"""

# vidur.main.main(), with Simulator.run's loop (up to _write_output) timed.
VIDUR_DRIVER = """
import json, time
from vidur.config import SimulationConfig
from vidur.entities import Batch
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
simulator = Simulator(config)
marks = {}
write_output = Simulator._write_output
def timed_write(self):
    marks["loop_end"] = (time.perf_counter(), time.process_time())
    write_output(self)
Simulator._write_output = timed_write
start = (time.perf_counter(), time.process_time())
simulator.run()
end = marks["loop_end"]
print("VIDUR_TIMES " + json.dumps({
    "loop_wall_s": end[0] - start[0], "loop_cpu_s": end[1] - start[1],
    "batches": Batch._id + 1, "sim_end_s": simulator._time}))
"""

PATCH_CHECK = """
import inspect
from vidur.entities.request import Request
from vidur.execution_time_predictor.linear_regression_execution_time_predictor import (
    LinearRegressionExecutionTimePredictor as LR)
print(int(inspect.isabstract(LR)), int("_num_stage_processed_tokens = 0" in
      inspect.getsource(Request.restart)))
"""


@dataclass
class Timed:
    """One child process: its totals and, where it reported them, its loop's."""

    wall_s: float
    cpu_s: float
    maxrss_mib: float
    loop_wall_s: float = float("nan")
    loop_cpu_s: float = float("nan")
    steps: int = 0
    extra: dict = field(default_factory=dict)


def child_env(**extra: str) -> dict:
    """The environment of a timed child: this one with ``extra``, one OpenMP thread, and
    bytecode caching on (no ``PYTHONDONTWRITEBYTECODE``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_timed(cmd: list[str], log: Path, env: dict | None = None) -> Timed:
    """Run ``cmd`` with stdout and stderr in ``log``; exit with its log's tail if it fails."""
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        sys.exit(f"error: {cmd[0]} exited with {proc.returncode}; {log}:\n" + "\n".join(tail))
    return Timed(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / MIB)


# --- the lab's side ---------------------------------------------------------------------


def load_base(path: Path) -> dict:
    """The benchmark YAML with its relative paths made absolute."""
    cfg = yaml.safe_load(path.read_text())
    for section, key in (("trace", "path"), ("cost_model", "profile")):
        if key in cfg.get(section, {}):
            cfg[section][key] = str((path.parent / cfg[section][key]).resolve())
    return cfg


def policy_entry(cfg: dict, name: str):
    for entry in cfg["policies"]:
        if (entry if isinstance(entry, str) else entry["name"]) == name:
            return entry
    sys.exit(
        f"error: the benchmark YAML ({cfg.get('name')}) has no policy {name!r} under 'policies'"
    )


def write_lab_yaml(cfg: dict, policy: str, folder: Path, trace: dict | None = None) -> Path:
    """``cfg`` with ``policy`` alone (and ``trace`` in place of its own), in ``folder``."""
    one = dict(cfg, name=f"sim_speed_{policy}", policies=[policy_entry(cfg, policy)])
    if trace is not None:
        one["trace"] = trace
    path = folder / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(one, sort_keys=False))
    return path


def lab_has_no_plots() -> bool:
    cmd = [sys.executable, "-c", "from sched_lab.cli import main; main(['run', '--help'])"]
    return "--no-plots" in subprocess.run(cmd, capture_output=True, text=True).stdout


def run_lab(yaml_path: Path, folder: Path, extra: list[str]) -> Timed:
    """``sched-lab run YAML`` as one process; its results folder is read, then removed."""
    out, log = folder / "out", folder / f"{yaml_path.stem}.lab.log"
    cmd = [sys.executable, "-c", LAB_DRIVER, "run", str(yaml_path), "--out", str(out)]
    timed = run_timed([*cmd, "--no-progress", *extra], log, child_env())
    text = log.read_text()
    laps = json.loads(re.search(r"^LAB_TIMES (.*)$", text, re.M).group(1))
    timed.loop_wall_s, timed.loop_cpu_s = laps[0]
    timed.steps = int(re.search(r"(\d+) steps in [\d.]+ s", text).group(1))
    summary = json.loads((out / "summary.json").read_text())
    run = next(iter(summary.values()))
    timed.extra = {"limits": run["limits"], "duration_s": run["duration"]}
    shutil.rmtree(out)
    return timed


# --- Vidur's side -----------------------------------------------------------------------


def vidur_patches_missing(python: str) -> list[str]:
    out = subprocess.run([python, "-c", PATCH_CHECK], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: {python} cannot import vidur: {out.stderr.strip().splitlines()[-1]}")
    abstract, restart_ok = out.stdout.split()
    missing = ["linear-regression predictor"] if abstract == "1" else []
    return missing + ([] if restart_ok == "1" else ["Request.restart"])


def patch_vidur(python: str) -> None:
    """Apply the two edits of the module docstring to Vidur's installed files (idempotent)."""
    where = subprocess.run(
        [python, "-c", "import vidur, os; print(os.path.dirname(vidur.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    lr = Path(where, "execution_time_predictor", "linear_regression_execution_time_predictor.py")
    text = lr.read_text()
    if "_get_kv_parallel_communication_time" not in text:
        text = text.replace(
            "from vidur.execution_time_predictor.sklearn",
            "from vidur.entities import Batch\nfrom vidur.execution_time_predictor.sklearn",
            1,
        )
        text += (
            "\n    def _get_kv_parallel_communication_time(self, batch: Batch) -> float:\n"
            "        return super()._get_kv_parallel_communication_time(batch)\n"
        )
        lr.write_text(text)
    request = Path(where, "entities", "request.py")
    raw = request.read_bytes()
    nl = b"\r\n" if b"\r\n" in raw else b"\n"
    old = b"        self._num_processed_tokens = 0" + nl + b"        self._num_processed_iterations"
    new = (
        b"        self._num_processed_tokens = 0"
        + nl
        + b"        self._num_stage_processed_tokens = 0"
        + nl
        + b"        self._is_prefill_stage_complete = False"
        + nl
        + b"        self._num_processed_iterations"
    )
    if b"self._num_stage_processed_tokens = 0" + nl + b"        self._is_prefill" not in raw:
        if raw.count(old) != 1:
            sys.exit(f"error: {request}: restart() is not the one of Vidur 0.0.26")
        request.write_bytes(raw.replace(old, new))


def build_vidur_profiles(python: str, anchor: Path, cache: Path) -> None:
    """The offline Hugging Face cache Vidur's predictor reads (see the module docstring)."""
    if (cache / "profiling_data").exists():
        return
    script = r"""
import json, sys
from pathlib import Path
import pandas as pd
anchor, cache = Path(sys.argv[1]) / "profiling", Path(sys.argv[2])
def snapshot(kind, repo):
    root = cache / "profiling_data" / kind / ("datasets--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text("0" * 40)
    folder = root / "snapshots" / ("0" * 40)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
compute = snapshot("compute", "project-vajra/dev-staging-meta-llama-llama-3-8b-h100")
mlp = pd.read_csv(anchor / "compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv")
mlp = mlp[mlp.num_tensor_parallel_workers == 1].copy()
scale = {"mlp_up_proj": 14336 / 11008, "mlp_down_proj": 14336 / 11008,
         "mlp_act": 14336 / 11008, "attn_pre_proj": (4096 + 2 * 1024) / (3 * 4096)}
for op, factor in scale.items():
    cols = [c for c in mlp.columns if c.startswith(f"time_stats.{op}.")]
    mlp[cols] = mlp[cols] * factor
mlp["n_kv_head"], mlp["n_expanded_embd"], mlp["vocab_size"] = 8, 14336, 128256
mlp.to_csv(compute / "mlp.csv.xz", index=False)
attn = pd.read_csv(anchor / "compute/a100/meta-llama/Llama-2-70b-hf/attention.csv")
attn["n_embd"], attn["n_q_head"], attn["n_kv_head"] = 4096, 32, 8
attn["num_tensor_parallel_workers"] = 1
attn.to_csv(compute / "attention.csv.xz", index=False)
(compute / "config.json").write_text(
    json.dumps({"model": "meta-llama/Llama-3-8B", "device_sku": "h100"}))
network = snapshot("network", "project-vajra/dev-staging-h100-dgx")
for name in ("all_reduce", "send_recv"):
    pd.read_csv(anchor / f"network/h100_dgx/{name}.csv").to_csv(
        network / f"{name}.csv.xz", index=False)
(network / "config.json").write_text(json.dumps({"sku": "h100_dgx"}))
"""
    if not (anchor / "profiling").is_dir():
        sys.exit(f"error: --anchor-data {anchor}: no profiling/ folder (Vidur's CSVs)")
    subprocess.run([python, "-c", script, str(anchor), str(cache)], check=True)


def write_vidur_trace(cfg: dict, path: Path) -> int:
    """The lab's requests (after its rate_scale and limit) in Vidur's trace-replay CSV;
    returns the longest request's tokens."""
    sys.path.insert(0, str(ROOT))
    from sched_lab.traces import load_trace

    requests = load_trace(cfg["trace"], ROOT)
    with open(path, "w") as f:
        f.write("Date,Time,PromptTokenCount,CompletionTokenCount\n")
        for r in requests:
            f.write(f"2023-11-16,{r.arrival_s!r},{r.prompt_len},{r.output_len}\n")
    return max(r.prompt_len + r.output_len for r in requests)


def vidur_args(scheduler: str, cfg: dict, lab_limits: dict, trace: Path, cache: Path,
               out: Path, grid: int, metrics: bool) -> list[str]:  # fmt: skip
    """Vidur's command-line flags for the lab's setup: the same KV blocks, batch cap, token
    budget (fcfs) or chunk (Sarathi); ``grid`` tokens bound every request and step (the
    predictor's tables and Vidur's max_tokens, which must not cut a prompt)."""
    kv, max_num_seqs = cfg["kv_cache"], cfg["scheduler"]["max_num_seqs"]
    if scheduler == "vllm":
        sched = ["--vllm_scheduler_config_batch_size_cap", max_num_seqs,
                 "--vllm_scheduler_config_max_tokens_in_batch",
                 lab_limits["max_num_batched_tokens"]]  # fmt: skip
    else:
        chunk = policy_entry(cfg, "chunked_prefill")["max_num_batched_tokens"]
        sched = ["--sarathi_scheduler_config_batch_size_cap", max_num_seqs,
                 "--sarathi_scheduler_config_chunk_size", chunk]  # fmt: skip
    p = "--linear_regression_execution_time_predictor_config_"
    args = [
        "--replica_config_model_name", "meta-llama/Llama-3-8B",
        "--replica_config_device", "h100", "--replica_config_network_device", "h100_dgx",
        "--replica_config_tensor_parallel_size", 1, "--replica_config_num_pipeline_stages", 1,
        "--cache_config_block_size", kv["block_size"],
        "--cache_config_num_blocks", kv["num_gpu_blocks"],
        "--replica_scheduler_config_type", scheduler, *sched,
        "--request_generator_config_type", "trace_replay",
        "--trace_request_generator_config_trace_file", trace,
        "--trace_request_generator_config_date", "2023-11-16",
        "--trace_request_generator_config_prefill_scale_factor", 1,
        "--trace_request_generator_config_decode_scale_factor", 1,
        "--trace_request_generator_config_time_scale_factor", 1,
        "--trace_request_generator_config_max_tokens", grid,
        "--execution_time_predictor_config_type", "linear_regression",
        p + "cache_dir", cache, p + "num_training_job_threads", 1,
        p + "prediction_max_batch_size", max_num_seqs,
        p + "prediction_max_tokens_per_request", grid,
        p + "prediction_max_prefill_chunk_size", grid,
        "--metrics_config_output_dir", out,
    ]  # fmt: skip
    if not metrics:
        args += ["--no-metrics_config_write_metrics", "--no-metrics_config_store_plots",
                 "--no-metrics_config_enable_chrome_trace"]  # fmt: skip
    return [str(a) for a in args]


def run_vidur(python: str, args: list[str], log: Path, out: Path) -> Timed:
    """``python -m vidur.main ARGS`` as one process (offline); its output is removed."""
    env = child_env(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    timed = run_timed([python, "-c", VIDUR_DRIVER, *args], log, env)
    marks = json.loads(re.search(r"^VIDUR_TIMES (.*)$", log.read_text(), re.M).group(1))
    timed.loop_wall_s, timed.loop_cpu_s = marks["loop_wall_s"], marks["loop_cpu_s"]
    timed.steps, timed.extra = marks["batches"], {"duration_s": marks["sim_end_s"]}
    shutil.rmtree(out, ignore_errors=True)
    return timed


# --- the two modes ----------------------------------------------------------------------


def best(runs: list[Timed]) -> Timed:
    """The run of least CPU time, its wall and loop times the least of all runs."""
    top = min(runs, key=lambda t: t.cpu_s)
    top.loop_cpu_s = min(t.loop_cpu_s for t in runs)
    top.loop_wall_s = min(t.loop_wall_s for t in runs)
    top.wall_s = min(t.wall_s for t in runs)
    return top


def compare(args: argparse.Namespace, work: Path) -> None:
    cfg = load_base(args.config)
    if args.limit:
        cfg["trace"]["limit"] = args.limit
    have_vidur = Path(args.vidur_python).exists()
    if have_vidur:
        if args.patch_vidur:
            patch_vidur(args.vidur_python)
        missing = vidur_patches_missing(args.vidur_python)
        if missing:
            sys.exit(
                f"error: {args.vidur_python}: Vidur is not patched ({', '.join(missing)}); "
                "rerun with --patch-vidur (see this script's docstring)"
            )
        build_vidur_profiles(args.vidur_python, args.anchor_data, work / "vidur_cache")
        trace = work / f"vidur_trace_{args.limit or 'all'}.csv"
        max_tokens = write_vidur_trace(cfg, trace)
    else:
        print(f"# no Vidur at {args.vidur_python}: the lab's figures only")
    variants = [("", [])] + ([("--no-plots", ["--no-plots"])] if lab_has_no_plots() else [])
    rows: dict[str, list[Timed]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="runs-", dir=work))  # this process's own
    grid = None
    run_lab(write_lab_yaml(cfg, PAIRS[0][0], scratch), scratch, variants[-1][1])  # bytecode caches
    for rep in range(args.repeat):
        for policy, scheduler in PAIRS:
            yaml_path = write_lab_yaml(cfg, policy, scratch)
            for label, extra in variants:
                key = f"lab {policy} {label}".strip()
                rows.setdefault(key, []).append(run_lab(yaml_path, scratch, extra))
            if not have_vidur:
                continue
            limits = rows[f"lab {policy}"][0].extra["limits"]
            if grid is None:  # one grid for both schedulers: one predictor cache
                grid = -(-max(max_tokens, limits["max_num_batched_tokens"]) // 4096) * 4096
            for label, metrics in (("", True), ("metrics off", False)):
                out = scratch / "vidur_out"
                vargs = vidur_args(scheduler, cfg, limits, trace, work / "vidur_cache", out,
                                   grid, metrics)  # fmt: skip
                log = scratch / f"vidur_{scheduler}.log"
                warm = work / "vidur_cache" / f"warm_{grid}"
                if not warm.exists():  # trains and caches the predictor: not timed
                    run_vidur(args.vidur_python, vargs, log, out)
                    warm.touch()
                key = f"vidur {scheduler} {label}".strip()
                rows.setdefault(key, []).append(run_vidur(args.vidur_python, vargs, log, out))
                if rep == 0 and metrics:
                    print(f"# Vidur command ({scheduler}): HF_HUB_OFFLINE=1 python -m vidur.main "
                          + " ".join(vargs))  # fmt: skip
        print(f"# repeat {rep + 1}/{args.repeat} done", flush=True)
    shutil.rmtree(scratch)
    table(rows, args)


def table(rows: dict[str, list[Timed]], args: argparse.Namespace) -> None:
    print(
        f"\n# {args.config.name}{f' --limit {args.limit}' if args.limit else ''}, "
        f"best of {args.repeat}; {platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}"
    )
    print("| run | steps | sim. end (s) | wall (s) | CPU (s) | loop wall (s) | loop CPU (s) "
          "| us/step (loop CPU) | peak RSS (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    best_of = {key: best(runs) for key, runs in rows.items()}
    for key, t in best_of.items():
        print(
            f"| {key} | {t.steps:,} | {t.extra['duration_s']:.1f} | {t.wall_s:.2f} | "
            f"{t.cpu_s:.2f} | {t.loop_wall_s:.2f} | {t.loop_cpu_s:.2f} | "
            f"{1e6 * t.loop_cpu_s / max(t.steps, 1):.1f} | {t.maxrss_mib:,.0f} |"
        )
    print()
    for policy, scheduler in PAIRS:
        lean = f"lab {policy} --no-plots" if f"lab {policy} --no-plots" in best_of else ""
        for lab_key, vidur_key in (
            (f"lab {policy}", f"vidur {scheduler}"),
            (lean or f"lab {policy}", f"vidur {scheduler} metrics off"),
        ):
            if vidur_key not in best_of:
                continue
            lab, vidur = best_of[lab_key], best_of[vidur_key]
            per_step = (vidur.loop_cpu_s / vidur.steps) / (lab.loop_cpu_s / lab.steps)
            print(
                f"{vidur_key} / {lab_key}, CPU seconds: end to end "
                f"{vidur.cpu_s / lab.cpu_s:.1f}x, loop {vidur.loop_cpu_s / lab.loop_cpu_s:.1f}x, "
                f"per step {per_step:.1f}x"
            )


def tiled_trace(cfg: dict, num_requests: int, path: Path) -> None:
    """The trace repeated back to back and cut to ``num_requests``, as Mooncake JSONL: each
    copy shifted by the trace's span plus one mean gap (ms on the trace's own clock, so the
    YAML's rate_scale still applies)."""
    sys.path.insert(0, str(ROOT))
    from sched_lab.traces import load_trace

    spec = {k: v for k, v in cfg["trace"].items() if k not in ("rate_scale", "limit")}
    requests = load_trace(spec, ROOT)
    times = [r.arrival_s for r in requests]
    shift = times[-1] + (times[-1] - times[0]) / max(len(times) - 1, 1)
    with open(path, "w") as f:
        for i in range(num_requests):
            k, j = divmod(i, len(requests))
            r = requests[j]
            f.write(
                f'{{"timestamp": {1000 * (times[j] + k * shift)!r}, '
                f'"input_length": {r.prompt_len}, "output_length": {r.output_len}}}\n'
            )


def scaling(args: argparse.Namespace, work: Path) -> None:
    cfg = load_base(args.config)
    extra = ["--no-plots"] if lab_has_no_plots() else []
    sizes = [n for n in args.sizes if n <= args.max_requests]
    skipped = [n for n in args.sizes if n > args.max_requests]
    folder = Path(tempfile.mkdtemp(prefix="runs-", dir=work))  # this process's own
    print(f"# scaling: lab {args.policy}{' ' + ' '.join(extra) if extra else ''}, one run each")
    print("| requests | steps | wall (s) | CPU (s) | loop wall (s) | loop CPU (s) "
          "| peak RSS (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    run_lab(write_lab_yaml(cfg, args.policy, folder), folder, extra)  # bytecode caches
    for n in sizes:
        trace = work / f"tiled_{n}.jsonl"  # n rows: the loader reads no more than it replays
        if not trace.exists():
            tiled_trace(cfg, n, trace)
        spec = {"format": "mooncake", "path": str(trace),
                "rate_scale": cfg["trace"].get("rate_scale", 1.0)}  # fmt: skip
        t = run_lab(write_lab_yaml(cfg, args.policy, folder, spec), folder, extra)
        print(
            f"| {n:,} | {t.steps:,} | {t.wall_s:.1f} | {t.cpu_s:.1f} | {t.loop_wall_s:.1f} | "
            f"{t.loop_cpu_s:.1f} | {t.maxrss_mib:,.0f} |",
            flush=True,
        )
    shutil.rmtree(folder)
    if skipped:
        print(f"# not run (above --max-requests {args.max_requests:,}): "
              + ", ".join(f"{n:,}" for n in skipped))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--repeat", type=int, default=3, help="best of N (default 3)")
    ap.add_argument("--limit", type=int, help="only the first N requests of the trace")
    ap.add_argument("--vidur-python", default=DEFAULT_VIDUR_PYTHON)
    ap.add_argument("--anchor-data", type=Path, default=DEFAULT_ANCHOR,
                    help="Vidur's public profiling CSVs (shared/anchor-data/vidur)")  # fmt: skip
    ap.add_argument("--patch-vidur", action="store_true",
                    help="apply the two patches to the Vidur install first")  # fmt: skip
    ap.add_argument("--work", type=Path, help="kept between runs: Vidur's profiles and "
                    "predictor cache, traces (default: a folder in the temp dir)")  # fmt: skip
    ap.add_argument("--scaling", action="store_true", help="the lab alone, 19k to 1M requests")
    ap.add_argument("--max-requests", type=int, default=1_000_000)
    ap.add_argument("--sizes", type=int, nargs="+", default=SCALING_SIZES,
                    help="the request counts of --scaling")  # fmt: skip
    ap.add_argument("--policy", default="fcfs", help="the policy of --scaling")
    args = ap.parse_args()
    work = args.work or Path(tempfile.gettempdir()) / "sched-lab-sim-speed-vidur"
    work.mkdir(parents=True, exist_ok=True)
    (scaling if args.scaling else compare)(args, work.resolve())


if __name__ == "__main__":
    main()
