"""CUDA graphs for every step of a bounded size: decode-only steps and mixed steps.

Decode graphs (one per batch size) hold the whole forward, logits included; mixed graphs
(one per token count and decode-row variant) end at the final norm. A step runs in the
smallest graph that holds it, padded (token 0, position 0, slot -1; padding writes no KV).
Who does what: :func:`sched_lab.backend.inputs.stage_step` computes the host arrays, the backend's
:class:`sched_lab.backend.attention.base.GraphMetadata` owns and fills the attention buffers, and
:class:`StepGraphs` copies the token rows, captures and replays. Sampling stays outside.

With LoRA attached, each key has two variants sharing the attention buffers and the memory
pool: one that runs the adapters' kernels and one without any LoRA op, replayed when no
sequence of the step has an adapter (:meth:`sched_lab.backend.lora.LoraSlots.needed`); a
decode key's two variants write one logits tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sched_lab.backend.attention.base import GraphKey
from sched_lab.backend.inputs import (
    BlockTables,
    DeviceFeed,
    HostStep,
    SeqInput,
    StepLimits,
    apply_feed,
    stage_step,
)
from sched_lab.backend.kv_cache import KVCache
from sched_lab.backend.lora import LoraSlots
from sched_lab.backend.model import Transformer

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Token counts of the mixed graphs: 16, multiples of 32 below 512 (weights dominate there),
# then 16 evenly spaced sizes per octave up to 8192, so padding adds at most 1/16 of a
# larger step's tokens.
DEFAULT_TOKEN_SIZES = (16,) + tuple(range(32, 512, 32)) + tuple(
    (1 << k) + i * (1 << k) // 16 for k in range(9, 13) for i in range(16)
) + (8192,)  # fmt: skip


def graph_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_GRAPH_SIZES) -> list[int]:
    """The sizes to capture, ascending: ``sizes`` up to ``max_num_seqs``, plus
    ``max_num_seqs`` itself when it falls between two of them; [] for empty ``sizes``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not sizes:
        return []
    if min(sizes) < 1:
        raise ValueError(f"CUDA graph sizes must be >= 1, got {list(sizes)}")
    out = sorted({s for s in sizes if s <= max_num_seqs})
    if max_num_seqs <= max(sizes) and (not out or out[-1] < max_num_seqs):
        out.append(max_num_seqs)
    return out


