"""One experiment: a trace, each policy (and each load when ``rate_scale`` is a list),
replayed through the simulator or the real engine, with metrics per run."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab import metrics
from lab.config import rate_scales, scale_label
from lab.sim.cost_model import AnalyticCostModel, CostModelExecutor, num_cpu_blocks, num_gpu_blocks
from lab.core.errors import ConfigError
from lab.sim.hardware import HARDWARE
from lab.core.kv import BlockManager
from lab.sim.models import MODELS
from lab.sim.replay import ReplayResult, replay
from lab.core.request import Request, RequestStatus
from lab.core.scheduler import SchedulerLimits, get_policy

log = logging.getLogger("lab.experiment")


@dataclass
class Run:
    """One policy at one load."""

    label: str
    policy: str
    rate_scale: float
    result: ReplayResult
    requests: pd.DataFrame
    itl_s: np.ndarray
    summary: dict[str, Any]


def resolve_limits(cfg: dict, policy: dict, capacity_tokens: int, max_position: int,
                   chunked: bool) -> SchedulerLimits:
    """A policy's limits: its own keys, else the ``scheduler`` section, else defaults.

    Defaults as vLLM: max_model_len = the model's context length, clamped to the KV
    capacity (vLLM refuses to start instead); max_num_batched_tokens = 2048 with chunked
    prefill, else max(max_model_len, 2048).

    Raises:
        ConfigError: max_model_len beyond the model's context (vLLM refuses it too: the
            positions past it were never trained); a budget below max_num_seqs, or (without
            chunked prefill) below max_model_len, so that some request could never be
            scheduled.
    """
    sched = cfg["scheduler"]

    def pick(key):
        return policy.get(key) if policy.get(key) is not None else sched.get(key)

    where = f"policies[{policy['label']}]"
    if pick("max_model_len") is not None and pick("max_model_len") > max_position:
        raise ConfigError(f"{where}: max_model_len {pick('max_model_len')} exceeds the model's "
                          f"context length (max_position_embeddings {max_position})")
    max_len = pick("max_model_len") or min(max_position, capacity_tokens)
    budget = pick("max_num_batched_tokens") or (2048 if chunked else max(max_len, 2048))
    seqs = pick("max_num_seqs")
    if budget < seqs:
        raise ConfigError(f"{where}: max_num_batched_tokens {budget} must be >= max_num_seqs {seqs}")
    if not chunked and budget < max_len:
        raise ConfigError(
            f"{where}: max_num_batched_tokens {budget} is below max_model_len {max_len}: "
            f"without chunked prefill a long prompt could never be scheduled")
    return SchedulerLimits(seqs, budget, max_len, sched["max_preemptions"])


def sim_parts(cfg: dict, base_dir: Path = Path(".")) -> tuple[AnalyticCostModel, int, int]:
    """The simulator's cost model (analytic, or calibrated from ``cost_model.profile``) and
    its KV capacity (GPU blocks, CPU blocks)."""
    model, hw, kv = MODELS[cfg["model"]], HARDWARE[cfg["hardware"]], cfg["kv_cache"]
    gpu = kv["num_gpu_blocks"] or num_gpu_blocks(
        model, hw, kv["block_size"], kv["gpu_memory_utilization"],
        cfg["scheduler"]["max_num_batched_tokens"] or 2048, cfg["scheduler"]["max_num_seqs"])
    if gpu < 1:
        block_bytes = model.kv_bytes_per_token * kv["block_size"]
        tokens = num_gpu_blocks(model, hw, 1, kv["gpu_memory_utilization"],
                                cfg["scheduler"]["max_num_batched_tokens"] or 2048,
                                cfg["scheduler"]["max_num_seqs"])
        if tokens >= 1:  # room for some KV, not for one block
            raise ConfigError(
                f"kv_cache.block_size: one block of {kv['block_size']} tokens needs "
                f"{block_bytes / 1e9:.1f} GB of KV cache for {model.name}; a {hw.name} has "
                f"room for {tokens} tokens")
        raise ConfigError(
            f"kv_cache.gpu_memory_utilization: {kv['gpu_memory_utilization']} of "
            f"{hw.memory_bytes / 1e9:.0f} GB leaves no room for KV after "
            f"{model.weight_bytes / 1e9:.1f} GB of weights and the activations")
    kv_bytes = gpu * model.kv_bytes_per_token * kv["block_size"]
    if kv_bytes > hw.memory_bytes:
        raise ConfigError(
            f"kv_cache.num_gpu_blocks: {gpu} blocks of {kv['block_size']} tokens need "
            f"{kv_bytes / 1e9:.1f} GB of KV cache for {model.name}, more than the "
            f"{hw.memory_bytes / 1e9:.0f} GB of a {hw.name}")
    cpu = num_cpu_blocks(model, kv["block_size"], kv["swap_space_gib"])
    cm = dict(cfg["cost_model"])
    profile, replay_steps = cm.pop("profile"), cm.pop("replay_steps")
    if profile is not None:
        from lab.sim.calibrated import CalibratedCostModel

        steps = tuple(base_dir / p for p in replay_steps)
        return CalibratedCostModel(base_dir / profile, steps), gpu, cpu
    return AnalyticCostModel(model, hw, **cm), gpu, cpu


def fresh(requests: list[Request]) -> list[Request]:
    """Copies of trace requests with runtime state reset (each run mutates its own); dropped
    trace rows keep their status and reason."""
    out = []
    for r in requests:
        c = Request(r.request_id, r.arrival_s, r.prompt_len, r.output_len,
                    r.prompt_token_ids, r.hash_ids, r.priority)
        if r.status is RequestStatus.DROPPED:
            c.status, c.reason = r.status, r.reason
        out.append(c)
    return out


def run_experiment(cfg: dict, base_dir: Path, progress: bool = True,
                   requests: list[Request] | None = None) -> list[Run]:
    """Replay the config's trace through every policy at every rate_scale.

    ``requests``, when given, replaces the trace file (benchmarks build their own workload);
    their arrival times are used as they are, so ``rate_scale`` must then be 1.

    Raises:
        ValueError: ``requests`` given with a rate_scale other than 1.
    """
    return list(iter_runs(cfg, base_dir, progress, requests))


def iter_runs(cfg: dict, base_dir: Path, progress: bool = True,
              requests: list[Request] | None = None) -> Iterator[Run]:
    """:func:`run_experiment` one run at a time: each run is yielded when its replay and
    metrics are done (the CLI keeps the completed ones when it is interrupted)."""
    from traces import load_trace

    if requests is not None and rate_scales(cfg) != [1.0]:
        raise ValueError("run_experiment: requests= takes arrival times as they are; "
                         f"rate_scale must be 1, got {cfg['trace'].get('rate_scale')}")

    if cfg["backend"] == "engine":
        from backend.engine import assign_prompt_tokens, engine_parts  # imports torch

        make_executor, gpu, cpu, max_position, vocab_size = engine_parts(cfg, base_dir)
    else:
        cost_model, gpu, cpu = sim_parts(cfg, base_dir)
        max_position = MODELS[cfg["model"]].max_position_embeddings
    bs = cfg["kv_cache"]["block_size"]
    scales = rate_scales(cfg)
    for scale in scales:
        spec = {**cfg["trace"], "rate_scale": scale}
        spec.setdefault("seed", cfg["seed"])
        trace = requests if requests is not None else load_trace(spec, base_dir)
        if cfg["backend"] == "engine":
            assign_prompt_tokens(trace, vocab_size, cfg["seed"])
        for pol in cfg["policies"]:
            cls = get_policy(pol["name"])
            limits = resolve_limits(cfg, pol, gpu * bs, max_position, cls.chunked_prefill)
            options = {k: v for k, v in pol.items() if k in cls.options}
            scheduler = cls(limits, BlockManager(gpu, cpu, bs, cfg["kv_cache"]["watermark"]),
                            **options)
            if cfg["backend"] == "engine":
                executor = make_executor(scheduler)
            else:
                executor = CostModelExecutor(cost_model, bs)
            label = pol["label"] if len(scales) == 1 else f"{pol['label']}@x{scale_label(scale)}"
            run_requests = fresh(trace)  # not ``requests``: each load reloads the trace
            with _ProgressBar(progress, label, len(run_requests)) as bar:
                result = replay(run_requests, scheduler, executor,
                                check_invariants=cfg["check_invariants"], progress=bar)
            df, itl = metrics.request_table(result, pol["label"], scale)
            summary = {"policy": pol["label"], "rate_scale": scale,
                       "limits": dataclasses.asdict(limits),
                       **metrics.summarize(df, itl, result, cfg["slo"])}
            if result.failure:
                summary["failure"] = result.failure
            log.info("%s: %d steps in %.2f s", label, summary["num_steps"], result.wall_s)
            if result.failure:
                log.error("%s stopped: %s", label, result.failure)
            yield Run(label, pol["label"], scale, result, df, itl, summary)


class _ProgressBar:
    """A tqdm bar of ended requests (only on a terminal), used as a replay callback."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        self.enabled, self.label, self.total, self.bar = enabled, label, total, None

    def __enter__(self):
        if not self.enabled:
            return None
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, desc=self.label, unit="req", leave=True,
                        disable=None, mininterval=0.5)
        return self

    def __call__(self, num_ended: int, sim_time_s: float) -> None:
        self.bar.n = num_ended
        self.bar.set_postfix_str(f"t={sim_time_s:.0f}s", refresh=False)
        self.bar.refresh()

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            if exc[0] is None:
                self.bar.n = self.total
            self.bar.close()
