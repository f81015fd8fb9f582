"""The engine side (``--engine``, GPU): each step a process of its own under a time limit.

Steps: check every run and the device, make a random-weight checkpoint if missing;
``sched_lab.backend.profile`` (``profile.csv``); pass ``calibration`` (``calibration/<name>/``); pass
``first`` (each window's capacity, then every load and policy into
``engine/<window>_<load>/``); pass ``repeat`` (``engine_repeat/``); pack ``--archive``.
A folder that would not end inside its pass's time limit is skipped and listed in
``engine.json``; on SIGTERM or Ctrl-C the running step is stopped and what ended is packed.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sched_lab.core.outputs import MANIFEST
from sched_lab.fidelity.archive import pack, repeat_archive
from sched_lab.fidelity.protocol import (
    ROOT,
    calibration_config,
    capacity_run,
    check_runs,
    engine_config,
    folder_name,
    load_config,
    load_protocol,
    pass_estimate_s,
    profile_geometry,
    scale_folder_name,
    slice_config,
    window_loads,
    window_rate_scales,
)

PASSES = ("calibration", "first", "repeat")


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM handler of the engine side: stop the running step as Ctrl-C would."""
    raise KeyboardInterrupt


def _run_step(argv: list[str]) -> int:
    """Run one step's command; its exit status. If this process is interrupted, the step
    is stopped first (SIGTERM, SIGKILL after 15 s)."""
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
    """SystemExit (one line naming ``experiment.engine.device``) unless torch sees the GPU
    the protocol's ``cuda`` device needs."""
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


def _prepare(protocol: dict[str, Any], protocol_path: Path, out: Path) -> Path:
    """Check every run and the device, clear ``out`` and copy the protocol there; returns
    the checkpoint folder (removed again, if empty, when a check fails)."""
    _check_out(out)
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
    return ckpt


# What the engine side writes in --out; a folder holding anything else is not cleared.
WORKING_ENTRIES = {"engine.json", "profile.csv", "protocol.yaml", "calibration", "engine",
                   "engine_repeat", MANIFEST}  # fmt: skip


def _check_out(out: Path) -> None:
    """SystemExit (one line) unless ``out`` is absent, empty or an engine side's folder."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out}: exists and is not a folder")
    foreign = (
        sorted(p.name for p in out.iterdir() if p.name not in WORKING_ENTRIES)
        if out.exists()
        else []
    )
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise SystemExit(
            f"error: --out {out}: holds {foreign[0]}{more}, not an engine side's working "
            "folder; refusing to clear it (choose a new or empty --out)"
        )


def _make_checkpoint(protocol: dict[str, Any], ckpt: Path) -> None:
    """A random-weight checkpoint of the protocol's preset (or config) in ``ckpt``, if none."""
    if (ckpt / "config.json").exists():
        return
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint
    from sched_lab.core.model_presets import PRESETS

    c = protocol["checkpoint"]
    config = c.get("config") or PRESETS[c["preset"]]
    write_random_checkpoint(config, ckpt, c.get("dtype", "bfloat16"), name=c.get("preset", "x"))
    _free_device_cache()  # the runs' processes get the memory its random draws cached


def _step_commands(
    protocol: dict[str, Any], protocol_path: Path, ckpt: Path, out: Path
) -> list[tuple[str, list[str]]]:
    """Each step's name and command: the profile, then the passes of this module."""
    from sched_lab.config import validate

    # the runs' engine options as validated (defaults filled in), for the profile's runner
    runs = validate(
        slice_config(protocol, next(iter(protocol["slices"]))), str(protocol_path), ROOT
    )
    profile = [sys.executable, "-m", "sched_lab.backend.profile", "--model-dir", str(ckpt),
               "--out", str(out / "profile.csv"),
               "--attention", runs.engine.attention_backend, "--dtype", runs.engine.dtype,
               "--triton-prefill-kernel", runs.engine.triton_prefill_kernel,
               "--block-size", str(runs.kv_cache.block_size),
               *profile_geometry(protocol["experiment"]),
               *map(str, protocol.get("profile_args", []))]  # fmt: skip
    passes = [p for p in PASSES if p != "calibration" or protocol.get("calibration")]
    return [("profile", profile)] + [
        (p, [sys.executable, "-m", "sched_lab.fidelity", "--engine-pass", p]) for p in passes
    ]


