"""Analytic step-time model (roofline) and the KV capacity rule; the simulator's executor.

Step time = max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s) + step overhead
          + swap bytes / host-link bytes/s.

* FLOPs: 2 per weight per token for the decoder layers (Kaplan et al. 2020, "Scaling Laws",
  §2.1), 2 per LM-head weight per sampled token, and attention 4 * layers * heads * head_dim
  per (query, key) pair (QK^T and PV), causal within a prefill chunk.
* Bytes: all weights once per step, the KV each decode or chunk reads, the KV it writes.
* Tensor parallelism over N GPUs (``tensor_parallel_size``; Megatron-LM, Shoeybi et al.
  2019, §3): each GPU does 1/N of the FLOPs and reads 1/N of the weights and KV bytes, and
  every layer adds 2 all-reduces (after attention's output projection and after the MLP)
  of the step's activations, tokens * hidden_size * dtype_bytes each. A ring all-reduce
  sends and receives 2(N-1)/N of the buffer per GPU in 2(N-1) steps (Patarasuk & Yuan 2009,
  "Bandwidth optimal all-reduce algorithms for clusters of workstations"; NCCL's
  nccl-tests "Performance" notes use the same 2(N-1)/N bus-bandwidth factor), so one costs
  2(N-1)/N * bytes / link bandwidth (one direction) + 2(N-1) * link latency, on the
  hardware preset's ``tp_link``. The embedding's all-reduce and the logits' all-gather are
  left out (one each per step, not per layer).
* Achieved = preset peak * efficiency. This class's defaults (0.7 of peak FLOP/s, 0.85 of
  HBM bandwidth, 2 ms per step) are datasheet assumptions, not measurements; an experiment
  YAML that leaves them out gets the values fitted to the shipped engine profiles of its
  hardware (:mod:`lab.sim.analytic_defaults`), and
  :class:`lab.sim.calibrated.CalibratedCostModel` is fitted to the real engine's profile.

Host and device time (asynchronous scheduling, vLLM V1's AsyncScheduler). A step's time
``step_time`` is what a synchronous engine pays: the host plans the step and prepares its
inputs, launches it, and waits for the device. Its host part, ``host_time`` (planning, input
preparation, launch: the work that comes before the device can start), is

    host = min(host_overhead_s + host_per_seq_s * sequences, step time)

(both 0 by default: then async timing equals sync timing; where the cap binds, the run
logs a warning with the number of such steps), and ``device_time`` = step time -
host time. Under async scheduling the host prepares step N+1 while the device runs step N,
so step N lasts max(device time of N, host time of N+1) (lab/sim/replay.py). The host part
is a share of ``step_overhead_s`` and of the per-sequence work, not added to it: step_time
does not depend on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab.core.errors import ConfigError
from lab.core.plan import SchedulerOutput, StepFeatures, StepResult
from lab.sim.hardware import LINKS, Hardware
from lab.sim.models import ModelSpec

GIB = 1 << 30


class AnalyticCostModel:
    """Predicts step durations in seconds from a plan.

    Args:
        model: the model's shape.
        hardware: the accelerator preset.
        flops_efficiency: fraction of ``hardware.peak_flops`` reached (0 < x <= 1).
        bandwidth_efficiency: fraction of ``hardware.mem_bandwidth`` reached (0 < x <= 1).
        step_overhead_s: fixed seconds per step (scheduling, input prep, kernel launches).
        tensor_parallel_size: GPUs one replica spans (module doc); > 1 needs the hardware
            preset's ``tp_link`` (ConfigError otherwise).
        host_overhead_s: seconds per step of host work before launch (planning, input
            preparation, launch), a part of ``step_overhead_s`` (module doc).
        host_per_seq_s: seconds of host work per sequence of the step (per-sequence input
            preparation: block tables, positions, sampling parameters).

    The defaults of the first three are the datasheet guesses
    (``lab.sim.analytic_defaults.GUESS``). A config that leaves them out gets the values
    fitted to the shipped profiles instead (``lab.sim.analytic_defaults.defaults(model,
    hardware)``); code that builds this model directly should pass those.
    """

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
    ) -> None:
        self.model, self.hardware = model, hardware
        self.step_overhead_s = step_overhead_s
        self.host_overhead_s, self.host_per_seq_s = host_overhead_s, host_per_seq_s
        self.num_capped_steps = 0  # steps whose host time was capped at the step (host_time)
        self._s_per_flop = 1.0 / (hardware.peak_flops * flops_efficiency)
        self._s_per_byte = 1.0 / (hardware.mem_bandwidth * bandwidth_efficiency)
        self._s_per_swap_byte = 1.0 / hardware.host_link_bandwidth
        m = model
        self._flops_per_token = 2.0 * m.matmul_params_per_token
        self._flops_per_sample = 2.0 * m.vocab_size * m.hidden_size
        self._attn_flops_per_pair = 4.0 * m.num_hidden_layers * m.num_attention_heads * m.head_dim
        self._kv_bytes_per_token = float(m.kv_bytes_per_token)
        self._weight_bytes = float(m.weight_bytes)
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
        """Seconds to run a step with features ``f`` (prefill chunks, decodes, swaps)."""
        tokens = f.num_tokens
        pairs = f.prefill_attention_pairs + f.decode_context_tokens  # a decode: 1 query
        flops = (
            self._flops_per_token * tokens
            + self._flops_per_sample * f.num_samples
            + self._attn_flops_per_pair * pairs
        )
        kv_read = f.prefill_context_tokens + f.decode_context_tokens
        nbytes = self._weight_bytes + self._kv_bytes_per_token * (kv_read + tokens)
        t = max(flops * self._s_per_flop, nbytes * self._s_per_byte) + self.step_overhead_s
        if self.tensor_parallel_size > 1:
            t += self._allreduce_s_per_token * tokens + self._allreduce_s_per_step
        if f.num_swap_blocks:
            t += f.num_swap_blocks * block_size * self._kv_bytes_per_token * self._s_per_swap_byte
        return t

    def host_time(self, f: StepFeatures, block_size: int = 0, step_s: float | None = None) -> float:
        """Seconds of host work before the step is launched (module doc), at most the step's
        time (``step_s``: that time if known, else computed with ``block_size``). The cap
        binds when ``host_per_seq_s`` * sequences outgrows the step: the host part is then
        the whole step; ``num_capped_steps`` counts those steps (the experiment warns)."""
        host = self.host_overhead_s + self.host_per_seq_s * f.num_seqs
        if host == 0.0:
            return 0.0
        step_s = self.step_time(f, block_size) if step_s is None else step_s
        if host <= step_s:
            return host
        self.num_capped_steps += 1
        return step_s

    def device_time(self, f: StepFeatures, block_size: int) -> float:
        """Seconds the device runs the step: step time - host time (module doc)."""
        step_s = self.step_time(f, block_size)
        return step_s - self.host_time(f, block_size, step_s)


@dataclass(slots=True)
class LaunchedStep:
    """A step handed to the simulated device (the handle of ``CostModelExecutor.launch``).

    Attributes:
        step_s: the step's synchronous time (``step_time``), what ``wait`` reports.
        host_s: its host part (``host_time``), 0 <= host_s <= step_s.
    """

    step_s: float
    host_s: float

    @property
    def device_s(self) -> float:
        """The device part: step_s - host_s."""
        return self.step_s - self.host_s


class CostModelExecutor:
    """The simulator's executor: a step takes the cost model's predicted time.

    ``execute(plan)`` equals ``wait(launch(plan))``; under asynchronous scheduling the replay
    loop reads the launched step's ``host_s`` and ``device_s`` to set the clock (a step
    lasts max(its device time, the next step's host time)). A cost model without
    ``host_time`` has no host part (host 0: async timing equals sync timing).
    """

    wall_clock = False

    def __init__(self, cost_model: AnalyticCostModel, block_size: int) -> None:
        self.cost_model, self.block_size = cost_model, block_size
        self._host_time = getattr(cost_model, "host_time", None)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        return StepResult(self.cost_model.step_time(plan.features(), self.block_size))

    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """The step's time and its host part (nothing runs: the clock is the replay loop's)."""
        f = plan.features()
        step_s = self.cost_model.step_time(f, self.block_size)
        host_s = 0.0 if self._host_time is None else self._host_time(f, self.block_size, step_s)
        return LaunchedStep(step_s, host_s)

    def wait(self, handle: LaunchedStep) -> StepResult:
        """The launched step's result: its synchronous time, as ``execute`` reports it."""
        return StepResult(handle.step_s)


def activation_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Estimated peak activation memory of one step, in bytes.

    A forward pass of ``max_num_batched_tokens`` tokens keeps a few hidden-size buffers and
    the gated MLP's two intermediate-size buffers live, plus fp32 logits for the sampled
    rows. vLLM measures this peak with a profiling run; this is an estimate of the same.
    """
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
    """KV blocks that fit in device memory, as vLLM sizes its cache:
    (memory * gpu_memory_utilization - weights - peak activations) / bytes per block.

    With tensor parallelism over N GPUs each holds 1/N of the weights and of every block (its
    KV heads; a KV head is replicated when N exceeds their number, as backend/tp.py does), and
    the activation estimate is kept whole (the residual stream is not split)."""
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
