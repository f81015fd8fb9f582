"""The simulator backend's setup: the cost model, its KV capacity, an executor per run."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from sched_lab.config import ExperimentConfig, PolicyConfig, check_swap_blocks, paths
from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import Executor
from sched_lab.core.scheduler import SchedulerLimits
from sched_lab.setup.base import Setup, async_scheduling
from sched_lab.sim import spec_executor
from sched_lab.sim.cost_model import (
    AnalyticCostModel,
    CostModelExecutor,
    LoRACost,
    activation_bytes,
    num_cpu_blocks,
    num_gpu_blocks,
)
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS, ModelSpec, with_kv_dtype, with_quantization
from sched_lab.sim.noise import NoisyCostModel, StepNoise, fit_to_profile, profile_features

log = logging.getLogger("sched_lab.setup.sim")


class SimSetup(Setup):
    """Step times from a cost model; many runs may share a process pool."""

    name = "sim"
    cheap_prepare = True

    def prepare(self) -> None:
        self.cost_model, self.num_gpu_blocks, self.num_cpu_blocks = sim_parts(self.cfg)
        self.max_position = MODELS[self.cfg.model].max_position_embeddings
        self._info = cost_model_info(self.cfg, self.cost_model)
        self._capped = 0
        self.noise = None
        if self.cfg.seeds:  # what the seeded replicas draw from
            self.noise, borrowed = step_noise(self.cfg, self.cost_model)
            extra = {"borrowed_from": borrowed} if borrowed else {}
            self._info = {**self._info, "noise": {**self.noise.to_dict(), **extra}}

    def check_policy(self, pol: PolicyConfig) -> None:
        if pol.speculative is not None:
            check_sim_speculative(self.cfg, pol)

    def check_run(
        self,
        pol: PolicyConfig,
        limits: SchedulerLimits,
        label: str,
        scale: float,
        num_requests: int | None,
        trace_sha256: str | None,
    ) -> None:
        """With ``cost_model.durations_from``: the engine run recorded this run's steps."""
        if self.cfg.cost_model.durations_from is None:
            return
        self._replayed_executor(pol, limits, label, scale)
        self.cost_model.check_trace(pol.label, trace_sha256, num_requests, label)

    def executor(
        self,
        pol: PolicyConfig,
        limits: SchedulerLimits,
        label: str,
        scale: float,
        seed: tuple[int, ...] | None = None,
    ) -> Executor:
        if self.cfg.cost_model.durations_from is not None:
            return self._replayed_executor(pol, limits, label, scale)
        bs = self.cfg.kv_cache.block_size
        cost_model = self.cost_model
        if seed is not None and self.noise is not None:
            cost_model = NoisyCostModel(cost_model, self.noise, seed)
        executor = CostModelExecutor(cost_model, bs)
        if pol.speculative is not None:  # noise once per step: the verify extra is priced plain
            executor = spec_executor.wrap(
                executor, self.cost_model, bs, pol.speculative, HARDWARE[self.cfg.hardware],
                self.cfg.base_dir,
            )  # fmt: skip
        return executor

    def _replayed_executor(
        self, pol: PolicyConfig, limits: SchedulerLimits, label: str, scale: float
    ) -> Executor:
        limits_d = dataclasses.asdict(limits)
        asynchronous = async_scheduling(self.cfg, pol)
        return self.cost_model.executor(pol.label, scale, limits_d, label, asynchronous)

    def run_info(self) -> dict[str, Any]:
        return self._info

    def begin_run(self) -> None:
        self._capped = _capped_steps(self.cost_model)

    def end_run(self, label: str, num_steps: int) -> None:
        capped = _capped_steps(self.cost_model) - self._capped
        if capped:
            log.warning(CAPPED_HOST, label, capped, num_steps)

    def describe(self) -> str:
        cfg = self.cfg
        line = f"simulated `{cfg.model}` on `{cfg.hardware}` (cost model step times)"
        c = cfg.cluster
        if c is None:
            return line
        if c.pool is not None:
            return f"{line}, {c.pool.replicas} replicas behind router `{c.pool.router}`"
        return (
            f"{line}, {c.prefill.replicas} prefill replicas (router `{c.prefill.router}`) and "
            f"{c.decode.replicas} decode replicas (router `{c.decode.router}`), KV over "
            f"`{c.link.name}` ({c.link.bandwidth * 8 / 1e9:g} Gb/s) into a "
            f"{c.host_buffer_bytes / (1 << 30):g} GiB host buffer per decode replica"
        )

    def kv_device(self) -> str:
        return f"{self.cfg.hardware} (simulated)"


