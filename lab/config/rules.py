"""Cross-feature rules: checks that span two sections, in one named table.

Each rule takes the validated config and the raw mapping, and raises a one-line
:class:`~sched_lab.core.errors.ConfigError` naming the key to change, or returns. A rule reads
the backend's row of :data:`sched_lab.config.backends.BACKENDS`, never its name.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sched_lab.config.backends import BACKENDS
from sched_lab.config.sections import ASYNC_KEY, CostModelConfig
from sched_lab.config.trace import TraceConfig
from sched_lab.config.walker import check_int
from sched_lab.core.errors import ConfigError
from sched_lab.sim.analytic_defaults import GUESS
from sched_lab.sim.analytic_defaults import defaults as analytic_defaults

# An ExperimentConfig (lab/config/load.py, which imports this module), every section valid.
ExperimentConfig = Any

log = logging.getLogger("sched_lab.config")


@dataclass(frozen=True)
class Draft:
    """What an ``early`` rule sees of the config: the file and the chosen backend."""

    source: str
    backend: str


@dataclass(frozen=True)
class Rule:
    """A named cross-feature rule; ``check(cfg, raw)`` raises ConfigError or returns. An
    ``early`` rule runs on a :class:`Draft` before the sections it concerns are walked."""

    name: str
    check: Callable[[ExperimentConfig, Mapping[str, Any]], None]
    early: bool = False

    @property
    def doc(self) -> str:
        return (self.check.__doc__ or "").strip().splitlines()[0]


def cluster_needs_simulator(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """A cluster of replicas is simulated: a backend that does not read ``cluster:`` refuses it."""
    if raw.get("cluster") is not None and "cluster" not in BACKENDS[cfg.backend].reads:
        raise ConfigError(
            f"{cfg.source}: cluster: the cluster is simulated only (backend: sim); backend: "
            "engine runs one replica on one device: remove cluster: or set backend: sim"
        )


def cluster_without_replayed_durations(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """``cost_model.durations_from`` replays one engine run's steps: not for a cluster."""
    if cfg.cluster is not None and cfg.cost_model.durations_from is not None:
        raise ConfigError(
            f"{cfg.source}: cost_model.durations_from replays one engine run's steps, which a "
            "cluster of replicas cannot: remove cluster: or durations_from"
        )


