"""The fidelity protocol: one YAML of trace windows, loads (fractions of each window's
measured engine capacity, all requests at t = 0) and/or rate scales (the window's own
arrival times, scaled), engine experiment and time limits; each (window, load) or (window,
rate scale) is one results folder (:func:`folder_name`, :func:`scale_folder_name`)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sched_lab.core.errors import short_repr

if TYPE_CHECKING:
    from sched_lab.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "benchmarks" / "fidelity_heldout.yaml"
ARCHIVE = ROOT / "docs" / "fidelity" / "heldout_engine.tar.gz"
DOC = ROOT / "docs" / "fidelity.md"  # the sim side's default --doc (in a source checkout)

PROTOCOL_KEYS = ("checkpoint", "profile_args", "calibration", "loads", "rate_scales", "slices",
                 "time_limits_s", "experiment")  # fmt: skip


class _Fail:
    """One-line ``error: PATH: KEY: expected ...`` exits for one protocol file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, key: str, expected: str, got: Any = None) -> SystemExit:
        shown = "" if got is None else f", got {short_repr(got, 60)}"
        return SystemExit(f"error: {self.path}: {key}: expected {expected}{shown}")


def load_protocol(path: Path) -> dict[str, Any]:
    """A protocol YAML, its shape checked before any GPU work.

    Raises:
        SystemExit: ``error: PATH: KEY: expected ...`` (one line) for an unreadable file, an
            unknown or missing key, or a bad value.
    """
    fail = _Fail(path)
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
    for key in ("checkpoint", "slices", "experiment", "time_limits_s"):
        if key not in p:
            raise SystemExit(f"error: {path}: missing key {key!r}")
    _check_checkpoint(p["checkpoint"], fail)
    _check_limits_and_loads(p, fail)
    _check_slices_and_experiment(p, fail)
    if p.get("calibration") is not None:
        _check_calibration(p["calibration"], fail)
    return p


def _check_checkpoint(ck: Any, fail: _Fail) -> None:
    if not isinstance(ck, dict) or not isinstance(ck.get("dir"), str) or not ck["dir"].strip():
        raise fail("checkpoint", "a mapping with dir: a folder path (and preset or config)", ck)
    if not isinstance(ck.get("config"), dict):
        from sched_lab.core.model_presets import PRESETS

        if ck.get("preset") not in PRESETS:
            raise fail("checkpoint.preset", f"one of {', '.join(PRESETS)} (or a config:)",
                       ck.get("preset"))  # fmt: skip
    if (ROOT / ck["dir"]).exists() and not (ROOT / ck["dir"]).is_dir():
        raise fail("checkpoint.dir", "a folder (it names a file)", ck["dir"])


def _check_limits_and_loads(p: dict[str, Any], fail: _Fail) -> None:
    limits = p["time_limits_s"]
    want = {"profile", "total"} | ({"calibration"} if p.get("calibration") is not None else set())
    if not isinstance(limits, dict) or set(limits) != want:
        raise fail("time_limits_s", f"a mapping with keys {', '.join(sorted(want))}", limits)
    for k, v in limits.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise fail(f"time_limits_s.{k}", "seconds > 0", v)
    if "loads" in p:
        _check_numbers(p["loads"], "loads", "fractions of capacity", fail)
    if "rate_scales" in p:
        _check_numbers(p["rate_scales"], "rate_scales", "multiples of each window's own "
                       "arrival rate", fail)  # fmt: skip


def _check_numbers(values: Any, key: str, meaning: str, fail: _Fail) -> None:
    if (
        not isinstance(values, list)
        or not values
        or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in values)
        or len(set(values)) != len(values)
    ):
        raise fail(key, f"a list of distinct numbers > 0 ({meaning})", values)


def _check_slices_and_experiment(p: dict[str, Any], fail: _Fail) -> None:
    if not isinstance(p["slices"], dict) or not p["slices"]:
        raise fail("slices", "a mapping of window names to trace specs", p["slices"])
    for name, spec in p["slices"].items():
        if not isinstance(spec, dict) or not spec.get("path"):
            raise fail(f"slices.{name}", "a trace spec read from a file (path:)", spec)
        if "rate_scales" in spec:
            _check_numbers(spec["rate_scales"], f"slices.{name}.rate_scales",
                           "multiples of the window's own arrival rate", fail)  # fmt: skip
        if not window_loads(p, name) and not window_rate_scales(p, name):
            raise fail(f"slices.{name}", "loads or rate_scales (this window or the protocol's)")
    exp = p["experiment"]
    if not isinstance(exp, dict) or exp.get("backend") != "engine":
        raise fail("experiment", "an experiment config with backend: engine", exp)
    for key in ("engine", "scheduler", "kv_cache"):
        if not isinstance(exp.get(key, {}), dict):
            raise fail(f"experiment.{key}", "a mapping", exp[key])