def sim_model(cfg: ExperimentConfig) -> ModelSpec:
    """The model preset with its KV cache in ``kv_cache.dtype`` (its KV bytes per token) and
    its projections in the top-level ``quantization`` (its weight bytes)."""
    return with_quantization(with_kv_dtype(MODELS[cfg.model], cfg.kv_cache.dtype), cfg.quantization)


def sim_parts(cfg: ExperimentConfig) -> tuple[AnalyticCostModel, int, int]:
    """The simulator's cost model (analytic, or calibrated from ``cost_model.profile``) and
    its KV capacity (GPU blocks, CPU blocks), both for ``kv_cache.dtype`` and the weight
    bytes of ``quantization`` (a calibrated model's step times are its profile's own)."""
    model, hw, kv = sim_model(cfg), HARDWARE[cfg.hardware], cfg.kv_cache
    tokens_per_step, seqs = cfg.profile_num_batched_tokens, cfg.scheduler.max_num_seqs
    tp = cfg.cost_model.tensor_parallel_size
    gpu = kv.num_gpu_blocks or num_gpu_blocks(
        model, hw, kv.block_size, kv.gpu_memory_utilization, tokens_per_step, seqs, tp
    )
    if gpu < 1:
        block_bytes = model.kv_bytes_per_token * kv.block_size
        tokens = num_gpu_blocks(model, hw, 1, kv.gpu_memory_utilization, tokens_per_step, seqs)
        if tokens >= 1:  # room for some KV, not for one block
            raise ConfigError(
                f"kv_cache.block_size: one block of {kv.block_size} tokens needs "
                f"{block_bytes / 1e9:.1f} GB of KV cache for {model.name}; a {hw.name} has "
                f"room for {tokens} tokens"
            )
        act = activation_bytes(model, tokens_per_step, seqs)
        raise ConfigError(
            f"kv_cache.gpu_memory_utilization: {kv.gpu_memory_utilization} of "
            f"{hw.memory_bytes / 1e9:.0f} GB leaves no room for KV after "
            f"{model.weight_bytes / 1e9:.1f} GB of weights and {act / 1e9:.1f} GB of "
            f"activations (scheduler.max_num_batched_tokens {tokens_per_step}, "
            f"scheduler.max_num_seqs {seqs})"
        )
    kv_bytes = gpu * model.kv_bytes_per_token * kv.block_size
    if tp > 1:  # per GPU: its share of the KV heads (lab/sim/cost_model.py)
        kv_bytes *= max(1, model.num_key_value_heads // tp) / model.num_key_value_heads
    if kv_bytes > hw.memory_bytes:
        raise ConfigError(
            f"kv_cache.num_gpu_blocks: {gpu} blocks of {kv.block_size} tokens need "
            f"{kv_bytes / 1e9:.1f} GB of KV cache for {model.name}, more than the "
            f"{hw.memory_bytes / 1e9:.0f} GB of a {hw.name}"
        )
    cpu = num_cpu_blocks(model, kv.block_size, kv.swap_space_gib)
    cm = cfg.cost_model
    if cm.durations_from is None:  # else the engine run's capacity (below)
        check_swap_blocks(kv, cpu, model.kv_bytes_per_token * kv.block_size, model.name)
    if cm.durations_from is not None:  # the engine run's durations and its KV capacity
        from sched_lab.sim.replayed import ReplayedDurations

        replayed = ReplayedDurations(cm.durations_from)
        gpu, cpu = replayed.capacity() or (gpu, cpu)
        return replayed, gpu, cpu
    lora = lora_cost(cfg)
    if cm.profile is not None:
        from sched_lab.sim.calibrated import CalibratedCostModel

        calibrated = CalibratedCostModel(cm.profile, cm.replay_steps, kv.dtype)
        if lora is not None:
            calibrated.lora_load_s = lora.load_s(model, hw)
        return calibrated, gpu, cpu
    return AnalyticCostModel(model, hw, **cm.analytic, lora=lora), gpu, cpu


def lora_cost(cfg: ExperimentConfig) -> LoRACost | None:
    """What the ``lora:`` section adds to a step's time (None without one)."""
    if cfg.lora is None:
        return None
    return LoRACost(cfg.lora.max_lora_rank, cfg.lora.load_latency_ms / 1000.0)


def step_noise(cfg: ExperimentConfig, cost_model: Any) -> tuple[StepNoise, list[str]]:
    """The step-time noise of seeded replicas (lab/sim/noise.py) and the profiles it was
    borrowed from (empty when it is this model's own): the calibrated model's own residuals;
    for the analytic roofline, its residuals on the profiles its efficiencies were fitted to;
    for hardware without a profile (datasheet-guess efficiencies), the residuals of the
    roofline on every shipped profile, each priced with that profile's own fitted
    efficiencies (the relative spread of another GPU's steps: an assumption, named in the
    summary as ``cost_model.noise.borrowed_from``). Raises ConfigError when every efficiency
    is set in the YAML (a model of the user's, with no measured steps behind it)."""
    if hasattr(cost_model, "noise"):
        return cost_model.noise, []
    from sched_lab.sim.analytic_defaults import FITTED, KEYS, ROOT, defaults
    from sched_lab.sim.calibrated import profile_block_size, profile_shape, read_profile

    source = analytic_source(cfg)
    if source["efficiencies"] == "yaml":
        raise ConfigError(
            f"{cfg.source}: seeds: the analytic model's efficiencies are all set in the YAML, "
            "not fitted to an engine profile, so there are no measured steps to draw noise "
            "from; set cost_model.profile (its residuals are the noise), or remove seeds"
        )
    borrowed = source["efficiencies"] == "guess"
    rels = sorted({p for e in FITTED.values() for p in e.profiles}) if borrowed else None
    frames, predicted = [], []
    for rel in rels or source["efficiency_profiles"]:
        df = read_profile(ROOT / rel)
        model, hardware = profile_shape(ROOT / rel)
        own = defaults(model, hardware) if borrowed else cfg.cost_model
        cm = AnalyticCostModel(MODELS[model], HARDWARE[hardware], *(getattr(own, k) for k in KEYS))
        bs = profile_block_size(ROOT / rel)
        predicted += [cm.step_time(f, bs) for f in profile_features(df)]
        frames.append(df)
    import pandas as pd

    # the roofline predicts every row without fitting it: its error is a held-out one; its
    # rows at >= 2x are its own misses (prompt rows it prices 2-7x short), not host stalls
    rows = pd.concat(frames, ignore_index=True)
    return fit_to_profile(rows, predicted, predicted, stalls=False), rels or []


def check_sim_speculative(cfg: ExperimentConfig, pol: PolicyConfig) -> None:
    """ConfigError naming the policy and key if the simulator cannot run its speculation
    (rates missing or bad, an unpriceable draft model, replayed durations)."""
    spec = pol.speculative
    where = f"policies[{pol.label}]"
    if cfg.cost_model.durations_from is not None:
        raise ConfigError(
            f"{where}: speculative with cost_model.durations_from is not supported: the "
            "simulator draws acceptance, so its plans would not be the engine run's"
        )
    if cfg.cluster is not None:
        raise ConfigError(f"{where}: speculative in a cluster run is not supported yet")
    try:
        spec_executor.acceptance_rates(spec, cfg.base_dir)
        if spec.method == "draft":
            spec_executor.draft_cost_model(spec, HARDWARE[cfg.hardware], cfg.base_dir)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


ANALYTIC_NOTE = (
    "the analytic roofline ran: its efficiencies and step overhead are assumptions, not "
    "measurements of an engine (the README compares its latencies with the calibrated "
    "model's); set cost_model.profile for measured step times"
)
# the same, when its efficiencies were fitted to the hardware's engine profiles
FITTED_NOTE = (
    "the analytic roofline ran, with efficiencies fitted to engine profiles "
    "(lab/sim/analytic_defaults.py), not the model calibrated from one (the README compares "
    "their latencies); set cost_model.profile for the calibrated step times"
)
NO_HOST_NOTE = (
    "cost_model.host_overhead_s and host_per_seq_s are 0: host time is 0, so asynchronous "
    "scheduling is predicted to save nothing"
)
CAPPED_HOST = (
    "%s: in %d of %d steps cost_model.host_overhead_s + host_per_seq_s * sequences exceeded "
    "the step time and was capped at it (a step's host part is at most the step: "
    "lab/sim/cost_model.py)"
)


def _shown(path: Path) -> str:
    """A path relative to the lab's data root when inside it, else absolute."""
    try:
        return str(path.relative_to(paths.DATA_ROOT))
    except ValueError:
        return str(path)


def cost_model_info(cfg: ExperimentConfig, cost_model: Any) -> dict[str, Any]:
    """Summary key ``cost_model``: ``kind`` (analytic, calibrated, replayed), ``profile``,
    ``fingerprint``, ``stale`` and ``why`` (:func:`sched_lab.sim.calibrated.staleness`),
    ``host_note`` (why the model has no host time, or empty), and for a calibrated run with a
    ``lora:`` section, ``lora_note`` when its LoRA compute is not priced as measured
    (:func:`calibrated_lora_note`; absent otherwise)."""
    cm = cfg.cost_model
    if cm.durations_from is not None:
        return {
            "kind": "replayed",
            "profile": _shown(cm.durations_from),
            "fingerprint": cost_model.fingerprint(),
            "stale": False,
            "why": "",
            "host_note": "",  # recorded durations hold the engine's own overlap
        }
    if cm.profile is not None:
        from sched_lab.backend.sources import checkout_engine
        from sched_lab.sim.calibrated import staleness

        stale, why = staleness(cost_model.fingerprint, checkout_engine())
        info = {
            "kind": "calibrated",
            "profile": _shown(cm.profile),
            "fingerprint": cost_model.fingerprint,
            "stale": stale,
            "why": why,
            "host_note": cost_model.host_note,
        }
        note = calibrated_lora_note(cfg, cost_model)
        return {**info, "lora_note": note} if note else info
    no_host = cm.host_overhead_s == 0 and cm.host_per_seq_s == 0
    source = analytic_source(cfg)
    why = FITTED_NOTE if source["efficiencies"] == "profile" else ANALYTIC_NOTE
    return {"kind": "analytic", "profile": None, "fingerprint": None, "stale": False,
            "why": why, "host_note": NO_HOST_NOTE if no_host else "", **source}  # fmt: skip


def calibrated_lora_note(cfg: ExperimentConfig, cost_model: Any) -> str:
    """Why a run with a ``lora:`` section is priced without, or with other, LoRA compute terms
    than its adapters' (summary key ``cost_model.lora_note``), or "" (also without LoRA)."""
    if cfg.lora is None:
        return ""
    if cost_model.lora_note:
        return cost_model.lora_note
    rank = cost_model.lora_rank
    if rank is not None and rank != cfg.lora.max_lora_rank:
        return (
            f"the profile's LoRA terms were measured with rank-{rank} adapters, the run's are "
            f"rank {cfg.lora.max_lora_rank} (lora.max_lora_rank): they are used unscaled"
        )
    return ""


def analytic_source(cfg: ExperimentConfig) -> dict[str, Any]:
    """``cost_model`` keys of an analytic run: ``efficiencies`` ("profile", "guess" or
    "yaml"), ``efficiency_profiles``, ``efficiency_error`` (median relative step-time error
    of the fit, or None), ``efficiencies_from_yaml`` and ``values``."""
    from sched_lab.sim.analytic_defaults import KEYS, defaults

    d = defaults(cfg.model, cfg.hardware)
    own = [k for k in KEYS if getattr(cfg.cost_model, k) != getattr(d, k)]
    return {
        "values": {k: getattr(cfg.cost_model, k) for k in KEYS},
        "efficiencies": "yaml" if len(own) == len(KEYS) else d.source,
        "efficiency_profiles": [] if len(own) == len(KEYS) else list(d.profiles),
        "efficiency_error": None if own else d.median_relative_error,
        "efficiencies_from_yaml": own,
    }


def _capped_steps(cost_model: Any) -> int:
    """Steps whose analytic host time was capped at the step time (0 if not counted)."""
    return getattr(cost_model, "num_capped_steps", 0)
