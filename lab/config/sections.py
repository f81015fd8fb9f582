"""The fixed-key sections of an experiment YAML (``kv_cache``, ``scheduler``,
``cost_model``, ``slo``, ``report``, ``engine``, ``lora``): one frozen dataclass each, every field
with its type, default and check (:func:`sched_lab.config.walker.option`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sched_lab.config import paths
from sched_lab.config.walker import (
    Context,
    check_num,
    existing,
    fail,
    is_bool,
    is_choice,
    is_int,
    is_num,
    option,
    walk,
)
from sched_lab.core.attention_names import ATTENTION_BACKENDS
from sched_lab.core.errors import ConfigError
from sched_lab.core.kv_dtypes import KV_CACHE_DTYPES, canonical_kv_dtype
from sched_lab.core.scheduler import VICTIM_RULES
from sched_lab.sim.analytic_defaults import GUESS

GIB = 1 << 30
MAX_SWAP_SPACE_GIB = 4096.0  # host memory for swapped-out KV blocks (4 TiB: beyond any host)
# A request is preempted at most once a step, so no run comes near 2**40 preemptions of one
# request; the bound is that of a token count (traces/validate.py MAX_TOKENS), and keeps the
# value an int64 in the results' tables.
MAX_PREEMPTIONS = 1 << 40
MAX_LIMIT = 1 << 40  # a token or sequence count of a limit (LIMIT_KEYS), as for MAX_PREEMPTIONS
MAX_STEP_OVERHEAD_S = 60.0  # a fixed cost per step; a minute is already far beyond any engine
# Below this a roofline efficiency means step times a million times the hardware's: no
# real engine, and 5e-324 gives infinite ones.
MIN_EFFICIENCY = 1e-6
MAX_HOST_PER_SEQ_S = 1.0  # host seconds per sequence of a step; real engines take microseconds
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
LIMIT_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")  # a policy's own
VICTIM_KEY = "preemption_victim"  # every policy's option (lab/core/scheduler.py VICTIM_RULES)
ASYNC_KEY = "async_scheduling"  # every policy's option (docs/ARCHITECTURE.md, "Scheduler rules")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


# ---------------------------------------------------------------------------- kv_cache
@dataclass(frozen=True)
class KVCacheConfig:
    """Paged KV cache: blocks of ``block_size`` tokens on the GPU, swap space on the host."""

    block_size: int = option(16, is_int())  # tokens per block (vLLM's default)
    # share of device memory for weights + activations + KV
    gpu_memory_utilization: float = option(0.9, is_num(0.0, 1.0, lo_open=True))
    # fixed GPU blocks; null: sized by the utilization
    num_gpu_blocks: int | None = option(None, is_int(optional=True))
    swap_space_gib: float = option(4.0, is_num(0.0, MAX_SWAP_SPACE_GIB))  # vLLM's default
    watermark: float = option(0.01, is_num(0.0, 0.5))  # share of GPU blocks kept free at admission
    # Automatic prefix caching (lab/core/kv.py PrefixCachingBlockManager). Off by default:
    # results of existing experiments stay as they were, and most trace formats carry no
    # prefix identity (hash ids or token ids) to key blocks by.
    enable_prefix_caching: bool = option(False, is_bool)
    # KV element type (vLLM's --kv-cache-dtype): auto = the model's dtype; fp8 = E4M3, one
    # byte, so about twice the blocks in the same memory (lab/core/kv_dtypes.py). The alias
    # fp8_e4m3 is read as fp8.
    dtype: str = option("auto", is_choice(KV_CACHE_DTYPES))

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space_gib * GIB)


def parse_kv_cache(ctx: Context, raw: Any) -> KVCacheConfig:
    values = walk(ctx, "kv_cache", raw, KVCacheConfig)
    return KVCacheConfig(**{**values, "dtype": canonical_kv_dtype(values["dtype"])})


def check_swap_blocks(kv: KVCacheConfig, num_cpu_blocks: int, block_bytes: float, model: str):
    """ConfigError (naming the key and one block's size) if a positive
    ``kv_cache.swap_space_gib`` holds no KV block of ``block_bytes``; 0 is taken."""
    if kv.swap_space_gib > 0 and num_cpu_blocks == 0:
        raise ConfigError(
            f"kv_cache.swap_space_gib: {kv.swap_space_gib:g} GiB holds no KV block: one block "
            f"of {kv.block_size} tokens of {model} needs {block_bytes / GIB:.3g} GiB; expected "
            "at least that, or 0 for no swap space"
        )


# ---------------------------------------------------------------------------- scheduler
@dataclass(frozen=True)
class SchedulerConfig:
    """Limits shared by every policy (a policy entry may override the first three); null
    limits are resolved as vLLM does (:func:`sched_lab.run.experiment.resolve_limits`)."""

    max_num_seqs: int = option(256, is_int(hi=MAX_LIMIT))  # running requests per step
    # tokens per step
    max_num_batched_tokens: int | None = option(None, is_int(optional=True, hi=MAX_LIMIT))
    # prompt + output tokens
    max_model_len: int | None = option(None, is_int(optional=True, hi=MAX_LIMIT))
    # of one request, before the run stops
    max_preemptions: int = option(1000, is_int(hi=MAX_PREEMPTIONS))
    # Which running request a policy preempts when KV blocks are short (VICTIM_RULES of
    # lab/core/scheduler.py); null: each policy's own rule (newest for most). A policy
    # entry's own ``preemption_victim`` wins.
    preemption_victim: str | None = option(None, is_choice(VICTIM_RULES, optional=True))
    # Plan step N+1 while step N runs (vLLM V1's async scheduler; semantics in
    # lab/core/scheduler.py). A policy entry's own ``async_scheduling`` wins.
    async_scheduling: bool = option(False, is_bool)


def parse_scheduler(ctx: Context, raw: Any) -> SchedulerConfig:
    return SchedulerConfig(**walk(ctx, "scheduler", raw, SchedulerConfig))


# ---------------------------------------------------------------------------- cost_model
def _optional_path(what: str) -> Any:
    def check(ctx: Context, key: str, v: Any) -> Any:
        if v is not None and (not isinstance(v, str) or not v):
            raise fail(ctx.where, key, what, v)
        return v

    return check


def _paths(ctx: Context, key: str, v: Any) -> Any:
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
        raise fail(ctx.where, key, "a list of steps.csv paths", v)
    return v


@dataclass(frozen=True)
class CostModelConfig:
    """The simulator's step times: an analytic roofline, or a model calibrated from an
    engine ``profile`` (plus ``replay_steps``). Roofline values the YAML leaves out come
    from :func:`sched_lab.sim.analytic_defaults.defaults` of its model and hardware."""

    flops_efficiency: float = option(0.7, is_num(MIN_EFFICIENCY, 1.0))  # share of peak FLOP/s
    # achieved share of peak memory bandwidth
    bandwidth_efficiency: float = option(0.85, is_num(MIN_EFFICIENCY, 1.0))
    step_overhead_s: float = option(0.002, is_num(0.0, MAX_STEP_OVERHEAD_S))  # fixed, per step
    # engine profile CSV (absolute)
    profile: Path | None = option(None, _optional_path("a path to an engine profile CSV"))
    replay_steps: tuple[Path, ...] = option((), _paths)  # steps.csv of engine runs (absolute)
    # an engine run's steps.csv whose measured durations the steps take, in order
    # (lab/sim/replayed.py); replaces the analytic and the calibrated model
    durations_from: Path | None = option(None, _optional_path("a path to a run's steps.csv"))
    # GPUs per simulated replica (lab/sim/cost_model.py)
    tensor_parallel_size: int = option(1, is_int())
    # the host's part of an analytic step (planning, input prep, launch; lab/sim/cost_model.py):
    # seconds per step (at most step_overhead_s) and per sequence
    host_overhead_s: float = option(0.0, is_num(0.0, MAX_STEP_OVERHEAD_S))
    host_per_seq_s: float = option(0.0, is_num(0.0, MAX_HOST_PER_SEQ_S))

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


def parse_cost_model(
    ctx: Context, raw: Any, fitted: Any = GUESS, shape: str = ""
) -> CostModelConfig:
    """``fitted``: the analytic defaults applied where the YAML leaves a key out; ``shape``
    names that model and hardware in messages. Paths must exist when the backend reads it."""
    where = ctx.where
    cm = walk(ctx, "cost_model", raw, CostModelConfig, fitted.values)
    profile, steps, replayed = cm["profile"], cm["replay_steps"], cm["durations_from"]
    if steps and profile is None:
        raise ConfigError(f"{where}: cost_model.replay_steps needs cost_model.profile")
    if replayed is not None and profile is not None:
        raise ConfigError(
            f"{where}: cost_model.durations_from replaces the cost model: drop cost_model.profile"
        )
    used = "cost_model" in ctx.reads
    if used and cm["host_overhead_s"] > cm["step_overhead_s"]:  # the engine refuses it
        default = "" if "step_overhead_s" in raw else f", the default for {shape}"
        raise ConfigError(
            f"{where}: cost_model.host_overhead_s: expected at most cost_model.step_overhead_s "
            f"({cm['step_overhead_s']:g} s{default}; the host's part of the fixed step cost), got "
            f"{cm['host_overhead_s']:g}"
        )
    if replayed is not None and cm["tensor_parallel_size"] != 1:
        raise ConfigError(
            f"{where}: cost_model.tensor_parallel_size: {cm['tensor_parallel_size']} with "
            "cost_model.durations_from, whose steps take the engine run's measured times and "
            "its KV capacity (its own engine.tensor_parallel_size): drop it"
        )
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

    def resolve(key: str, value: str | None) -> Path | None:
        if value is None:
            return None
        return existing(ctx, key, value, "file") if used else paths.resolve(value, ctx.base_dir)

    cm["profile"] = resolve("cost_model.profile", profile)
    cm["replay_steps"] = tuple(
        resolve(f"cost_model.replay_steps[{i}]", p) for i, p in enumerate(steps)
    )
    seen: dict[Path, int] = {}
    for i, p in enumerate(cm["replay_steps"]):
        j = seen.setdefault(Path(p).resolve(), i)
        if j != i:  # fitted twice, and never held out from itself (lab/sim/calibrated.py noise)
            raise ConfigError(
                f"{where}: cost_model.replay_steps[{i}]: {steps[i]} is replay_steps[{j}] again; "
                "expected each engine run once"
            )
    cm["durations_from"] = resolve("cost_model.durations_from", replayed)
    return CostModelConfig(**cm)


# ---------------------------------------------------------------------------- slo, report
@dataclass(frozen=True)
class SLOConfig:
    """Latency targets (seconds, None: no target) for goodput and SLO attainment."""

    ttft_s: float | None = option(None, is_num(0.0, lo_open=True, optional=True))
    tpot_s: float | None = option(None, is_num(0.0, lo_open=True, optional=True))
    e2e_s: float | None = option(None, is_num(0.0, lo_open=True, optional=True))

    def to_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


def parse_slo(ctx: Context, raw: Any, key: str = "slo") -> SLOConfig:
    return SLOConfig(**walk(ctx, key, raw, SLOConfig))


def _percentiles(ctx: Context, key: str, v: Any) -> tuple[float, ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise fail(ctx.where, key, "a list of numbers in (0, 100]", v)
    for i, p in enumerate(v):
        check_num(ctx.where, f"{key}[{i}]", p, 0.0, 100.0, lo_open=True)
    return tuple(float(p) for p in v)


def _ids(ctx: Context, key: str, v: Any) -> tuple[str, ...]:
    """Request ids as text, each once, in the order first given (7 and '7' are one id)."""
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, (str, int)) for x in v):
        raise fail(ctx.where, key, "a list of request ids", v)
    return tuple(dict.fromkeys(str(x) for x in v))


def _window(ctx: Context, key: str, v: Any) -> tuple[float, float] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise fail(ctx.where, key, "[start, end] in seconds", v)
    lo = check_num(ctx.where, f"{key}[0]", v[0])
    hi = check_num(ctx.where, f"{key}[1]", v[1])
    if hi <= lo:
        raise fail(ctx.where, key, "[start, end] with end > start", v)
    return (float(lo), float(hi))


@dataclass(frozen=True)
class ReportConfig:
    """What the results folder shows beyond the metrics.

    metric_percentiles: percentiles of the vLLM-format result files (vLLM's
        ``--metric-percentiles``).
    timeline_slowest / timeline_by: the timeline shows the slowest N requests by ``e2e`` or
        ``ttft``, unless ``timeline_ids`` or ``timeline_window_s`` ([start, end] s) is given.
    """

    metric_percentiles: tuple[float, ...] = option((50.0, 90.0, 99.0, 99.9), _percentiles)
    timeline_slowest: int = option(12, is_int(lo=1))
    timeline_by: str = option("e2e", is_choice(("e2e", "ttft")))
    timeline_ids: tuple[str, ...] = option((), _ids)
    timeline_window_s: tuple[float, float] | None = option(None, _window)


def parse_report(ctx: Context, raw: Any) -> ReportConfig:
    return ReportConfig(**walk(ctx, "report", raw, ReportConfig))


# ---------------------------------------------------------------------------- engine
def _model_dir(ctx: Context, key: str, v: Any) -> Any:
    if not isinstance(v, str):
        raise fail(ctx.where, key, "a model directory (config.json + safetensors)", v)
    return v


def _device(ctx: Context, key: str, v: Any) -> Any:
    if not isinstance(v, str) or not _DEVICE.fullmatch(v):
        raise fail(ctx.where, key, "cpu, cuda or cuda:N", v)
    return v


def _cuda_graphs(ctx: Context, key: str, v: Any) -> Any:
    if v is not None and not isinstance(v, bool):
        raise fail(ctx.where, key, "true, false or null (on with CUDA and triton)", v)
    return v


@dataclass(frozen=True)
class EngineConfig:
    """The real engine (``backend: engine``); checked only when the backend reads it."""

    # model directory: config.json + safetensors (absolute)
    model_path: Path | None = option(None, _model_dir)
    device: str = option("cpu", _device)  # cpu | cuda | cuda:N
    dtype: str = option("auto", is_choice(DTYPES))  # auto: the checkpoint's
    # lab/core/attention_names.py
    attention_backend: str = option("torch", is_choice(ATTENTION_BACKENDS))
    temperature: float = option(0.0, is_num(0.0))  # 0: greedy
    cuda_graphs: bool | None = option(None, _cuda_graphs)  # None: on with CUDA and triton
    mixed_graphs: bool = option(True, is_bool)  # false: only decode-only steps replay graphs
    kn_weights: bool = option(False, is_bool)  # projection weights in (K, N) memory order
    # CPU device: torch threads (None: min(4, cores), or OMP_NUM_THREADS)
    num_threads: int | None = option(None, is_int(optional=True))
    # ranks, one process each (backend/tp.py; cuda: one GPU each)
    tensor_parallel_size: int = option(1, is_int())
    # kernel of eager prefill chunks from position 0 (backend/attention/flash_varlen.py)
    prefill_attention: str = option("auto", is_choice(("auto", "triton", "flash_varlen")))
    # the triton backend's paged prefill kernel: base, or exp2 (backend/attention/prefill_exp2.py)
    triton_prefill_kernel: str = option("base", is_choice(("base", "exp2")))


def parse_engine(ctx: Context, raw: Any) -> EngineConfig:
    """The ``engine:`` section; when the backend does not read it, only its model path is
    made absolute."""
    used = "engine" in ctx.reads
    e = walk(ctx, "engine", raw, EngineConfig, checked=used)
    path = e["model_path"]
    if used:
        e["model_path"] = existing(
            ctx,
            "engine.model_path",
            path,
            "directory",
            "; make a model directory with `python -m sched_lab.backend.tools convert-smollm2` or "
            "`make-random-checkpoint`",
        )
    elif isinstance(path, str) and path:
        e["model_path"] = paths.resolve(path, ctx.base_dir)
    return EngineConfig(**e)


# ---------------------------------------------------------------------------- lora
LORA_ASSIGN = ("none", "uniform", "zipf")


def _adapter_dir(ctx: Context, key: str, v: Any) -> Any:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise fail(ctx.where, key, "a folder of PEFT adapters lora-0, lora-1, ... or null", v)
    return paths.resolve(v, ctx.base_dir)


MAX_LORA_RANK = 512
MAX_NUM_ADAPTERS = 100_000  # the slots and LRUs hold every name: bounded, so a run ends


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``--max-loras``, ``--max-cpu-loras``, ``--max-lora-rank``;
    rules in docs/lora.md). Absent: no adapters, and a trace that names one is refused."""

    max_loras: int = option(1, is_int())  # distinct adapters in one step: GPU slots
    # host LRU of adapters; null: max_loras
    max_cpu_loras: int | None = option(None, is_int(optional=True))
    # every simulated adapter has this rank; vLLM's largest --max-lora-rank is 512
    max_lora_rank: int = option(16, is_int(hi=MAX_LORA_RANK))
    # adapters named lora-0 .. lora-{N-1}
    num_adapters: int = option(1, is_int(hi=MAX_NUM_ADAPTERS))
    # requests with no lora_name of their own: none, uniform or zipf over the adapters
    assign: str = option("none", is_choice(LORA_ASSIGN))
    zipf_alpha: float = option(1.0, is_num(0.0))  # P(lora-i) ~ 1 / (i + 1) ** alpha
    base_share: float = option(0.0, is_num(0.0, 1.0))  # of assigned requests: base model
    adapter_dir: Path | None = option(None, _adapter_dir)  # the engine's PEFT adapters
    load_latency_ms: float = option(1.0, is_num(0.0, MAX_STEP_OVERHEAD_S * 1000))  # per load

    @property
    def cpu_loras(self) -> int:
        """The host LRU's capacity (``max_cpu_loras``, null: ``max_loras``)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def parse_lora(ctx: Context, raw: Any) -> LoRAConfig | None:
    """The ``lora:`` section, or None when it is absent (null)."""
    if raw is None:
        return None
    cfg = LoRAConfig(**walk(ctx, "lora", raw, LoRAConfig))
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise fail(
            ctx.where, "lora.max_cpu_loras", f"an integer >= lora.max_loras ({cfg.max_loras})",
            cfg.max_cpu_loras,
        )  # fmt: skip
    # (the default 1.0 is taken with any rule: a results folder's config.yaml writes it)
    if cfg.assign != "zipf" and cfg.zipf_alpha != LoRAConfig.zipf_alpha:
        raise ConfigError(
            f"{ctx.where}: lora.zipf_alpha: set only with lora.assign: zipf (assign is "
            f"{cfg.assign!r})"
        )
    if cfg.assign == "none" and cfg.base_share != LoRAConfig.base_share:
        raise ConfigError(
            f"{ctx.where}: lora.base_share: set only with lora.assign: uniform or zipf (with "
            "assign none no request is given an adapter, so none is kept on the base model)"
        )
    return cfg