def _check_calibration(cal: Any, fail: _Fail) -> None:
    if not isinstance(cal, dict) or set(cal) - {"policies", "workloads"}:
        raise fail("calibration", "a mapping with workloads (and policies)", cal)
    if not isinstance(cal.get("workloads"), dict) or not cal["workloads"]:
        raise fail("calibration.workloads", "a mapping of names to synthetic traces")
    for name, spec in cal["workloads"].items():
        if not isinstance(spec, dict) or spec.get("format") != "synthetic":
            raise SystemExit(
                f"error: {fail.path}: calibration.workloads.{name}: expected a synthetic trace "
                "(format: synthetic): calibration never replays trace rows"
            )


def folder_name(slice_name: str, load: float) -> str:
    """The results folder of window ``slice_name`` at ``load``: ``WINDOW_LOAD``."""
    return f"{slice_name}_{load:g}"


def scale_folder_name(slice_name: str, rate_scale: float) -> str:
    """The results folder of window ``slice_name`` replayed at its own arrival times scaled
    by ``rate_scale``: ``WINDOW_xSCALE``."""
    return f"{slice_name}_x{rate_scale:g}"


def window_loads(protocol: dict[str, Any], name: str) -> list[float]:
    """Window ``name``'s loads (fractions of its capacity, all requests at t = 0): the
    protocol's ``loads``, or none."""
    return list(protocol.get("loads") or [])


def window_rate_scales(protocol: dict[str, Any], name: str) -> list[float]:
    """Window ``name``'s rate scales (its own arrival times, scaled): ``slices.NAME.rate_scales``
    if given, else the protocol's ``rate_scales``, or none."""
    spec = protocol["slices"][name]
    return list(spec.get("rate_scales", protocol.get("rate_scales")) or [])


def calibration_config(protocol: dict[str, Any], name: str) -> dict[str, Any]:
    """The raw experiment config of calibration workload ``name`` (through
    ``calibration.policies`` when given); always synchronous, so its steps.csv durations
    are host + device step times."""
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
    trace = {k: v for k, v in protocol["slices"][name].items() if k != "rate_scales"}
    return {**raw, "name": name, "trace": trace}


def check_runs(protocol: dict[str, Any], path: Path) -> None:
    """Validate every config the engine side will run before the profile; SystemExit (one
    line naming the protocol key)."""
    from sched_lab.config import validate
    from sched_lab.core.errors import UserError
    from sched_lab.traces import load_trace

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


def profile_geometry(exp: dict[str, Any]) -> list[str]:
    """``sched_lab.backend.profile`` arguments that give the profiled runner the engine runs' shape
    (max_model_len, max_num_seqs, num_gpu_blocks)."""
    sch, kv = exp.get("scheduler", {}), exp.get("kv_cache", {})
    args = []
    for flag, value in (("--max-model-len", sch.get("max_model_len")),
                        ("--max-num-seqs", sch.get("max_num_seqs")),
                        ("--num-gpu-blocks", kv.get("num_gpu_blocks"))):  # fmt: skip
        if value is not None:
            args += [flag, str(value)]
    return args


def capacity_run(cfg: ExperimentConfig) -> tuple[list, float, ExperimentConfig]:
    """A window's capacity run (its replayed requests all at t = 0, through fcfs), and its
    own rate (req/s over its span)."""
    from sched_lab.traces import load_trace

    reqs = [r for r in load_trace(cfg.trace.spec, ROOT) if r.status.value != "dropped"]
    native = (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s)
    for r in reqs:
        r.arrival_s = 0.0
    offline = dataclasses.replace(cfg, policies=tuple(p for p in cfg.policies if p.name == "fcfs"))
    return reqs, native, offline


def pass_estimate_s(
    cfg: ExperimentConfig, num_requests: int, load: float, capacity: float
) -> float:
    """Estimated seconds of a (window, load) folder in a pass, all policies (a rate-scale
    folder: ``load`` = its offered rate over ``capacity``)."""
    return 1.15 * len(cfg.policies) * num_requests / (min(load, 1.0) * capacity) + 3


def load_config(cfg: ExperimentConfig, folder: str, rate_scale: float) -> ExperimentConfig:
    """A window's config replayed at ``rate_scale`` x its own rate, named ``folder``."""
    return dataclasses.replace(cfg.with_trace(rate_scale=rate_scale), name=folder)


def engine_config(raw: dict[str, Any]) -> ExperimentConfig:
    """A results folder's config.yaml as an ExperimentConfig, paths resolved in this
    checkout."""
    from sched_lab.config import validate

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
