"""Multi-LoRA on the engine and in the simulator, one YAML, one device call (issue 34, item 6).

    # H200, no internet (the 8B shape: about 7 minutes estimated; timings_s records them):
    timeout 540 python benchmarks/multi_lora_h200.py --out $OUT/multi_lora_h200
    # the same with Qwen3-0.6B, if the 8B does not fit the time:
    timeout 540 python benchmarks/multi_lora_h200.py --preset qwen3-0.6b --out $OUT/multi_lora_h200
    # CPU smoke test (tiny random model, 4 adapters, tiny sizes; measures nothing):
    python benchmarks/multi_lora_h200.py --dry-run --out /tmp/multi_lora_dry

In order, each step timed (``timings_s`` in the JSON):

1. a random-weight bf16 checkpoint of ``--preset`` (``sched-lab tools make-random-checkpoint``'s
   writer; reused when ``--work`` already holds one) and ``--adapters`` random PEFT adapters
   of rank ``--rank`` on all seven projections (``make-random-lora``'s writer);
2. the profile with LoRA rows: ``python -m sched_lab.backend.profile --grid small --lora-dir``
   with the runner shaped as the experiment's engine (max_model_len, max_num_seqs, KV
   blocks), in a process of its own, right before the runs it predicts;
3. for each ``--max-loras`` value: the experiment YAML (``--experiment``, default
   experiments/multi_lora_h200.yaml) on the engine (its ``engine:`` section pointed at the
   checkpoint, ``lora.adapter_dir`` at the adapters), then the same YAML in the simulator
   (``backend: sim``, ``cost_model.profile``: the fresh profile). Neither side sees the other's
   runs: the profile is a grid of synthetic step shapes, so nothing evaluated was fitted.

Writes under ``--out``: ``profile.csv`` and ``fit.json`` (``sched-lab fit``: its LoRA
coefficients), ``engine/max_loras_N/`` and ``sim/max_loras_N/`` results folders (no plots),
and ``multi_lora_h200.md`` and ``.json``: per max_loras and policy, engine and simulator
request throughput, TTFT p50 / p99, TPOT p50, adapter loads and adapters per step, with the
simulator's relative error. The table is rewritten after every point, so a run cut short
still leaves the points it finished; a point that would not end within ``--budget-s`` of
the start (estimated from the points before it) is skipped and listed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METRICS = (  # summary.json key, table heading
    ("request_throughput", "req/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("num_lora_loads", "loads"),
    ("mean_loras_per_step", "adapters/step"),
)
FIRST_POINT_S = 150.0  # a point's estimated seconds (both policies, runner build included)
# until one has run; later points are estimated from the slowest one so far


def tiny_llama(max_position_embeddings: int) -> dict:
    """A 2-layer Llama config for the CPU dry run."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": max_position_embeddings,
    }


def dry_run_yaml(raw: dict) -> dict:
    """The experiment shrunk for the CPU: few short requests, torch attention, float32."""
    raw = copy.deepcopy(raw)
    raw["trace"].update(num_requests=8, prompt_len={"uniform": [16, 64]},
                        output_len={"uniform": [4, 16]})  # fmt: skip
    raw["engine"].update(device="cpu", dtype="float32", attention_backend="torch", num_threads=1)
    raw["kv_cache"] = {"block_size": 16, "num_gpu_blocks": 4096, "swap_space_gib": 0.01}
    raw["scheduler"] = {"max_num_seqs": 32, "max_model_len": 2048}
    raw["lora"].update(num_adapters=4, max_cpu_loras=4, max_lora_rank=8)
    return raw


def make_model(args, work: Path) -> tuple[Path, Path]:
    """(checkpoint, adapter folder) under ``work``, written unless already there."""
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.backend.tools.random_lora import write_random_loras
    from sched_lab.core.model_presets import PRESETS

    ckpt = work / ("tiny" if args.dry_run else args.preset)
    if not (ckpt / "config.json").exists():
        config = tiny_llama(2048) if args.dry_run else PRESETS[args.preset]
        dtype = "float32" if args.dry_run else "bfloat16"
        write_random_checkpoint(config, ckpt, dtype, name="tiny" if args.dry_run else args.preset)
    loras = work / f"{ckpt.name}-loras-r{args.rank}"
    if not (loras / f"lora-{args.adapters - 1}" / "adapter_config.json").exists():
        write_random_loras(ckpt, loras, args.adapters, args.rank, targets=ALL_TARGETS,
                           dtype="float32" if args.dry_run else "bfloat16")  # fmt: skip
    return ckpt, loras


