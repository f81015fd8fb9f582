"""The whole experiment: :class:`ExperimentConfig`, and :func:`load_config` /
:func:`validate`, which walk each section once, then apply the cross-feature rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sched_lab.config import paths
from sched_lab.config.backends import BACKENDS
from sched_lab.config.cluster import cluster_to_dict, parse_cluster
from sched_lab.config.policy_entries import (
    DEFAULT_POLICIES,
    PolicyConfig,
    parse_policies,
    parse_speculative,
)
from sched_lab.config.rules import Draft, apply_rules, hash_blocks_hold_kv_blocks
from sched_lab.config.sections import (
    CostModelConfig,
    EngineConfig,
    KVCacheConfig,
    LoRAConfig,
    ReportConfig,
    SchedulerConfig,
    SLOConfig,
    parse_cost_model,
    parse_engine,
    parse_kv_cache,
    parse_lora,
    parse_report,
    parse_scheduler,
    parse_slo,
)
from sched_lab.config.trace import NAME, Workload, parse_workload, scale_label, with_keys
from sched_lab.config.walker import (
    Context,
    check_bool,
    check_choice,
    check_int,
    check_mapping,
    fail,
)
from sched_lab.core.errors import ConfigError
from sched_lab.core.spec import SpeculativeConfig
from sched_lab.sim.analytic_defaults import GUESS
from sched_lab.sim.analytic_defaults import defaults as analytic_defaults
from sched_lab.sim.cluster import ClusterSpec
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS
from sched_lab.traces.readers import load_yaml_file

MAX_NAME_CHARS = 128  # a folder name: file systems allow 255 bytes, the temporary name adds 14
TOP_KEYS = (
    "name",
    "backend",
    "seed",
    "seeds",
    "trace",
    "model",
    "hardware",
    "cost_model",
    "kv_cache",
    "scheduler",
    "policies",
    "slo",
    "engine",
    "check_invariants",
    "trace_file",
    "cluster",
    "report",
    "speculative",
    "lora",
    "quantization",
)
#: top-level keys that make a YAML a sweep (lab/sweeps/sweep.py), not one experiment
SWEEP_KEYS = ("sweep", "search")
#: weight quantization (vLLM's --quantization), read by both backends (lab/sim/models.py,
#: backend/quant_formats.py)
QUANTIZATION_METHODS = ("fp8", "int8", "awq", "gptq")


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one workload, replayed through every policy at every rate_scale.
    ``source`` prefixes messages and ``base_dir`` resolved relative paths; neither is in
    :meth:`to_dict`."""

    name: str
    trace: Workload
    backend: str = "sim"
    seed: int = 0
    seeds: int | None = None  # seeded replicas per run with step-time noise; None: deterministic
    model: str = "llama-3.1-8b"
    hardware: str = "h200-sxm"
    cost_model: CostModelConfig = CostModelConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    policies: tuple[PolicyConfig, ...] = ()
    slo: SLOConfig = SLOConfig()
    engine: EngineConfig = EngineConfig()
    check_invariants: bool = False
    cluster: ClusterSpec | None = None  # None: one replica (lab/sim/cluster.py)
    report: ReportConfig = ReportConfig()
    speculative: SpeculativeConfig | None = None  # shared by every policy; None = off
    lora: LoRAConfig | None = None  # multi-LoRA serving (docs/lora.md); None = no adapters
    # null: unquantized weights (the engine: unless the checkpoint's quantization_config says)
    quantization: str | None = None
    source: str = field(default="config", compare=False)
    base_dir: Path = field(default=Path("."), compare=False)

    @property
    def rate_scales(self) -> tuple[float, ...]:
        return self.trace.rate_scales

    @property
    def profile_num_batched_tokens(self) -> int:
        """The largest step KV sizing reserves activations for: max_num_batched_tokens, or
        the backend's ``profile_tokens`` when it is null."""
        default = BACKENDS[self.backend].profile_tokens
        return self.scheduler.max_num_batched_tokens or default

    def run_label(self, policy: PolicyConfig, rate_scale: float) -> str:
        """A run's name: the policy's label, with ``@x{scale}`` when there are several loads."""
        if len(self.rate_scales) == 1:
            return policy.label
        return f"{policy.label}@x{scale_label(rate_scale)}"

    def with_trace(self, **keys: Any) -> ExperimentConfig:
        """A copy with trace keys replaced (``limit=100``, ``path=``), validated as in a
        YAML file; a new ``path`` or ``format`` drops ``trace_file``; with classes every
        class gets the keys and ``limit`` is shared."""
        ctx = Context(self.source, self.base_dir, BACKENDS[self.backend].reads)
        cfg = dataclasses.replace(self, trace=with_keys(ctx, self.trace, keys))
        hash_blocks_hold_kv_blocks(cfg, {})
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, as results/<name>/config.yaml holds it (plain types)."""

        def plain(section) -> dict[str, Any]:
            d = dataclasses.asdict(section)
            return {k: _plain(v) for k, v in d.items()}

        out = {
            "name": self.name,
            "backend": self.backend,
            "seed": self.seed,
            **({"seeds": self.seeds} if self.seeds is not None else {}),
            "trace": self.trace.to_dict(),
            "model": self.model,
            "hardware": self.hardware,
            "cost_model": plain(self.cost_model),
            "kv_cache": plain(self.kv_cache),
            "scheduler": plain(self.scheduler),
            "policies": [p.to_dict() for p in self.policies],
            "slo": self.slo.to_dict(),
            "engine": plain(self.engine),
            "check_invariants": self.check_invariants,
            "report": plain(self.report),
        }
        if self.cluster is not None:
            out["cluster"] = cluster_to_dict(self.cluster)
        if self.speculative is not None:  # absent when off: older dumps stay as they were
            out["speculative"] = self.speculative.to_dict()
        if self.lora is not None:  # absent when off: older dumps stay as they were
            out["lora"] = plain(self.lora)
        if self.quantization is not None:  # absent when off, as speculative
            out["quantization"] = self.quantization
        if self.trace.expected is not None:
            out["trace_file"] = dict(self.trace.expected)
        return out


def _plain(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate an experiment YAML; ``path`` and its relative paths resolve as
    :mod:`sched_lab.config.paths` says; ``name`` defaults to the file name.

    Raises:
        ConfigError: missing file, bad YAML, unknown key, wrong type, a missing file named
            in it (naming the key path and the value as written).
    """
    path = Path(path).expanduser()
    if not path.exists():
        bundled = paths.resolve(path, Path.cwd())
        path = bundled if bundled.is_file() else path
    raw = load_yaml_file(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level")
    name = raw.get("name")
    if name is None:
        name = check_name(str(path), "name (from the file name)", path.stem)
    return validate({**raw, "name": name}, str(path), path.absolute().parent)


def validate(
    raw: Mapping[str, Any], where: str = "config", base_dir: Path | None = None
) -> ExperimentConfig:
    """Validate a config mapping into an :class:`ExperimentConfig`: every section in key
    order, then :data:`sched_lab.config.rules.RULES`. ``where`` prefixes every message;
    ``base_dir`` (default: the current folder) resolves relative paths; ``name`` defaults
    to "experiment".

    Raises:
        ConfigError: one line naming ``where``, the key path and what was expected.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys at the top level")
    sweep = next((k for k in raw if k in SWEEP_KEYS), None)
    if sweep is not None:
        raise ConfigError(
            f"{where}: {sweep}: a sweep, not one experiment (sched-lab run takes either)"
        )
    # the message lists sweep and search too: valid keys of a file, that make it a sweep
    check_mapping(where, "", raw, (*TOP_KEYS, *SWEEP_KEYS))
    top = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}
    top.update(raw)
    name = check_name(where, "name", raw["name"] if raw.get("name") is not None else "experiment")
    backend = check_choice(where, "backend", top["backend"], BACKENDS)
    reads = BACKENDS[backend].reads
    ctx = Context(where, Path(base_dir if base_dir is not None else ".").absolute(), reads)
    seed = check_int(where, "seed", top["seed"], lo=0)
    seeds = check_seeds(where, backend, top["seeds"])
    trace = parse_workload(ctx, raw)
    if "model" in reads:
        check_choice(where, "model", top["model"], MODELS)
    if "hardware" in reads:
        check_choice(where, "hardware", top["hardware"], HARDWARE)
    check_bool(where, "check_invariants", top["check_invariants"])
    quantization = top.get("quantization")
    if quantization is not None:
        check_choice(where, "quantization", quantization, QUANTIZATION_METHODS)
    scheduler = parse_scheduler(ctx, raw.get("scheduler", {}))
    spec = parse_speculative(ctx, "speculative", raw.get("speculative"))
    apply_rules(Draft(where, backend), raw)  # the early rules
    cluster = None
    if raw.get("cluster") is not None and "cluster" in reads:
        cluster = parse_cluster(ctx, raw["cluster"])
    pols = parse_policies(
        ctx,
        raw.get("policies", list(DEFAULT_POLICIES)),
        trace.tenants,
        spec,
        tuple(raw["speculative"]) if spec is not None else (),
    )
    named = isinstance(top["model"], str) and isinstance(top["hardware"], str)
    fitted = analytic_defaults(top["model"], top["hardware"]) if named else GUESS
    shape = f"{top['model']} on {top['hardware']}"
    cost_model = parse_cost_model(ctx, raw.get("cost_model", {}), fitted, shape)
    engine = parse_engine(ctx, raw.get("engine", {}))
    cfg = ExperimentConfig(
        name=name,
        trace=trace,
        backend=backend,
        seed=seed,
        seeds=seeds,
        model=top["model"],
        hardware=top["hardware"],
        cost_model=cost_model,
        kv_cache=parse_kv_cache(ctx, raw.get("kv_cache", {})),
        scheduler=scheduler,
        policies=pols,
        slo=parse_slo(ctx, raw.get("slo", {})),
        engine=engine,
        check_invariants=top["check_invariants"],
        cluster=cluster,
        report=parse_report(ctx, raw.get("report", {})),
        speculative=spec,
        lora=parse_lora(ctx, raw.get("lora")),
        quantization=quantization,
        source=where,
        base_dir=ctx.base_dir,
    )
    apply_rules(cfg, raw)
    return cfg


MAX_SEEDS = 1000  # replicas per run: each is a whole replay


def check_seeds(where: str, backend: str, v: Any) -> int | None:
    """``seeds``: None, or a number of seeded replicas in [1, MAX_SEEDS] on a backend whose
    step times are simulated (a measured step has its own noise)."""
    seeds = check_int(where, "seeds", v, optional=True, hi=MAX_SEEDS)
    if seeds is not None and not BACKENDS[backend].simulated_steps:
        raise ConfigError(
            f"{where}: seeds: backend {backend} measures its step times; seeded replicas "
            "with step-time noise are the simulator's (backend: sim), or remove seeds"
        )
    return seeds


def check_seeds_flag(where: str, raw: Any, seeds: int) -> None:
    """``--seeds`` checked against a YAML's ``backend`` (its mapping ``raw`` as read) before
    the rest of the file is validated, so an engine experiment refuses it in one line first,
    not once its model directory exists. A ``raw`` that is not a mapping, or a backend that
    is no known name, is left to :func:`validate` to refuse."""
    backend = raw.get("backend", "sim") if isinstance(raw, Mapping) else None
    if isinstance(backend, str) and backend in BACKENDS:
        check_seeds(f"{where} (--seeds)", backend, seeds)


def with_seeds(cfg: ExperimentConfig, seeds: int) -> ExperimentConfig:
    """A copy with ``seeds`` set (``--seeds``), checked as in a YAML file."""
    out = dataclasses.replace(cfg, seeds=check_seeds(f"{cfg.source} (--seeds)", cfg.backend, seeds))
    apply_rules(out, {})
    return out


def check_name(where: str, key: str, name: Any) -> str:
    """An experiment name (a folder under results/): letters, digits, '.', '_' and '-',
    starting with a letter or digit."""
    if (
        not isinstance(name, str)
        or not NAME.fullmatch(name)
        or name in (".", "..")
        or len(name) > MAX_NAME_CHARS
    ):
        raise fail(
            where,
            key,
            f"a name of at most {MAX_NAME_CHARS} letters, digits, '.', '_' and '-' starting "
            "with a letter or digit (it names the results folder)",
            name,
        )
    return name
