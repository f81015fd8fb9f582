"""One experiment: a trace, each policy (and each load when ``rate_scale`` is a list),
replayed through the simulator or the real engine, with metrics per run."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sched_lab.config import ExperimentConfig, PolicyConfig, paths
from sched_lab.core.errors import ConfigError, TraceError
from sched_lab.core.kv import has_prefix_identity, make_block_manager
from sched_lab.core.lora import LoRASlots, adapter_names
from sched_lab.core.plan import Executor
from sched_lab.core.request import Request, RequestStatus
from sched_lab.core.scheduler import Scheduler, SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.report.progress import Phase
from sched_lab.results import bands, cluster_metrics, fairness, metrics, spec_metrics, vllm_result
from sched_lab.results.run import Run
from sched_lab.setup import Setup, setup_for
from sched_lab.setup.sim import sim_model
from sched_lab.sim.cluster import ClusterResult, replay_cluster
from sched_lab.sim.records import ReplayResult
from sched_lab.sim.replay import replay
from sched_lab.traces.adapters import assign_adapters

log = logging.getLogger("sched_lab.run.experiment")


def resolve_limits(
    cfg: ExperimentConfig,
    policy: PolicyConfig,
    capacity_tokens: int,
    max_position: int,
    chunked: bool,
) -> SchedulerLimits:
    """A policy's limits: its own keys, else the ``scheduler`` section, else vLLM's defaults
    (max_model_len: the model's context clamped to the KV capacity; max_num_batched_tokens:
    2048 with chunked prefill, else max(max_model_len, 2048)).

    Raises:
        ConfigError: max_model_len beyond the model's context; a budget below max_num_seqs,
            or (without chunked prefill) below max_model_len.
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


def check_prefix_identity(requests: list[Request], cfg: ExperimentConfig, token_ids: bool) -> None:
    """With the prefix cache on: ConfigError unless some request has prefix identity and
    every hash block size is a multiple of the KV block size; with ``token_ids``, also if
    hash ids go past a prompt's hash blocks (generated tokens are not the ids' tokens)."""
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
            token_ids
            and r.hash_ids is not None
            and len(r.hash_ids) > -(-r.prompt_len // r.hash_block_size)
        ):
            raise ConfigError(
                f"{where}: request {r.request_id}: its hash ids cover tokens it will generate "
                "(multi-turn sessions of trace.prefix); on the engine those tokens are the "
                "model's own, not the ids' tokens, so a later turn would reuse KV of other "
                "tokens; run such traces with caching in the simulator"
            )


def check_adapters(requests: list[Request], cfg: ExperimentConfig) -> None:
    """Without a ``lora:`` section, ConfigError if a request names a LoRA adapter (the run
    would not be the one the trace asks for). With one, a request naming an adapter not
    configured is rejected at arrival (lab/core/lora.py); nothing to check here."""
    if cfg.lora is not None:
        return
    named = next((r for r in requests if r.lora_name), None)
    if named is not None:
        raise ConfigError(
            f"{cfg.name}: request {named.request_id} names LoRA adapter {named.lora_name!r} "
            "and the experiment has no lora: section; expected one (docs/lora.md) or a trace "
            "without lora_name"
        )


def prefix_routed_pools(cfg: ExperimentConfig) -> list[str]:
    """The keys (``cluster``, ``cluster.prefill``, ``cluster.decode``) of the pools of
    ``cluster:`` that route by prefix (``prefix_affinity``); empty without a cluster."""
    c = cfg.cluster
    if c is None:
        return []
    pools = [("cluster", c.pool)] if c.pool is not None else []
    pools += (
        [("cluster.prefill", c.prefill), ("cluster.decode", c.decode)] if c.disaggregated else []
    )
    return [key for key, pool in pools if pool.router == "prefix_affinity"]


