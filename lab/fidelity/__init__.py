"""Held-out simulator fidelity: ``sched-lab fidelity --engine`` (GPU) and ``--sim`` (CPU).

    sched-lab fidelity --engine --out /tmp/fidelity --archive docs/fidelity/heldout_engine.tar.gz
    sched-lab fidelity --sim --archive docs/fidelity/heldout_engine.tar.gz   # docs/fidelity.md

The protocol is one file (``benchmarks/fidelity_heldout.yaml``): trace windows, loads as
fractions of the engine's measured capacity, the engine config, time limits.

Engine side, each step a process of its own under a time limit (``timeout``):

Time: ``time_limits_s.total`` for all of it, from the start; ``profile`` for the profile and
``calibration`` for the calibration replays; the first pass gets 52% of what is left after
them, the repeat the rest. Stopped (SIGTERM, Ctrl-C), it stops the running step and packs
what ended before it.

1. every run's config (:func:`check_runs`) and the device (:func:`check_device`) checked,
   then a random-weight checkpoint of the protocol's preset, if missing;
2. ``backend.profile`` on it, the runner shaped as the engine runs are
   (:func:`profile_geometry`): the profile grid (``profile.csv``);
3. pass ``calibration`` (when the protocol has ``calibration:``): its synthetic workloads
   replayed on the engine through its policies, each a results folder
   ``calibration/<name>/``; their steps are fitted beside the grid (never a trace row);
   synchronously even for an asynchronous protocol (:func:`calibration_config`);
4. pass ``first``: per window, the engine's capacity (all requests at t = 0, fcfs:
   finished / makespan), then every load through every policy, each (window, load) a
   results folder ``engine/<window>_<load>/``, written as soon as its runs end;
5. pass ``repeat``: each folder's config.yaml replayed again in a new process, into
   ``engine_repeat/`` (the engine's own run-to-run spread);

then everything (without tokens and plots) packed into ``--archive`` (.tar.gz). A folder
that would not end inside its pass's limit (estimated from the capacity) is skipped and
listed in ``engine.json``.

Simulator side, from the archive: each engine run replayed by the simulator twice, with
the cost model calibrated from the archive's profile and calibration replays alone (errors
of TTFT, TPOT, ITL, E2E P50/P90/P99 and throughput, beside the engine's own spread; policy
rankings, leaving out pairs that plan alike: :func:`plans_alike`) and with the engine's
measured durations (``cost_model.durations_from``: the fraction of steps planned
identically); each engine step's duration predicted from its exact batch (step-level error
by kind, beside the engine's own spread between steps of one shape: :func:`step_noise`);
plots; docs/fidelity.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

from lab.core.errors import short_repr

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "benchmarks" / "fidelity_heldout.yaml"
ARCHIVE = ROOT / "docs" / "fidelity" / "heldout_engine.tar.gz"
METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
PCTS = ("p50", "p90", "p99")
RANKED = (("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("e2e_s", "p50"))
PACKED = ("config.yaml", "summary.json", "requests.csv", "steps.csv", "timing.json")


PROTOCOL_KEYS = ("checkpoint", "profile_args", "calibration", "loads", "slices",
                 "time_limits_s", "experiment")  # fmt: skip


def load_protocol(path: Path) -> dict[str, Any]:
    """A protocol YAML, its shape checked before any GPU work.

    Raises:
        SystemExit: ``error: PATH: KEY: expected ...`` (one line) for a missing or unreadable
            file, an unknown or missing key, a checkpoint without a folder (dir) or a known
            preset (or a config), a time limit that is not a number > 0, loads
            that are not distinct numbers > 0, no slices, an experiment that is not an
            engine run, or a calibration workload that is not a synthetic trace.
    """

    def fail(key: str, expected: str, got: Any = None) -> SystemExit:
        shown = "" if got is None else f", got {short_repr(got, 60)}"
        return SystemExit(f"error: {path}: {key}: expected {expected}{shown}")

    try:
        p = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path}: cannot read the protocol ({e})") from None
    except yaml.YAMLError as e:
        raise SystemExit(f"error: {path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(p, dict):
        raise fail("the file", "a mapping of protocol keys", p)
    unknown = sorted(set(p) - set(PROTOCOL_KEYS), key=str)
    if unknown:
        raise fail(str(unknown[0]), f"a protocol key ({', '.join(PROTOCOL_KEYS)})")
    for key in ("checkpoint", "loads", "slices", "experiment", "time_limits_s"):
        if key not in p:
            raise SystemExit(f"error: {path}: missing key {key!r}")
    ck = p["checkpoint"]
    if not isinstance(ck, dict) or not isinstance(ck.get("dir"), str) or not ck["dir"].strip():
        raise fail("checkpoint", "a mapping with dir: a folder path (and preset or config)", ck)
    if not isinstance(ck.get("config"), dict):
        from lab.core.model_presets import PRESETS

        if ck.get("preset") not in PRESETS:
            raise fail("checkpoint.preset", f"one of {', '.join(PRESETS)} (or a config:)",
                       ck.get("preset"))  # fmt: skip
    if (ROOT / ck["dir"]).exists() and not (ROOT / ck["dir"]).is_dir():
        raise fail("checkpoint.dir", "a folder (it names a file)", ck["dir"])
    limits = p["time_limits_s"]
    want = {"profile", "total"} | ({"calibration"} if p.get("calibration") is not None else set())
    if not isinstance(limits, dict) or set(limits) != want:
        raise fail("time_limits_s", f"a mapping with keys {', '.join(sorted(want))}", limits)
    for k, v in limits.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise fail(f"time_limits_s.{k}", "seconds > 0", v)
    loads = p["loads"]
    if (
        not isinstance(loads, list)
        or not loads
        or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in loads)
        or len(set(loads)) != len(loads)
    ):
        raise fail("loads", "a list of distinct numbers > 0 (fractions of capacity)", loads)
    if not isinstance(p["slices"], dict) or not p["slices"]:
        raise fail("slices", "a mapping of window names to trace specs", p["slices"])
    for name, spec in p["slices"].items():
        if not isinstance(spec, dict) or not spec.get("path"):
            raise fail(f"slices.{name}", "a trace spec read from a file (path:)", spec)
    exp = p["experiment"]
    if not isinstance(exp, dict) or exp.get("backend") != "engine":
        raise fail("experiment", "an experiment config with backend: engine", exp)
    for key in ("engine", "scheduler", "kv_cache"):
        if not isinstance(exp.get(key, {}), dict):
            raise fail(f"experiment.{key}", "a mapping", exp[key])
    cal = p.get("calibration")
    if cal is not None:
        if not isinstance(cal, dict) or set(cal) - {"policies", "workloads"}:
            raise fail("calibration", "a mapping with workloads (and policies)", cal)
        if not isinstance(cal.get("workloads"), dict) or not cal["workloads"]:
            raise fail("calibration.workloads", "a mapping of names to synthetic traces")
        for name, spec in cal["workloads"].items():
            if not isinstance(spec, dict) or spec.get("format") != "synthetic":
                raise SystemExit(
                    f"error: {path}: calibration.workloads.{name}: expected a synthetic trace "
                    "(format: synthetic): calibration never replays trace rows"
                )
    return p


def folder_name(slice_name: str, load: float) -> str:
    return f"{slice_name}_{load:g}"


def calibration_config(protocol: dict[str, Any], name: str) -> dict[str, Any]:
    """The raw experiment config of calibration workload ``name``: the protocol's engine
    experiment over that synthetic trace, through ``calibration.policies`` when given.

    Always synchronous: an asynchronous protocol's calibration replays run with
    ``scheduler.async_scheduling: false``, so that their steps.csv durations are step times
    (host + device), what the calibrated model fits (lab/sim/calibrated.py); the profile's
    ``host_s`` fit splits off the host part that async scheduling overlaps. (An async
    step's duration is the async clock, max(device time of N, host time of N + 1), which
    that fit cannot take as a row.)"""
    cal = protocol["calibration"]
    raw = {**copy.deepcopy(protocol["experiment"]), "name": f"calibration_{name}",
           "trace": dict(cal["workloads"][name])}  # fmt: skip
    if cal.get("policies"):
        raw["policies"] = cal["policies"]
    sch = raw.get("scheduler")
    if isinstance(sch, dict) and sch.get("async_scheduling"):
        sch["async_scheduling"] = False
    return raw


def slice_config(protocol: dict[str, Any], name: str) -> dict[str, Any]:
    """The raw experiment config of window ``name`` (before its load's rate_scale)."""
    raw = copy.deepcopy(protocol["experiment"])
    return {**raw, "name": name, "trace": dict(protocol["slices"][name])}


def check_runs(protocol: dict[str, Any], path: Path) -> None:
    """Every config the engine side will run (calibration workloads, windows), validated
    before the profile: one line naming the protocol key (SystemExit)."""
    from lab.config import validate
    from lab.core.errors import UserError
    from traces import load_trace

    cal = (protocol.get("calibration") or {}).get("workloads", {})
    configs = [(f"calibration.workloads.{n}", calibration_config(protocol, n)) for n in cal]
    configs += [(f"slices.{n}", slice_config(protocol, n)) for n in protocol["slices"]]
    for key, raw in configs:
        try:
            reqs = load_trace(validate(raw, str(path), ROOT).trace.spec, ROOT)  # keys, rows
        except UserError as e:
            raise SystemExit(f"error: {key}: {e}") from None
        kept = [r.arrival_s for r in reqs if r.status.value != "dropped"]
        if key.startswith("slices.") and (len(kept) < 2 or max(kept) == min(kept)):
            raise SystemExit(
                f"error: {path}: {key}: expected a window of >= 2 requests over a time span "
                f"(its own rate scales the loads), got {len(kept)} request(s)"
            )


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM handler of the engine side: stop the running step as Ctrl-C would."""
    raise KeyboardInterrupt


def _run_step(argv: list[str]) -> int:
    """Run one step's command to its end; returns its exit status. If this process is
    interrupted meanwhile, the step is stopped first (SIGTERM, which ``timeout`` hands on
    to the pass; SIGKILL after 15 s), so no pass outlives the parent."""
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def check_device(protocol: dict[str, Any], path: Path) -> None:
    """The engine device the protocol's experiment names is here: for ``cuda``, torch sees a
    GPU. Checked before the checkpoint is made (an 8B one is 16 GB of random draws).

    Raises:
        SystemExit: one line naming ``experiment.engine.device``.
    """
    device = str((protocol["experiment"].get("engine") or {}).get("device", "cpu"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                f"error: {path}: experiment.engine.device: {device}, but torch "
                f"{torch.__version__} sees no CUDA device here: run the engine side on a GPU "
                "machine (a CPU smoke test of the same steps: benchmarks/fidelity_tiny.yaml)"
            )


def _free_device_cache() -> None:
    """Give the device memory this process's caching allocator holds back to the driver."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- engine side (GPU)


def profile_geometry(exp: dict[str, Any]) -> list[str]:
    """``backend.profile`` arguments that give the profiled runner the engine runs' shape
    (max_model_len, max_num_seqs, num_gpu_blocks): the width of its block tables and graph
    buffers changes step times by a few percent (BENCHMARKS.md, fidelity)."""
    sch, kv = exp.get("scheduler", {}), exp.get("kv_cache", {})
    args = []
    for flag, value in (("--max-model-len", sch.get("max_model_len")),
                        ("--max-num-seqs", sch.get("max_num_seqs")),
                        ("--num-gpu-blocks", kv.get("num_gpu_blocks"))):  # fmt: skip
        if value is not None:
            args += [flag, str(value)]
    return args


def engine(protocol_path: Path, out: Path, archive: Path | None) -> int:
    """The whole engine side (see the module docstring); returns the exit status."""
    from lab.config import validate

    protocol = load_protocol(protocol_path)
    ckpt = ROOT / protocol["checkpoint"]["dir"]
    made = [d for d in (ckpt, *ckpt.parents) if not d.exists()]  # deepest first
    ckpt.mkdir(parents=True, exist_ok=True)  # engine.model_path must exist for check_runs
    try:  # every run's config and the device, before the checkpoint, --out and any GPU work
        check_runs(protocol, protocol_path)
        check_device(protocol, protocol_path)
    except SystemExit:
        for d in made:  # the folders made just now, if still empty
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    out.mkdir(parents=True, exist_ok=True)
    for name in ("engine.json", "profile.csv", "protocol.yaml"):  # a reused --out: nothing
        (out / name).unlink(missing_ok=True)  # of an earlier run may reach this archive
    for name in ("calibration", "engine", "engine_repeat"):
        shutil.rmtree(out / name, ignore_errors=True)
    shutil.copy(protocol_path, out / "protocol.yaml")
    limits = protocol["time_limits_s"]
    log: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    try:  # named in the doc (older archives have no name: the default protocol's)
        log["protocol"] = str(Path(protocol_path).resolve().relative_to(ROOT))
    except ValueError:
        log["protocol"] = str(protocol_path)
    t0 = time.perf_counter()
    if not (ckpt / "config.json").exists():
        from backend.tools.random_checkpoint import write_random_checkpoint
        from lab.core.model_presets import PRESETS

        c = protocol["checkpoint"]
        config = c.get("config") or PRESETS[c["preset"]]
        write_random_checkpoint(config, ckpt, c.get("dtype", "bfloat16"), name=c.get("preset", "x"))
        _free_device_cache()  # the runs' processes get the memory its random draws cached
    log["steps"]["checkpoint_s"] = time.perf_counter() - t0
    exp = protocol["experiment"]
    # the runs' engine options as validated (defaults filled in), for the profile's runner
    runs = validate(
        slice_config(protocol, next(iter(protocol["slices"]))), str(protocol_path), ROOT
    )
    steps = [
        (
            "profile",
            [
                sys.executable,
                "-m",
                "backend.profile",
                "--model-dir",
                str(ckpt),
                "--out",
                str(out / "profile.csv"),
                "--attention",
                runs.engine.attention_backend,
                "--dtype",
                runs.engine.dtype,
                "--block-size",
                str(runs.kv_cache.block_size),
                *profile_geometry(exp),
                *map(str, protocol.get("profile_args", [])),
            ],
        ),  # fmt: skip
        *(
            [
                (
                    "calibration",
                    [sys.executable, "-m", "lab.fidelity", "--engine-pass", "calibration"],
                )
            ]
            if protocol.get("calibration")
            else []
        ),
        ("first", [sys.executable, "-m", "lab.fidelity", "--engine-pass", "first"]),
        ("repeat", [sys.executable, "-m", "lab.fidelity", "--engine-pass", "repeat"]),
    ]
    status = 0
    end = time.time() - (time.perf_counter() - t0) + limits["total"]  # epoch seconds
    previous = signal.signal(signal.SIGTERM, _stop)  # a stopped run packs what ended
    try:
        for name, cmd in steps:
            left = end - time.time()
            # the repeat replays what the first pass ran: about half of what is left each
            limit = {"profile": limits["profile"], "calibration": limits.get("calibration", 0),
                     "first": 0.52 * left, "repeat": left - 5}[name]  # fmt: skip
            limit = int(max(limit, 1))
            if name != "profile":
                cmd += ["--out", str(out), "--protocol", str(protocol_path),
                        "--deadline", str(time.time() + limit - 10)]  # fmt: skip
            t = time.perf_counter()
            print(f"== {name} (limit {limit} s): {' '.join(cmd)}", flush=True)
            stopped = False
            try:
                rc = _run_step(["timeout", "-k", "10", str(limit), *cmd])
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM (_stop): the step was stopped
                rc, stopped = -signal.SIGTERM, True
            log["steps"][f"{name}_s"] = time.perf_counter() - t
            log["steps"][f"{name}_rc"] = rc
            print(f"== {name}: exit {rc} after {time.perf_counter() - t:.1f} s", flush=True)
            if stopped:
                print(f"warning: stopped during the {name} step: packing what ended before it",
                      file=sys.stderr)  # fmt: skip
                status = 1
                if name == "profile":
                    return 1
                break
            if rc != 0:
                status = 1
                if name == "profile":
                    print(f"error: the profile step failed (exit {rc}): no calibration data, so "
                          "nothing is held out and no archive is written", file=sys.stderr)  # fmt: skip
                    return 1
                if name == "calibration":  # engine.json lists the workloads that finished
                    print(f"warning: the calibration step failed (exit {rc}): the workloads that "
                          "finished are fitted beside the grid", file=sys.stderr)  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    done = out / "engine.json"
    passes = json.loads(done.read_text()) if done.exists() else {}
    (out / "engine.json").write_text(json.dumps({**passes, **log}, indent=2) + "\n")
    if not passes.get("folders"):
        print("error: no engine run ended inside the time limits (engine.json: skipped)",
              file=sys.stderr)  # fmt: skip
        status = 1
    if archive is not None:
        pack(out, archive)
    return status


def engine_pass(which: str, protocol_path: Path, out: Path, deadline: float) -> None:
    """One pass of engine runs in this process (``first``: capacity + runs; ``repeat``: the
    first pass's folders again); a folder that would end past ``deadline`` (epoch seconds)
    is skipped."""
    from lab.config import validate
    from lab.report.folder import write_results
    from lab.run.experiment import run_experiment

    protocol = load_protocol(protocol_path)
    record_path = out / "engine.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record.setdefault("skipped", [])
    if which == "calibration":
        record["calibration"] = []
        for name in protocol["calibration"]["workloads"]:
            if time.time() > deadline:  # the grid and the workloads so far still calibrate
                record["skipped"].append(f"calibration {name} (past the calibration limit)")
                continue
            cfg = validate(calibration_config(protocol, name), str(protocol_path), ROOT)
            runs = run_experiment(cfg, progress=False)
            write_results(out / "calibration" / name, cfg, runs)
            steps = sum(r.summary["num_steps"] for r in runs)
            print(f"  calibration {name}: {_throughputs(runs)}, {steps} steps", flush=True)
            record["calibration"].append(name)
            record_path.write_text(json.dumps(record, indent=2) + "\n")
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        return
    if which == "repeat":
        for folder in record.get("folders", []):
            est = record["estimates_s"][folder]
            if time.time() + est > deadline:
                record["skipped"].append(f"{folder} repeat (estimated {est:.0f} s)")
                continue
            cfg = _engine_config(
                yaml.safe_load((out / "engine" / folder / "config.yaml").read_text())
            )
            runs = run_experiment(cfg, progress=False)
            write_results(out / "engine_repeat" / folder, cfg, runs)
            print(f"  {folder} again: " + _throughputs(runs), flush=True)
            record.setdefault("repeated", []).append(folder)
            record_path.write_text(json.dumps(record, indent=2) + "\n")
        record_path.write_text(json.dumps(record, indent=2) + "\n")  # skips after the last
        return
    record.update(folders=[], estimates_s={}, capacity={})  # keeps the calibration pass's
    for name in protocol["slices"]:
        cfg = validate(slice_config(protocol, name), str(protocol_path), ROOT)
        reqs, native, offline = capacity_run(cfg)
        if time.time() + 10 > deadline:
            record["skipped"].append(f"{name} (no time for its capacity run)")
            continue
        run = run_experiment(offline, progress=False, requests=reqs)[0]
        capacity = run.summary["finished"] / run.summary["duration_s"]
        record["capacity"][name] = {"capacity_req_s": capacity, "native_req_s": native,
                                    "requests": len(reqs)}  # fmt: skip
        print(f"{name}: capacity {capacity:.2f} req/s, own rate {native:.3f}", flush=True)
        for load in protocol["loads"]:
            folder = folder_name(name, load)
            est = pass_estimate_s(cfg, len(reqs), load, capacity)
            if time.time() + est > deadline:
                record["skipped"].append(f"{folder} (estimated {est:.0f} s)")
                continue
            cfg_l = load_config(cfg, folder, load * capacity / native)
            runs = run_experiment(cfg_l, progress=False)
            write_results(out / "engine" / folder, cfg_l, runs)
            record["folders"].append(folder)
            record["estimates_s"][folder] = est
            print(f"  load {load:g}: " + _throughputs(runs), flush=True)
            record_path.write_text(json.dumps(record, indent=2) + "\n")
    record_path.write_text(json.dumps(record, indent=2) + "\n")


def capacity_run(cfg):
    """A window's capacity run: its requests (dropped ones left out) all arriving at t = 0,
    its own rate (requests per second over its span) and ``cfg`` through fcfs alone."""
    from traces import load_trace

    reqs = [r for r in load_trace(cfg.trace.spec, ROOT) if r.status.value != "dropped"]
    native = (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s)
    for r in reqs:
        r.arrival_s = 0.0
    offline = dataclasses.replace(cfg, policies=tuple(p for p in cfg.policies if p.name == "fcfs"))
    return reqs, native, offline


def pass_estimate_s(cfg, num_requests: int, load: float, capacity: float) -> float:
    """Seconds a (window, load) folder takes in a pass, all policies: each run lasts about
    requests / min(offered rate, capacity), a little more."""
    return 1.15 * len(cfg.policies) * num_requests / (min(load, 1.0) * capacity) + 3


def load_config(cfg, folder: str, rate_scale: float):
    """A window's config replayed at ``rate_scale`` x its own rate, named ``folder``."""
    return dataclasses.replace(cfg.with_trace(rate_scale=rate_scale), name=folder)


def _engine_config(raw: dict):
    """A results folder's config.yaml as an ExperimentConfig, its paths resolved in this
    checkout (the folder may come from another machine)."""
    from lab.config import validate

    def here(path: str, folder: str) -> str:  # a path of another machine: this checkout's
        return path if Path(path).exists() else str(ROOT / folder / Path(path).name)

    raw = copy.deepcopy(raw)
    if raw["trace"].get("path"):  # synthetic traces have none
        raw["trace"]["path"] = here(raw["trace"]["path"], "traces/data")
    if raw.get("trace_file"):
        raw["trace_file"]["path"] = raw["trace"]["path"]
    if raw.get("backend") == "engine":
        raw["engine"]["model_path"] = here(raw["engine"]["model_path"], "checkpoints")
    raw["cost_model"] = {k: v for k, v in raw.get("cost_model", {}).items() if v not in (None, [])}
    if raw["cost_model"].get("profile"):
        raw["cost_model"]["profile"] = here(raw["cost_model"]["profile"], "profiles")
    return validate(raw, "config.yaml", ROOT)


def _throughputs(runs) -> str:
    return ", ".join(f"{r.label} {r.summary['request_throughput']:.2f} req/s" for r in runs)


def repeat_archive(archive: Path) -> Path:
    """Where the repeat pass is packed, beside ``archive`` (two files, each below the
    device tool's 16 MB per file)."""
    return archive.with_name(archive.name.removesuffix(".tar.gz") + "_repeat.tar.gz")


def pack(out: Path, archive: Path) -> None:
    """The profile, the protocol, engine.json and the PACKED files of each calibration and
    first-pass folder into ``archive`` (.tar.gz); the repeat pass's into
    :func:`repeat_archive`."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    for path, sides, extra in (
        (archive, ("calibration", "engine"), ("profile.csv", "protocol.yaml", "engine.json")),
        (repeat_archive(archive), ("engine_repeat",), ()),
    ):
        with tarfile.open(path, "w:gz") as tar:
            for name in extra:
                if (out / name).exists():
                    tar.add(out / name, arcname=name)
            for side in sides:
                for folder in sorted((out / side).glob("*")) if (out / side).is_dir() else []:
                    for f in PACKED:
                        if (folder / f).exists():
                            tar.add(folder / f, arcname=f"{side}/{folder.name}/{f}")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)


# ---------------------------------------------------------------- simulator side (CPU)


def unpack(archive: Path) -> Path:
    """The archive's contents (and its repeat archive's) in a temporary folder, or
    ``archive`` itself if it is a folder; a missing repeat archive is warned about (no
    spreads then)."""
    if not archive.exists():
        raise SystemExit(
            f"error: {archive}: no such archive (the default is the source checkout's "
            "docs/fidelity/heldout_engine.tar.gz: run from a clone, or pass --archive)"
        )
    if archive.is_dir():
        return archive
    if not repeat_archive(archive).exists():
        print(
            f"warning: {repeat_archive(archive)} not found: no repeat runs, so no engine "
            "spread (every spread reads '-')",
            file=sys.stderr,
        )
    tmp = Path(tempfile.mkdtemp(prefix="fidelity-"))
    try:
        for path in (archive, repeat_archive(archive)):
            if path.exists():
                with tarfile.open(path) as tar:
                    tar.extractall(tmp, filter="data")
    except BaseException:  # a damaged archive: the caller reports it; no folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def rel(sim: float, real: float) -> float:
    return abs(sim - real) / real if real else float("nan")


def sim(archive: Path, doc: Path) -> dict[str, Any]:
    """Every comparison of the simulator side; writes docs/fidelity.md (``doc``), its
    table (fidelity/heldout.csv) and plots beside it; returns the numbers. The archive is
    unpacked into a temporary folder, removed at the end.

    Raises:
        SystemExit: one line, before any replay, if ``doc`` is a folder or its folder
            cannot be made or written."""
    try:
        doc.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --doc {doc}: cannot make its folder ({e.strerror})") from None
    if doc.is_dir() or not os.access(doc.parent, os.W_OK):
        raise SystemExit(f"error: --doc {doc}: expected a markdown file path in a writable folder")
    src = unpack(archive)
    try:
        return _sim(archive, src, doc)
    finally:
        if src != archive:
            shutil.rmtree(src, ignore_errors=True)


def _sim(archive: Path, src: Path, doc: Path) -> dict[str, Any]:
    import numpy as np
    import pandas as pd

    from lab.run.experiment import run_experiment
    from lab.sim.calibrated import CalibratedCostModel, read_fingerprint, staleness

    profile = src / "profile.csv"
    if not (src / "engine.json").exists() or not profile.exists():
        raise SystemExit(
            f"error: {archive}: no engine.json or profile.csv (not an engine side's archive)"
        )
    record = json.loads((src / "engine.json").read_text())
    if not isinstance(record, dict):
        raise SystemExit(f"error: {archive}: engine.json: expected a mapping")
    if not record.get("folders"):
        raise SystemExit(
            f"error: {archive}: no engine runs (skipped: {', '.join(record.get('skipped', [])) or '-'})"
        )
    for key, side in (("folders", "engine"), ("calibration", "calibration")):
        names = record.get(key) or []
        if not isinstance(names, list) or not all(
            isinstance(n, str) and "/" not in n and n not in ("", ".", "..")
            and (src / side / n / "steps.csv").is_file()
            for n in names
        ):  # fmt: skip
            raise SystemExit(
                f"error: {archive}: engine.json: {key}: expected names of folders under "
                f"{side}/ that hold a steps.csv, got {short_repr(names, 60)}"
            )
    bad = [f for f in record["folders"] if "_" not in f]
    if bad:
        raise SystemExit(
            f"error: {archive}: engine.json: folders: expected WINDOW_LOAD names, got {bad[0]!r}"
        )
    calibration = [
        str(src / "calibration" / n / "steps.csv") for n in record.get("calibration") or []
    ]
    model = CalibratedCostModel(profile, tuple(calibration))
    cost_model = {"profile": str(profile), **({"replay_steps": calibration} if calibration else {})}
    rows, steps_err, cdfs, plan, stale, equivalent = [], [], {}, [], {}, []
    for folder in record["folders"]:
        real_dir, again_dir = src / "engine" / folder, src / "engine_repeat" / folder
        raw = yaml.safe_load((real_dir / "config.yaml").read_text())
        real = json.loads((real_dir / "summary.json").read_text())
        again = (
            json.loads((again_dir / "summary.json").read_text())
            if (again_dir / "summary.json").exists()
            else None
        )
        sim_raw = {**raw, "backend": "sim", "cost_model": cost_model}
        sims = run_experiment(_engine_config(sim_raw), progress=False)
        rep_raw = {**raw, "backend": "sim",
                   "cost_model": {"durations_from": str(real_dir / "steps.csv")}}  # fmt: skip
        replays = run_experiment(_engine_config(rep_raw), progress=False)
        real_req = pd.read_csv(real_dir / "requests.csv")
        real_steps = pd.read_csv(real_dir / "steps.csv")
        slice_name, load = folder.rsplit("_", 1)
        for s, rp in zip(sims, replays, strict=True):
            r = real[s.label]
            fp = (r.get("cost_model") or {}).get("fingerprint")
            stale[folder] = staleness(read_fingerprint(profile), fp) if fp else (None, "")
            row: dict[str, Any] = {"slice": slice_name, "load": float(load), "policy": s.label}
            for m in METRICS:
                for p in PCTS:
                    row[f"real_{m}_{p}"] = r[m][p]
                    row[f"sim_{m}_{p}"] = s.summary[m][p]
                    row[f"err_{m}_{p}"] = rel(s.summary[m][p], r[m][p])
                    if again is not None:
                        row[f"again_{m}_{p}"] = again[s.label][m][p]
                        row[f"spread_{m}_{p}"] = rel(again[s.label][m][p], r[m][p])
            row["err_throughput"] = rel(s.summary["output_throughput"], r["output_throughput"])
            if again is not None:
                row["spread_throughput"] = rel(
                    again[s.label]["output_throughput"], r["output_throughput"]
                )
            pre = r["preemptions"]
            row["real_preemptions"] = pre["recompute"] + pre["swap"]
            row["sim_preemptions"] = (
                s.summary["preemptions"]["recompute"] + s.summary["preemptions"]["swap"]
            )
            pm = rp.summary["plan_match"]
            plan.append({"run": f"{folder} {s.label}", **pm})
            row["plans_identical"] = pm["fraction_identical"]
            rows.append(row)
            st = real_steps[real_steps.policy == s.label]
            async_ = bool((raw.get("scheduler") or {}).get("async_scheduling"))
            pred = predicted_durations(model, st, async_)
            steps_err.append(
                pd.DataFrame(
                    {
                        "kind": _step_kind(st),
                        "err": (pred - st.duration_s) / st.duration_s,
                        "noise": step_noise(st),
                        "saturated": float(load) > 1.0,
                    }
                )  # fmt: skip
            )
            rq = real_req[real_req.policy == s.label]
            cdfs[(slice_name, float(load), s.label)] = {
                m: (rq[m].dropna().to_numpy(), s.requests[m].dropna().to_numpy())
                for m in ("ttft_s", "e2e_s")
            }
        labels = [x.label for x in sims]
        equivalent += [(slice_name, float(load), a, b)
                       for a, b in combinations(labels, 2)
                       if plans_alike(raw, real_steps, a, b)]  # fmt: skip
    table = pd.DataFrame(rows)
    steps = pd.concat(steps_err, ignore_index=True)
    rankings = rank_agreement(table, frozenset(equivalent))
    plans = pd.DataFrame(plan)
    out_dir = doc.parent / "fidelity"
    out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_dir / "heldout.csv", index=False, float_format="%.6g")
    _plots(steps, cdfs, out_dir)
    protocol = (
        yaml.safe_load((src / "protocol.yaml").read_text())
        if (src / "protocol.yaml").exists()
        else {}
    )
    text = _markdown(
        table, steps, rankings, plans, record, stale, profile, np, _shown(archive), protocol,
        equivalent,
    )  # fmt: skip
    notes = notes_path(archive)
    if notes.exists():
        text += "\n" + notes.read_text()
    doc.write_text(text)
    print(f"wrote {doc} (and its tables and plots in {out_dir})")
    print("\nfor the README's fidelity paragraph:\n" + text.split("\n\n")[1], flush=True)
    return {"table": table, "steps": steps, "rankings": rankings, "plans": plans}


def notes_path(archive: Path) -> Path:
    """The hand-written notes the sim side appends to ``archive``'s doc: beside it and named
    after it (``NAME.tar.gz``: ``NAME_notes.md``; an unpacked folder: its ``notes.md``), so
    another archive in the same folder does not get them."""
    if archive.is_dir():
        return archive / "notes.md"
    return archive.with_name(archive.name.removesuffix(".tar.gz") + "_notes.md")


def predicted_durations(model, st, async_scheduling: bool = False):
    """Each step's duration in seconds predicted by the calibrated ``model`` from its exact
    batch, for one run's steps ``st`` (a steps.csv frame of one policy, in step order).

    Synchronous: the step time S (host + device). Asynchronous: the clock the simulator
    runs (lab/sim/replay.py), max(S_n - H_n, H_{n+1}) with H the model's host time, where
    H_{n+1} counts only if step n + 1 starts where step n ends (it was planned while n
    ran; after an idle gap the pipeline restarts), as the engine's steps.csv durations are
    that clock."""
    import numpy as np

    from lab.sim.calibrated import design, host_design, steps_as_profile

    prof = steps_as_profile(st)
    step_s = design(prof) @ model.coef
    if not async_scheduling:
        return step_s
    host = np.zeros(len(st)) if model.host_coef is None else host_design(prof) @ model.host_coef
    host = np.clip(host, 0.0, step_s)
    start, end = st.time_s.to_numpy(float), (st.time_s + st.duration_s).to_numpy(float)
    chained = np.abs(start[1:] - end[:-1]) <= 1e-7 * np.maximum(1.0, end[:-1])
    host_next = np.append(np.where(chained, host[1:], 0.0), 0.0)
    return np.maximum(step_s - host, host_next)


def plan_alike_replay(raw: dict, real_steps, a: str, b: str):
    """Policy ``b`` of an engine run's config replayed with policy ``a``'s measured step
    durations (``cost_model.durations_from``, a's rows relabelled b): its plan_match."""
    import logging

    from lab.run.experiment import run_experiment

    quiet = logging.getLogger("lab.run.experiment")
    level, quiet.level = quiet.level, logging.CRITICAL  # b running out of a's steps is news
    try:  # to no one: it only means the two do not plan alike
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "steps.csv"
            real_steps[real_steps.policy == a].assign(policy=b).to_csv(path, index=False)
            cross = {**raw, "backend": "sim", "cost_model": {"durations_from": str(path)},
                     "policies": [p for p in raw["policies"] if _label(p) == b]}  # fmt: skip
            runs = run_experiment(_engine_config(cross), progress=False)
    finally:
        quiet.level = level
    return runs[0].summary["plan_match"]


def plans_alike(raw: dict, real_steps, a: str, b: str) -> bool:
    """Whether policies ``a`` and ``b`` plan alike on this run: ``b`` fed ``a``'s engine
    step durations makes ``a``'s plan on every step (then what differs between them on the
    engine is its noise, not the policy)."""
    from lab.core.errors import UserError

    try:
        pm = plan_alike_replay(raw, real_steps, a, b)
    except UserError:  # b asked for more steps than a ran: not alike
        return False
    return pm["steps_matched"] == pm["steps_recorded"] == pm["steps_simulated"]


def _label(p) -> str:
    return p if isinstance(p, str) else p.get("label") or p["name"]


def step_noise(st):
    """Each engine step's distance from the median duration of the run's steps of the same
    shape, |d / median - 1| (NaN where fewer than 5 steps share it): the engine's own
    step-to-step spread, which no prediction from a step's features can beat. A shape is the
    step's kind, prompt tokens (to 64), prompts, decodes and context tokens (decode context
    to 512 x decodes, prompt context to 512)."""
    import numpy as np

    decodes = st.num_decode_tokens.to_numpy()
    key = [
        st.num_prefills.to_numpy(),
        st.num_prefill_tokens.to_numpy() // 64,
        decodes,
        st.decode_context_tokens.to_numpy() // (512 * np.maximum(decodes, 1)),
        st.prefill_context_tokens.to_numpy() // 512,
        (st.num_swap_out_blocks + st.num_swap_in_blocks).to_numpy() > 0,
    ]
    d = st.duration_s
    groups = d.groupby(key)
    med, size = groups.transform("median"), groups.transform("size")
    return ((d / med - 1).abs()).where(size >= 5).to_numpy()


def _step_kind(st) -> list[str]:
    """Each engine step's kind: swap (blocks copied), mixed (prompt tokens and decodes),
    prefill (prompt tokens only), decode (decodes only)."""
    out = []
    for p, d, so, si in zip(st.num_prefill_tokens, st.num_decode_tokens,
                            st.num_swap_out_blocks, st.num_swap_in_blocks):  # fmt: skip
        out.append("swap" if so + si else "mixed" if p and d else "prefill" if p else "decode")
    return out


def rank_agreement(table, equivalent: frozenset = frozenset()) -> list[dict[str, Any]]:
    """For every (slice, load), ranked metric and pair of policies whose engine difference
    exceeds the engine's own spread (|a - b| > |a - a'| + |b - b'|, a' the repeat) and
    which the repeat orders the same way: does the simulator order them the same way?
    Pairs in ``equivalent`` ((slice, load, a, b): policy b, fed a's engine step durations,
    plans every step as a did; e.g. sjf and fcfs without a queue) are left out: what
    differs between them on the engine is its noise."""
    out = []
    if "again_ttft_s_p50" not in table:
        return out
    for (sl, load), g in table.groupby(["slice", "load"]):
        g = g.set_index("policy")
        for m, p in RANKED:
            col = f"{m}_{p}"
            for a, b in combinations(g.index, 2):
                if (sl, load, a, b) in equivalent:
                    continue
                ra, rb = g.at[a, f"real_{col}"], g.at[b, f"real_{col}"]
                aa, ab = g.at[a, f"again_{col}"], g.at[b, f"again_{col}"]
                if any(v != v for v in (ra, rb, aa, ab)):  # NaN: no repeat
                    continue
                noise = abs(ra - aa) + abs(rb - ab)
                if abs(ra - rb) <= noise or (ra - rb) * (aa - ab) <= 0:
                    continue
                sa, sb = g.at[a, f"sim_{col}"], g.at[b, f"sim_{col}"]
                out.append({"slice": sl, "load": load, "metric": col, "pair": f"{a} vs {b}",
                            "engine": ra - rb, "noise": noise, "sim": sa - sb,
                            "agree": (ra - rb) * (sa - sb) > 0})  # fmt: skip
    return out


def _plots(steps, cdfs, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, g in steps.groupby("kind"):
        e = np.sort(g.err.to_numpy() * 100)
        ax.plot(e, np.linspace(0, 1, len(e)), label=f"{kind} ({len(e):,} steps)")
    ax.set_xlim(-40, 40)
    ax.axvline(0, color="k", lw=0.5)
    ax.set_xlabel("per-step error, calibrated prediction vs engine (%)")
    ax.set_ylabel("fraction of engine steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "heldout_step_error.png", dpi=110)
    plt.close(fig)
    slices = sorted({k[0] for k in cdfs})
    loads = sorted({k[1] for k in cdfs})
    fig, axes = plt.subplots(
        2 * len(slices), len(loads), figsize=(3 * len(loads), 2.6 * 2 * len(slices)),
        squeeze=False,
    )  # fmt: skip
    for (sl, load, policy), d in cdfs.items():
        for k, m in enumerate(("ttft_s", "e2e_s")):
            ax = axes[2 * slices.index(sl) + k, loads.index(load)]
            real, simd = d[m]
            (line,) = ax.plot(np.sort(real), np.linspace(0, 1, len(real)), label=f"{policy}")
            ax.plot(np.sort(simd), np.linspace(0, 1, len(simd)), "--", color=line.get_color())
            ax.set_xscale("log")
            ax.set_title(f"{sl} {load:g}x: {m[:-2].upper()} (s)", fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=6)
    axes[0, 0].legend(fontsize=6, title="solid engine, dashed sim", title_fontsize=6)
    fig.tight_layout()
    fig.savefig(out_dir / "heldout_cdfs.png", dpi=90)
    plt.close(fig)


def _pct(v: float) -> str:
    return "-" if v != v else f"{v * 100:.1f}%"


def _target(p: str) -> float:
    return {"p50": 0.05, "p90": 0.05, "p99": 0.10}.get(p, 0.03)


def _shown(archive: Path) -> str:
    """The archive's path as the doc names it: relative to the repository when inside it."""
    try:
        return str(Path(archive).resolve().relative_to(ROOT))
    except ValueError:
        return str(archive)


def _setup_line(protocol: dict[str, Any]) -> str:
    """The protocol's model and engine setup, in words, for the doc."""
    exp, ck = protocol.get("experiment", {}), protocol.get("checkpoint", {})
    eng, kv, sch = exp.get("engine", {}), exp.get("kv_cache", {}), exp.get("scheduler", {})
    pols = [
        p if isinstance(p, str) else p.get("label", p.get("name", "?"))
        for p in exp.get("policies", [])
    ]
    mode = "asynchronous" if sch.get("async_scheduling") else "synchronous"
    return (
        f"Model: {ck.get('preset', exp.get('model', '?'))} shape, random {ck.get('dtype', '?')} "
        f"weights, {eng.get('attention_backend', '?')} attention, {kv.get('num_gpu_blocks', '?')} "
        f"KV blocks of {kv.get('block_size', '?')} tokens, policies {', '.join(pols)}, "
        f"{mode} scheduling."
    )


def _markdown(
    table, steps, rankings, plans, record, stale, profile, np, archive="", protocol=None,
    equivalent=(),
) -> str:  # fmt: skip
    cols = [(m, p) for m in METRICS for p in PCTS]
    has_spread = "spread_ttft_s_p50" in table

    def cell(r, m, p) -> str:
        key = f"{m}_{p}" if m != "throughput" else "throughput"
        e = r[f"err_{key}"]
        s = r.get(f"spread_{key}", float("nan")) if has_spread else float("nan")
        limit = max(_target(p), s if s == s else 0.0)
        return f"{_pct(e)} ({_pct(s)})" + ("" if e <= limit else " ✗")

    head = ["window", "load", "policy"] + [f"{m[:-2].upper()} {p}" for m, p in cols]
    head += ["throughput", "preempt engine / sim", "plans identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    met = missed = 0
    for _, r in table.iterrows():
        cells = [r.slice, f"{r.load:g}", r.policy]
        cells += [cell(r, m, p) for m, p in cols] + [cell(r, "throughput", "tp")]
        met += sum("✗" not in c for c in cells[3:])
        missed += sum("✗" in c for c in cells[3:])
        cells += [f"{r.real_preemptions} / {r.sim_preemptions}", _pct(r.plans_identical)]
        lines.append("| " + " | ".join(cells) + " |")
    med = ["| median over runs | " + " | ".join(f"{m[:-2].upper()} {p}" for m, p in cols)
           + " | throughput |", "|" + "---|" * (len(cols) + 2)]  # fmt: skip
    for label, prefix, sel in (
        ("simulator vs engine, all loads", "err_", table.load > 0),
        ("simulator vs engine, loads <= 0.95", "err_", table.load <= 0.95),
        ("simulator vs engine, saturated (1.1, 1.3)", "err_", table.load > 1.0),
        ("engine vs its repeat, all loads", "spread_", table.load > 0),
        ("engine vs its repeat, saturated", "spread_", table.load > 1.0),
    ):
        if prefix == "spread_" and not has_spread:
            continue
        t = table[sel]
        vals = [t[f"{prefix}{m}_{p}"].median() for m, p in cols] + [
            t[f"{prefix}throughput"].median()
        ]
        label += f" ({t[f'{prefix}ttft_s_p50'].notna().sum()} runs)"
        med.append(f"| {label} | " + " | ".join(_pct(v) for v in vals) + " |")
    e = np.abs(steps.err.to_numpy())

    def noise(g, q: float) -> str:
        n = g.noise.dropna().to_numpy() if "noise" in g else np.array([])
        return _pct(np.percentile(n, q)) if len(n) else "-"

    by_kind = [
        f"| {k} | {len(g):,} | {_pct(np.median(np.abs(g.err)))} | "
        f"{_pct(np.percentile(np.abs(g.err), 90))} | {_pct(np.median(g.err))} | "
        f"{noise(g, 50)} / {noise(g, 90)} |"
        for k, g in [("all", steps), *steps.groupby("kind")]
    ]
    sat_steps = steps[steps.saturated]
    n_plans = int(plans.steps_recorded.sum())
    identical = int(plans.steps_matched.sum())
    first_bad = plans[plans.first_mismatch.notna()]
    agree = sum(r["agree"] for r in rankings)
    rank_lines = [
        f"| {r['slice']} | {r['load']:g} | {r['metric']} | {r['pair']} | "
        f"{r['engine'] * 1e3:+.2f} | {r['noise'] * 1e3:.2f} | {r['sim'] * 1e3:+.2f} | "
        f"{'yes' if r['agree'] else '**tie**' if r['sim'] == 0 else '**no**'} |"
        for r in rankings
    ]
    sat, low = table[table.load > 1.0], table[table.load <= 1.0]

    def mdn(t, col: str) -> str:
        return _pct(t[col].median()) if col in t and len(t) else "-"

    headline = (
        f"Held out ({len(table)} engine runs): plans identical under replayed durations "
        f"{_pct(identical / max(n_plans, 1))} of {n_plans:,} steps; step-level error median "
        f"{_pct(np.median(e))}, P90 {_pct(np.percentile(e, 90))} (engine's own step-to-step "
        f"spread {noise(steps, 50)}, {noise(steps, 90)}); median errors (engine's own "
        f"spread in brackets) TTFT p50 {mdn(table, 'err_ttft_s_p50')} "
        f"({mdn(table, 'spread_ttft_s_p50')}), TPOT p50 {mdn(table, 'err_tpot_s_p50')} "
        f"({mdn(table, 'spread_tpot_s_p50')}), E2E p50 {mdn(table, 'err_e2e_s_p50')} "
        f"({mdn(table, 'spread_e2e_s_p50')}), throughput {mdn(table, 'err_throughput')} "
        f"({mdn(table, 'spread_throughput')}); policy pairs ordered as on the engine: "
        f"{sum(r['agree'] for r in rankings)} of {len(rankings)}."
    )
    saturated = (
        "No saturated runs (loads above 1) in this archive.\n"
        if sat.empty
        else SATURATED.format(
            sat_bias=_pct(np.median(sat_steps.err)) if len(sat_steps) else "-",
            low_bias=_pct(np.median(steps[~steps.saturated].err))
            if (~steps.saturated).any()
            else "-",
            sat_ttft=mdn(sat, "err_ttft_s_p50"),
            sat_ttft_spread=mdn(sat, "spread_ttft_s_p50"),
            low_ttft=mdn(low, "err_ttft_s_p50"),
            sat_e2e=mdn(sat, "err_e2e_s_p50"),
            sat_e2e_spread=mdn(sat, "spread_e2e_s_p50"),
            sat_tp=mdn(sat, "err_throughput"),
            sat_tp_spread=mdn(sat, "spread_throughput"),
        )
    )
    cap = record.get("capacity", {})
    stale_notes = sorted({why for s, why in stale.values() if s})
    fp = json.loads(json.dumps(_read_fp(profile)))
    source = record.get("source") or (
        f"`sched-lab fidelity --engine` made them on one {(fp or {}).get('gpu', 'GPU')} (started "
        f"{record.get('started', '?')} UTC; step times in s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in record.get("steps", {}).items() if k.endswith("_s"))
        + "), the profile first, minutes before the replays, on the same machine. Protocol: "
        f"`{record.get('protocol', 'benchmarks/fidelity_heldout.yaml')}` (what it leaves out of "
        "a full protocol, and why, is written there)."
    )
    async_protocol = bool(
        ((protocol or {}).get("experiment", {}).get("scheduler") or {}).get("async_scheduling")
    )
    return TEMPLATE.format(
        archive=archive,
        setup=_setup_line(protocol or {}),
        source=source,
        loads=", ".join(f"{x:g}" for x in sorted(table.load.unique())),
        fingerprint=", ".join(f"{k} `{v}`" for k, v in sorted((fp or {}).items())) or "none",
        calibration=(
            "the simulator's calibration data is the profile grid (`profile.csv` in the "
            "archive) and the engine's steps in synthetic calibration replays run right after "
            f"it (`calibration/` in the archive: {', '.join(record['calibration'])}; "
            "arrivals and lengths drawn from the protocol's distributions, no trace row); no "
            "step of an evaluated window is fitted"
            + (
                " (the replays ran with synchronous scheduling: their steps are step times, "
                "whose host part the profile's `host_s` fit splits off)."
                if async_protocol
                else "."
            )
            if record.get("calibration")
            else "the simulator's only calibration data is the profile grid (`profile.csv` in "
            "the archive); no engine replay step is fitted."
        ),
        stale=(
            "The profile matches the engine runs' fingerprint (made by the same engine, GPU "
            "and versions)."
            if not stale_notes and all(s is False for s, _ in stale.values())
            else "**Stale**: "
            + "; ".join(stale_notes or ["the profile or the engine runs have no fingerprint"])
            + "."
        ),
        capacity="\n".join(
            f"| {k} | {v['requests']} | {v['native_req_s']:.3f} | {v['capacity_req_s']:.1f} |"
            for k, v in cap.items()
        ),
        skipped=", ".join(record.get("skipped", [])) or "none",
        identical_pct=_pct(identical / max(n_plans, 1)),
        identical=identical,
        n_plans=n_plans,
        n_runs=len(plans),
        plan_note=(
            "every step of every run was planned as on the engine."
            if first_bad.empty
            else "runs with a mismatch: "
            + "; ".join(f"{r.run}: {r.first_mismatch}" for r in first_bad.itertuples())
        ),
        async_steps=(
            " (asynchronous scheduling: the clock the simulator runs, max(device time of N, "
            "host time of N + 1), as the engine's durations are)"
            if async_protocol
            else ""
        ),
        step_p50=_pct(np.median(e)),
        step_p90=_pct(np.percentile(e, 90)),
        step_sat=_pct(np.median(np.abs(sat_steps.err))) if len(sat_steps) else "-",
        headline=headline,
        saturated=saturated,
        by_kind="\n".join(by_kind),
        met=met,
        total=met + missed,
        medians="\n".join(med),
        table="\n".join(lines),
        agree=agree,
        pairs=len(rankings),
        rank_table="\n".join(rank_lines) or "| - | - | - | - | - | - | - | - |",
        same_plans=_equivalent_text(equivalent),
    )


def _equivalent_text(equivalent) -> str:
    """The policy pairs that plan alike under the same step durations, in words."""
    if not equivalent:
        return "none (every pair of policies planned differently under the same durations)"
    pairs = "; ".join(f"{a} and {b} at {sl} {load:g}x" for sl, load, a, b in sorted(equivalent))
    return (
        f"{len(equivalent)} pairs whose second policy, fed the first's engine step "
        f"durations, made the first's plan on every step, so that what differs between them "
        f"on the engine is its noise ({pairs})"
    )


def _read_fp(profile: Path):
    from lab.sim.calibrated import read_fingerprint

    return read_fingerprint(profile)


TEMPLATE = """# Simulator fidelity, held out

{headline}

Generated by `sched-lab fidelity --sim` from `{archive}` (and its `_repeat` archive). {source}
{setup}

**Held out**: {calibration} Profile fingerprint: {fingerprint}. {stale}

Windows and the engine's capacity on each (all requests at t = 0, fcfs); loads are {loads}
times it:

| window | requests | own rate (req/s) | capacity (req/s) |
|---|---|---|---|
{capacity}

Skipped for time: {skipped}.

## Plans identical under replayed durations

Fed each engine run's measured step durations in order (`cost_model: {{durations_from:
RUN/steps.csv}}`), the simulator planned **{identical_pct}** of the engine's steps
identically ({identical:,} of {n_plans:,} steps in {n_runs} runs: same prefill tokens and
chunks, decodes, contexts, preemptions, swap-outs and swap-ins); {plan_note}

## Step-level error

Each engine step's duration predicted by the calibrated model from that step's exact batch{async_steps}:
median {step_p50}, P90 {step_p90} (absolute; saturated runs alone: median {step_sat}).
Targets: median <= 3%, P90 <= 8%. The last column is the engine's own spread between steps
of one shape: each step's distance from the median of the run's steps of its shape (kind,
prompt tokens to 64, prompts, decodes, context to 512 tokens a sequence; shapes of >= 5
steps), median / P90. A model that sees only a step's shape cannot do better than that.

| step kind | steps | median abs error | P90 abs error | median signed error | engine's spread, same shape |
|---|---|---|---|---|---|
{by_kind}

![per-step error by step kind](fidelity/heldout_step_error.png)

## Distribution errors

Relative error |sim - engine| / engine of each percentile; in brackets the engine's own
spread, |repeat - first| / first, for the same run. ✗ marks a miss of max(5% at P50/P90, 10%
at P99, 3% for throughput, the engine's own spread): {met} of {total} cells met.

{medians}

Per run:

{table}

![engine (solid) vs simulator (dashed): TTFT and E2E CDFs](fidelity/heldout_cdfs.png)

{saturated}
## Rankings

For every (window, load), metric (TTFT p50, TTFT p99, TPOT p50, E2E p50) and pair of
policies whose engine difference exceeds the engine's own spread (|a - b| > |a - a'| +
|b - b'|, a' the repeat, and the repeat orders them the same way): the simulator orders
{agree} of {pairs} such pairs as the engine does (a tie in the simulator counts as not).
Left out: {same_plans}. Differences in ms.

| window | load | metric | pair | engine a - b | spread | sim a - b | same order |
|---|---|---|---|---|---|---|---|
{rank_table}
"""


SATURATED = """## The saturated regime (1.1 and 1.3 x capacity)

Above capacity the queue grows for the whole window, so a request's TTFT is its wait behind
everything that arrived before it: the sum of many steps' durations, where at low load it is
about one prefill step. A bias in the step times then carries into TTFT whole instead of
averaging out: the saturated runs' step predictions have a signed median error of
{sat_bias} ({low_bias} at loads <= 1), and their median TTFT p50 error is {sat_ttft}
against the engine's own spread of {sat_ttft_spread} (the simulator's error at loads <= 1:
{low_ttft}). E2E p50:
{sat_e2e} (engine {sat_e2e_spread}). Throughput there is the engine's service rate: error
{sat_tp} (engine {sat_tp_spread}).
"""


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None, prog: str = "sched-lab fidelity") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + "\n".join(__doc__.split("\n\n")[1].splitlines()),
    )
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--engine", action="store_true", help="GPU side: profile, runs, repeats")
    side.add_argument("--sim", action="store_true", help="CPU side: docs/fidelity.md")
    side.add_argument("--engine-pass", choices=("calibration", "first", "repeat"),
                      help=argparse.SUPPRESS)  # fmt: skip
    ap.add_argument("--protocol", type=Path, default=PROTOCOL, help="protocol YAML")
    ap.add_argument("--out", type=Path, default=Path("/tmp/sched-lab-fidelity"),
                    help="engine side: working folder (default /tmp/sched-lab-fidelity)")  # fmt: skip
    ap.add_argument("--archive", type=Path, default=None,
                    help=f"engine side: .tar.gz to write; sim side: to read (default {ARCHIVE.relative_to(ROOT)})")  # fmt: skip
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "fidelity.md",
                    help="sim side: the markdown to write")  # fmt: skip
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except SystemExit as e:  # the one-line errors above: bad input, exit status 2
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise


def _main(args: argparse.Namespace) -> int:
    if args.engine_pass:
        engine_pass(args.engine_pass, args.protocol, args.out, args.deadline or float("inf"))
        return 0
    if args.engine:
        return engine(args.protocol, args.out, args.archive)
    from lab.core.errors import UserError

    archive = args.archive or ARCHIVE
    try:
        sim(archive, args.doc)
    except (OSError, EOFError, tarfile.TarError, json.JSONDecodeError, yaml.YAMLError,
            UserError) as e:  # fmt: skip
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {archive}: a damaged archive ({type(e).__name__}: {short_repr(why, 200)[1:-1]})",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0
