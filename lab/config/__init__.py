"""Experiment YAML: a typed, frozen config with every default in one place.

Layout (every key optional except ``trace``; see experiments/quickstart.yaml)::

    name: quickstart             # default: the file name; it names results/<name>
    backend: sim                 # sim | engine
    seed: 0
    trace: {format: azure2023, path: ..., rate_scale: 2.0 or [1, 2, 3], ...}   # traces/
    # or a list of workload classes (traces/classes.py), each a trace spec of its own plus
    # name, priority, tenant and slo: [{name: chat, priority: 0, tenant: t1,
    #   slo: {ttft_s: 1.0}, format: azure2023, path: ..., rate_scale: 1.0}, {name: batch, ...}]
    model: llama-3.1-8b          # lab/sim/models.py preset (sim)
    hardware: h200-sxm           # lab/sim/hardware.py preset (sim)
    cost_model: {flops_efficiency: 0.7, bandwidth_efficiency: 0.85, step_overhead_s: 0.002,
                 # (left out: fitted to the shipped profiles of the hardware, else these
                 # datasheet guesses; lab/sim/analytic_defaults.py)
                 host_overhead_s: 0, host_per_seq_s: 0,  # the host part (async scheduling)
                 profile: null, replay_steps: [], tensor_parallel_size: 1}  # profile: engine
                 # profile CSV, and replay_steps: steps.csv of engine runs to fit with it
                 # (lab/sim/calibrated.py); tensor_parallel_size: GPUs per simulated replica;
                 # or {durations_from: RUN/steps.csv}: the engine run's measured step times
                 # in order (lab/sim/replayed.py). The simulator's: backend: engine refuses
                 # host_*, durations_from, another TP size, and warns about the rest
    kv_cache: {block_size: 16, gpu_memory_utilization: 0.9, num_gpu_blocks: null,
               swap_space_gib: 4, watermark: 0.01, enable_prefix_caching: false}
    scheduler: {max_num_seqs: 256, max_num_batched_tokens: null, max_model_len: null,
                max_preemptions: 1000, preemption_victim: null, async_scheduling: false}
    policies: [fcfs, swap, {name: chunked_prefill, max_num_batched_tokens: 512},
               {name: priority, priority_preemption: true, preemption_victim: most_blocks}]
    slo: {ttft_s: null, tpot_s: null, e2e_s: null}
    engine: {model_path: DIR, device: cpu, dtype: auto, attention_backend: torch,
             temperature: 0.0, cuda_graphs: null, mixed_graphs: true, kn_weights: false,
             num_threads: null, tensor_parallel_size: 1, prefill_attention: auto}
             # backend: engine only (backend/README.md)
    check_invariants: false
    speculative: {method: ngram, num_speculative_tokens: 3, prompt_lookup_min: 1,
                  prompt_lookup_max: 4}   # or draft (model: DIR) or synthetic
                  # (acceptance_rates: [p1..pk]); lab/core/spec.py. A policy entry's own
                  # speculative: replaces it (null: off for that policy); default: off
    cluster: {replicas: 4, router: least_kv}      # simulator only (lab/sim/cluster.py); or
             # {prefill: {replicas: 2, router: ...}, decode: {replicas: 2}, kv_transfer: ib-ndr}
    trace_file: {path: ..., sha256: ..., rows: ...}   # written into results' config.yaml;
             # when given, the trace file must still be that file

Load a file with :func:`load_config` (YAML rules: :mod:`traces.readers`; path rules:
:mod:`lab.config.paths`), or a mapping built in code with :func:`validate`. Read values as
attributes: ``cfg.kv_cache.block_size``, ``cfg.policies[0].label``, ``cfg.rate_scales``.
:meth:`ExperimentConfig.to_dict` gives the resolved config (the layout above, paths
absolute) that results/<name>/config.yaml holds. Every mistake raises
:class:`~lab.core.errors.ConfigError` with one line naming the file and the key path.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import policies
from lab.config import paths
from lab.core.errors import ConfigError, short_repr
from lab.core.scheduler import VICTIM_RULES
from lab.core.spec import SpeculativeConfig
from lab.sim.analytic_defaults import GUESS
from lab.sim.analytic_defaults import defaults as analytic_defaults
from lab.sim.cluster import ClusterSpec, PoolSpec
from lab.sim.hardware import HARDWARE, LINKS, Link
from lab.sim.models import MODELS
from policies import get_policy
from traces.classes import CLASS_KEYS
from traces.readers import load_yaml_file

log = logging.getLogger("lab.config")

GIB = 1 << 30
MAX_SWAP_SPACE_GIB = 4096.0  # host memory for swapped-out KV blocks (4 TiB: beyond any host)
MAX_STEP_OVERHEAD_S = 60.0  # a fixed cost per step; a minute is already far beyond any engine
# Below this a roofline efficiency means step times a million times the hardware's: no
# real engine, and 5e-324 gives infinite ones.
MIN_EFFICIENCY = 1e-6
MAX_HOST_PER_SEQ_S = 1.0  # host seconds per sequence of a step; real engines take microseconds
# Outside this, arrival times lose float precision (an hour-long trace at 1e-12 spans
# 3.6e15 s, where doubles are 0.5 s apart) or the trace collapses into one instant.
RATE_SCALE_RANGE = (1e-6, 1e6)
# The step size the KV sizing reserves activation memory for when
# scheduler.max_num_batched_tokens is null: vLLM's chunked-prefill budget in the
# simulator; on the engine, the tokens of its warm-up forward (which measures the
# activation peak) and the cut of its token-count CUDA graphs (backend/runner.py).
SIM_PROFILE_TOKENS, ENGINE_PROFILE_TOKENS = 2048, 8192

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+ -]*")  # it names runs in tables and plots
_SHA256 = re.compile(r"[0-9a-f]{64}")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
from lab.core.attention_names import ATTENTION_BACKENDS  # noqa: E402
LIMIT_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")  # a policy's own
VICTIM_KEY = "preemption_victim"  # every policy's option (lab/core/scheduler.py VICTIM_RULES)
ASYNC_KEY = "async_scheduling"  # every policy's option (lab/core/scheduler.py module doc)


# ---------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class TraceConfig:
    """The ``trace:`` block. ``spec`` is handed to :mod:`traces` as it is (traces/spec.py
    validates it when the trace is loaded), with its paths made absolute.

    Args:
        spec: the block as written, paths absolute (``rate_scale`` included).
        rate_scales: the offered-load multipliers, one run per policy each (>= 1 entry).
        expected: ``trace_file`` of a results' config.yaml (path, sha256, rows), or None.
    """

    spec: Mapping[str, Any]
    rate_scales: tuple[float, ...] = (1.0,)
    expected: Mapping[str, Any] | None = None
    classes: tuple[Mapping[str, Any], ...] = ()  # workload classes (traces/classes.py)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants the workload classes name (empty for a single trace)."""
        return frozenset(c.get("tenant", "") for c in self.classes) - {""}

    @property
    def format(self) -> str | None:
        return self.spec.get("format")

    @property
    def path(self) -> Path | None:
        """The trace file (absolute), or None for generated traces."""
        p = self.spec.get("path")
        return Path(p) if isinstance(p, str) else None

    def to_dict(self) -> dict[str, Any] | list[dict[str, Any]]:
        if self.classes:
            return [copy.deepcopy(dict(c)) for c in self.classes]
        return copy.deepcopy(dict(self.spec))


