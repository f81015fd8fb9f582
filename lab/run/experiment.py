"""One experiment: a trace, each policy (and each load when ``rate_scale`` is a list),
replayed through the simulator or the real engine, with metrics per run."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab.config import ExperimentConfig, PolicyConfig, check_swap_blocks, paths
from lab.core.errors import ConfigError, TraceError
from lab.core.kv import has_prefix_identity, make_block_manager
from lab.core.request import Request, RequestStatus
from lab.core.scheduler import SchedulerLimits
from lab.report.progress import Phase
from lab.results import cluster_metrics, fairness, metrics, spec_metrics, vllm_result
from lab.sim import spec_executor
from lab.sim.cluster import ClusterResult, replay_cluster
from lab.sim.cost_model import (
    AnalyticCostModel,
    CostModelExecutor,
    activation_bytes,
    num_cpu_blocks,
    num_gpu_blocks,
)
from lab.sim.hardware import HARDWARE
from lab.sim.models import MODELS
from lab.sim.records import ReplayResult
from lab.sim.replay import replay
from policies import get_policy

log = logging.getLogger("lab.run.experiment")


@dataclass
class Run:
    """One policy at one load."""

    label: str
    policy: str
    rate_scale: float
    result: ReplayResult
    requests: pd.DataFrame
    itl_cdf_s: np.ndarray  # ITL at CDF levels linspace(0, 1, len): metrics.cdf_points
    summary: dict[str, Any]
    # The run in the format of vLLM's `vllm bench serve --save-result` (lab/results/vllm_result.py)
    vllm: dict[str, Any] = field(default_factory=dict)
    # ITL tail: (fraction of gaps above, gap in s), shape (2, n): vllm_result.tail_points
    itl_tail_s: np.ndarray | None = None


def resolve_limits(
    cfg: ExperimentConfig,
    policy: PolicyConfig,
    capacity_tokens: int,
    max_position: int,
    chunked: bool,
) -> SchedulerLimits:
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

    def pick(key: str) -> int | None:
        return policy.limit(key, cfg.scheduler)

    where = f"policies[{policy.label}]"
    if pick("max_model_len") is not None and pick("max_model_len") > max_position:
        raise ConfigError(
            f"{where}: max_model_len {pick('max_model_len')} exceeds the model's "
            f"context length (max_position_embeddings {max_position})"
        )
    max_len = pick("max_model_len") or min(max_position, capacity_tokens)
    budget = pick("max_num_batched_tokens") or (2048 if chunked else max(max_len, 2048))
    seqs = pick("max_num_seqs")
    if budget < seqs:
        raise ConfigError(
            f"{where}: max_num_batched_tokens {budget} must be >= max_num_seqs {seqs}"
        )
    if not chunked and budget < max_len:
        raise ConfigError(
            f"{where}: max_num_batched_tokens {budget} is below max_model_len {max_len}: "
            f"without chunked prefill a long prompt could never be scheduled"
        )
    return SchedulerLimits(seqs, budget, max_len, cfg.scheduler.max_preemptions)


def sim_parts(cfg: ExperimentConfig) -> tuple[AnalyticCostModel, int, int]:
    """The simulator's cost model (analytic, or calibrated from ``cost_model.profile``) and
    its KV capacity (GPU blocks, CPU blocks)."""
    model, hw, kv = MODELS[cfg.model], HARDWARE[cfg.hardware], cfg.kv_cache
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
        from lab.sim.replayed import ReplayedDurations

        replayed = ReplayedDurations(cm.durations_from)
        gpu, cpu = replayed.capacity() or (gpu, cpu)
        return replayed, gpu, cpu
    if cm.profile is not None:
        from lab.sim.calibrated import CalibratedCostModel

        return CalibratedCostModel(cm.profile, cm.replay_steps), gpu, cpu
    return AnalyticCostModel(model, hw, **cm.analytic), gpu, cpu


def check_prefix_identity(requests: list[Request], cfg: ExperimentConfig) -> None:
    """With the prefix cache on: some request must carry prefix identity (hash ids or
    prompt token ids), and every hash block size must be a multiple of the KV block size.
    On the engine, hash ids must not go past the prompt's hash blocks (the engine keys
    blocks by hash ids, as the simulator does, so both make the same decisions; tokens the
    model generates are not the ids' tokens).

    Raises:
        ConfigError: one line naming the trace, the request and the key.
    """
    where = f"{cfg.name}: kv_cache.enable_prefix_caching"
    bs = cfg.kv_cache.block_size
    live = [r for r in requests if r.status is not RequestStatus.DROPPED]
    if live and not any(has_prefix_identity(r) for r in live):
        raise ConfigError(
            f"{where}: trace format {cfg.trace.format!r} gives its requests no prefix identity "
            "(no hash_ids, no prompt token ids): nothing could ever be cached"
        )
    for r in live:
        if r.hash_ids is not None and (r.hash_block_size < bs or r.hash_block_size % bs):
            raise ConfigError(
                f"{where}: request {r.request_id}: hash_block_size {r.hash_block_size} is not "
                f"a multiple of kv_cache.block_size {bs}"
            )
        if (
            cfg.backend == "engine"
            and r.hash_ids is not None
            and len(r.hash_ids) > -(-r.prompt_len // r.hash_block_size)
        ):
            raise ConfigError(
                f"{where}: request {r.request_id}: its hash ids cover tokens it will generate "
                "(multi-turn sessions of trace.prefix); on the engine those tokens are the "
                "model's own, not the ids' tokens, so a later turn would reuse KV of other "
                "tokens; run such traces with caching in the simulator"
            )


ANALYTIC_NOTE = (
    "the analytic roofline ran: its efficiencies and step overhead are assumptions, not "
    "measurements of an engine; on the quickstart (Llama-3.1-8B, H200) its TTFT p50 is "
    "2.0-3.9x the calibrated model's (README); set cost_model.profile for measured step times"
)
# the same, when its efficiencies were fitted to the hardware's engine profiles
FITTED_NOTE = (
    "the analytic roofline ran, with efficiencies fitted to engine profiles "
    "(lab/sim/analytic_defaults.py), not the model calibrated from one: on the quickstart "
    "(Llama-3.1-8B, H200) its TTFT p50 is 18-28x the calibrated model's (README); set "
    "cost_model.profile for the calibrated step times"
)
NO_HOST_NOTE = (
    "cost_model.host_overhead_s and host_per_seq_s are 0: host time is 0, so asynchronous "
    "scheduling is predicted to save nothing"
)


def _shown(path: Path) -> str:
    """A data path as results show it: relative to the lab's data root when inside it (the
    same in every checkout), else absolute."""
    try:
        return str(path.relative_to(paths.DATA_ROOT))
    except ValueError:
        return str(path)


def cost_model_info(cfg: ExperimentConfig, cost_model: Any) -> dict[str, Any]:
    """What made a sim run's step times (summary key ``cost_model``): ``kind`` (analytic,
    calibrated, replayed), ``profile`` (its file), ``fingerprint`` (of the engine it
    describes), ``stale`` and ``why`` (a calibrated profile whose fingerprint is missing
    or names other backend sources than this checkout's; see
    :func:`lab.sim.calibrated.staleness`), and ``host_note``: why the model has no host
    time (asynchronous scheduling then saves nothing), empty when it has one."""
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
        from lab.sim.calibrated import staleness

        stale, why = staleness(cost_model.fingerprint)
        return {
            "kind": "calibrated",
            "profile": _shown(cm.profile),
            "fingerprint": cost_model.fingerprint,
            "stale": stale,
            "why": why,
            "host_note": cost_model.host_note,
        }
    no_host = cm.host_overhead_s == 0 and cm.host_per_seq_s == 0
    source = analytic_source(cfg)
    why = FITTED_NOTE if source["efficiencies"] == "profile" else ANALYTIC_NOTE
    return {"kind": "analytic", "profile": None, "fingerprint": None, "stale": False,
            "why": why, "host_note": NO_HOST_NOTE if no_host else "", **source}  # fmt: skip


def analytic_source(cfg: ExperimentConfig) -> dict[str, Any]:
    """Where an analytic run's efficiencies came from (summary keys of ``cost_model``):
    ``efficiencies`` "profile" (fitted to the shipped profiles of its hardware), "guess"
    (datasheet assumptions: no profile) or "yaml" (every value set in the YAML);
    ``efficiency_profiles`` (the files fitted), ``efficiency_error`` (the fit's median
    relative step-time error on their rows, None: unknown), ``efficiencies_from_yaml`` (the
    keys whose value is not the default; lab/sim/analytic_defaults.py), ``values`` (the
    three values the run used)."""
    from lab.sim.analytic_defaults import KEYS, defaults

    d = defaults(cfg.model, cfg.hardware)
    own = [k for k in KEYS if getattr(cfg.cost_model, k) != getattr(d, k)]
    return {
        "values": {k: getattr(cfg.cost_model, k) for k in KEYS},
        "efficiencies": "yaml" if len(own) == len(KEYS) else d.source,
        "efficiency_profiles": [] if len(own) == len(KEYS) else list(d.profiles),
        "efficiency_error": None if own else d.median_relative_error,
        "efficiencies_from_yaml": own,
    }


def engine_info(cfg: ExperimentConfig, executor: Any) -> dict[str, Any]:
    """An engine run's summary key ``cost_model``: measured, with the engine fingerprint."""
    from backend.profile import engine_fingerprint

    runner = getattr(executor.runner, "runner", executor.runner)  # rank 0's, under TP
    fp = engine_fingerprint(runner, cfg.engine.kn_weights)
    if cfg.engine.tensor_parallel_size > 1:
        fp["tensor_parallel_size"] = cfg.engine.tensor_parallel_size
    return {"kind": "measured", "profile": None, "fingerprint": fp, "stale": False, "why": ""}