def profile(args, raw: dict, ckpt: Path, loras: Path, out: Path, timeout_s: float) -> None:
    """The profile with LoRA rows, in its own process, the runner shaped as the engine's."""
    kv, sch, eng = raw["kv_cache"], raw["scheduler"], raw["engine"]
    cmd = [sys.executable, "-m", "sched_lab.backend.profile", "--model-dir", str(ckpt),
           "--out", str(out / "profile.csv"), "--grid", "small", "--lora-dir", str(loras),
           "--max-loras", str(max(args.max_loras)), "--attention", eng["attention_backend"],
           "--dtype", eng["dtype"], "--block-size", str(kv["block_size"]),
           "--num-gpu-blocks", str(kv["num_gpu_blocks"]),
           "--max-num-seqs", str(sch["max_num_seqs"]),
           "--max-model-len", str(sch["max_model_len"]), *args.profile_args.split()]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=timeout_s, cwd=ROOT)
    from sched_lab.sim.calibrated import main as fit_main

    fit_main([str(out / "profile.csv"), "--out", str(out / "fit.json")])


def point_configs(raw: dict, args, ckpt: Path, loras: Path, out: Path, max_loras: int):
    """(engine config, simulator config) of one max_loras point."""
    from sched_lab.config import validate

    engine = copy.deepcopy(raw)
    engine["name"] = f"multi_lora_h200_max_loras_{max_loras}"
    engine["engine"]["model_path"] = str(ckpt)
    if not args.dry_run:  # the simulator's shape (adapter and KV bytes): the checkpoint's
        engine["model"] = args.preset
    engine["lora"].update(adapter_dir=str(loras), max_loras=max_loras,
                          num_adapters=args.adapters, max_lora_rank=args.rank)  # fmt: skip
    engine["lora"]["max_cpu_loras"] = max(engine["lora"].get("max_cpu_loras") or 0, max_loras)
    if args.requests is not None:
        engine["trace"]["num_requests"] = args.requests
    sim = copy.deepcopy(engine)
    sim["backend"] = "sim"
    sim["cost_model"] = {"profile": str(out / "profile.csv")}
    where = str(args.experiment)
    return (validate(engine, where, args.experiment.parent),
            validate(sim, where, args.experiment.parent))  # fmt: skip


def run_point(cfg, folder: Path) -> dict[str, dict]:
    """Run ``cfg``, write its results folder (no plots); policy label -> summary."""
    from sched_lab.report.folder import write_results
    from sched_lab.run.experiment import run_experiment

    runs = run_experiment(cfg, progress=False)
    write_results(folder, cfg, runs, plots=False)
    keys = [k for k, _ in METRICS] + ["completed", "duration", "mean_loras_per_step"]
    return {r.label: {k: r.summary.get(k) for k in keys} for r in runs}


def relative_error(sim: float | None, engine: float | None) -> float | None:
    """(sim - engine) / engine, None when either is missing or the engine's is 0."""
    if sim is None or engine is None or engine == 0:
        return None
    return (sim - engine) / engine


