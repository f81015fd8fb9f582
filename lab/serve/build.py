"""One serving instance from an experiment YAML: the backend's setup (lab/setup/), one policy
entry's scheduler with its limits and KV blocks, its executor, and the backend's text.

The scheduler is made as a run makes a replica (lab/run/experiment.py ``_replica_factory``):
the same limits, block manager, speculation, victim rule, async scheduling and policy
options. The trace of the YAML is not read: requests come over HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

from sched_lab.config import ExperimentConfig, PolicyConfig
from sched_lab.core.errors import ConfigError
from sched_lab.core.kv import make_block_manager
from sched_lab.core.lora import LoRASlots, adapter_names
from sched_lab.core.plan import Executor
from sched_lab.core.scheduler import Scheduler, SchedulerLimits
from sched_lab.policies import get_policy
from sched_lab.run.experiment import resolve_limits
from sched_lab.serve.loop import PlaceholderTokens
from sched_lab.serve.text import IdText, ModelText, PlaceholderText, engine_text
from sched_lab.setup import setup_for


@dataclass
class Served:
    """What the server runs: one scheduler and executor, the text, names for the API.
    ``samples_tokens``: the executor samples real tokens (the engine), so a request's
    sampling applies; the simulator's placeholder tokens ignore it."""

    cfg: ExperimentConfig
    policy: PolicyConfig
    scheduler: Scheduler
    executor: Executor
    text: PlaceholderText | IdText | ModelText
    model_name: str
    limits: SchedulerLimits
    samples_tokens: bool = False
    adapters: tuple[str, ...] = ()  # LoRA adapters a request's ``model`` may name


def pick_policy(cfg: ExperimentConfig, name: str | None) -> PolicyConfig:
    """The policy entry labelled (or named) ``name``; the first entry when None."""
    if name is None:
        return cfg.policies[0]
    for pol in cfg.policies:
        if name in (pol.label, pol.name):
            return pol
    known = ", ".join(p.label for p in cfg.policies)
    raise ConfigError(f"--policy: no entry {name!r} in policies; the YAML has: {known}")


def build(
    cfg: ExperimentConfig, policy: str | None, model_name: str | None, speed: float = 1.0
) -> Served:
    """Set the backend up (loads the engine's model) and make the scheduler and executor.
    A backend whose executor samples real tokens (``Setup.token_ids``) serves its model's
    text; the others serve placeholder tokens (lab/serve/text.py).

    Raises:
        UserError: one line naming the key (a cluster config, seeds, replayed durations, a bad
            policy entry, a model that does not load, ``speed`` with a measured clock).
    """
    if cfg.cluster is not None:
        raise ConfigError("cluster: sched-lab serve runs one replica; remove cluster:")
    if cfg.seeds is not None:
        raise ConfigError("seeds: sched-lab serve runs one replica on the clock; remove seeds:")
    pol = pick_policy(cfg, policy)
    setup = setup_for(cfg)
    setup.check()
    setup.prepare()
    cls = get_policy(pol.name)
    kv = cfg.kv_cache
    capacity = setup.num_gpu_blocks * kv.block_size
    limits = resolve_limits(cfg, pol, capacity, setup.max_position, cls.chunked_prefill)
    setup.check_policy(pol)
    blocks = make_block_manager(setup.num_gpu_blocks, setup.num_cpu_blocks, kv.block_size,
                                kv.watermark, pol.prefix_caching(kv))  # fmt: skip
    options = {
        "preemption_victim": cfg.scheduler.preemption_victim,
        "async_scheduling": cfg.scheduler.async_scheduling,
        **pol.options,
    }
    lo, adapters, lora = cfg.lora, (), None
    if lo is not None:
        adapters = adapter_names(lo.num_adapters)
        lora = LoRASlots(adapters, lo.max_loras, lo.cpu_loras)
    scheduler = cls(limits, blocks, speculative=pol.speculative, lora=lora, **options)
    executor = setup.executor(pol, limits, pol.label, 1.0)
    if hasattr(executor, "plan_match"):  # the steps of a recorded run, in its order
        raise ConfigError(
            "cost_model.durations_from: replays a recorded run's steps; a server needs a "
            "cost model (remove durations_from)"
        )
    if speed != 1.0 and getattr(executor, "wall_clock", False):
        raise ConfigError(f"--speed: the {setup.name} backend's steps take real time; expected 1")
    if setup.token_ids:
        text = engine_text(setup.model_dir())
    else:
        executor, text = PlaceholderTokens(executor), PlaceholderText()
    name = model_name or setup.model_id()
    return Served(cfg, pol, scheduler, executor, text, name, limits, setup.token_ids, adapters)