def fresh(requests: list[Request]) -> list[Request]:
    """Copies of trace requests with runtime state reset (each run mutates its own); dropped
    trace rows keep their status and reason."""
    out = []
    for r in requests:
        c = Request(
            r.request_id,
            r.arrival_s,
            r.prompt_len,
            r.output_len,
            r.prompt_token_ids,
            r.hash_ids,
            r.priority,
            r.class_name,
            r.tenant,
            r.ttft_slo_s,
            hash_block_size=r.hash_block_size,
        )
        if r.status is RequestStatus.DROPPED:
            c.status, c.reason = r.status, r.reason
        out.append(c)
    return out


def trace_info(cfg: ExperimentConfig, rows: int, sha256_before: str | None) -> dict[str, Any]:
    """What identifies the trace a run replayed: its file (absolute path or None for a
    generated trace), the file's sha256 (None without a file) and ``rows``, the entries
    the format read (:func:`traces.load_table`).

    Args:
        sha256_before: the file's sha256 taken before it was read.

    Raises:
        TraceError: the file changed while it was read.
        ConfigError: the config's ``trace_file`` names another sha256 or row count (a
            results' config.yaml replayed after its trace file changed).
    """
    path = cfg.trace.path
    info = {
        "path": None if path is None else str(path),
        "sha256": None if path is None else sha256_of(path),
        "rows": rows,
    }
    if info["sha256"] != sha256_before:
        raise TraceError(f"trace.path: {path} changed while it was read; run again")
    expected = cfg.trace.expected or {}
    for key in ("sha256", "rows"):
        if expected.get(key) is not None and expected[key] != info[key]:
            raise ConfigError(
                f"trace_file.{key}: the trace has {key} {info[key]}, not the "
                f"{expected[key]} this config was written with (the file "
                "changed)"
            )
    return info


