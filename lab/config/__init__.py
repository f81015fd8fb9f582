"""Experiment YAML: a typed, frozen config with every default in one place.

Top-level keys (all optional but ``trace``; experiments/quickstart.yaml is an example):
``name``, ``backend`` (sim | engine), ``seed``, ``trace`` (one spec or a list of workload
classes), ``model``, ``hardware``, ``cost_model``, ``kv_cache``, ``scheduler``,
``policies``, ``slo``, ``engine``, ``check_invariants``, ``speculative``, ``cluster``,
``report``, ``lora`` and ``trace_file`` (the trace's path, sha256 and rows, written into results).

Load a file with :func:`load_config` or validate a mapping with :func:`validate`; read values
as attributes (``cfg.kv_cache.block_size``); :meth:`ExperimentConfig.to_dict` gives the
resolved config of results/<name>/config.yaml. Every mistake raises
:class:`~sched_lab.core.errors.ConfigError` with one line naming the file and the key path.
Each key's type, default and check live in :mod:`~sched_lab.config.sections`,
:mod:`~sched_lab.config.trace`, :mod:`~sched_lab.config.policy_entries` and :mod:`~sched_lab.config.cluster`;
cross-feature rules in :mod:`~sched_lab.config.rules`.
"""

from __future__ import annotations

from sched_lab.config import paths
from sched_lab.config.backends import BACKENDS, ENGINE_PROFILE_TOKENS, SIM_PROFILE_TOKENS, Backend
from sched_lab.config.cluster import CLUSTER_KEYS, MAX_REPLICAS, cluster_to_dict
from sched_lab.config.load import (
    MAX_NAME_CHARS,
    SWEEP_KEYS,
    TOP_KEYS,
    ExperimentConfig,
    check_name,
    check_seeds_flag,
    load_config,
    validate,
    with_seeds,
)
from sched_lab.config.policy_entries import DEFAULT_POLICIES, PolicyConfig
from sched_lab.config.rules import RULES, Rule
from sched_lab.config.sections import (
    ASYNC_KEY,
    DTYPES,
    GIB,
    LIMIT_KEYS,
    MAX_HOST_PER_SEQ_S,
    MAX_STEP_OVERHEAD_S,
    MAX_SWAP_SPACE_GIB,
    MIN_EFFICIENCY,
    VICTIM_KEY,
    CostModelConfig,
    EngineConfig,
    KVCacheConfig,
    LoRAConfig,
    ReportConfig,
    SchedulerConfig,
    SLOConfig,
    check_swap_blocks,
)
from sched_lab.config.trace import (
    RATE_SCALE_RANGE,
    ClassesConfig,
    TraceConfig,
    Workload,
    scale_label,
)
from sched_lab.core.attention_names import ATTENTION_BACKENDS

__all__ = [
    "ASYNC_KEY",
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "CLUSTER_KEYS",
    "DEFAULT_POLICIES",
    "DTYPES",
    "ENGINE_PROFILE_TOKENS",
    "GIB",
    "LIMIT_KEYS",
    "MAX_HOST_PER_SEQ_S",
    "MAX_NAME_CHARS",
    "MAX_REPLICAS",
    "MAX_STEP_OVERHEAD_S",
    "MAX_SWAP_SPACE_GIB",
    "MIN_EFFICIENCY",
    "RATE_SCALE_RANGE",
    "RULES",
    "SIM_PROFILE_TOKENS",
    "SWEEP_KEYS",
    "TOP_KEYS",
    "VICTIM_KEY",
    "Backend",
    "ClassesConfig",
    "CostModelConfig",
    "EngineConfig",
    "ExperimentConfig",
    "KVCacheConfig",
    "LoRAConfig",
    "PolicyConfig",
    "ReportConfig",
    "Rule",
    "SLOConfig",
    "SchedulerConfig",
    "TraceConfig",
    "Workload",
    "check_name",
    "check_swap_blocks",
    "cluster_to_dict",
    "load_config",
    "paths",
    "scale_label",
    "check_seeds_flag",
    "validate",
    "with_seeds",
]