def table(points: list[dict]) -> str:
    """The markdown table of every finished point: engine, simulator, error per metric."""
    head = "| max_loras | policy | " + " | ".join(f"{h} engine | {h} sim | err" for _, h in METRICS)
    lines = [head + " |", "|" + "---|" * (2 + 3 * len(METRICS))]
    for p in points:
        for policy, e in p["engine"].items():
            s = p["sim"].get(policy, {})
            cells = []
            for key, _ in METRICS:
                err = relative_error(s.get(key), e.get(key))
                cells += [fmt(e.get(key)), fmt(s.get(key)),
                          "-" if err is None else f"{err * 100:+.1f}%"]  # fmt: skip
            lines.append(f"| {p['max_loras']} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def write_report(out: Path, record: dict) -> None:
    """multi_lora_h200.json (everything) and .md (the table and what ran)."""
    (out / "multi_lora_h200.json").write_text(json.dumps(record, indent=2) + "\n")
    fit = record.get("lora_coefficients")
    lines = [
        f"# Multi-LoRA, engine vs simulator ({record['device']}, {record['date']})",
        "",
        f"Model: {record['model']} shape, random weights; {record['adapters']} random "
        f"rank-{record['rank']} adapters on all seven projections; YAML "
        f"`{record['experiment']}` ({record['num_requests']} requests). Simulator: calibrated "
        "from `profile.csv`, made in this call before the engine runs (grid only).",
        "",
        "LoRA terms fitted from the profile (s): "
        + (", ".join(f"{k} {v:.3g}" for k, v in fit.items()) if fit else "none"),
        "",
        table(record["points"]),
        "",
        "err = (sim - engine) / engine. Step times in s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in record["timings_s"].items()),
    ]
    if record["skipped"]:
        lines += ["", "Skipped (time budget): " + "; ".join(record["skipped"])]
    (out / "multi_lora_h200.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the profile, results and table")
    ap.add_argument("--preset", default="llama-3.1-8b", help="checkpoint shape (model preset)")
    ap.add_argument("--experiment", type=Path, default=ROOT / "experiments/multi_lora_h200.yaml")
    ap.add_argument("--work", type=Path, default=Path("/tmp/multi_lora_h200"),
                    help="checkpoint and adapters (reused when there)")  # fmt: skip
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", default="1,4,16", help="comma-separated lora.max_loras")
    ap.add_argument("--requests", type=int, help="trace.num_requests (default: the YAML's)")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="skip a point that would end later than this after the start")  # fmt: skip
    ap.add_argument("--profile-args", default="", help="extra arguments of the profile")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny random model, 4 rank-8 adapters, 8 short requests, "
                    "max_loras 1 and 2")  # fmt: skip
    args = ap.parse_args()
    start = time.perf_counter()
    import yaml

    args.max_loras = [int(x) for x in args.max_loras.split(",")]
    raw = yaml.safe_load(args.experiment.read_text())
    if args.dry_run:
        raw = dry_run_yaml(raw)
        args.adapters, args.rank = min(args.adapters, 4), 8
        args.max_loras = [1, 2]
        args.profile_args = args.profile_args or "--passes 1 --repeat 1"
    out = args.out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def lap(name: str, t0: float) -> None:
        timings[name] = time.perf_counter() - t0
        print(f"[{time.perf_counter() - start:.0f} s] {name}: {timings[name]:.1f} s", flush=True)

    t0 = time.perf_counter()
    ckpt, loras = make_model(args, args.work)
    lap("checkpoint_and_adapters", t0)
    t0 = time.perf_counter()
    profile(args, raw, ckpt, loras, out, max(60.0, args.budget_s - (t0 - start) - 120))
    lap("profile", t0)
    fit = json.loads((out / "fit.json").read_text())
    try:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "cpu"
    record = {
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": "tiny" if args.dry_run else args.preset,
        "adapters": args.adapters,
        "rank": args.rank,
        "experiment": str(args.experiment),
        "num_requests": args.requests or raw["trace"]["num_requests"],
        "lora_coefficients": fit.get("lora_coefficients"),
        "base_coefficients": fit.get("coefficients"),
        "profile_held_out_error": fit.get("held_out_relative_error"),
        "points": [],
        "skipped": [],
        "timings_s": timings,
    }
    slowest = FIRST_POINT_S
    for m in args.max_loras:
        now = time.perf_counter() - start
        if now + slowest > args.budget_s:
            record["skipped"].append(f"max_loras {m} (estimated {slowest:.0f} s at {now:.0f} s)")
            write_report(out, record)
            continue
        t0 = time.perf_counter()
        engine_cfg, sim_cfg = point_configs(raw, args, ckpt, loras, out, m)
        engine = run_point(engine_cfg, out / "engine" / f"max_loras_{m}")
        lap(f"engine_max_loras_{m}", t0)
        gc.collect()
        t1 = time.perf_counter()
        sim = run_point(sim_cfg, out / "sim" / f"max_loras_{m}")
        lap(f"sim_max_loras_{m}", t1)
        slowest = max(slowest if record["points"] else 0.0, time.perf_counter() - t0)
        record["points"].append({"max_loras": m, "engine": engine, "sim": sim})
        write_report(out, record)
        print(table(record["points"][-1:]), flush=True)
    timings["total"] = time.perf_counter() - start
    write_report(out, record)
    print((out / "multi_lora_h200.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