def sha256_of(path: Path | None) -> str | None:
    """The sha256 of a file's bytes (hex), or None for no file."""
    if path is None:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as e:
        raise TraceError(f"trace.path: {path}: cannot be read ({e.strerror})") from None
    return digest.hexdigest()


def run_experiment(
    cfg: ExperimentConfig, progress: bool = True, requests: list[Request] | None = None
) -> list[Run]:
    """Replay the config's trace through every policy at every rate_scale.

    The trace is read once (every load derives from the same table); everything that can
    fail (each policy's limits, each load's arrival times, the engine's model) fails
    before the first replay starts. ``requests``, when given, replaces the trace file
    (benchmarks build their own workload); their arrival times are used as they are, so
    ``rate_scale`` must then be 1.

    Raises:
        ValueError: ``requests`` given with a rate_scale other than 1.
        UserError: a bad config or trace (one line).
    """
    return list(iter_runs(cfg, progress, requests))


def iter_runs(
    cfg: ExperimentConfig, progress: bool = True, requests: list[Request] | None = None
) -> Iterator[Run]:
    """:func:`run_experiment` one run at a time: each run is yielded when its replay and
    metrics are done (the CLI keeps the completed ones when it is interrupted). Everything
    that can fail before a replay fails before the first one starts."""
    from traces import load_table, scale_table

    if requests is not None and cfg.rate_scales != (1.0,):
        raise ValueError(
            "run_experiment: requests= takes arrival times as they are; "
            f"rate_scale must be 1, got {cfg.trace.spec.get('rate_scale')}"
        )

    if cfg.backend == "engine" and importlib.util.find_spec("torch") is None:
        raise ConfigError(
            'backend: engine needs torch, which is not installed: pip install -e ".[engine]"'
        )
    if requests is None and cfg.trace.classes:
        from traces.classes import load_classes

        with Phase(f"loading {len(cfg.trace.classes)} workload classes", bars=progress):
            requests, rows = load_classes(cfg.trace.classes, cfg.base_dir, cfg.seed, cfg.slo.ttft_s)
        info = {"path": None, "sha256": None, "rows": rows}
    elif requests is None:
        before = sha256_of(cfg.trace.path)
        with Phase(f"loading trace ({cfg.trace.format})", bars=progress):
            table, rows = load_table({"seed": cfg.seed, **cfg.trace.spec}, cfg.base_dir)
        tables = {scale: scale_table(table, scale) for scale in cfg.rate_scales}
        info = trace_info(cfg, rows, before)
    else:
        info = {"path": None, "sha256": None, "rows": len(requests)}
    if cfg.backend == "engine":
        from backend.engine import assign_prompt_tokens  # imports torch
        from lab.setup.engine import engine_parts
        from traces.hash_tokens import assign_hash_prompt_tokens

        make_executor, gpu, cpu, max_position, vocab_size = engine_parts(cfg)
        info_cm = None
    else:
        cost_model, gpu, cpu = sim_parts(cfg)
        max_position = MODELS[cfg.model].max_position_embeddings
        info_cm = cost_model_info(cfg, cost_model)
    bs = cfg.kv_cache.block_size
    policies = []
    for pol in cfg.policies:
        cls = get_policy(pol.name)
        policies.append(
            (pol, cls, resolve_limits(cfg, pol, gpu * bs, max_position, cls.chunked_prefill))
        )
        if cfg.backend == "sim" and _speculative(pol) is not None:
            check_sim_speculative(cfg, pol)

    def async_of(pol) -> bool:  # a policy entry's own async_scheduling wins
        return bool(pol.options.get("async_scheduling", cfg.scheduler.async_scheduling))

    if cfg.backend == "sim" and cfg.cost_model.durations_from is not None:
        for scale in cfg.rate_scales:  # every run has recorded steps, before any replays
            t = tables.get(scale) if requests is None and not cfg.trace.classes else None
            dropped = 0 if t is None or t.drop_reason is None else (t.drop_reason != "").sum()
            n = None if t is None else len(t) - int(dropped)
            for pol, _, limits in policies:
                label = cfg.run_label(pol, scale)
                cost_model.executor(
                    pol.label, scale, dataclasses.asdict(limits), label, async_of(pol)
                )
                cost_model.check_trace(pol.label, info["sha256"], n, label)
    any_spec = any(_speculative(pol) is not None for pol in cfg.policies)
    for scale in cfg.rate_scales:
        trace = requests if requests is not None else tables.pop(scale).to_requests()
        for r in trace:  # EDF's deadline for a single trace: the top-level TTFT SLO
            if r.ttft_slo_s is None:
                r.ttft_slo_s = cfg.slo.ttft_s
        if any(pol.prefix_caching(cfg.kv_cache) for pol in cfg.policies):
            check_prefix_identity(trace, cfg)
        if cfg.backend == "engine":  # hash ids make shared prefixes real tokens
            assign_hash_prompt_tokens(trace, vocab_size, cfg.seed)
            assign_prompt_tokens(trace, vocab_size, cfg.seed)
        for pol, cls, limits in policies:
            label = cfg.run_label(pol, scale)

            def make_replica(cls=cls, limits=limits, pol=pol, label=label, scale=scale):
                nonlocal info_cm
                kv = cfg.kv_cache
                scheduler = cls(
                    limits,
                    make_block_manager(gpu, cpu, bs, kv.watermark, pol.prefix_caching(kv)),
                    speculative=pol.speculative,
                    **{
                        "preemption_victim": cfg.scheduler.preemption_victim,
                        "async_scheduling": cfg.scheduler.async_scheduling,
                        **pol.options,
                    },
                )
                if cfg.backend == "engine":
                    asynchronous = pol.options.get(
                        "async_scheduling", cfg.scheduler.async_scheduling
                    )
                    executor = make_executor(pol.speculative, asynchronous)
                    if info_cm is None:
                        info_cm = engine_info(cfg, executor)
                elif cfg.cost_model.durations_from is not None:
                    limits_d = dataclasses.asdict(limits)
                    executor = cost_model.executor(pol.label, scale, limits_d, label, async_of(pol))
                else:
                    executor = CostModelExecutor(cost_model, bs)
                    if _speculative(pol) is not None:
                        executor = spec_executor.wrap(
                            executor, cost_model, bs, _speculative(pol), HARDWARE[cfg.hardware],
                            cfg.base_dir,
                        )  # fmt: skip
                return scheduler, executor

            capped = _capped_steps(cost_model) if cfg.backend == "sim" else 0
            run_requests = fresh(trace)
            replayed = [r for r in run_requests if r.status is not RequestStatus.DROPPED]
            n = len(replayed)
            with Phase(f"{label}: replay {n:,} requests", n, "req", progress) as phase:
                executor = None  # the cluster's replicas make their own
                if cfg.cluster is None:
                    scheduler, executor = make_replica()
                    result = replay(
                        replayed,
                        scheduler,
                        executor,
                        check_invariants=cfg.check_invariants,
                        progress=phase.replay_callback,
                    )
                else:
                    result = replay_cluster(
                        replayed,
                        cfg.cluster,
                        make_replica,
                        MODELS[cfg.model].kv_bytes_per_token,
                        cfg.seed,
                        cfg.check_invariants,
                        phase.replay_callback,
                    )
            rows = metrics.in_trace_order(run_requests, result.requests)  # dropped rows too
            spec = _speculative(pol)
            with Phase(f"{label}: metrics", len(rows), "req", progress) as phase:
                df, itl = metrics.request_table(
                    result, pol.label, scale, phase.set, rows, split_itl=spec is not None
                )
                summary = {
                    "policy": pol.label,
                    "rate_scale": scale,
                    "limits": dataclasses.asdict(limits),
                    "trace": info,
                    **metrics.summarize(df, itl, result, cfg.slo.to_dict()),
                    "num_cpu_blocks": cpu,
                    "cost_model": info_cm,
                }
                if spec is not None:  # lab/results/spec_metrics.py
                    summary["speculative"] = spec_metrics.run_summary(result.requests, spec)
                    df = spec_metrics.add_request_columns(df, rows, spec.num_speculative_tokens)
                if any_spec and not isinstance(result, ClusterResult):  # every run: one table
                    n = len(result.steps["time_s"])
                    result.steps.update(spec_metrics.step_columns(result, n))
                if cfg.trace.classes:  # per class and per tenant (lab/results/fairness.py)
                    slos = fairness.class_slos(cfg.trace.classes, cfg.slo.to_dict())
                    duration = summary["duration_s"]
                    summary.update(fairness.summarize_classes(df, rows, result, slos, duration))
                vllm = vllm_result.vllm_result(
                    df,
                    itl,
                    summary,
                    result.step_end_s,
                    metrics.decode_output_tokens(result.steps),
                    label=label,
                    model=_model_id(cfg),
                    backend=f"sched-lab-{cfg.backend}",
                    percentiles=cfg.report.metric_percentiles,
                )
                vllm.update(spec_metrics.vllm_keys(summary))
                itl_tail = vllm_result.tail_points(itl)
                if hasattr(executor, "plan_match"):  # replayed durations
                    summary["plan_match"] = executor.plan_match()
                itl = metrics.cdf_points(itl, overwrite=True)  # all gaps: a run's largest array
                if isinstance(result, ClusterResult):
                    df, summary["cluster"] = cluster_metrics.add_cluster(df, result, rows, summary)
            if result.failure:
                summary["failure"] = result.failure
            log.info("%s: %d steps in %.2f s", label, summary["num_steps"], result.wall_s)
            capped = _capped_steps(cost_model) - capped if cfg.backend == "sim" else 0
            if capped:
                log.warning(CAPPED_HOST, label, capped, summary["num_steps"])
            if result.failure:
                log.error("%s stopped: %s", label, result.failure)
            yield Run(label, pol.label, scale, result, df, itl, summary, vllm, itl_tail)