def _run_steps(
    steps: list[tuple[str, list[str]]],
    limits: dict[str, float],
    end: float,
    args: list[str],
    log: dict[str, Any],
    last: str | None = None,
) -> tuple[int, bool]:
    """Run the steps in order, each under its limit, timing them into ``log["steps"]``.
    Returns (exit status, whether to pack): a failed or stopped profile packs nothing.
    ``last``: the last step, which gets all that is left (else the first pass 52% of it)."""
    status = 0
    for name, cmd in steps:
        left = end - time.time()
        # the repeat replays what the first pass ran: about half of what is left each
        limit = {"profile": limits["profile"], "calibration": limits.get("calibration", 0),
                 "first": left - 5 if last == "first" else 0.52 * left,
                 "repeat": left - 5}[name]  # fmt: skip
        limit = int(max(limit, 1))
        if name != "profile":
            cmd += [*args, "--deadline", str(time.time() + limit - 10)]
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
            return 1, name != "profile"
        if rc != 0:
            status = 1
            if name == "profile":
                print(f"error: the profile step failed (exit {rc}): no calibration data, so "
                      "nothing is held out and no archive is written", file=sys.stderr)  # fmt: skip
                return 1, False
            if name == "calibration":  # engine.json lists the workloads that finished
                print(f"warning: the calibration step failed (exit {rc}): the workloads that "
                      "finished are fitted beside the grid", file=sys.stderr)  # fmt: skip
    return status, True