def pick_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None if none does."""
    for s in sorted(sizes):
        if s >= num_seqs:
            return s
    return None


class StepGraphs:
    """Static token buffers, the backend's graph metadata and (on CUDA) one graph per key.

    Args:
        model: the loaded model; its attention backend must support graphs.
        kv_cache: the runner's cache; graphs bake in its per-layer tensors.
        block_size: tokens per block. max_model_len: sizes the block-table width.
        sizes: decode batch sizes (see :func:`graph_sizes`).
        token_sizes: mixed-step token counts (may be empty).
        max_num_seqs: most sequences of a mixed step.
        capture: record CUDA graphs; False runs the padded forward eagerly (CPU tests).
        lora: the model's adapter slots, or None; the step's LoRA segments are a static
            input (:meth:`LoraSlots.static_buffer`) written at each staging. With
            ``lora.options.skip_idle``, every key is captured twice (see the module doc).
    """

    def __init__(
        self,
        model: Transformer,
        kv_cache: KVCache,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        sizes: Sequence[int],
        token_sizes: Sequence[int],
        max_num_seqs: int,
        capture: bool,
        lora: LoraSlots | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = StepLimits(block_size, kv_cache.num_gpu_blocks, max_model_len, vocab_size)
        self.sizes = sorted(sizes)
        self.token_sizes = sorted(token_sizes)
        self.capture = capture
        self.device = kv_cache.gpu.device
        self.pin = self.device.type == "cuda"
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.max_seqs = max(self.max_size, max_num_seqs if self.token_sizes else 0)
        self.max_blocks = -(-max_model_len // block_size)  # static block-table width
        big = self.token_sizes[-1] if self.token_sizes else 0
        tokens, dev = max(self.max_size, big), self.device
        # Normal (not inference-mode) tensors, so they may be updated in and out of it.
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        # The mixed graphs' output: final hidden states, copied here at each graph's end so
        # the graphs' own activations (pool memory) are not kept per graph.
        self.hidden = torch.zeros(big, model.config.hidden_size,
                                  dtype=model.embed_tokens.weight.dtype, device=dev)  # fmt: skip
        self.attn = model.attn_backend.graph_metadata(
            model.config.num_kv_heads, max_model_len, self.sizes, self.token_sizes, self.max_seqs
        )
        self.tables = BlockTables(self.max_seqs, self.max_blocks)  # host mirror, kept per step
        self.lora = lora
        self.lora_buffer = lora.static_buffer(tokens) if lora is not None else None
        # ("decode", size, size) or ("mixed", tokens, decode rows) -> graph, and its static
        # output: logits (size, vocab) float32 for decode graphs, a view of ``hidden`` for
        # mixed graphs. With LoRA attached these graphs run the adapters, and ``plain_*``
        # hold the LoRA-free variants (only when lora.options.skip_idle).
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.plain_graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.plain_outputs: dict[GraphKey, torch.Tensor] = {}
        self.split = lora is not None and lora.options.skip_idle
        self.lora_on = False  # the variant of the step being run (see lora_variant)
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def keys(self) -> list[GraphKey]:
        """Every graph in capture order: mixed then decode, largest first."""
        keys = [("mixed", t, r) for t in reversed(self.token_sizes)
                for r in reversed(self.attn.decode_rows(t))]  # fmt: skip
        return keys + [("decode", s, s) for s in reversed(self.sizes)]

    def variants(self) -> list[bool]:
        """The LoRA variants each key is captured in (True: the one running adapters)."""
        return [True, False] if self.split else [self.lora is not None]

    def lora_variant(self, seqs: list[SeqInput]) -> bool:
        """Whether this step replays the graphs that run LoRA ops (False without LoRA)."""
        return self.lora is not None and self.lora.needed([s.lora_name for s in seqs])

    def _table(
        self, lora_on: bool
    ) -> tuple[dict[GraphKey, torch.cuda.CUDAGraph], dict[GraphKey, torch.Tensor]]:
        """(graphs, outputs) of one LoRA variant."""
        if lora_on or not self.split:
            return self.graphs, self.outputs
        return self.plain_graphs, self.plain_outputs

    # -- per step ---------------------------------------------------------------------------

    def size_for(self, seqs: list[SeqInput]) -> int | None:
        """The decode graph size for this step, or None."""
        if not seqs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        return pick_size(len(seqs), self.sizes)

    def token_size_for(self, seqs: list[SeqInput]) -> int | None:
        """The mixed graph size (tokens) for this step, or None."""
        if not seqs or len(seqs) > self.max_seqs:
            return None
        return pick_size(sum(len(s.token_ids) for s in seqs), self.token_sizes)

    def run(
        self, seqs: list[SeqInput], feed: DeviceFeed | None = None
    ) -> tuple[list[int], list[SeqInput], torch.Tensor] | None:
        """Run a step in a graph: (sampled seq indices, their SeqInputs, their
        (num_sampled, vocab) float32 logits), or None when no graph fits. The logits may
        view a static output: use them before the next step."""
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        picked = [seqs[i] for i in sampled]
        self.lora_on = self.lora_variant(seqs)
        size = self.size_for(seqs)
        if size is not None:
            self._ensure_captured(("decode", size, size))
            self.stage(seqs, size)
            apply_feed(self.input_ids, feed, self.pin)
            logits = self._replay(("decode", size, size))
            if len(sampled) == len(seqs):
                return sampled, picked, logits[: len(seqs)]
            index = torch.tensor(sampled, dtype=torch.long).to(self.device)
            return sampled, picked, logits[index]
        tokens = self.token_size_for(seqs)
        if tokens is None:
            return None
        decodes = sum(len(s.token_ids) == 1 for s in seqs)
        rows = next(r for r in self.attn.decode_rows(tokens) if r >= decodes)
        self._ensure_captured(("mixed", tokens, rows))
        last_rows = self.stage_mixed(seqs, tokens, rows)
        apply_feed(self.input_ids, feed, self.pin)
        hidden = self._replay(("mixed", tokens, rows))
        return sampled, picked, self.model.compute_logits(hidden[last_rows])

    def run_rows(self, seqs: list[SeqInput], rows: torch.Tensor) -> torch.Tensor | None:
        """Run a step in a graph; the (len(rows), vocab) float32 logits of the given fed
        token rows, or None when no graph fits."""
        self.lora_on = self.lora_variant(seqs)
        size = self.size_for(seqs)
        if size is not None:
            self._ensure_captured(("decode", size, size))
            self.stage(seqs, size)
            return self._replay(("decode", size, size))[rows]
        tokens = self.token_size_for(seqs)
        if tokens is None:
            return None
        decodes = sum(len(s.token_ids) == 1 for s in seqs)
        key = ("mixed", tokens, next(r for r in self.attn.decode_rows(tokens) if r >= decodes))
        self._ensure_captured(key)
        self.stage_mixed(seqs, tokens, key[2])
        return self.model.compute_logits(self._replay(key)[rows])

    def stage(self, seqs: list[SeqInput], size: int) -> None:
        """Validate a decode-only step (ValueError naming the first bad sequence) and write
        it, padded to ``size`` rows, into the decode graphs' buffers."""
        step = stage_step(seqs, self.limits, self.tables, pad_to=size, logits=False,
                          pin=self.pin, decode_only=True)  # fmt: skip
        self._copy(step, ("decode", size, size), seqs)

    def stage_mixed(self, seqs: list[SeqInput], tokens: int,
                    decode_rows: int | None = None) -> torch.Tensor:  # fmt: skip
        """Validate a step and write it, padded to ``tokens`` rows and ``decode_rows``, into
        the mixed graphs' buffers; returns the (num_sampled,) int64 device logits rows."""
        step = stage_step(seqs, self.limits, self.tables, pad_to=tokens, pin=self.pin)
        key = ("mixed", tokens, decode_rows or self.attn.decode_rows(tokens)[-1])
        return self._copy(step, key, seqs)

    def _copy(self, step: HostStep, key: GraphKey, seqs: list[SeqInput]) -> torch.Tensor:
        """Issue the step's copies into ``key``'s buffers; returns the device logits rows."""
        size = key[1]
        self.lora_on = self.lora_variant(seqs)
        if self.lora is not None:
            names = [s.lora_name for s in seqs]
            self.lora.stage(names, step.query_lens, size, into=self.lora_buffer)
        ids, positions, slots, last = step.rows(step.tokens.to(self.device, non_blocking=True))
        self.input_ids[:size].copy_(ids)
        self.positions[:size].copy_(positions)
        self.attn.prepare_for_replay(key, step.query_lens, step.query_start_loc, step.seq_lens,
                                     step.block_tables, slots)  # fmt: skip
        return last

    # -- the forward --------------------------------------------------------------------------

    def _forward(self, key: GraphKey, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The padded forward of ``key``; a decode key's logits go into ``logits`` when
        given (the other LoRA variant's output), else into a new tensor."""
        kind, size, _ = key
        meta = self.attn.metadata(key)
        self.attn.graph_prologue(meta)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache.layers,
                            meta)  # fmt: skip
        if kind == "mixed":  # the sampled rows' logits follow the replay
            return self.hidden[:size].copy_(hidden)  # (tokens, hidden)
        if logits is None:
            return self.model.compute_logits(hidden)  # (size, vocab) float32
        return self.model.compute_logits(hidden, out=logits)

    def _ensure_captured(self, key: GraphKey) -> None:
        """Capture ``key`` in the step's LoRA variant if not captured yet (before staging:
        capture pads every row)."""
        if self.capture and key not in self._table(self.lora_on)[0]:
            self.capture_one(key, self.lora_on)

    def _replay(self, key: GraphKey) -> torch.Tensor:
        """Run ``key`` in the LoRA variant :attr:`lora_on` (eagerly without capture: the
        staged step's :attr:`LoraSlots.active` says the same)."""
        if not self.capture:
            return self._forward(key)
        graphs, outputs = self._table(self.lora_on)
        graphs[key].replay()
        return outputs[key]

    def _set_padding(self, key: GraphKey) -> None:
        """Make every row the graph ``key`` reads padding (used before warm-up and capture)."""
        size = key[1]
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.attn.prepare_for_capture(key)
        if self.lora is not None:  # no row in a segment; later steps write their own
            assert self.lora_buffer is not None
            self.lora_buffer.zero_()
            self.lora.batch = self.lora_buffer
            self.lora.active = self.lora_on

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every key of :meth:`keys`, in each of :meth:`variants`, not captured yet."""
        for key in self.keys():
            for lora_on in self.variants():
                if key not in self._table(lora_on)[0]:
                    self.capture_one(key, lora_on)

    @torch.inference_mode()
    def capture_one(self, key: GraphKey, lora_on: bool | None = None) -> None:
        """Capture ``key`` in one LoRA variant (None: the one running adapters if LoRA is
        attached); a decode key shares the other variant's logits tensor when captured."""
        self.lora_on = self.lora is not None if lora_on is None else lora_on
        graphs, outputs = self._table(self.lora_on)
        shared = self._table(not self.lora_on)[1].get(key) if self.split else None
        self._set_padding(key)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(key, shared)  # warm-up: compiles Triton kernels, picks cuBLAS kernels
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(key, shared)
        torch.cuda.synchronize(self.device)
        graphs[key] = graph
        outputs[key] = out
