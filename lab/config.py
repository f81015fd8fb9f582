"""Experiment YAML: reading, validation with one-line errors, defaults.

Layout (every key optional except ``trace``; see experiments/quickstart.yaml)::

    name: quickstart
    backend: sim                 # sim | engine
    trace: {format: azure2023, path: ..., rate_scale: 2.0 or [1, 2, 3], ...}   # traces/
    model: llama-3.1-8b          # lab/sim/models.py preset (sim)
    hardware: h200-sxm           # lab/sim/hardware.py preset (sim)
    cost_model: {flops_efficiency: 0.7, bandwidth_efficiency: 0.85, step_overhead_s: 0.002,
                 profile: null, replay_steps: []}  # profile: engine profile CSV, and
                 # replay_steps: steps.csv of engine runs to fit with it (lab/sim/calibrated.py)
    kv_cache: {block_size: 16, gpu_memory_utilization: 0.9, num_gpu_blocks: null,
               swap_space_gib: 4, watermark: 0.01}
    scheduler: {max_num_seqs: 256, max_num_batched_tokens: null, max_model_len: null,
                max_preemptions: 1000}
    policies: [fcfs, swap, {name: chunked_prefill, max_num_batched_tokens: 512}]
    slo: {ttft_s: null, tpot_s: null, e2e_s: null}
    engine: {model_path: DIR, device: cpu, dtype: auto, attention_backend: torch,
             temperature: 0.0}   # backend: engine only (backend/README.md)

YAML is read with a ``yaml.SafeLoader`` that also rejects a key given twice in one mapping
(plain YAML keeps the last silently); policies are looked up by registered name.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import yaml

from lab.core.errors import ConfigError
from lab.sim.hardware import HARDWARE
from lab.sim.models import MODELS

DEFAULTS: dict[str, Any] = {
    "name": None,
    "backend": "sim",
    "seed": 0,
    "trace": None,
    "model": "llama-3.1-8b",
    "hardware": "h200-sxm",
    "cost_model": {"flops_efficiency": 0.7, "bandwidth_efficiency": 0.85, "step_overhead_s": 0.002,
                   "profile": None, "replay_steps": []},
    "kv_cache": {"block_size": 16, "gpu_memory_utilization": 0.9, "num_gpu_blocks": None,
                 "swap_space_gib": 4.0, "watermark": 0.01},
    "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": None, "max_model_len": None,
                  "max_preemptions": 1000},
    "policies": ["fcfs", "swap", "chunked_prefill"],
    "slo": {"ttft_s": None, "tpot_s": None, "e2e_s": None},
    "engine": {"model_path": None, "device": "cpu", "dtype": "auto", "attention_backend": "torch",
               "temperature": 0.0},
    "check_invariants": False,
}
SCHEDULER_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")


def _fail(where: str, key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{where}: {key}: expected {expected}, got {value!r}")


def _int(where, key, v, lo=1, optional=False):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _fail(where, key, f"an integer >= {lo}" + (" or null" if optional else ""), v)
    return v


def _num(where, key, v, lo=0.0, hi=math.inf, lo_open=False, optional=False):
    if v is None and optional:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        if math.isinf(hi):
            rng = f"a finite number {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"a number in {'(' if lo_open else '['}{lo}, {hi}]"
        raise _fail(where, key, rng + (" or null" if optional else ""), v)
    return float(v)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+ -]*")  # it names runs in tables and plots
MAX_SWAP_SPACE_GIB = 4096.0  # host memory for swapped-out KV blocks (4 TiB: beyond any host)
MAX_STEP_OVERHEAD_S = 60.0  # a fixed cost per step; a minute is already far beyond any engine


def check_name(where: str, key: str, name) -> str:
    """An experiment name: it becomes a folder under results/, so letters, digits, '.', '_'
    and '-' only, starting with a letter or digit (no '', '.', '..' or paths)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise _fail(where, key, "a name of letters, digits, '.', '_' and '-' starting with a "
                    "letter or digit (it names the results folder)", name)
    return name