def engine(protocol_path: Path, out: Path, archive: Path | None, split: str | None = None) -> int:
    """The whole engine side into ``out``, packed into ``archive`` when given; returns 0,
    or 1 if a step failed or no run ended. SystemExit (one line) for a bad protocol, run or
    device.

    ``split`` runs it in two device calls: ``"first"`` is the checkpoint, profile,
    calibration and first pass (the first pass gets all that is left of
    ``time_limits_s.total``), packed into ``archive`` only; ``"repeat"`` unpacks that
    ``archive`` into ``out``, makes the checkpoint and runs the repeat pass (under its own
    ``time_limits_s.total``), packed into the ``_repeat`` archive beside it. ``--sim``
    reads both as one run."""
    if split == "repeat":
        return _engine_repeat(protocol_path, out, archive)
    protocol = load_protocol(protocol_path)
    if archive is not None:  # before the work: a file of the user's is never replaced
        _check_archives([archive] if split == "first" else [archive, repeat_archive(archive)])
    ckpt = _prepare(protocol, protocol_path, out)
    limits = protocol["time_limits_s"]
    log: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    try:  # named in the doc (older archives have no name: the default protocol's)
        log["protocol"] = str(Path(protocol_path).resolve().relative_to(ROOT))
    except ValueError:
        log["protocol"] = str(protocol_path)
    t0 = time.perf_counter()
    _make_checkpoint(protocol, ckpt)
    log["steps"]["checkpoint_s"] = time.perf_counter() - t0
    steps = _step_commands(protocol, protocol_path, ckpt, out)
    if split == "first":
        steps = [s for s in steps if s[0] != "repeat"]
    end = time.time() - (time.perf_counter() - t0) + limits["total"]  # epoch seconds
    args = ["--out", str(out), "--protocol", str(protocol_path)]
    previous = signal.signal(signal.SIGTERM, _stop)  # a stopped run packs what ended
    try:
        status, packs = _run_steps(steps, limits, end, args, log, last="first" if split else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not packs:
        return 1
    done = out / "engine.json"
    passes = json.loads(done.read_text()) if done.exists() else {}
    (out / "engine.json").write_text(json.dumps({**passes, **log}, indent=2) + "\n")
    if not passes.get("folders"):
        print("error: no engine run ended inside the time limits (engine.json: skipped)",
              file=sys.stderr)  # fmt: skip
        status = 1
    if archive is not None:
        pack(out, archive, parts=("first",) if split == "first" else ("first", "repeat"))
    return status


def _check_archives(paths: list[Path]) -> None:
    from sched_lab.core.errors import UserError
    from sched_lab.core.outputs import check_output

    try:
        for path in paths:
            check_output(path, "--archive")
    except UserError as e:
        raise SystemExit(f"error: {e}") from None


def _engine_repeat(protocol_path: Path, out: Path, archive: Path | None) -> int:
    """``--split repeat``: the repeat pass of the first pass packed in ``archive`` (its
    protocol, engine.json and run folders unpacked into ``out``), into the ``_repeat``
    archive beside it."""
    import tarfile

    if archive is None or not archive.is_file():
        raise SystemExit(f"error: --split repeat: expected --archive, the first call's .tar.gz "
                         f"(--split first), got {archive}")  # fmt: skip
    load_protocol(protocol_path)  # its shape, as the first call checked it
    _check_archives([repeat_archive(archive)])
    _check_out(out)
    for name in WORKING_ENTRIES - {MANIFEST}:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")
    except (OSError, EOFError, tarfile.TarError) as e:
        raise SystemExit(f"error: --archive {archive}: cannot be unpacked ({e})") from None
    record_path = out / "engine.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    if not record.get("folders") or not (out / "protocol.yaml").exists():
        raise SystemExit(f"error: --archive {archive}: no first-pass runs to repeat (not a "
                         "--split first archive)")  # fmt: skip
    protocol = load_protocol(out / "protocol.yaml")  # the protocol the first call ran
    check_device(protocol, protocol_path)
    ckpt = ROOT / protocol["checkpoint"]["dir"]
    t0 = time.perf_counter()
    ckpt.mkdir(parents=True, exist_ok=True)
    _make_checkpoint(protocol, ckpt)
    record.setdefault("steps", {})["repeat_checkpoint_s"] = time.perf_counter() - t0
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    end = time.time() - (time.perf_counter() - t0) + protocol["time_limits_s"]["total"]
    cmd = [sys.executable, "-m", "sched_lab.fidelity", "--engine-pass", "repeat"]
    args = ["--out", str(out), "--protocol", str(out / "protocol.yaml")]
    log: dict[str, Any] = {"steps": {}}
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        status, _ = _run_steps([("repeat", cmd)], protocol["time_limits_s"], end, args, log)
    finally:
        signal.signal(signal.SIGTERM, previous)
    record = json.loads(record_path.read_text())
    record["steps"].update(log["steps"])
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    if not record.get("repeated"):
        print("error: no repeat run ended inside the time limit (engine.json: skipped)",
              file=sys.stderr)  # fmt: skip
        status = 1
    pack(out, archive, parts=("repeat",))
    return status


# ---------------------------------------------------------------- one pass, in its own process


def engine_pass(which: str, protocol_path: Path, out: Path, deadline: float) -> None:
    """One pass of engine runs in this process, recorded in ``out/engine.json`` as each
    run ends; a run that would end past ``deadline`` (epoch seconds) is skipped."""
    one = _Pass(protocol_path, out, deadline)
    {"calibration": one.calibration, "first": one.first, "repeat": one.repeat}[which]()
    one.save()  # the skips after the last run


class _Pass:
    """A pass's protocol, folder, deadline and ``engine.json`` record."""

    def __init__(self, protocol_path: Path, out: Path, deadline: float) -> None:
        self.protocol = load_protocol(protocol_path)
        self.protocol_path, self.out, self.deadline = protocol_path, out, deadline
        self.record_path = out / "engine.json"
        path = self.record_path
        self.record: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.record.setdefault("skipped", [])

    def save(self) -> None:
        self.record_path.write_text(json.dumps(self.record, indent=2) + "\n")

    def _validate(self, raw: dict[str, Any]):
        from sched_lab.config import validate

        return validate(raw, str(self.protocol_path), ROOT)

    def calibration(self) -> None:
        from sched_lab.report.folder import write_results
        from sched_lab.run.experiment import run_experiment

        record = self.record
        record["calibration"] = []
        for name in self.protocol["calibration"]["workloads"]:
            if time.time() > self.deadline:  # the grid and the workloads so far calibrate
                record["skipped"].append(f"calibration {name} (past the calibration limit)")
                continue
            cfg = self._validate(calibration_config(self.protocol, name))
            runs = run_experiment(cfg, progress=False)
            write_results(self.out / "calibration" / name, cfg, runs)
            steps = sum(r.summary["num_steps"] for r in runs)
            print(f"  calibration {name}: {_throughputs(runs)}, {steps} steps", flush=True)
            record["calibration"].append(name)
            self.save()

    def repeat(self) -> None:
        from sched_lab.report.folder import write_results
        from sched_lab.run.experiment import run_experiment

        record = self.record
        for folder in record.get("folders", []):
            est = record["estimates_s"][folder]
            if time.time() + est > self.deadline:
                record["skipped"].append(f"{folder} repeat (estimated {est:.0f} s)")
                continue
            config_yaml = self.out / "engine" / folder / "config.yaml"
            cfg = engine_config(yaml.safe_load(config_yaml.read_text()))
            runs = run_experiment(cfg, progress=False)
            write_results(self.out / "engine_repeat" / folder, cfg, runs)
            print(f"  {folder} again: " + _throughputs(runs), flush=True)
            record.setdefault("repeated", []).append(folder)
            self.save()

    def first(self) -> None:
        from sched_lab.run.experiment import run_experiment

        record = self.record
        record.update(folders=[], estimates_s={}, capacity={}, rate_scales={})  # keeps the
        # calibration's
        for name in self.protocol["slices"]:
            cfg = self._validate(slice_config(self.protocol, name))
            reqs, native, offline = capacity_run(cfg)
            if time.time() + 10 > self.deadline:
                record["skipped"].append(f"{name} (no time for its capacity run)")
                continue
            run = run_experiment(offline, progress=False, requests=reqs)[0]
            capacity = run.summary["completed"] / run.summary["duration"]
            record["capacity"][name] = {"capacity_req_s": capacity, "native_req_s": native,
                                        "requests": len(reqs)}  # fmt: skip
            print(f"{name}: capacity {capacity:.2f} req/s, own rate {native:.3f}", flush=True)
            for load in window_loads(self.protocol, name):
                self._load(name, cfg, load, len(reqs), capacity, native)
            for scale in window_rate_scales(self.protocol, name):
                self._scale(name, cfg, scale, len(reqs), capacity, native)

    def _load(self, name: str, cfg, load: float, n: int, capacity: float, native: float) -> None:
        """Window ``name`` at ``load`` x ``capacity`` through every policy, unless it would
        end past the deadline."""
        self._folder(folder_name(name, load), cfg, load, n, capacity, load * capacity / native)

    def _scale(self, name: str, cfg, scale: float, n: int, capacity: float, native: float) -> None:
        """Window ``name`` at its own arrival times scaled by ``scale`` through every policy
        (recorded with its offered load, ``scale`` x own rate / capacity), unless it would end
        past the deadline."""
        folder = scale_folder_name(name, scale)
        offered = scale * native / capacity
        self.record.setdefault("rate_scales", {})[folder] = {"rate_scale": scale,
                                                             "offered_load": offered}  # fmt: skip
        self._folder(folder, cfg, offered, n, capacity, scale)

    def _folder(self, folder: str, cfg, load: float, n: int, capacity: float, scale: float) -> None:
        from sched_lab.report.folder import write_results
        from sched_lab.run.experiment import run_experiment

        est = pass_estimate_s(cfg, n, load, capacity)
        if time.time() + est > self.deadline:
            self.record["skipped"].append(f"{folder} (estimated {est:.0f} s)")
            return
        cfg_l = load_config(cfg, folder, scale)
        runs = run_experiment(cfg_l, progress=False)
        write_results(self.out / "engine" / folder, cfg_l, runs)
        self.record["folders"].append(folder)
        self.record["estimates_s"][folder] = est
        print(f"  {folder} (load {load:.2f}): " + _throughputs(runs), flush=True)
        self.save()


def _throughputs(runs) -> str:
    return ", ".join(f"{r.label} {r.summary['request_throughput']:.2f} req/s" for r in runs)
