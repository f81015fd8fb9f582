"""Analytic step-time model (roofline) and the KV capacity rule; the simulator's executor.

Step time = max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s) + step overhead
          + swap time, with achieved = preset peak * efficiency.

* Swap time = host <-> device copies * the preset's ``host_link_latency_s`` + swapped bytes /
  ``host_link_bandwidth``. The engine (backend/kv_cache.py) gathers a swap's blocks on the
  device and copies each run of consecutive CPU block ids as one transfer, so the copies are
  the plan's ``num_swap_runs`` and a swapped block costs its bytes (block_size tokens of KV).

* FLOPs: 2 per weight per token (Kaplan et al. 2020, "Scaling Laws", §2.1), 2 per LM-head
  weight per sampled token, 4 * layers * heads * head_dim per attention (query, key) pair.
* Bytes: all weights once per step, the KV each decode or chunk reads, the KV it writes.
  Quantized weights (``ModelSpec.quantization``) read their stored bytes (lab/sim/models.py).
* FP8 weights (W8A8): the layer matmuls' FLOPs run at the preset's ``peak_flops_fp8`` (the
  LM head and attention stay at ``peak_flops``); weight-only int8/int4 dequantize to bf16
  and run at ``peak_flops``.
* Tensor parallelism over N GPUs (Megatron-LM, Shoeybi et al. 2019, §3): 1/N of the FLOPs,
  weight and KV bytes per GPU, plus 2 all-reduces per layer of tokens * hidden_size *
  dtype_bytes, each a ring costing 2(N-1)/N * bytes / link bandwidth + 2(N-1) * link latency
  on the preset's ``tp_link`` (Patarasuk & Yuan 2009; nccl-tests "Performance" notes).

LoRA (``lora=LoRACost``, only with a ``lora:`` section; docs/lora.md): shrink + expand
FLOPs 2 * rank * (in + out) per projection per token (``num_lora_tokens``), the weights of
each distinct adapter of the step read once (``num_loras``), both inside the roofline's max;
plus ``num_lora_loads`` x (adapter bytes / ``host_link_bandwidth`` + ``load_latency_s``),
an adapter copied host -> GPU before the step that first uses it (as swapped KV is).

Host and device time (asynchronous scheduling, vLLM V1's AsyncScheduler): ``host_time`` =
min(host_overhead_s + host_per_seq_s * sequences, step time), a share of the step, not added
to it; ``device_time`` = step time - host time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import SchedulerOutput, StepFeatures, StepResult
from sched_lab.sim.hardware import LINKS, Hardware
from sched_lab.sim.models import ModelSpec

GIB = 1 << 30


@dataclass(frozen=True)
class LoRACost:
    """What LoRA adds to a step: ``rank`` of every adapter, ``load_latency_s`` per adapter
    loaded (the fixed part; its bytes go over the host link)."""

    rank: int
    load_latency_s: float

    def load_s(self, model: ModelSpec, hardware: Hardware) -> float:
        """Seconds to load one adapter host -> GPU: bytes / host link bandwidth + latency."""
        nbytes = model.lora_adapter_bytes(self.rank)
        return nbytes / hardware.host_link_bandwidth + self.load_latency_s


class AnalyticCostModel:
    """Predicts step durations in seconds from a plan.

    Args:
        flops_efficiency: fraction of ``hardware.peak_flops`` reached (0 < x <= 1).
        bandwidth_efficiency: fraction of ``hardware.mem_bandwidth`` reached (0 < x <= 1).
        step_overhead_s: fixed seconds per step.
        tensor_parallel_size: GPUs one replica spans; > 1 needs the preset's ``tp_link``.
        host_overhead_s: host seconds per step before launch, part of ``step_overhead_s``.
        host_per_seq_s: host seconds per sequence of the step.

    The efficiency and overhead defaults are ``sched_lab.sim.analytic_defaults.GUESS``; callers
    should pass ``sched_lab.sim.analytic_defaults.defaults(model, hardware)``.

    Raises:
        ConfigError: a ``tensor_parallel_size`` the model's heads or the preset cannot take.
    """

    #: ``step_time`` depends on its arguments alone (the simulator may fast-forward with it).
    deterministic: ClassVar[bool] = True

    def __init__(
        self,
        model: ModelSpec,
        hardware: Hardware,
        flops_efficiency: float = 0.7,
        bandwidth_efficiency: float = 0.85,
        step_overhead_s: float = 0.002,
        tensor_parallel_size: int = 1,
        host_overhead_s: float = 0.0,
        host_per_seq_s: float = 0.0,
        lora: LoRACost | None = None,
    ) -> None:
        self.model, self.hardware = model, hardware
        self.step_overhead_s = step_overhead_s
        self.host_overhead_s, self.host_per_seq_s = host_overhead_s, host_per_seq_s
        self.num_capped_steps = 0  # steps whose host time was capped at the step (host_time)
        self._s_per_flop = 1.0 / (hardware.peak_flops * flops_efficiency)
        self._s_per_byte = 1.0 / (hardware.mem_bandwidth * bandwidth_efficiency)
        self._s_per_swap_byte = 1.0 / hardware.host_link_bandwidth
        self._s_per_swap_run = hardware.host_link_latency_s
        m = model
        self._flops_per_token = 2.0 * m.matmul_params_per_token
        self._flops_per_sample = 2.0 * m.vocab_size * m.hidden_size
        self._attn_flops_per_pair = 4.0 * m.num_hidden_layers * m.num_attention_heads * m.head_dim
        self._kv_bytes_per_token = float(m.kv_bytes_per_token)
        self._weight_bytes = float(m.weight_bytes)
        self.lora = lora
        self._lora_flops_per_token = self._lora_adapter_bytes = self._lora_load_s = 0.0
        if lora is not None:
            rank_dims = lora.rank * m.lora_dims_per_layer * m.num_hidden_layers
            self._lora_flops_per_token = 2.0 * rank_dims
            self._lora_adapter_bytes = float(m.lora_adapter_bytes(lora.rank))
            self._lora_load_s = lora.load_s(m, hardware)
        # FP8 layer matmuls: seconds per FLOP relative to the bf16 peak (1.0: same peak)
        self._fp8_flop_ratio = 1.0
        if m.quantization == "fp8" and hardware.peak_flops_fp8 is not None:
            self._fp8_flop_ratio = hardware.peak_flops / hardware.peak_flops_fp8
        self.tensor_parallel_size = n = tensor_parallel_size
        self._allreduce_s_per_token = self._allreduce_s_per_step = 0.0
        if n > 1:
            for what, size in (
                ("attention heads", m.num_attention_heads),
                ("MLP width", m.intermediate_size),
            ):
                if size % n:
                    raise ConfigError(
                        f"cost_model.tensor_parallel_size: {n} does not divide the "
                        f"{what} ({size}) of model {m.name!r}"
                    )
            kv = m.num_key_value_heads
            if kv % n if n <= kv else n % kv:
                raise ConfigError(
                    f"cost_model.tensor_parallel_size: {n} must divide the {kv} KV heads of "
                    f"model {m.name!r}, or be a multiple of them (replicated KV heads)"
                )
            if hardware.tp_link is None:
                raise ConfigError(
                    f"cost_model.tensor_parallel_size: {n} needs link figures between GPUs; "
                    f"hardware {hardware.name!r} has none (tp_link in lab/sim/hardware.py)"
                )
            link = LINKS[hardware.tp_link]
            ring = 2 * (n - 1) / n  # share of the buffer each GPU sends (and receives)
            per_token = 2 * m.num_hidden_layers * m.hidden_size * m.dtype_bytes  # 2 per layer
            self._allreduce_s_per_token = ring * per_token / link.bandwidth
            self._allreduce_s_per_step = 2 * m.num_hidden_layers * 2 * (n - 1) * link.latency_s
            self._s_per_flop *= 1.0 / n
            self._s_per_byte *= 1.0 / n

    def step_time(self, f: StepFeatures, block_size: int) -> float:
        """Seconds to run a step with features ``f``."""
        tokens = f.num_tokens
        pairs = f.prefill_attention_pairs + f.decode_context_tokens  # a decode: 1 query
        layer_flops = self._flops_per_token * tokens
        if self._fp8_flop_ratio != 1.0:  # bf16-equivalent FLOPs of the FP8 matmuls
            layer_flops *= self._fp8_flop_ratio
        flops = (
            layer_flops + self._flops_per_sample * f.num_samples + self._attn_flops_per_pair * pairs
        )
        kv_read = f.prefill_context_tokens + f.decode_context_tokens
        nbytes = self._weight_bytes + self._kv_bytes_per_token * (kv_read + tokens)
        if f.num_loras:  # zero without LoRA: the sums above stay as they were
            flops += self._lora_flops_per_token * f.num_lora_tokens
            nbytes += self._lora_adapter_bytes * f.num_loras
        t = max(flops * self._s_per_flop, nbytes * self._s_per_byte) + self.step_overhead_s
        if self.tensor_parallel_size > 1:
            t += self._allreduce_s_per_token * tokens + self._allreduce_s_per_step
        if f.num_swap_blocks:
            swap_bytes = f.num_swap_blocks * block_size * self._kv_bytes_per_token
            t += f.num_swap_runs * self._s_per_swap_run + swap_bytes * self._s_per_swap_byte
        if f.num_lora_loads:
            t += f.num_lora_loads * self._lora_load_s
        return t

    def host_time(self, f: StepFeatures, block_size: int = 0, step_s: float | None = None) -> float:
        """Host seconds before launch, at most ``step_s`` (default: the step's time); each
        capped step adds 1 to ``num_capped_steps``."""
        host = self.host_overhead_s + self.host_per_seq_s * f.num_seqs
        if host == 0.0:
            return 0.0
        step_s = self.step_time(f, block_size) if step_s is None else step_s
        if host <= step_s:
            return host
        self.num_capped_steps += 1
        return step_s

    def device_time(self, f: StepFeatures, block_size: int) -> float:
        """Device seconds of the step: step time - host time."""
        step_s = self.step_time(f, block_size)
        return step_s - self.host_time(f, block_size, step_s)


@dataclass(slots=True)
class LaunchedStep:
    """The handle of ``CostModelExecutor.launch``: ``step_s`` (synchronous time) and its host
    part ``host_s`` (0 <= host_s <= step_s)."""

    step_s: float
    host_s: float

    @property
    def device_s(self) -> float:
        """The device part: step_s - host_s."""
        return self.step_s - self.host_s


class CostModelExecutor:
    """The simulator's executor: a step takes the cost model's predicted time.
    ``execute(plan)`` equals ``wait(launch(plan))``; a cost model without ``host_time`` has
    host part 0."""

    wall_clock = False

    def __init__(self, cost_model: AnalyticCostModel, block_size: int) -> None:
        self.cost_model, self.block_size = cost_model, block_size
        self._host_time = getattr(cost_model, "host_time", None)
        #: ``step_time(features) -> s``, what ``execute`` gives a plan with these features,
        #: where that depends on nothing else (``cost_model.deterministic``; not a seeded
        #: replica's draws): then the replay loop may price repeated decode steps without
        #: plans (``Scheduler.repeat_decodes_run``). None otherwise, and in a subclass that
        #: overrides ``execute`` (it may count or fail steps).
        self.step_time: Callable[[StepFeatures], float] | None = None
        #: ``decode_step_time(features) -> price``, ``price(ctx)`` being ``step_time`` of
        #: those features with ``decode_context_tokens = ctx`` (to the last bit), where
        #: ``step_time`` is set and the cost model has ``decode_step_time``; else None.
        self.decode_step_time: Callable[[StepFeatures], Callable[[int], float]] | None = None
        plain = type(self).execute is CostModelExecutor.execute
        if plain and getattr(cost_model, "deterministic", False) is True:
            self.step_time = self._step_time
            if hasattr(cost_model, "decode_step_time"):
                self.decode_step_time = self._decode_step_time

    def _step_time(self, f: StepFeatures) -> float:
        """The cost model's step time at this block size (a bound method: a partial with
        a keyword argument builds a dict on every call, and runs call it every step)."""
        return self.cost_model.step_time(f, self.block_size)

    def _decode_step_time(self, f: StepFeatures) -> Callable[[int], float]:
        return self.cost_model.decode_step_time(f, self.block_size)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return StepResult(self.cost_model.step_time(plan.features(), self.block_size))

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """The step's time and its host part (nothing runs)."""
        f = plan.features()
        step_s = self.cost_model.step_time(f, self.block_size)
        host_s = 0.0 if self._host_time is None else self._host_time(f, self.block_size, step_s)
        return LaunchedStep(step_s, host_s)

    def wait(self, handle: LaunchedStep) -> StepResult:
        """The launched step's synchronous time, as ``execute`` reports it."""
        return StepResult(handle.step_s)