@dataclass(frozen=True)
class KVCacheConfig:
    """Paged KV cache: blocks of ``block_size`` tokens on the GPU, swap space on the host."""

    block_size: int = 16  # tokens per block (vLLM's default)
    gpu_memory_utilization: float = 0.9  # share of device memory for weights + activations + KV
    num_gpu_blocks: int | None = None  # fixed GPU blocks; null: sized by the utilization
    swap_space_gib: float = 4.0  # host swap space (vLLM's default)
    watermark: float = 0.01  # share of GPU blocks kept free at admission
    # Automatic prefix caching (lab/core/kv.py PrefixCachingBlockManager). Off by default:
    # results of existing experiments stay as they were, and most trace formats carry no
    # prefix identity (hash ids or token ids) to key blocks by.
    enable_prefix_caching: bool = False

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space_gib * GIB)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits shared by every policy (a policy entry may override the first three); null
    limits are resolved as vLLM does once the KV capacity is known
    (:func:`lab.run.experiment.resolve_limits`)."""

    max_num_seqs: int = 256  # running requests per step
    max_num_batched_tokens: int | None = None  # token budget per step
    max_model_len: int | None = None  # prompt + output tokens of one request
    max_preemptions: int = 1000  # of one request, before the run stops as stuck
    # Which running request a policy preempts when KV blocks are short (VICTIM_RULES of
    # lab/core/scheduler.py); null: each policy's own rule (newest for most). A policy
    # entry's own ``preemption_victim`` wins.
    preemption_victim: str | None = None
    # Plan step N+1 while step N runs (vLLM V1's async scheduler; semantics in
    # lab/core/scheduler.py). A policy entry's own ``async_scheduling`` wins.
    async_scheduling: bool = False


@dataclass(frozen=True)
class PolicyConfig:
    """One entry of ``policies:``: a registered policy, its label, its own limits (None:
    the ``scheduler`` section's), its options (``options`` of the policy class) and its own
    ``enable_prefix_caching`` (None: ``kv_cache``'s), so one experiment compares caching off
    and on."""

    name: str
    label: str
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    enable_prefix_caching: bool | None = None
    # Speculative decoding for this policy's runs (lab/core/spec.py): the entry's own
    # ``speculative:`` (``own_speculative``) or else the top-level one; None = off.
    speculative: SpeculativeConfig | None = None
    own_speculative: bool = False

    def prefix_caching(self, kv: KVCacheConfig) -> bool:
        """Whether this policy's runs cache prefixes (its own key, else ``kv_cache``'s)."""
        own = self.enable_prefix_caching
        return own if own is not None else kv.enable_prefix_caching

    def limit(self, key: str, scheduler: SchedulerConfig) -> int | None:
        """This policy's value of a limit in :data:`LIMIT_KEYS`, else the scheduler's."""
        own = getattr(self, key)
        return own if own is not None else getattr(scheduler, key)

    def to_dict(self) -> dict[str, Any]:
        limits = {k: getattr(self, k) for k in LIMIT_KEYS if getattr(self, k) is not None}
        own = (
            {}
            if self.enable_prefix_caching is None
            else {"enable_prefix_caching": self.enable_prefix_caching}
        )
        if self.own_speculative:
            own["speculative"] = None if self.speculative is None else self.speculative.to_dict()
        return {
            "label": self.label,
            "name": self.name,
            **limits,
            **own,
            **copy.deepcopy(dict(self.options)),
        }


@dataclass(frozen=True)
class CostModelConfig:
    """The simulator's step times: an analytic roofline, or a model calibrated from an
    engine profile (``profile``, plus ``replay_steps``). The roofline's three values below
    are the datasheet guesses; a YAML that leaves them out gets
    :func:`lab.sim.analytic_defaults.defaults` of its model and hardware instead (fitted
    to the shipped profiles where the hardware has one)."""

    flops_efficiency: float = 0.7  # achieved share of peak FLOP/s
    bandwidth_efficiency: float = 0.85  # achieved share of peak memory bandwidth
    step_overhead_s: float = 0.002  # fixed cost per step
    profile: Path | None = None  # engine profile CSV (absolute)
    replay_steps: tuple[Path, ...] = ()  # steps.csv of engine runs (absolute)
    # an engine run's steps.csv whose measured durations the steps take, in order
    # (lab/sim/replayed.py); replaces the analytic and the calibrated model
    durations_from: Path | None = None
    tensor_parallel_size: int = 1  # GPUs per simulated replica (lab/sim/cost_model.py)
    # the host's part of an analytic step (planning, input prep, launch; lab/sim/cost_model.py):
    # seconds per step (at most step_overhead_s) and per sequence
    host_overhead_s: float = 0.0
    host_per_seq_s: float = 0.0

    @property
    def analytic(self) -> dict[str, float]:
        """The analytic model's keyword arguments."""
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "flops_efficiency": self.flops_efficiency,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "step_overhead_s": self.step_overhead_s,
            "host_overhead_s": self.host_overhead_s,
            "host_per_seq_s": self.host_per_seq_s,
        }


