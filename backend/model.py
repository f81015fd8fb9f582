"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

No batch dimension: a step's tokens are concatenated, (num_tokens, ...), and the attention
metadata keeps sequences apart. q/k/v and gate/up are fused projections; parameter names are
the Hugging Face ones less ``model.``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sched_lab.backend.attention import AttentionBackend, AttentionMetadata
from sched_lab.backend.config import ModelConfig
from sched_lab.backend.rope import apply_rope


class LoraDelta(Protocol):
    """What the layers ask of LoRA (:class:`sched_lab.backend.lora.LoraSlots`)."""

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) plus each token's adapter delta for fused projection ``proj``."""
        ...


def fused_ops(fused: bool):
    """:mod:`sched_lab.backend.triton_ops` when ``fused``, else None; imported on demand so tests can
    set ``TRITON_INTERPRET`` first."""
    if not fused:
        return None
    from sched_lab.backend import triton_ops

    return triton_ops


# Per-layer (k_cache, v_cache), each (num_blocks, block_size, num_kv_heads, head_dim).
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.ops = fused_ops(fused)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim in float32, scale in x's dtype (as transformers does)."""
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)[0]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        if self.ops is not None:
            out, summed = self.ops.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return out, summed
        summed = x + residual
        return self.forward(summed), summed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool) -> None:
        super().__init__()
        self.ops = fused_ops(fused)
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split_sizes = [config.q_size, config.kv_size, config.kv_size]
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split_sizes), bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend
        self.lora: LoraDelta | None = None  # set by Transformer.set_lora
        self.layer = 0

    def _lora(self, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each token's adapter delta of ``proj``; y itself when LoRA is off."""
        return y if self.lora is None else self.lora.apply(self.layer, proj, x, y)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: (num_tokens, hidden_size) -> (num_tokens, hidden_size); writes this layer's KV."""
        num_tokens = x.shape[0]
        if self.ops is not None:
            qkv = self._lora("qkv_proj", x, self.qkv_proj(x))
            own_kv = meta.varlen_seqs > 0  # prefill chunks attend over their own k/v
            q = self.ops.qkv_prepare(
                qkv, cos, sin, *kv_cache, meta.slot_mapping, self.num_heads,
                self.num_kv_heads, self.head_dim,
                None if self.q_norm is None else self.q_norm.weight,
                None if self.k_norm is None else self.k_norm.weight, self.eps, own_kv,
                self.backend.k_scale, self.backend.v_scale,
            )  # fmt: skip
            if own_kv:  # k rotated in place; views, no copies
                _, k, v = qkv.split(self.split_sizes, dim=-1)
                k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
                v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
                out = self.backend.attend_with_kv(q, k, v, *kv_cache, meta, self.scale)
            else:
                out = self.backend.attend(q, *kv_cache, meta, self.scale)
            out = out.view(num_tokens, -1)
            return self._lora("o_proj", out, self.o_proj(out))
        qkv = self._lora("qkv_proj", x, self.qkv_proj(x))
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.backend.forward(
            q, k, v, *kv_cache, meta, self.scale
        )  # (num_tokens, heads, head_dim)
        out = out.reshape(num_tokens, -1)
        return self._lora("o_proj", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.ops = fused_ops(fused)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.lora: LoraDelta | None = None  # set by Transformer.set_lora
        self.layer = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            return self._forward_lora(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _forward_lora(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with each token's adapter added to gate/up and down."""
        assert self.lora is not None
        gate_up = self.lora.apply(self.layer, "gate_up_proj", x, self.gate_up_proj(x))
        if self.ops is not None:
            h = self.ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.lora.apply(self.layer, "down_proj", h, self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.self_attn = Attention(config, backend, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.mlp = MLP(config, fused)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); the
        previous residual add is fused into this layer's first norm, as in vLLM."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    """The decoder stack plus embedding and LM head. The loader sets ``rope_cos`` /
    ``rope_sin`` (max_model_len, head_dim // 2) float32; ``fused`` selects the Triton
    elementwise kernels."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, fused: bool | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = backend  # shared by every layer
        self.fused = backend.name == "triton" if fused is None else fused
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, self.fused) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.fused)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) int64 -> final hidden states (num_tokens, hidden_size)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (num_tokens, head_dim // 2)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm.add_and_norm(x, residual)[0] if residual is not None else self.norm(x)

    def set_lora(self, lora: LoraDelta | None) -> None:
        """Run every layer's projections with ``lora``'s adapters (None: without)."""
        for i, layer in enumerate(self.layers):
            for block in (layer.self_attn, layer.mlp):
                block.lora, block.layer = lora, i

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: (n, hidden_size) -> logits (n, vocab_size) float32, written into ``out``
        when given (the same cast as into a new tensor)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if out is not None:
            return out.copy_(F.linear(hidden, weight))
        return F.linear(hidden, weight).float()