def activation_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Estimated peak activation bytes of one step (vLLM measures it with a profiling run):
    4 hidden-size and 2 intermediate-size buffers per token, fp32 logits per sequence."""
    per_token = (4 * model.hidden_size + 2 * model.intermediate_size) * model.dtype_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * model.vocab_size * 4


def num_gpu_blocks(
    model: ModelSpec,
    hardware: Hardware,
    block_size: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
) -> int:
    """KV blocks per GPU, as vLLM sizes its cache: (memory * gpu_memory_utilization - weights
    - peak activations) / bytes per block; over N GPUs each holds 1/N of the weights and
    ceil(kv_heads / N) KV heads of every block."""
    n = tensor_parallel_size
    budget = hardware.memory_bytes * gpu_memory_utilization
    if n == 1:
        free = (
            budget
            - model.weight_bytes
            - activation_bytes(model, max_num_batched_tokens, max_num_seqs)
        )
        return max(0, math.floor(free / (model.kv_bytes_per_token * block_size)))
    kv_share = -(-model.num_key_value_heads // n) / model.num_key_value_heads  # ceil
    free = (
        budget
        - model.weight_bytes / n
        - activation_bytes(model, max_num_batched_tokens, max_num_seqs)
    )
    return max(0, math.floor(free / (model.kv_bytes_per_token * kv_share * block_size)))


def num_cpu_blocks(model: ModelSpec, block_size: int, swap_space_gib: float) -> int:
    """Swap-space blocks in ``swap_space_gib`` GiB of host memory (vLLM's swap_space)."""
    return math.floor(swap_space_gib * GIB / (model.kv_bytes_per_token * block_size))