def _choice(where, key, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise _fail(where, key, "one of " + ", ".join(sorted(choices)), v)
    return v


def _mapping(where, key, v, allowed) -> dict:
    if not isinstance(v, dict):
        raise _fail(where, key, "a mapping", v)
    for k in v:
        if k not in allowed:
            raise ConfigError(f"{where}: unknown key {key}.{k}; allowed: {', '.join(allowed)}")
    return v


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with a repeated key (a likely typo: the
    first value would be dropped without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value, not a list or mapping",
                    key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """Parse YAML safely, refusing repeated keys (see :class:`UniqueKeyLoader`)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and validate an experiment YAML; returns the config with defaults filled in.

    Raises:
        ConfigError: missing file, bad YAML, unknown key, wrong type (naming the key path).
    """
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO would block
        raise ConfigError(f"{path}: not a regular file, expected an experiment YAML file")
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected an experiment YAML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be an experiment YAML") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{line} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    cfg = validate(raw, str(path))
    if cfg["name"] is None:
        cfg["name"] = check_name(str(path), "name (from the file name)", path.stem)
    return cfg


def validate(raw: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """Validate a config mapping and fill in defaults (see the module docstring)."""
    for k in raw:
        if k not in DEFAULTS:
            raise ConfigError(f"{where}: unknown key {k}; allowed: {', '.join(DEFAULTS)}")
    cfg = copy.deepcopy(DEFAULTS)
    for k, v in raw.items():
        if isinstance(DEFAULTS[k], dict):
            cfg[k].update(_mapping(where, k, v, DEFAULTS[k]))
        else:
            cfg[k] = v
    if cfg["name"] is not None:
        check_name(where, "name", cfg["name"])
    _choice(where, "backend", cfg["backend"], {"sim", "engine"})
    _int(where, "seed", cfg["seed"], lo=0)
    if not isinstance(cfg["trace"], dict):
        raise _fail(where, "trace", "a mapping with at least 'format'", cfg["trace"])
    rs = cfg["trace"].get("rate_scale", 1.0)
    if rs == []:
        raise _fail(where, "trace.rate_scale", "a number > 0 or a non-empty list of them", rs)
    for v in rs if isinstance(rs, list) else [rs]:
        _num(where, "trace.rate_scale", v, lo=0.0, lo_open=True)
    names = [scale_label(v) for v in (rs if isinstance(rs, list) else [rs])]
    if len(set(names)) != len(names):
        raise _fail(where, "trace.rate_scale", "distinct values (to 6 significant digits: "
                    "they name the runs, as 'fcfs@x2')", rs)
    if cfg["backend"] == "sim":
        _choice(where, "model", cfg["model"], MODELS)
        _choice(where, "hardware", cfg["hardware"], HARDWARE)
    cm = cfg["cost_model"]
    _num(where, "cost_model.flops_efficiency", cm["flops_efficiency"], 0.0, 1.0, lo_open=True)
    _num(where, "cost_model.bandwidth_efficiency", cm["bandwidth_efficiency"], 0.0, 1.0, lo_open=True)
    _num(where, "cost_model.step_overhead_s", cm["step_overhead_s"], 0.0, MAX_STEP_OVERHEAD_S)
    if cm["profile"] is not None and not isinstance(cm["profile"], str):
        raise _fail(where, "cost_model.profile", "a path to an engine profile CSV", cm["profile"])
    if not isinstance(cm["replay_steps"], list) or not all(
            isinstance(p, str) for p in cm["replay_steps"]):
        raise _fail(where, "cost_model.replay_steps", "a list of steps.csv paths",
                    cm["replay_steps"])
    if cm["replay_steps"] and cm["profile"] is None:
        raise ConfigError(f"{where}: cost_model.replay_steps needs cost_model.profile")
    kv = cfg["kv_cache"]
    _int(where, "kv_cache.block_size", kv["block_size"])
    _num(where, "kv_cache.gpu_memory_utilization", kv["gpu_memory_utilization"], 0.0, 1.0, lo_open=True)
    _int(where, "kv_cache.num_gpu_blocks", kv["num_gpu_blocks"], optional=True)
    _num(where, "kv_cache.swap_space_gib", kv["swap_space_gib"], 0.0, MAX_SWAP_SPACE_GIB)
    _num(where, "kv_cache.watermark", kv["watermark"], 0.0, 0.5)
    _int(where, "scheduler.max_num_seqs", cfg["scheduler"]["max_num_seqs"])
    _check_limits(where, "scheduler", cfg["scheduler"])
    _int(where, "scheduler.max_preemptions", cfg["scheduler"]["max_preemptions"])
    pols = cfg["policies"]
    if not isinstance(pols, list) or not pols:
        raise _fail(where, "policies", "a non-empty list of policy names or mappings", pols)
    from policies import get_policy

    resolved = []
    for i, p in enumerate(pols):
        key = f"policies[{i}]"
        if isinstance(p, str):
            p = {"name": p}
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            raise _fail(where, key, "a policy name or a mapping with 'name'", p)
        try:
            cls = get_policy(p["name"])
        except ConfigError as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
        allowed = ("name", "label", *SCHEDULER_KEYS, *cls.options)
        _mapping(where, key, p, allowed)
        _check_limits(where, key, p)
        if "label" in p and (not isinstance(p["label"], str) or not _LABEL.fullmatch(p["label"])):
            raise _fail(where, f"{key}.label", "a label of letters, digits, '.', '_', '-', '+' "
                        "and spaces, starting with a letter or digit", p["label"])
        resolved.append({"label": p.get("label", p["name"]), **p})
    labels = [p["label"] for p in resolved]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{where}: policies: labels must be unique (give 'label:'), got {labels}")
    cfg["policies"] = resolved
    for k in ("ttft_s", "tpot_s", "e2e_s"):
        _num(where, f"slo.{k}", cfg["slo"][k], 0.0, lo_open=True, optional=True)
    if cfg["backend"] == "engine":
        eng = cfg["engine"]
        if not isinstance(eng["model_path"], str):
            raise _fail(where, "engine.model_path", "a model directory (config.json + safetensors)",
                        eng["model_path"])
        if not isinstance(eng["device"], str) or not _DEVICE.fullmatch(eng["device"]):
            raise _fail(where, "engine.device", "cpu, cuda or cuda:N", eng["device"])
        _choice(where, "engine.dtype", eng["dtype"],
                {"auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"})
        _choice(where, "engine.attention_backend", eng["attention_backend"],
                {"torch", "triton", "flash_attn"})
        _num(where, "engine.temperature", eng["temperature"], 0.0)
    if not isinstance(cfg["check_invariants"], bool):
        raise _fail(where, "check_invariants", "true or false", cfg["check_invariants"])
    return cfg


def _check_limits(where: str, key: str, d: dict) -> None:
    _int(where, f"{key}.max_num_seqs", d.get("max_num_seqs"), optional=True)
    _int(where, f"{key}.max_num_batched_tokens", d.get("max_num_batched_tokens"), optional=True)
    _int(where, f"{key}.max_model_len", d.get("max_model_len"), optional=True)


def scale_label(scale: float) -> str:
    """How a rate_scale names its runs when there are several: ``{label}@x{scale_label}``."""
    return f"{scale:g}"


def rate_scales(cfg: dict[str, Any]) -> list[float]:
    rs = cfg["trace"].get("rate_scale", 1.0)
    return [float(v) for v in rs] if isinstance(rs, list) else [float(rs)]