CAPPED_HOST = (
    "%s: in %d of %d steps cost_model.host_overhead_s + host_per_seq_s * sequences exceeded "
    "the step time and was capped at it (a step's host part is at most the step: "
    "lab/sim/cost_model.py)"
)


def _capped_steps(cost_model: Any) -> int:
    """Steps so far whose analytic host time was capped at the step time (0 for models
    without the count)."""
    return getattr(cost_model, "num_capped_steps", 0)


def _speculative(pol: PolicyConfig):
    """The policy's resolved ``speculative:`` config (lab/core/spec.py), or None (off)."""
    return pol.speculative


def check_sim_speculative(cfg: ExperimentConfig, pol: PolicyConfig) -> None:
    """Fail before any replay when the simulator cannot run a policy's speculation: rates
    missing or bad, a draft model it cannot price, or replayed engine durations (the engine
    run's acceptance is not replayed step by step).

    Raises:
        ConfigError: one line naming the policy and the key.
    """
    spec = _speculative(pol)
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


def _model_id(cfg: ExperimentConfig) -> str:
    """The model as vLLM's ``model_id`` names it: the preset, or the engine's model folder."""
    if cfg.backend == "engine" and cfg.engine.model_path is not None:
        return Path(cfg.engine.model_path).name
    return cfg.model