def check_router_keys(requests: list[Request], cfg: ExperimentConfig) -> None:
    """ConfigError if a pool of ``cluster:`` routes by prefix (``prefix_affinity``) and no
    request has hash ids: every request would go to the replica with the fewest."""
    keys = prefix_routed_pools(cfg)
    if not keys or any(r.hash_ids for r in requests if r.status is not RequestStatus.DROPPED):
        return
    raise ConfigError(
        f"{cfg.name}: {keys[0]}.router: prefix_affinity routes by hash ids, and trace "
        f"format {cfg.trace.format!r} gives its requests none (every request would go "
        "to the replica with the fewest requests); expected a trace with hash ids or "
        "another router"
    )


def fresh(requests: list[Request]) -> list[Request]:
    """Copies of trace requests with runtime state reset (dropped rows keep status and reason)."""
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
            lora_name=r.lora_name,
            cache_salt=r.cache_salt,
            finish_reason=r.finish_reason,
        )
        if r.status is RequestStatus.DROPPED:
            c.status, c.reason = r.status, r.reason
        out.append(c)
    return out


def trace_info(cfg: ExperimentConfig, rows: int, sha256_before: str | None) -> dict[str, Any]:
    """The replayed trace's file (or None; relative to the experiment's folder or to the
    bundled data where it lies there, see :func:`sched_lab.config.paths.shown`), sha256 (or None)
    and ``rows`` read. ``sha256_before``: taken before reading.

    Raises:
        TraceError: the file changed while it was read.
        ConfigError: the config's ``trace_file`` names another sha256 or row count.
    """
    path = cfg.trace.path
    info = {
        "path": None if path is None else paths.shown(path, cfg.base_dir),
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
    """Replay the config's trace through every policy at every rate_scale; whatever can
    fail does so before the first replay. ``requests`` replaces the trace file (arrival
    times as given).

    Raises:
        ValueError: ``requests`` given with a rate_scale other than 1.
        UserError: a bad config or trace (one line).
    """
    return list(iter_runs(cfg, progress, requests))


def check_before_runs(cfg: ExperimentConfig) -> None:
    """What :func:`iter_runs` checks before any replay, short of reading the trace: the
    backend, its KV sizing and every policy's limits; only where the backend's
    :meth:`~sched_lab.setup.Setup.prepare` is cheap (the simulator's), else nothing.

    Raises:
        UserError: one line naming the key.
    """
    setup = setup_for(cfg)
    if not setup.cheap_prepare:
        return
    setup.check()
    setup.prepare()
    _resolve_policies(cfg, setup)


@dataclass
class _Experiment:
    """What every run of one experiment shares."""

    cfg: ExperimentConfig
    setup: Setup
    trace_info: dict[str, Any]  # trace_info()'s keys
    any_spec: bool  # some policy speculates: every run's steps get the spec columns
    progress: bool


@dataclass(frozen=True)
class _Planned:
    """One run before its replay: a policy entry at a load."""

    pol: PolicyConfig
    cls: type[Scheduler]
    limits: SchedulerLimits
    scale: float
    label: str


def iter_runs(
    cfg: ExperimentConfig, progress: bool = True, requests: list[Request] | None = None
) -> Iterator[Run]:
    """:func:`run_experiment`, yielding each run when its metrics are done."""
    if requests is not None and cfg.rate_scales != (1.0,):
        raise ValueError(
            "run_experiment: requests= takes arrival times as they are; "
            f"rate_scale must be 1, got {cfg.trace.spec.get('rate_scale')}"
        )
    setup = setup_for(cfg)
    setup.check()
    requests, tables, info = _load_trace(cfg, requests, progress)
    setup.prepare()
    policies = _resolve_policies(cfg, setup)
    for scale in cfg.rate_scales:  # every run can be made, before any replays
        n = None if requests is not None else _num_replayed(tables[scale])
        for pol, _, limits in policies:
            setup.check_run(pol, limits, cfg.run_label(pol, scale), scale, n, info["sha256"])
    any_spec = any(pol.speculative is not None for pol in cfg.policies)
    ex = _Experiment(cfg, setup, info, any_spec, progress)
    for scale in cfg.rate_scales:
        table = tables.pop(scale, None)
        if table is None:
            _prepare_trace(ex, requests)
        for pol, cls, limits in policies:
            planned = _Planned(pol, cls, limits, scale, cfg.run_label(pol, scale))
            if table is None:
                done, stop = _run(ex, planned, requests)
            else:  # requests of its own, made from the table: no list kept between runs
                done, stop = _run(ex, planned, _requests_from(ex, table), own=True)
            yield done
            if stop is not None:  # replicas cut short: the run is handed on, then the stop
                raise stop


def _load_trace(
    cfg: ExperimentConfig, requests: list[Request] | None, progress: bool
) -> tuple[list[Request] | None, dict[float, Any], dict[str, Any]]:
    """(requests for every load or None, else the trace table per rate_scale; trace info)."""
    from sched_lab.traces import load_table, scale_table

    if requests is not None:
        return requests, {}, {"path": None, "sha256": None, "rows": len(requests)}
    if cfg.trace.classes:
        from sched_lab.traces.classes import load_classes

        with Phase(f"loading {len(cfg.trace.classes)} workload classes", bars=progress):
            requests, rows = load_classes(cfg.trace.classes, cfg.base_dir, cfg.seed, cfg.slo.ttft_s)
        return requests, {}, {"path": None, "sha256": None, "rows": rows}
    before = sha256_of(cfg.trace.path)
    with Phase(f"loading trace ({cfg.trace.format})", bars=progress):
        table, rows = load_table({"seed": cfg.seed, **cfg.trace.spec}, cfg.base_dir)
    tables = {scale: scale_table(table, scale) for scale in cfg.rate_scales}
    return None, tables, trace_info(cfg, rows, before)


def _num_replayed(table: Any) -> int:
    dropped = 0 if table.drop_reason is None else (table.drop_reason != "").sum()
    return len(table) - int(dropped)


def _resolve_policies(
    cfg: ExperimentConfig, setup: Setup
) -> list[tuple[PolicyConfig, type[Scheduler], SchedulerLimits]]:
    """Each policy entry with its class and limits, checked against the backend."""
    bs = cfg.kv_cache.block_size
    out = []
    for pol in cfg.policies:
        cls = get_policy(pol.name)
        capacity = setup.num_gpu_blocks * bs
        out.append(
            (pol, cls, resolve_limits(cfg, pol, capacity, setup.max_position, cls.chunked_prefill))
        )
        setup.check_policy(pol)
    return out


def _requests_from(ex: _Experiment, table: Any) -> list[Request]:
    """A load's requests made from its trace table and prepared (:func:`_prepare_trace`):
    every call gives equal requests, never replayed."""
    trace = table.to_requests()
    _prepare_trace(ex, trace)
    return trace


def _prepare_trace(ex: _Experiment, trace: list[Request]) -> None:
    """A load's requests before its runs: SLOs, prefix identity, the backend's needs."""
    cfg = ex.cfg
    for r in trace:  # EDF's deadline for a single trace: the top-level TTFT SLO
        if r.ttft_slo_s is None:
            r.ttft_slo_s = cfg.slo.ttft_s
    if cfg.lora is not None:
        lo = cfg.lora
        names = adapter_names(lo.num_adapters)
        assign_adapters(trace, names, lo.assign, cfg.seed, lo.zipf_alpha, lo.base_share)
    check_adapters(trace, cfg)
    if any(pol.prefix_caching(cfg.kv_cache) for pol in cfg.policies):
        check_prefix_identity(trace, cfg, ex.setup.token_ids)
    check_router_keys(trace, cfg)
    ex.setup.prepare_trace(trace)


def _run(
    ex: _Experiment, run: _Planned, trace: list[Request], own: bool = False
) -> tuple[Run, KeyboardInterrupt | None]:
    """Replay one run over fresh copies of ``trace`` (``own``, without seeds: over ``trace``'s
    requests themselves, which must never have been replayed) and measure it. With ``seeds:
    N``: N replicas whose step times carry noise seeded (seed, k), k = 0..N-1; the run is
    replica 0's, its summary with the replicas' medians and bands (lab/results/bands.py).

    Returns:
        (the run, None); or, when an interruption (Ctrl-C, SIGTERM: a KeyboardInterrupt)
        stops the replicas after replica 0 finished, (the run with the bands of the k
        replicas that finished, summary ``seeds`` k and ``seeds_requested`` N; the
        interruption), for the caller to raise once it has handed the run on. Interrupted
        before replica 0 finished, the run is lost, as a plain run is.
    """
    seeds = ex.cfg.seeds
    if seeds is None:
        return _run_once(ex, run, trace, None, own), None
    first = _run_once(ex, run, trace, 0)
    summaries = [first.summary]
    stop = None
    try:
        for k in range(1, seeds):
            summaries.append(_run_once(ex, run, trace, k).summary)  # the rest: summaries only
    except KeyboardInterrupt as e:
        stop = e
        log.info("%s: stopped after %d of %d seeded replicas", run.label, len(summaries), seeds)
    first.summary.update(bands.band_fields(summaries, seeds))
    return first, stop


def _run_once(
    ex: _Experiment, run: _Planned, trace: list[Request], seed: int | None, own: bool = False
) -> Run:
    """One replay of the run (with ``seed``: seeded replica ``seed``) and its metrics;
    ``own``: replays ``trace``'s requests themselves, not copies."""
    ex.setup.begin_run()
    run_requests = trace if own else fresh(trace)
    result, executor = _replay(ex, run, run_requests, seed)
    rows = metrics.in_trace_order(run_requests, result.requests)  # dropped rows too
    df, itl, summary, vllm, itl_tail = _measure(ex, run, result, rows, executor, seed)
    if result.failure:
        summary["failure"] = result.failure
    log.info("%s: %d steps in %.2f s", _tag(run, seed), summary["num_steps"], result.wall_s)
    ex.setup.end_run(run.label, summary["num_steps"])
    if result.failure:
        log.error("%s stopped: %s", _tag(run, seed), result.failure)
    return Run(run.label, run.pol.label, run.scale, result, df, itl, summary, vllm, itl_tail)


def _tag(run: _Planned, seed: int | None) -> str:
    """The run's label, with its seeded replica when it has one (``fcfs [seed 3]``)."""
    return run.label if seed is None else f"{run.label} [seed {seed}]"


def _replica_factory(
    ex: _Experiment, run: _Planned, seed: int | None = None
) -> Callable[[], tuple[Scheduler, Executor]]:
    """A factory of one replica: a fresh scheduler (own KV blocks) and executor; with
    ``seed``, the i-th executor made draws its step-time noise from (cfg.seed, seed, i)."""
    cfg, pol = ex.cfg, run.pol
    made = [0]  # executors made: a cluster's replicas each get a stream of their own

    def make_replica() -> tuple[Scheduler, Executor]:
        kv, lo = cfg.kv_cache, cfg.lora
        lora = None
        if lo is not None:
            lora = LoRASlots(adapter_names(lo.num_adapters), lo.max_loras, lo.cpu_loras)
        scheduler = run.cls(
            run.limits,
            make_block_manager(
                ex.setup.num_gpu_blocks,
                ex.setup.num_cpu_blocks,
                kv.block_size,
                kv.watermark,
                pol.prefix_caching(kv),
            ),
            speculative=pol.speculative,
            lora=lora,
            **{
                "preemption_victim": cfg.scheduler.preemption_victim,
                "async_scheduling": cfg.scheduler.async_scheduling,
                **pol.options,
            },
        )
        stream = None if seed is None else (cfg.seed, seed, made[0])
        made[0] += 1
        return scheduler, ex.setup.executor(pol, run.limits, run.label, run.scale, stream)

    return make_replica


def _replay(
    ex: _Experiment, run: _Planned, run_requests: list[Request], seed: int | None = None
) -> tuple[ReplayResult, Executor | None]:
    """The run's replay and its executor (None for a cluster)."""
    cfg = ex.cfg
    make_replica = _replica_factory(ex, run, seed)
    replayed = [r for r in run_requests if r.status is not RequestStatus.DROPPED]
    n = len(replayed)
    with Phase(f"{_tag(run, seed)}: replay {n:,} requests", n, "req", ex.progress) as phase:
        if cfg.cluster is not None:
            result = replay_cluster(
                replayed,
                cfg.cluster,
                make_replica,
                sim_model(cfg).kv_bytes_per_token,
                cfg.seed,
                cfg.check_invariants,
                phase.replay_callback,
            )
            return result, None
        scheduler, executor = make_replica()
        result = replay(
            replayed,
            scheduler,
            executor,
            check_invariants=cfg.check_invariants,
            progress=phase.replay_callback,
        )
    return result, executor


def _measure(
    ex: _Experiment,
    run: _Planned,
    result: ReplayResult,
    rows: list[Request],
    executor: Executor | None,
    seed: int | None = None,
) -> tuple[pd.DataFrame, np.ndarray, dict[str, Any], dict[str, Any], np.ndarray]:
    """(request table, ITL CDF points, summary, vLLM result, ITL tail points); adds the
    speculative step columns to ``result.steps``."""
    cfg, spec = ex.cfg, run.pol.speculative
    with Phase(f"{_tag(run, seed)}: metrics", len(rows), "req", ex.progress) as phase:
        df, itl = metrics.request_table(
            result, run.pol.label, run.scale, phase.set, rows, split_itl=spec is not None
        )
        summary = {
            "policy": run.pol.label,
            "rate_scale": run.scale,
            "limits": dataclasses.asdict(run.limits),
            "trace": ex.trace_info,
            **metrics.summarize(df, itl, result, cfg.slo.to_dict(), cfg.report.metric_percentiles),
            "num_cpu_blocks": ex.setup.num_cpu_blocks,
            "cost_model": ex.setup.run_info(),
        }
        if spec is not None:  # lab/results/spec_metrics.py
            summary["speculative"] = spec_metrics.run_summary(result.requests, spec)
            df = spec_metrics.add_request_columns(df, rows, spec.num_speculative_tokens)
        if ex.any_spec and not isinstance(result, ClusterResult):  # every run: one table
            n = result.num_steps
            result.steps.update(spec_metrics.step_columns(result, n))
        if cfg.trace.classes:  # per class and per tenant (lab/results/fairness.py)
            slos = fairness.class_slos(cfg.trace.classes, cfg.slo.to_dict())
            duration = summary["duration"]
            summary.update(
                fairness.summarize_classes(
                    df, rows, result, slos, duration, cfg.report.metric_percentiles
                )
            )
        vllm = _vllm(ex, run, df, itl, summary, result)
        if hasattr(executor, "plan_match"):  # replayed durations
            summary["plan_match"] = executor.plan_match()
        # Gaps as an array (up to metrics.GAPS_IN_MEMORY): both reorder it in place (no
        # copy), the CDF's sample (every j-th gap) first; the tail does not depend on the
        # order. A TokenGaps (more gaps) gives both exactly.
        itl_cdf = metrics.cdf_points(itl, overwrite=True)
        itl_tail = vllm_result.tail_points(itl, overwrite=True)
        itl = itl_cdf
        if isinstance(result, ClusterResult):
            df, summary["cluster"] = cluster_metrics.add_cluster(df, result, rows, summary)
    return df, itl, summary, vllm, itl_tail


def _vllm(
    ex: _Experiment,
    run: _Planned,
    df: pd.DataFrame,
    itl: np.ndarray,
    summary: dict[str, Any],
    result: ReplayResult,
) -> dict[str, Any]:
    """The run in the format of vLLM's ``vllm bench serve --save-result``."""
    vllm = vllm_result.vllm_result(
        df,
        itl,
        summary,
        result.step_end_s,
        metrics.DecodeOutputTokens(result),  # made a part at a time
        label=run.label,
        model=ex.setup.model_id(),
        backend=f"sched-lab-{ex.setup.name}",
        percentiles=ex.cfg.report.metric_percentiles,
    )
    vllm.update(spec_metrics.vllm_keys(summary))
    return vllm