@dataclass(frozen=True)
class SLOConfig:
    """Latency targets (seconds, None: no target) for goodput and SLO attainment."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ReportConfig:
    """What the results folder shows beyond the metrics (lab/report/folder.py, lab/report/timeline.py).

    metric_percentiles: the percentiles of the vLLM-format result files (vLLM's
        ``--metric-percentiles``; keys ``p50_ttft_ms`` ... ``p99.9_ttft_ms``).
    timeline_slowest / timeline_by: the timeline picture shows the slowest N requests of
        each run by ``e2e`` or ``ttft``, unless ``timeline_ids`` (request ids) or
        ``timeline_window_s`` ([start, end] seconds: the requests in flight then) is given.
    """

    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9)
    timeline_slowest: int = 12
    timeline_by: str = "e2e"  # e2e | ttft
    timeline_ids: tuple[str, ...] = ()
    timeline_window_s: tuple[float, float] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """The real engine (``backend: engine``; backend/README.md)."""

    model_path: Path | None = None  # model directory: config.json + safetensors (absolute)
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: the checkpoint's
    attention_backend: str = "torch"  # torch | triton | flash_attn
    temperature: float = 0.0  # 0: greedy
    cuda_graphs: bool | None = None  # None: on with CUDA and the triton backend
    mixed_graphs: bool = True  # false: only decode-only steps replay graphs
    kn_weights: bool = False  # projection weights in (K, N) memory order
    num_threads: int | None = (
        None  # CPU device: torch threads (None: min(4, cores), or OMP_NUM_THREADS)
    )
    tensor_parallel_size: int = 1  # ranks, one process each (backend/tp.py; cuda: one GPU each)
    # kernel of eager prefill chunks from position 0 (backend/attention/flash_varlen.py)
    prefill_attention: str = "auto"  # auto | triton | flash_varlen


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one trace, replayed through every policy at every rate_scale.

    ``source`` (the YAML file, or "config") prefixes messages; ``base_dir`` is the folder
    relative paths were resolved against (:mod:`lab.config.paths`); neither is in :meth:`to_dict`.
    """

    name: str
    trace: TraceConfig
    backend: str = "sim"
    seed: int = 0
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
    source: str = field(default="config", compare=False)
    base_dir: Path = field(default=Path("."), compare=False)

    @property
    def rate_scales(self) -> tuple[float, ...]:
        return self.trace.rate_scales

    @property
    def profile_num_batched_tokens(self) -> int:
        """The largest step KV sizing reserves activations for: max_num_batched_tokens, or
        :data:`SIM_PROFILE_TOKENS` / :data:`ENGINE_PROFILE_TOKENS` when it is null."""
        default = ENGINE_PROFILE_TOKENS if self.backend == "engine" else SIM_PROFILE_TOKENS
        return self.scheduler.max_num_batched_tokens or default

    def run_label(self, policy: PolicyConfig, rate_scale: float) -> str:
        """A run's name: the policy's label, with ``@x{scale}`` when there are several loads."""
        if len(self.rate_scales) == 1:
            return policy.label
        return f"{policy.label}@x{scale_label(rate_scale)}"

    def with_trace(self, **keys: Any) -> ExperimentConfig:
        """A copy with trace keys replaced (``limit=100``, ``rate_scale=2.0``, ``path=``),
        validated as in a YAML file (a new relative path resolves against ``base_dir``);
        a new ``path`` or ``format`` drops the expected ``trace_file``."""
        expected = None if {"path", "format"} & set(keys) else self.trace.expected
        if self.trace.classes:  # every class gets the keys; ``limit`` is shared among them
            n = len(self.trace.classes)
            if "limit" in keys and isinstance(keys["limit"], int) and keys["limit"] >= 1:
                keys = {**keys, "limit": max(1, keys["limit"] // n)}
            raw = [{**c, **keys} for c in self.trace.classes]
            return dataclasses.replace(self, trace=_classes(self.source, raw, self.base_dir))
        raw = {**self.trace.spec, **keys}
        trace = _trace(self.source, raw, self.base_dir, expected)
        _hash_block_size(self.source, trace, self.kv_cache)
        return dataclasses.replace(self, trace=trace)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config, as results/<name>/config.yaml holds it (plain types)."""

        def plain(section) -> dict[str, Any]:
            d = dataclasses.asdict(section)
            return {k: _plain(v) for k, v in d.items()}

        out = {
            "name": self.name,
            "backend": self.backend,
            "seed": self.seed,
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
        if self.trace.expected is not None:
            out["trace_file"] = dict(self.trace.expected)
        return out


def _plain(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def scale_label(scale: float) -> str:
    """How a rate_scale names its runs when there are several: ``{label}@x{scale_label}``."""
    return f"{scale:g}"


# ---------------------------------------------------------------------------- loading
TOP_KEYS = (
    "name",
    "backend",
    "seed",
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
)
DEFAULT_POLICIES = ("fcfs", "swap", "chunked_prefill")


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate an experiment YAML; its relative paths resolve against its folder
    (then the bundled data: :mod:`lab.config.paths`); ``name`` defaults to the file name.

    ``path`` itself follows the same rule from the current folder: a relative path that
    names no file here names the bundled one (``experiments/quickstart.yaml`` from anywhere).

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
    """Validate a config mapping (as parsed from YAML) into an :class:`ExperimentConfig`.

    Args:
        where: the file it came from, prefixing every message.
        base_dir: the folder relative paths resolve against (default: the current one).

    ``name`` defaults to "experiment" here (:func:`load_config`: the file name).
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys at the top level")
    _mapping(where, "", raw, TOP_KEYS)
    base_dir = Path(base_dir if base_dir is not None else ".").absolute()
    top = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}
    top.update(raw)
    name = check_name(where, "name", raw["name"] if raw.get("name") is not None else "experiment")
    backend = _choice(where, "backend", top["backend"], ("sim", "engine"))
    seed = _int(where, "seed", top["seed"], lo=0)
    if "trace" not in raw or not isinstance(raw["trace"], (Mapping, list)):
        raise _fail(
            where,
            "trace",
            "a mapping with at least 'format', or a list of classes",
            raw.get("trace"),
        )
    expected = _trace_file(where, raw["trace_file"]) if "trace_file" in raw else None
    if isinstance(raw["trace"], list):
        trace = _classes(where, raw["trace"], base_dir)
    else:
        trace = _trace(where, raw["trace"], base_dir, expected)
    if backend == "sim":
        _choice(where, "model", top["model"], MODELS)
        _choice(where, "hardware", top["hardware"], HARDWARE)
    if not isinstance(top["check_invariants"], bool):
        raise _fail(where, "check_invariants", "true or false", top["check_invariants"])
    scheduler = _scheduler(where, raw.get("scheduler", {}))
    spec = _speculative(where, "speculative", raw.get("speculative"), base_dir, backend)
    cluster = None if raw.get("cluster") is None else _cluster(where, raw["cluster"], backend)
    if cluster is not None and (raw.get("cost_model") or {}).get("durations_from") is not None:
        raise ConfigError(
            f"{where}: cost_model.durations_from replays one engine run's steps, which a "
            "cluster of replicas cannot: remove cluster: or durations_from"
        )
    pols = _policies(
        where,
        raw.get("policies", list(DEFAULT_POLICIES)),
        trace.tenants,
        spec,
        base_dir,
        backend,
        tuple(raw["speculative"]) if spec is not None else (),
    )
    for i, p in enumerate(pols):  # the engine has no device-side drafts for async steps
        if backend == "engine" and p.speculative is not None:
            if p.options.get(ASYNC_KEY, scheduler.async_scheduling):
                raise ConfigError(
                    f"{where}: policies[{i}] ({p.label}): speculative with {ASYNC_KEY}: true "
                    f"runs in the simulator only; set {ASYNC_KEY}: false or backend: sim"
                )
    if cluster is not None:  # name the key where async was turned on for some policy
        on = [f"policies[{i}].{ASYNC_KEY}" for i, p in enumerate(pols) if p.options.get(ASYNC_KEY)]
        if scheduler.async_scheduling and not all(ASYNC_KEY in p.options for p in pols):
            on.insert(0, f"scheduler.{ASYNC_KEY}")
        if on:
            raise ConfigError(
                f"{where}: {on[0]}: the cluster simulator runs synchronous replicas only; "
                f"remove cluster: or set {ASYNC_KEY}: false"
            )
    named = isinstance(top["model"], str) and isinstance(top["hardware"], str)
    fitted = analytic_defaults(top["model"], top["hardware"]) if named else GUESS
    shape = f"{top['model']} on {top['hardware']}"
    cost_model = _cost_model(where, raw.get("cost_model", {}), base_dir, backend == "sim",
                             fitted, shape)  # fmt: skip
    engine = _engine(where, raw.get("engine", {}), base_dir, backend == "engine")
    if backend == "engine":
        _simulator_only(where, cost_model, engine, pols, fitted.values)
    return ExperimentConfig(
        name=name,
        trace=trace,
        backend=backend,
        seed=seed,
        model=top["model"],
        hardware=top["hardware"],
        cost_model=cost_model,
        kv_cache=_hash_block_size(where, trace, _kv_cache(where, raw.get("kv_cache", {}))),
        scheduler=scheduler,
        policies=pols,
        slo=_slo(where, raw.get("slo", {})),
        engine=engine,
        check_invariants=top["check_invariants"],
        cluster=cluster,
        report=_report(where, raw.get("report", {})),
        speculative=spec,
        source=where,
        base_dir=base_dir,
    )


_WARNED: set[str] = set()  # simulator-only keys already warned about (once a process)


def _simulator_only(
    where: str,
    cm: CostModelConfig,
    engine: EngineConfig,
    pols: tuple[PolicyConfig, ...],
    defaults: dict[str, float],
) -> None:
    """``backend: engine`` with keys only the simulator reads. Refused in one line where the
    key names something the engine has but sets otherwise (its host time, its tensor
    parallelism, its acceptance: measured or given by ``engine:``), so that setting it can
    only mislead; warned about once where it is the simulator side of a file that serves
    both backends (``cost_model.profile`` of experiments/sim_vs_real.yaml: the engine
    measures its step times). ``defaults``: the analytic values the config would get
    without the keys (lab/sim/analytic_defaults.py); those are not warned about.

    Raises:
        ConfigError: one line naming the key and the engine's own setting.
    """
    for key in ("host_overhead_s", "host_per_seq_s"):
        if getattr(cm, key):
            raise ConfigError(
                f"{where}: cost_model.{key}: sets the simulator's host time per step; the "
                "engine's host time is its own (measured, not set): remove it or set backend: sim"
            )
    if cm.durations_from is not None:
        raise ConfigError(
            f"{where}: cost_model.durations_from: replays an engine run's step times in the "
            "simulator; the engine measures its own: remove it or set backend: sim"
        )
    tp = cm.tensor_parallel_size
    if tp != 1 and tp != engine.tensor_parallel_size:
        raise ConfigError(
            f"{where}: cost_model.tensor_parallel_size: {tp} GPUs per simulated replica; the "
            f"engine's tensor parallelism is engine.tensor_parallel_size "
            f"({engine.tensor_parallel_size}): set that one"
        )
    ignored = [
        f"cost_model.{f.name}"
        for f in dataclasses.fields(CostModelConfig)
        if f.name
        in (
            "flops_efficiency",
            "bandwidth_efficiency",
            "step_overhead_s",
            "profile",
            "replay_steps",
        )  # fmt: skip
        and getattr(cm, f.name) != defaults.get(f.name, f.default)
    ]
    seen = set()
    for i, p in enumerate(pols):
        spec, key = p.speculative, f"policies[{i}].speculative" if p.own_speculative else ""
        if spec is None or id(spec) in seen:
            continue
        seen.add(id(spec))
        key = key or "speculative"
        if spec.acceptance_from is not None:
            raise ConfigError(
                f"{where}: {key}.acceptance_from: the simulator's acceptance, taken from an "
                "engine run; the engine verifies its own drafts: remove it or set backend: sim"
            )
        if spec.acceptance_rates is not None and spec.method != "synthetic":
            ignored.append(f"{key}.acceptance_rates (method {spec.method})")
    line = (
        f"{where}: backend engine measures its step times and acceptance, so it ignores the "
        f"simulator-only {', '.join(ignored)}"
    )
    if ignored and line not in _WARNED:
        _WARNED.add(line)
        log.warning(line)


MAX_NAME_CHARS = 128  # a folder name: file systems allow 255 bytes, the temporary name adds 14


def check_name(where: str, key: str, name) -> str:
    """An experiment name: it becomes a folder under results/, so letters, digits, '.', '_'
    and '-' only, starting with a letter or digit (no '', '.', '..' or paths)."""
    if (
        not isinstance(name, str)
        or not _NAME.fullmatch(name)
        or name in (".", "..")
        or len(name) > MAX_NAME_CHARS
    ):
        raise _fail(
            where,
            key,
            f"a name of at most {MAX_NAME_CHARS} letters, digits, '.', '_' and '-' starting "
            "with a letter or digit (it names the results folder)",
            name,
        )
    return name


def _section(where: str, key: str, raw: Any, cls: type) -> dict[str, Any]:
    """A section's mapping checked for unknown keys, over the dataclass's defaults."""
    _mapping(where, key, raw, tuple(f.name for f in dataclasses.fields(cls)))
    defaults = {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }
    return {**defaults, **raw}


def _trace(
    where: str,
    raw: Mapping[str, Any],
    base_dir: Path,
    expected: Mapping[str, Any] | None,
    key: str = "trace",
) -> TraceConfig:
    spec = copy.deepcopy(dict(raw))
    rs = spec.get("rate_scale", 1.0)
    if rs == []:
        raise _fail(where, f"{key}.rate_scale", "a number > 0 or a non-empty list of them", rs)
    lo, hi = RATE_SCALE_RANGE
    for v in rs if isinstance(rs, list) else [rs]:
        _num(where, f"{key}.rate_scale", v, lo=0.0, lo_open=True)
        if not lo <= v <= hi:
            raise _fail(
                where,
                f"{key}.rate_scale",
                f"a number in [{lo:g}, {hi:g}] (outside it arrival times lose float precision)",
                v,
            )
    scales = tuple(float(v) for v in (rs if isinstance(rs, list) else [rs]))
    names = [scale_label(v) for v in scales]
    if len(set(names)) != len(names):
        raise _fail(
            where,
            f"{key}.rate_scale",
            "distinct values (to 6 significant digits: they name the runs, as 'fcfs@x2')",
            rs,
        )
    if isinstance(spec.get("path"), str) and spec["path"]:
        spec["path"] = str(_existing(where, f"{key}.path", spec["path"], base_dir, "file"))
    if isinstance(spec.get("tokenizer"), str) and spec["tokenizer"]:
        spec["tokenizer"] = str(paths.resolve(spec["tokenizer"], base_dir))
    return TraceConfig(MappingProxyType(spec), scales, expected)


def _classes(where: str, raw: list, base_dir: Path) -> TraceConfig:
    """``trace:`` as a list of workload classes (traces/classes.py): each a mapping of
    :data:`CLASS_KEYS` and a trace spec of its own (one ``rate_scale`` number, not a list)."""
    if not raw:
        raise _fail(where, "trace", "a mapping, or a non-empty list of workload classes", raw)
    classes, names = [], set()
    for i, c in enumerate(raw):
        key = f"trace[{i}]"
        if not isinstance(c, Mapping):
            raise _fail(where, key, "a workload class: a mapping with name and a trace spec", c)
        name = c.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in names:
            why = "a name used by no other class" if name in names else "a class name"
            raise _fail(where, f"{key}.name", f"{why} (letters, digits, '.', '_', '-')", name)
        names.add(name)
        prio = c.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise _fail(where, f"{key}.priority", "an integer (lower runs first)", prio)
        tenant = c.get("tenant", "")
        if not isinstance(tenant, str) or (tenant and not _LABEL.fullmatch(tenant)):
            raise _fail(where, f"{key}.tenant", "a tenant name (letters, digits, ._+- )", tenant)
        slo = _slo(where, c.get("slo", {}), f"{key}.slo")
        spec = {k: v for k, v in c.items() if k not in CLASS_KEYS}
        if "format" not in spec:
            raise ConfigError(
                f"{where}: {key}: class {name!r} has no trace: give its 'format' and the "
                "format's keys, as for a single trace"
            )
        if isinstance(spec.get("rate_scale"), list):
            raise _fail(
                where, f"{key}.rate_scale", "a number (one load per class)", spec["rate_scale"]
            )
        one = _trace(where, spec, base_dir, None, key)
        own = {"name": name, "priority": prio, "tenant": tenant}
        if "slo" in c:
            own["slo"] = {k: v for k, v in slo.to_dict().items() if v is not None}
        classes.append(MappingProxyType({**own, **one.spec}))
    return TraceConfig(MappingProxyType({"format": "classes"}), (1.0,), None, tuple(classes))


def _trace_file(where: str, raw: Any) -> Mapping[str, Any]:
    d = _mapping(where, "trace_file", raw, ("path", "sha256", "rows"))
    sha = d.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
        raise _fail(where, "trace_file.sha256", "64 hexadecimal digits or null", sha)
    _int(where, "trace_file.rows", d.get("rows"), lo=0, optional=True)
    return MappingProxyType(dict(d))


def _existing(where: str, key: str, value: str, base_dir: Path, kind: str, hint: str = "") -> Path:
    """``value`` resolved (:mod:`lab.config.paths`); ConfigError naming the key and the value as
    written when no ``kind`` ("file", "directory") exists there."""
    path = paths.resolve(value, base_dir)
    if not (path.is_file() if kind == "file" else path.is_dir()):
        raise ConfigError(
            f"{where}: {key}: {short_repr(value)}: no such {kind} (looked for "
            f"{paths.looked_in(value, base_dir)}){hint}"
        )
    return path


def _cost_model(
    where: str, raw: Any, base_dir: Path, used: bool, fitted: Any = GUESS, shape: str = ""
) -> CostModelConfig:
    """``fitted``: the analytic defaults of the run's model and hardware
    (lab/sim/analytic_defaults.py, an Efficiencies), applied where the YAML leaves a key
    out; ``shape`` names that model and hardware in messages."""
    cm = _section(where, "cost_model", raw, CostModelConfig)
    cm.update({k: v for k, v in fitted.values.items() if k not in raw})  # the YAML's win
    for key in ("flops_efficiency", "bandwidth_efficiency"):
        _num(where, f"cost_model.{key}", cm[key], MIN_EFFICIENCY, 1.0)
    _num(where, "cost_model.step_overhead_s", cm["step_overhead_s"], 0.0, MAX_STEP_OVERHEAD_S)
    profile, steps = cm["profile"], cm["replay_steps"]
    if profile is not None and (not isinstance(profile, str) or not profile):
        raise _fail(where, "cost_model.profile", "a path to an engine profile CSV", profile)
    if not isinstance(steps, (list, tuple)) or not all(isinstance(p, str) and p for p in steps):
        raise _fail(where, "cost_model.replay_steps", "a list of steps.csv paths", steps)
    if steps and profile is None:
        raise ConfigError(f"{where}: cost_model.replay_steps needs cost_model.profile")
    replayed = cm.get("durations_from")
    if replayed is not None:
        if not isinstance(replayed, str) or not replayed:
            raise _fail(where, "cost_model.durations_from", "a path to a run's steps.csv", replayed)
        if profile is not None:
            raise ConfigError(
                f"{where}: cost_model.durations_from replaces the cost model: "
                "drop cost_model.profile"
            )
    _int(where, "cost_model.tensor_parallel_size", cm["tensor_parallel_size"])
    _num(where, "cost_model.host_overhead_s", cm["host_overhead_s"], 0.0, MAX_STEP_OVERHEAD_S)
    if used and cm["host_overhead_s"] > cm["step_overhead_s"]:  # the engine refuses it
        default = "" if "step_overhead_s" in raw else f", the default for {shape}"
        raise ConfigError(
            f"{where}: cost_model.host_overhead_s: expected at most cost_model.step_overhead_s "
            f"({cm['step_overhead_s']:g} s{default}; the host's part of the fixed step cost), got "
            f"{cm['host_overhead_s']:g}"
        )
    _num(where, "cost_model.host_per_seq_s", cm["host_per_seq_s"], 0.0, MAX_HOST_PER_SEQ_S)
    if (cm["host_overhead_s"] or cm["host_per_seq_s"]) and (profile or replayed) is not None:
        key = "host_overhead_s" if cm["host_overhead_s"] else "host_per_seq_s"
        raise ConfigError(
            f"{where}: cost_model.{key} sets the analytic model's host time; "
            + (
                "the calibrated model fits it to the profile's host_s column: drop it"
                if profile is not None
                else "durations_from replays measured step times: drop it"
            )
        )

    def resolve(key: str, value: str) -> Path:
        if used:
            return _existing(where, key, value, base_dir, "file")
        return paths.resolve(value, base_dir)

    return CostModelConfig(
        cm["flops_efficiency"],
        cm["bandwidth_efficiency"],
        cm["step_overhead_s"],
        None if profile is None else resolve("cost_model.profile", profile),
        tuple(resolve(f"cost_model.replay_steps[{i}]", p) for i, p in enumerate(steps)),
        durations_from=None if replayed is None else resolve("cost_model.durations_from", replayed),
        tensor_parallel_size=cm["tensor_parallel_size"],
        host_overhead_s=cm["host_overhead_s"],
        host_per_seq_s=cm["host_per_seq_s"],
    )


def _kv_cache(where: str, raw: Any) -> KVCacheConfig:
    kv = _section(where, "kv_cache", raw, KVCacheConfig)
    _int(where, "kv_cache.block_size", kv["block_size"])
    _num(
        where,
        "kv_cache.gpu_memory_utilization",
        kv["gpu_memory_utilization"],
        0.0,
        1.0,
        lo_open=True,
    )
    _int(where, "kv_cache.num_gpu_blocks", kv["num_gpu_blocks"], optional=True)
    _num(where, "kv_cache.swap_space_gib", kv["swap_space_gib"], 0.0, MAX_SWAP_SPACE_GIB)
    _num(where, "kv_cache.watermark", kv["watermark"], 0.0, 0.5)
    if not isinstance(kv["enable_prefix_caching"], bool):
        raise _fail(
            where, "kv_cache.enable_prefix_caching", "true or false", kv["enable_prefix_caching"]
        )
    return KVCacheConfig(**kv)


def check_swap_blocks(kv: KVCacheConfig, num_cpu_blocks: int, block_bytes: float, model: str):
    """A positive ``kv_cache.swap_space_gib`` that holds no KV block (of ``block_bytes``
    bytes for ``model``) would leave swap-mode preemption nothing to swap to, so it would
    recompute instead, silently. ``swap_space_gib: 0`` (no swap space) is taken.

    Raises:
        ConfigError: one line naming the key and the size one block needs.
    """
    if kv.swap_space_gib > 0 and num_cpu_blocks == 0:
        raise ConfigError(
            f"kv_cache.swap_space_gib: {kv.swap_space_gib:g} GiB holds no KV block: one block "
            f"of {kv.block_size} tokens of {model} needs {block_bytes / GIB:.3g} GiB; expected "
            "at least that, or 0 for no swap space"
        )


def _hash_block_size(where: str, trace: TraceConfig, kv: KVCacheConfig) -> KVCacheConfig:
    """Check ``trace.hash_block_size`` (tokens per hash id, :mod:`traces.prefix`) against
    the KV block size: a multiple of it, so that every full KV block lies inside one hash
    block. Checked when given, when ``trace.prefix`` makes hash ids (default 16), and for
    Mooncake's default of 512 when prefix caching is on. Returns ``kv`` unchanged."""
    spec = trace.spec
    if "hash_block_size" in spec:
        size, why = _int(where, "trace.hash_block_size", spec["hash_block_size"]), ""
    elif "prefix" in spec:
        from traces.prefix import PREFIX_HASH_BLOCK_SIZE

        size, why = PREFIX_HASH_BLOCK_SIZE, " (the default for trace.prefix)"
    elif trace.format == "mooncake" and kv.enable_prefix_caching:
        from traces.loaders import MOONCAKE_HASH_BLOCK_SIZE

        size, why = MOONCAKE_HASH_BLOCK_SIZE, " (Mooncake's default)"
    else:
        return kv
    if size % kv.block_size:
        raise ConfigError(
            f"{where}: trace.hash_block_size: {size}{why} is not a multiple of "
            f"kv_cache.block_size {kv.block_size}; expected a multiple, so that every KV "
            "block lies inside one hash block"
        )
    return kv


def _scheduler(where: str, raw: Any) -> SchedulerConfig:
    s = _section(where, "scheduler", raw, SchedulerConfig)
    _int(where, "scheduler.max_num_seqs", s["max_num_seqs"])
    _check_limits(where, "scheduler", s)
    _int(where, "scheduler.max_preemptions", s["max_preemptions"])
    if s[VICTIM_KEY] is not None:
        _choice(where, f"scheduler.{VICTIM_KEY}", s[VICTIM_KEY], VICTIM_RULES)
    if not isinstance(s[ASYNC_KEY], bool):
        raise _fail(where, f"scheduler.{ASYNC_KEY}", "true or false", s[ASYNC_KEY])
    return SchedulerConfig(**s)


def _policies(
    where: str,
    pols: Any,
    tenants: frozenset[str] = frozenset(),
    spec: SpeculativeConfig | None = None,
    base_dir: Path = Path("."),
    backend: str = "sim",
    spec_keys: tuple[str, ...] = (),
) -> tuple[PolicyConfig, ...]:
    """The policy entries. ``spec``: the top-level ``speculative:`` block (``spec_keys``: the
    keys written in it), which an entry's own block replaces whole."""
    if policies.BROKEN:  # a policy file that cannot be imported: say which, run nothing
        path, why = next(iter(policies.BROKEN.items()))
        raise ConfigError(f"{path}: the policy module cannot be imported ({why}); fix or remove it")
    if not isinstance(pols, list) or not pols:
        raise _fail(where, "policies", "a non-empty list of policy names or mappings", pols)

    resolved = []
    for i, p in enumerate(pols):
        key = f"policies[{i}]"
        if isinstance(p, str):
            p = {"name": p}
        if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
            raise _fail(where, key, "a policy name or a mapping with 'name'", p)
        try:
            cls = get_policy(p["name"])
        except ConfigError as e:
            raise ConfigError(f"{where}: {key}: {e}") from None
        _mapping(
            where,
            key,
            p,
            (
                "name",
                "label",
                *LIMIT_KEYS,
                VICTIM_KEY,
                ASYNC_KEY,
                "enable_prefix_caching",
                "speculative",
                *cls.options,
            ),
        )
        if ASYNC_KEY in p and not isinstance(p[ASYNC_KEY], bool):
            raise _fail(where, f"{key}.{ASYNC_KEY}", "true or false", p[ASYNC_KEY])
        _check_limits(where, key, p)
        if VICTIM_KEY in p:
            _choice(where, f"{key}.{VICTIM_KEY}", p[VICTIM_KEY], VICTIM_RULES)
        why = cls.check_options({k: v for k, v in p.items() if k in cls.options}, tenants)
        if why:
            raise ConfigError(f"{where}: {key}.{why}")
        caching = p.get("enable_prefix_caching")
        if caching is not None and not isinstance(caching, bool):
            raise _fail(where, f"{key}.enable_prefix_caching", "true or false", caching)
        label = p.get("label", p["name"])
        if not isinstance(label, str) or not _LABEL.fullmatch(label):
            raise _fail(
                where,
                f"{key}.label",
                "a label of letters, digits, '.', '_', '-', '+' "
                "and spaces, starting with a letter or digit",
                label,
            )
        own = (*cls.options, VICTIM_KEY, ASYNC_KEY)
        options = {k: copy.deepcopy(v) for k, v in p.items() if k in own}
        own_spec = "speculative" in p
        try:
            policy_spec = _speculative(
                where, f"{key}.speculative", p.get("speculative"), base_dir, backend
            )
        except ConfigError as e:  # a partial block: say that it is not merged
            block = p.get("speculative")
            missing = [k for k in spec_keys if isinstance(block, Mapping) and k not in block]
            if not missing:
                raise
            raise ConfigError(
                f"{e} ({key}.speculative replaces the top-level speculative: block whole, "
                f"not key by key; it lacks {', '.join(missing)})"
            ) from None
        resolved.append(
            PolicyConfig(
                p["name"],
                label,
                *(p.get(k) for k in LIMIT_KEYS),
                options=MappingProxyType(options),
                enable_prefix_caching=caching,
                speculative=policy_spec if own_spec else spec,
                own_speculative=own_spec,
            )
        )
    labels = [p.label for p in resolved]
    if len(set(labels)) != len(labels):
        raise ConfigError(
            f"{where}: policies: labels must be unique (give 'label:'), got {short_repr(labels)}"
        )
    return tuple(resolved)


def _speculative(
    where: str, key: str, raw: Any, base_dir: Path, backend: str
) -> SpeculativeConfig | None:
    """``speculative:`` (top level or a policy's) validated by lab/core/spec.py, its paths
    made absolute: ``model`` must exist on the engine, ``acceptance_from`` in the simulator."""
    if raw is None:
        return None
    try:
        spec = SpeculativeConfig.from_mapping(raw, key)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    found = {}
    for sub, used in (("model", backend == "engine"), ("acceptance_from", backend == "sim")):
        value = getattr(spec, sub)
        if sub == "model" and not used and value in MODELS:
            continue  # the simulator takes a model preset's name as it is
        if value is not None:
            path = (
                _existing(where, f"{key}.{sub}", value, base_dir, "directory")
                if used
                else paths.resolve(value, base_dir)
            )
            found[sub] = str(path)
    return dataclasses.replace(spec, **found)


def _slo(where: str, raw: Any, key: str = "slo") -> SLOConfig:
    s = _section(where, key, raw, SLOConfig)
    for k, v in s.items():
        _num(where, f"{key}.{k}", v, 0.0, lo_open=True, optional=True)
    return SLOConfig(**s)


def _report(where: str, raw: Any) -> ReportConfig:
    r = _section(where, "report", raw, ReportConfig)
    pcts = r.get("metric_percentiles", ReportConfig.metric_percentiles)
    if not isinstance(pcts, (list, tuple)) or not pcts:
        raise _fail(where, "report.metric_percentiles", "a list of numbers in (0, 100]", pcts)
    for i, p in enumerate(pcts):
        _num(where, f"report.metric_percentiles[{i}]", p, 0.0, 100.0, lo_open=True)
    r["metric_percentiles"] = tuple(float(p) for p in pcts)
    if "timeline_slowest" in r:
        _int(where, "report.timeline_slowest", r["timeline_slowest"], lo=1)
    if "timeline_by" in r:
        _choice(where, "report.timeline_by", r["timeline_by"], ("e2e", "ttft"))
    ids = r.get("timeline_ids", ())
    if not isinstance(ids, (list, tuple)) or not all(isinstance(x, (str, int)) for x in ids):
        raise _fail(where, "report.timeline_ids", "a list of request ids", ids)
    r["timeline_ids"] = tuple(str(x) for x in ids)
    window = r.get("timeline_window_s")
    if window is not None:
        if not isinstance(window, (list, tuple)) or len(window) != 2:
            raise _fail(where, "report.timeline_window_s", "[start, end] in seconds", window)
        lo = _num(where, "report.timeline_window_s[0]", window[0])
        hi = _num(where, "report.timeline_window_s[1]", window[1])
        if hi <= lo:
            raise _fail(where, "report.timeline_window_s", "[start, end] with end > start", window)
        r["timeline_window_s"] = (float(lo), float(hi))
    return ReportConfig(**r)


def _engine(where: str, raw: Any, base_dir: Path, used: bool) -> EngineConfig:
    e = _section(where, "engine", raw, EngineConfig)
    path = e["model_path"]
    if used and not isinstance(path, str):
        raise _fail(
            where, "engine.model_path", "a model directory (config.json + safetensors)", path
        )
    if used:
        if not isinstance(e["device"], str) or not _DEVICE.fullmatch(e["device"]):
            raise _fail(where, "engine.device", "cpu, cuda or cuda:N", e["device"])
        _choice(where, "engine.dtype", e["dtype"], DTYPES)
        _choice(where, "engine.attention_backend", e["attention_backend"], ATTENTION_BACKENDS)
        _num(where, "engine.temperature", e["temperature"], 0.0)
        if e["cuda_graphs"] is not None and not isinstance(e["cuda_graphs"], bool):
            raise _fail(
                where,
                "engine.cuda_graphs",
                "true, false or null (on with CUDA and triton)",
                e["cuda_graphs"],
            )
        for key in ("mixed_graphs", "kn_weights"):
            if not isinstance(e[key], bool):
                raise _fail(where, f"engine.{key}", "true or false", e[key])
        _int(where, "engine.num_threads", e["num_threads"], optional=True)
        _int(where, "engine.tensor_parallel_size", e["tensor_parallel_size"])
        _choice(where, "engine.prefill_attention", e["prefill_attention"],
                ("auto", "triton", "flash_varlen"))  # fmt: skip
        e["model_path"] = _existing(
            where,
            "engine.model_path",
            path,
            base_dir,
            "directory",
            "; make a model directory with `python -m backend.tools convert-smollm2` or "
            "`make-random-checkpoint`",
        )
    elif isinstance(path, str) and path:
        e["model_path"] = paths.resolve(path, base_dir)
    return EngineConfig(**e)


# ---------------------------------------------------------------------------- cluster
CLUSTER_KEYS = ("replicas", "router", "prefill", "decode", "kv_transfer")
MAX_REPLICAS = 4096  # each replica holds its own scheduler and block manager in memory
_DISAGGREGATED_KEYS = ("prefill", "decode", "kv_transfer")


def _cluster(where: str, raw: Any, backend: str) -> ClusterSpec:
    """``cluster:``: aggregated ``{replicas, router}`` or disaggregated ``{prefill: {replicas,
    router}, decode: {replicas, router}, kv_transfer: LINK | {bandwidth_gbps, latency_s}}``."""
    if backend == "engine":
        raise ConfigError(
            f"{where}: cluster: the cluster is simulated only (backend: sim); backend: engine "
            "runs one replica on one device: remove cluster: or set backend: sim"
        )
    d = _mapping(where, "cluster", raw, CLUSTER_KEYS)
    disaggregated = [k for k in _DISAGGREGATED_KEYS if k in d]
    if not disaggregated:
        return ClusterSpec(pool=_pool(where, "cluster", d, ("replicas", "router")))
    if "replicas" in d or "router" in d:
        raise ConfigError(
            f"{where}: cluster: give replicas and router (aggregated) or prefill, decode and "
            f"kv_transfer (disaggregated), not both"
        )
    missing = [k for k in _DISAGGREGATED_KEYS if k not in d]
    if missing:
        raise ConfigError(
            f"{where}: cluster: a disaggregated cluster needs prefill, decode and kv_transfer; "
            f"missing {', '.join(missing)}"
        )
    return ClusterSpec(
        prefill=_pool(where, "cluster.prefill", d["prefill"], ("replicas", "router")),
        decode=_pool(where, "cluster.decode", d["decode"], ("replicas", "router")),
        link=_link(where, "cluster.kv_transfer", d["kv_transfer"]),
    )


def _pool(where: str, key: str, raw: Any, allowed: tuple[str, ...]) -> PoolSpec:
    from lab.sim.router import get_router

    d = _mapping(where, key, raw, allowed)
    replicas = _int(where, f"{key}.replicas", d.get("replicas", 1))
    if replicas > MAX_REPLICAS:
        raise _fail(where, f"{key}.replicas", f"an integer in [1, {MAX_REPLICAS}]", replicas)
    router = d.get("router", "round_robin")
    spec = {"name": router} if isinstance(router, str) else router
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise _fail(where, f"{key}.router", "a router name or a mapping with 'name'", router)
    try:
        cls = get_router(spec["name"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {key}.router: {e}") from None
    _mapping(where, f"{key}.router", spec, ("name", *cls.options))
    options = {}
    for k, v in spec.items():
        if k == "name":
            continue
        if isinstance(cls.options[k], int):
            options[k] = _int(where, f"{key}.router.{k}", v)
        else:
            options[k] = _num(where, f"{key}.router.{k}", v, lo=1.0)
    return PoolSpec(replicas, spec["name"], MappingProxyType(options))


def _link(where: str, key: str, raw: Any) -> Link:
    if isinstance(raw, str):
        return LINKS[_choice(where, key, raw, LINKS)]
    d = _mapping(where, key, raw, ("bandwidth_gbps", "latency_s"))
    if "bandwidth_gbps" not in d:
        raise _fail(where, key, "a link preset name or {bandwidth_gbps, latency_s}", raw)
    gbps = _num(where, f"{key}.bandwidth_gbps", d["bandwidth_gbps"], 0.0, lo_open=True)
    latency = _num(where, f"{key}.latency_s", d.get("latency_s", 0.0), 0.0)
    return Link("custom", gbps * 1e9 / 8, float(latency), f"{gbps} Gb/s, {latency} s")


def cluster_to_dict(c: ClusterSpec) -> dict[str, Any]:
    """A cluster spec as written in YAML (presets by name)."""

    def pool(p: PoolSpec) -> dict[str, Any]:
        router = {"name": p.router, **p.router_options} if p.router_options else p.router
        return {"replicas": p.replicas, "router": router}

    if c.pool is not None:
        return pool(c.pool)
    link: Any = c.link.name
    if c.link.name not in LINKS:
        link = {"bandwidth_gbps": c.link.bandwidth * 8 / 1e9, "latency_s": c.link.latency_s}
    return {"prefill": pool(c.prefill), "decode": pool(c.decode), "kv_transfer": link}


# ---------------------------------------------------------------------------- checks
def _fail(where: str, key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{where}: {key}: expected {expected}, got {short_repr(value)}")


def _int(where, key, v, lo=1, optional=False):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _fail(where, key, f"an integer >= {lo}" + (" or null" if optional else ""), v)
    return v


def _num(where, key, v, lo=0.0, hi=math.inf, lo_open=False, optional=False):
    """A finite number in the range, returned as written (an int stays an int)."""
    if v is None and optional:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        if math.isinf(hi):
            rng = f"a finite number {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"a number in {'(' if lo_open else '['}{lo}, {hi}]"
        raise _fail(where, key, rng + (" or null" if optional else ""), v)
    return v


def _choice(where, key, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise _fail(where, key, "one of " + ", ".join(sorted(choices)), v)
    return v


def _mapping(where, key, v, allowed) -> Mapping:
    if not isinstance(v, Mapping):
        raise _fail(where, key, "a mapping", v)
    for k in v:
        if k not in allowed:
            shown = k if isinstance(k, str) and len(k) <= 80 else short_repr(k)
            raise ConfigError(
                f"{where}: unknown key {key + '.' if key else ''}{shown}; "
                f"allowed: {', '.join(allowed)}"
            )
    return v


def _check_limits(where: str, key: str, d: Mapping) -> None:
    for k in LIMIT_KEYS:
        _int(where, f"{key}.{k}", d.get(k), optional=True)
