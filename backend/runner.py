"""Execute one scheduler step on a real model: the engine side of the plan/execute split.

The runner makes no scheduling decision: it writes the fed tokens' KV into the paged cache at
the block ids the scheduler chose, runs the model and samples. When ``num_gpu_blocks`` is not
given, the cache gets ``total * gpu_memory_utilization - in use - activation peak`` on CUDA
(as vLLM does) and ``CPU_KV_CACHE_BYTES`` on the CPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sched_lab.backend.attention import get_attention_backend
from sched_lab.backend.config import ModelConfig
from sched_lab.backend.cuda_graphs import (
    DEFAULT_GRAPH_SIZES,
    DEFAULT_TOKEN_SIZES,
    StepGraphs,
    graph_sizes,
)
from sched_lab.backend.dtypes import check_dtype_supported, resolve_device, resolve_dtype
from sched_lab.backend.errors import UnsupportedModelError
from sched_lab.backend.inputs import DeviceFeed, SeqInput, apply_feed, prepare_inputs
from sched_lab.backend.kv_cache import GiB, KVCache, blocks_in, bytes_per_block, kv_torch_dtype
from sched_lab.backend.loader import checkpoint_quantization, load_model
from sched_lab.backend.lora import LoraAdapter, LoraOptions, LoraSlots
from sched_lab.backend.quant_formats import resolve_quantization
from sched_lab.backend.sampler import sample_seqs
from sched_lab.backend.tp import TPShard, agree_min, check_tp_size, load_tp_model, shard_config
from sched_lab.core.errors import ConfigError

__all__ = ["DeviceFeed", "ModelRunner", "PendingStep", "SeqInput"]

DEFAULT_SWAP_SPACE_BYTES = 4 * GiB  # vLLM's default swap space
CPU_KV_CACHE_BYTES = 1 * GiB  # KV budget on the CPU when num_gpu_blocks is not given
CPU_THREADS = 4  # most torch threads on a CPU device by default

log = logging.getLogger("sched_lab.backend.runner")


@dataclass(slots=True)
class PendingStep:
    """A step launched on the device and not yet waited for (:meth:`ModelRunner.launch`).

    Attributes:
        sampled_seqs: indices into the step's SeqInput list of the sampled sequences.
        sampled: (len(sampled_seqs),) int64 sampled ids on the device, or None.
        host: where the ids land on the host (pinned on CUDA).
        done: CUDA event recorded after that copy (None on the CPU).
    """

    num_seqs: int
    sampled_seqs: list[int]
    sampled: torch.Tensor | None
    host: torch.Tensor | None
    done: torch.cuda.Event | None


class ModelRunner:
    """A model, its paged KV cache and swap space, driven one step at a time.

    Args:
        model_dir: Hugging Face layout (config.json + *.safetensors); ``~`` is expanded.
        device: "cpu" or "cuda[:N]".
        dtype: "float32", "bfloat16", "float16" (CUDA only), or "auto" (the checkpoint's).
        attention_backend: "torch", "triton" or "flash_attn".
        block_size: tokens per KV block.
        num_gpu_blocks: device KV blocks; None derives it from memory.
        gpu_memory_utilization: fraction of device memory the runner may use (CUDA).
        swap_space_bytes: host memory for swapped-out blocks.
        max_model_len: longest sequence; default max_position_embeddings.
        max_num_batched_tokens: warm-up forward size; the largest mixed-graph size.
        max_num_seqs: most sequences in a step; the largest decode-graph size.
        cuda_graphs: None = on for CUDA with a graph-capable backend; True on a backend
            without graphs raises ConfigError; True off CUDA runs the padded path uncaptured.
        mixed_graphs: also capture mixed-step graphs.
        kn_weights: keep projection weights in (K, N) order (CUDA only).
        cuda_graph_sizes, cuda_graph_token_sizes: candidate graph sizes, cut at the maxima.
        num_threads: torch intra-op threads on CPU (process-wide); see :func:`set_cpu_threads`.
        prefill_attention: "auto", "triton" or "flash_varlen" (triton backend only).
        triton_prefill_kernel: "base" or "exp2" (triton backend only;
            :mod:`sched_lab.backend.attention.prefill_exp2`): the paged prefill kernel.
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (E4M3, scales 1.0; torch and
            triton backends): the same memory rule sizes the cache, so about twice the
            blocks of a bf16 one.
        tensor_parallel: this rank of an initialised torch.distributed group; every rank
            must get the same calls in the same order. None: one device.
        lora_adapters: adapter name -> PEFT folder (:mod:`sched_lab.backend.lora`); a
            SeqInput's ``lora_name`` picks one. None or empty: LoRA off (the model runs
            exactly as without these arguments).
        max_loras: most distinct adapters in one step (device slots).
        max_lora_rank: the largest adapter rank accepted.
        quantization: "fp8", "int8", "awq", "gptq" or None; a checkpoint with a
            ``quantization_config`` runs quantized by it (a different method here is a
            ConfigError); an unquantized one is quantized at load time
            (backend/quant_formats.py). Not with ``tensor_parallel``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        attention_backend: str = "torch",
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES,
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        cuda_graphs: bool | None = None,
        mixed_graphs: bool = True,
        kn_weights: bool = False,
        cuda_graph_sizes: Sequence[int] = DEFAULT_GRAPH_SIZES,
        cuda_graph_token_sizes: Sequence[int] = DEFAULT_TOKEN_SIZES,
        num_threads: int | None = None,
        tensor_parallel: TPShard | None = None,
        prefill_attention: str = "auto",
        triton_prefill_kernel: str = "base",
        lora_adapters: dict[str, Path] | None = None,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
    ) -> None:
        if lora_adapters and tensor_parallel is not None:
            raise ConfigError("lora: adapters with tensor parallelism are not implemented")
        model_dir = Path(model_dir).expanduser()
        self.config = ModelConfig.from_dir(model_dir)
        # the checkpoint's quantization_config wins; a different request is one line
        self.quantization = resolve_quantization(
            quantization, checkpoint_quantization(model_dir), str(model_dir / "config.json")
        )
        if self.quantization is not None and tensor_parallel is not None:
            raise ConfigError(
                f"quantization {self.quantization.method!r} with tensor parallelism is not "
                "supported: set engine.tensor_parallel_size to 1"
            )
        self.tensor_parallel = tensor_parallel
        full_config = self.config
        if tensor_parallel is not None:  # this rank's shapes: heads, KV heads, MLP / size
            check_tp_size(full_config, tensor_parallel.size)
            self.config = shard_config(full_config, tensor_parallel.size)
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            set_cpu_threads(num_threads)
        self.dtype = resolve_dtype(dtype, self.config)
        check_dtype_supported(self.device, self.dtype)
        self.block_size = block_size
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        _check_max_model_len(self.config, self.max_model_len, model_dir)
        backend = get_attention_backend(attention_backend, self.device, self.dtype, block_size)
        backend.set_prefill_attention(prefill_attention)
        backend.set_prefill_kernel(triton_prefill_kernel)
        self.kv_dtype = kv_torch_dtype(kv_cache_dtype, self.dtype)
        backend.set_kv_cache_dtype(self.kv_dtype)
        self.attn_backend = backend
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and backend.supports_graphs
        elif cuda_graphs and not backend.supports_graphs:
            raise ConfigError(
                f"cuda_graphs needs a graph-safe attention backend (triton); got {backend.name!r}"
            )
        if tensor_parallel is None:
            self.model = load_model(model_dir, self.config, backend, self.device, self.dtype,
                                    self.max_model_len, kn_weights, self.quantization)  # fmt: skip
        else:
            self.model = load_tp_model(model_dir, full_config, tensor_parallel, backend,
                                       self.device, self.dtype, self.max_model_len, kn_weights)  # fmt: skip
        self.lora: LoraSlots | None = None
        if lora_adapters:
            self.attach_lora(lora_adapters, max_loras, max_lora_rank, rebuild_graphs=False)
        self.generator = torch.Generator(self.device).manual_seed(seed)  # the warm-up samples
        self.graphs: StepGraphs | None = None  # set once the KV cache exists
        self._free_ids: list[torch.Tensor] = []  # pinned sampled-id buffers (launch / wait)
        block_bytes = bytes_per_block(self.config, block_size, self.kv_dtype)
        if num_gpu_blocks is None:
            budget, what = self._kv_budget_bytes(gpu_memory_utilization, max_num_batched_tokens)
            num_gpu_blocks = blocks_in(budget, block_bytes, what)
        if tensor_parallel is not None:  # every rank holds the same block ids; this first
            # collective also sets NCCL up before any CUDA-graph capture
            num_gpu_blocks = agree_min(num_gpu_blocks, self.device)
        self.kv_cache = KVCache(
            self.config,
            block_size,
            num_gpu_blocks,
            swap_space_bytes // block_bytes,
            self.kv_dtype,
            self.device,
        )
        log.info(self.capacity_line())
        backend.warm_up(*self.kv_cache.layers[0], self.config.num_heads)
        self._graph_sizes = (
            graph_sizes(max_num_seqs, cuda_graph_sizes),
            graph_sizes(max_num_batched_tokens, cuda_graph_token_sizes if mixed_graphs else ()),
            max_num_seqs,
        )
        if cuda_graphs:
            self._build_graphs()
            if tensor_parallel is not None and not agree_min(self.graphs is not None, self.device):
                self.graphs = None  # a rank whose capture failed: every rank runs eagerly

    def _build_graphs(self) -> None:
        """Make the step graphs (and capture them on CUDA) for the current model and LoRA."""
        sizes, token_sizes, max_num_seqs = self._graph_sizes
        self.graphs = StepGraphs(self.model, self.kv_cache, self.block_size, self.max_model_len,
                                 self.config.vocab_size, sizes, token_sizes, max_num_seqs,
                                 capture=self.device.type == "cuda", lora=self.lora)  # fmt: skip
        if self.graphs.capture:
            self._capture_graphs()

    def attach_lora(self, adapters: dict[str, Path | LoraAdapter], max_loras: int,
                    max_lora_rank: int, rebuild_graphs: bool = True,
                    options: LoraOptions | None = None) -> None:  # fmt: skip
        """Read ``adapters`` (host copies), give the model ``max_loras`` device slots and run
        its projections with them (``options``: how, :class:`LoraOptions`); with
        ``rebuild_graphs``, capture the step graphs again (the old ones hold no LoRA).
        Benchmarks call it to switch ranks or options on one model."""
        kernels = self.device.type == "cuda" or _interpreting()
        self.model.set_lora(None)
        self.lora = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.lora = LoraSlots(self.config, adapters, max_loras, max_lora_rank, self.device,
                              self.dtype, kernels, options)  # fmt: skip
        self.model.set_lora(self.lora)
        if rebuild_graphs and self.graphs is not None:
            self.graphs = None
            self._build_graphs()

    def _capture_graphs(self) -> None:
        """Capture every size; on failure, say so and run every step eagerly."""
        assert self.graphs is not None
        t0 = time.perf_counter()
        sizes, tokens = self.graphs.sizes, self.graphs.token_sizes
        try:
            self.graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - a capture failure must not stop the engine
            self.graphs = None
            log.warning("CUDA graphs: capture failed, steps run eagerly: %r", e)
            return
        families = [
            f"{len(v)} {what} {v[0]}..{v[-1]}"
            for what, v in (("decode batch sizes", sizes), ("token counts", tokens))
            if v
        ]
        twice = " (each with and without the LoRA ops)" if self.graphs.split else ""
        log.info("CUDA graphs: %s captured%s in %.1f s", ", ".join(families) or "no sizes",
                 twice, time.perf_counter() - t0)  # fmt: skip

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.kv_cache.num_cpu_blocks

    def capacity_line(self) -> str:
        """One line: device blocks, tokens and GiB, and the swap space."""
        block_bytes = self.kv_cache.block_bytes
        tp = self.tensor_parallel
        where = f" per rank of {tp.size} (tensor parallel)" if tp is not None else ""
        return (
            f"KV cache: {self.num_gpu_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_gpu_blocks * self.block_size} tokens, "
            f"{self.num_gpu_blocks * block_bytes / GiB:.2f} GiB on {self.device} ({self.kv_dtype}){where}; "
            f"swap space: {self.num_cpu_blocks} blocks, {self.num_cpu_blocks * block_bytes / GiB:.2f} GiB"
        )

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> list[int | None]:
        """Run one step (writes its KV); the sampled token of each sequence, None where not
        sampled. Blocks until the device finishes."""
        if not seqs:
            return []
        sampled_seqs, rows, logits = self._forward(seqs, self.kv_cache)
        tokens: list[int | None] = [None] * len(seqs)
        if sampled_seqs:
            sampled = sample_seqs(logits, rows, self.generator).tolist()  # syncs
            for i, token in zip(sampled_seqs, sampled, strict=True):
                tokens[i] = token
        self.synchronize()
        return tokens

    @torch.inference_mode()
    def launch(self, seqs: list[SeqInput], feed: DeviceFeed | None = None) -> PendingStep:
        """Enqueue one step on the current stream and return without waiting; ``feed`` rows
        come from an earlier step's sampled ids on the device. :meth:`wait` gives the tokens."""
        if not seqs:
            return PendingStep(0, [], None, None, None)
        sampled_seqs, rows, logits = self._forward(seqs, self.kv_cache, feed)
        if not sampled_seqs:
            return PendingStep(len(seqs), [], None, None, None)
        sampled = sample_seqs(logits, rows, self.generator)
        if self.device.type != "cuda":
            return PendingStep(len(seqs), sampled_seqs, sampled, sampled, None)
        host = self._pinned_ids(len(sampled_seqs))  # may be longer: a pooled buffer
        host[: len(sampled_seqs)].copy_(sampled, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingStep(len(seqs), sampled_seqs, sampled, host, done)

    def wait(self, step: PendingStep) -> list[int | None]:
        """The sampled token of each sequence of a launched step (None where not sampled);
        blocks on that step's event only (earlier steps finished before it)."""
        tokens: list[int | None] = [None] * step.num_seqs
        if step.host is None:
            return tokens
        if step.done is not None:
            step.done.synchronize()
        sampled = step.host[: len(step.sampled_seqs)].tolist()
        if step.done is not None:
            self._free_ids.append(step.host)
            step.host = None  # handed back: a second wait would read a reused buffer
        for i, token in zip(step.sampled_seqs, sampled, strict=True):
            tokens[i] = token
        return tokens

    def _pinned_ids(self, n: int) -> torch.Tensor:
        """A pinned (>= n,) int64 buffer for a step's sampled ids, reused after its wait."""
        while self._free_ids:
            buf = self._free_ids.pop()
            if buf.numel() >= n:
                return buf
        return torch.empty(max(n, 256), dtype=torch.long, pin_memory=True)

    @torch.inference_mode()
    def execute_logits(self, seqs: list[SeqInput]) -> list[torch.Tensor | None]:
        """:meth:`execute`, returning each sampled sequence's (vocab_size,) float32 logits."""
        sampled_seqs, _, logits = self._forward(seqs, self.kv_cache)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for row, i in enumerate(sampled_seqs):
            out[i] = logits[row].clone()  # a graph's output is overwritten by its next replay
        self.synchronize()
        return out

    @torch.inference_mode()
    def logits_at(self, seqs: list[SeqInput], rows: Sequence[int]) -> torch.Tensor:
        """Run one step (writes its KV); the (len(rows), vocab_size) float32 logits at the
        given fed-token rows, on the device, without waiting."""
        index = torch.tensor(list(rows), dtype=torch.long).to(self.device, non_blocking=True)
        if self.graphs is not None:
            out = self.graphs.run_rows(seqs, index)
            if out is not None:
                return out
        inputs = prepare_inputs(seqs, self.block_size, self.kv_cache.num_gpu_blocks,
                                self.max_model_len, self.config.vocab_size, self.device)  # fmt: skip
        self._stage_lora(seqs)
        attn = self.attn_backend.prepare_metadata(inputs.attn, self.config.num_kv_heads)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, attn)
        return self.model.compute_logits(hidden[index])

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy [(gpu_block, cpu_block), ...] to the swap space (batched, non-blocking on CUDA)."""
        self.kv_cache.swap_out(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy [(cpu_block, gpu_block), ...] back to the device (batched, non-blocking on CUDA)."""
        self.kv_cache.swap_in(mapping)

    def synchronize(self) -> None:
        """Wait for the device (its kernels and swap copies)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(
        self, seqs: list[SeqInput], kv_cache: KVCache, feed: DeviceFeed | None = None
    ) -> tuple[list[int], list[SeqInput], torch.Tensor]:
        """(indices of the sampled seqs, their SeqInputs, their (num_sampled, vocab_size)
        float32 logits); replays a CUDA graph when one fits."""
        if self.graphs is not None and kv_cache is self.kv_cache:
            out = self.graphs.run(seqs, feed)
            if out is not None:
                return out
        inputs = prepare_inputs(seqs, self.block_size, kv_cache.num_gpu_blocks,
                                self.max_model_len, self.config.vocab_size, self.device)  # fmt: skip
        apply_feed(inputs.input_ids, feed, self.device.type == "cuda")
        self._stage_lora(seqs)
        attn = self.attn_backend.prepare_metadata(inputs.attn, self.config.num_kv_heads)
        hidden = self.model(inputs.input_ids, inputs.positions, kv_cache.layers, attn)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return inputs.sampled_seqs, inputs.sampled_inputs, logits

    def _stage_lora(self, seqs: list[SeqInput]) -> None:
        """Load the step's adapters and copy its LoRA segments to the device (eager steps)."""
        if self.lora is not None:
            q = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
            self.lora.stage([s.lora_name for s in seqs], q, int(q.sum()))

    @torch.inference_mode()
    def _kv_budget_bytes(self, utilization: float, max_num_batched_tokens: int) -> tuple[int, str]:
        """Bytes left for the KV cache, and a phrase naming where they come from."""
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES, "the fixed CPU budget (CPU_KV_CACHE_BYTES)"
        activation_peak = self._profile_activation_bytes(max_num_batched_tokens)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free  # weights, RoPE table, CUDA context, other processes
        budget = int(total * utilization) - in_use - activation_peak
        what = (
            f"gpu_memory_utilization={utilization} of {total / GiB:.1f} GiB less {in_use / GiB:.2f} GiB in use "
            f"and a {activation_peak / GiB:.2f} GiB activation peak ({max_num_batched_tokens} tokens)"
        )
        return budget, what

    def _profile_activation_bytes(self, num_tokens: int) -> int:
        """Peak bytes a forward of ``num_tokens`` prompt tokens allocates beyond what is
        resident (also compiles the attention kernels)."""
        lengths = [
            min(self.max_model_len, num_tokens - start)
            for start in range(0, num_tokens, self.max_model_len)
        ]
        blocks = [-(-n // self.block_size) for n in lengths]
        scratch = KVCache(self.config, self.block_size, sum(blocks), 0, self.kv_dtype, self.device)
        seqs, first = [], 0
        for n, b in zip(lengths, blocks, strict=True):
            seqs.append(
                SeqInput(
                    token_ids=[0] * n,
                    start_pos=0,
                    block_table=list(range(first, first + b)),
                    sample=True,
                )
            )
            first += b
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        _, rows, logits = self._forward(seqs, scratch)
        sample_seqs(logits, rows, self.generator)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - resident
        del scratch, logits
        return peak


def _check_max_model_len(config: ModelConfig, max_model_len: int, model_dir: str | Path) -> None:
    if max_model_len > config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    window = config.sliding_window
    if window is not None and max_model_len > window:
        raise UnsupportedModelError(
            f"{model_dir}: sliding-window attention (window {window} tokens) is not implemented; "
            f"pass max_model_len <= {window} so the window never cuts the context"
        )


def _interpreting() -> bool:
    """True when Triton's CPU interpreter is on (the LoRA kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_cpu_threads(num_threads: int | None) -> None:
    """Set torch's intra-op threads (process-wide): ``num_threads``, or with None
    ``min(CPU_THREADS, cores)`` unless ``OMP_NUM_THREADS`` is set."""
    if num_threads is None:
        if "OMP_NUM_THREADS" in os.environ:
            return
        num_threads = min(CPU_THREADS, os.cpu_count() or 1)
    if num_threads < 1:
        raise ConfigError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