def seeds_need_priced_steps(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """``seeds`` draws noise around predicted step times: not with replayed durations."""
    if cfg.seeds is not None and cfg.cost_model.durations_from is not None:
        raise ConfigError(
            f"{cfg.source}: seeds: cost_model.durations_from replays one engine run's own "
            "step times, which have no noise to draw; remove seeds or durations_from"
        )


def speculative_async_needs_support(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """Speculative decoding with async scheduling needs a backend with async drafts (the
    engine has no device-side drafts for async steps)."""
    if BACKENDS[cfg.backend].async_speculative:
        return
    for i, p in enumerate(cfg.policies):
        if p.speculative is not None and p.options.get(ASYNC_KEY, cfg.scheduler.async_scheduling):
            raise ConfigError(
                f"{cfg.source}: policies[{i}] ({p.label}): speculative with {ASYNC_KEY}: true "
                f"runs in the simulator only; set {ASYNC_KEY}: false or backend: sim"
            )


def cluster_is_synchronous(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """The cluster simulator runs synchronous replicas: no async scheduling in any policy
    (the message names the key where async was turned on)."""
    if cfg.cluster is None:
        return
    pols = cfg.policies
    on = [f"policies[{i}].{ASYNC_KEY}" for i, p in enumerate(pols) if p.options.get(ASYNC_KEY)]
    if cfg.scheduler.async_scheduling and not all(ASYNC_KEY in p.options for p in pols):
        on.insert(0, f"scheduler.{ASYNC_KEY}")
    if on:
        raise ConfigError(
            f"{cfg.source}: {on[0]}: the cluster simulator runs synchronous replicas only; "
            f"remove cluster: or set {ASYNC_KEY}: false"
        )


_WARNED: set[str] = set()  # simulator-only keys already warned about (once a process)


def measured_steps_refuse_simulator_keys(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """A backend that measures its step times refuses the simulator's keys that name
    something it has but sets otherwise (host time, tensor parallelism, acceptance), and
    warns once about the rest."""
    if BACKENDS[cfg.backend].simulated_steps:
        return
    where, cm = cfg.source, cfg.cost_model
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
    tp, engine_tp = cm.tensor_parallel_size, cfg.engine.tensor_parallel_size
    if tp != 1 and tp != engine_tp:
        raise ConfigError(
            f"{where}: cost_model.tensor_parallel_size: {tp} GPUs per simulated replica; the "
            f"engine's tensor parallelism is engine.tensor_parallel_size ({engine_tp}): set "
            "that one"
        )
    named = isinstance(cfg.model, str) and isinstance(cfg.hardware, str)
    defaults = (analytic_defaults(cfg.model, cfg.hardware) if named else GUESS).values
    simulated = ("flops_efficiency", "bandwidth_efficiency", "step_overhead_s", "profile",
                 "replay_steps")  # fmt: skip
    ignored = [
        f"cost_model.{f.name}"
        for f in dataclasses.fields(CostModelConfig)
        if f.name in simulated and getattr(cm, f.name) != defaults.get(f.name, f.default)
    ]
    ignored += _engine_speculative(cfg)
    line = (
        f"{where}: backend engine measures its step times and acceptance, so it ignores the "
        f"simulator-only {', '.join(ignored)}"
    )
    if ignored and line not in _WARNED:
        _WARNED.add(line)
        log.warning(line)


def _engine_speculative(cfg: ExperimentConfig) -> list[str]:
    """The speculative keys the engine ignores; raises for ``acceptance_from``."""
    ignored, seen = [], set()
    for i, p in enumerate(cfg.policies):
        spec, key = p.speculative, f"policies[{i}].speculative" if p.own_speculative else ""
        if spec is None or id(spec) in seen:
            continue
        seen.add(id(spec))
        key = key or "speculative"
        if spec.acceptance_from is not None:
            raise ConfigError(
                f"{cfg.source}: {key}.acceptance_from: the simulator's acceptance, taken from an "
                "engine run; the engine verifies its own drafts: remove it or set backend: sim"
            )
        if spec.acceptance_rates is not None and spec.method != "synthetic":
            ignored.append(f"{key}.acceptance_rates (method {spec.method})")
    return ignored


def hash_blocks_hold_kv_blocks(cfg: ExperimentConfig, raw: Mapping[str, Any]) -> None:
    """``trace.hash_block_size`` (tokens per hash id, :mod:`sched_lab.traces.prefix`) is a multiple
    of ``kv_cache.block_size``: when given, when ``prefix`` makes ids, and for Mooncake's
    512 with prefix caching on."""
    trace, kv = cfg.trace, cfg.kv_cache
    if not isinstance(trace, TraceConfig):
        return
    spec = trace.spec
    if "hash_block_size" in spec:
        size = check_int(cfg.source, "trace.hash_block_size", spec["hash_block_size"])
        why = ""
    elif "prefix" in spec:
        from sched_lab.traces.prefix import PREFIX_HASH_BLOCK_SIZE

        size, why = PREFIX_HASH_BLOCK_SIZE, " (the default for trace.prefix)"
    elif trace.format == "mooncake" and kv.enable_prefix_caching:
        from sched_lab.traces.loaders import MOONCAKE_HASH_BLOCK_SIZE

        size, why = MOONCAKE_HASH_BLOCK_SIZE, " (Mooncake's default)"
    else:
        return
    if size % kv.block_size:
        raise ConfigError(
            f"{cfg.source}: trace.hash_block_size: {size}{why} is not a multiple of "
            f"kv_cache.block_size {kv.block_size}; expected a multiple, so that every KV "
            "block lies inside one hash block"
        )


RULES: tuple[Rule, ...] = (
    Rule("cluster_needs_simulator", cluster_needs_simulator, early=True),
    Rule("cluster_without_replayed_durations", cluster_without_replayed_durations),
    Rule("seeds_need_priced_steps", seeds_need_priced_steps),
    Rule("speculative_async_needs_support", speculative_async_needs_support),
    Rule("cluster_is_synchronous", cluster_is_synchronous),
    Rule("measured_steps_refuse_simulator_keys", measured_steps_refuse_simulator_keys),
    Rule("hash_blocks_hold_kv_blocks", hash_blocks_hold_kv_blocks),
)


def apply_rules(cfg: ExperimentConfig | Draft, raw: Mapping[str, Any]) -> None:
    """Run :data:`RULES` in order (early ones on a :class:`Draft`); the first that refuses
    raises."""
    early = isinstance(cfg, Draft)
    for rule in RULES:
        if rule.early == early:
            rule.check(cfg, raw)
