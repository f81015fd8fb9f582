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

Where things are: :mod:`~lab.config.sections` (the fixed-key sections: each field's type,
default and check), :mod:`~lab.config.trace` (the trace, or workload classes),
:mod:`~lab.config.policy_entries`, :mod:`~lab.config.cluster`, :mod:`~lab.config.walker`
(the checks and the walk), :mod:`~lab.config.backends` (what each backend reads),
:mod:`~lab.config.rules` (cross-feature rules, one table) and :mod:`~lab.config.load`.
"""

from __future__ import annotations

from lab.config import paths
from lab.config.backends import BACKENDS, ENGINE_PROFILE_TOKENS, SIM_PROFILE_TOKENS, Backend
from lab.config.cluster import CLUSTER_KEYS, MAX_REPLICAS, cluster_to_dict
from lab.config.load import (
    MAX_NAME_CHARS,
    TOP_KEYS,
    ExperimentConfig,
    check_name,
    load_config,
    validate,
)
from lab.config.policy_entries import DEFAULT_POLICIES, PolicyConfig
from lab.config.rules import RULES, Rule
from lab.config.sections import (
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
    ReportConfig,
    SchedulerConfig,
    SLOConfig,
    check_swap_blocks,
)
from lab.config.trace import RATE_SCALE_RANGE, ClassesConfig, TraceConfig, Workload, scale_label
from lab.core.attention_names import ATTENTION_BACKENDS

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
    "TOP_KEYS",
    "VICTIM_KEY",
    "Backend",
    "ClassesConfig",
    "CostModelConfig",
    "EngineConfig",
    "ExperimentConfig",
    "KVCacheConfig",
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
    "validate",
]
