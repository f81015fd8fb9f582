"""Model shapes (from each model's public Hugging Face ``config.json``) and the sizes the
cost model and the KV-capacity rule derive from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sched_lab.core.kv_dtypes import kv_dtype_bytes
from sched_lab.core.model_presets import PRESETS


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder's shape: config.json names; ``dtype_bytes`` 2 for bf16/fp16;
    ``kv_dtype_bytes`` of one cached K or V element (None: ``dtype_bytes``; see
    :func:`with_kv_dtype`)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2
    kv_dtype_bytes: int | None = None

    @property
    def params_per_layer(self) -> int:
        """Weights of one decoder layer (attention projections, gated MLP, norms)."""
        h, d = self.hidden_size, self.head_dim
        q_o = 2 * h * self.num_attention_heads * d
        k_v = 2 * h * self.num_key_value_heads * d
        return q_o + k_v + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_params(self) -> int:
        """All weights, embedding and LM head included (the head once if tied)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_hidden_layers * self.params_per_layer + embed + head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies (layers; the LM head is counted per sample)."""
        return self.num_hidden_layers * self.params_per_layer

    @property
    def lora_dims_per_layer(self) -> int:
        """Sum over the projections a LoRA adapter covers (q, k, v, o, gate, up, down) of
        in + out features: one rank-r adapter holds r * this many weights per layer (A is
        r x in, B is out x r)."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
            self.intermediate_size,
        )
        return (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)

    def lora_adapter_bytes(self, rank: int) -> int:
        """Bytes of one rank-``rank`` adapter over every layer, in the model's dtype."""
        return self.num_hidden_layers * rank * self.lora_dims_per_layer * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: 2 * layers * kv_heads * head_dim * KV bytes."""
        element = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element

    @classmethod
    def from_config(cls, name: str, config: dict) -> ModelSpec:
        """The shape of a Hugging Face ``config.json`` (head_dim defaults to hidden / heads)."""
        heads = config["num_attention_heads"]
        return cls(
            name,
            config["hidden_size"],
            config["num_hidden_layers"],
            heads,
            config.get("num_key_value_heads", heads),
            config.get("head_dim") or config["hidden_size"] // heads,
            config["intermediate_size"],
            config["vocab_size"],
            config["max_position_embeddings"],
            config.get("tie_word_embeddings", False),
        )


def with_kv_dtype(model: ModelSpec, kv_cache_dtype: str) -> ModelSpec:
    """``model`` with its KV cache in ``kv_cache_dtype`` (``kv_cache.dtype``: auto, fp8);
    ``auto`` returns ``model`` itself."""
    if kv_cache_dtype == "auto":
        return model
    return dataclasses.replace(
        model, kv_dtype_bytes=kv_dtype_bytes(kv_cache_dtype, model.dtype_bytes)
    )


#: The simulator's model presets, from the public config.json values in lab/core/model_presets.py
#: (e.g. llama-3.1-8b: 8.03 B parameters; qwen3-0.6b: head_dim 128 > hidden / heads, tied
#: embeddings).
MODELS: dict[str, ModelSpec] = {n: ModelSpec.from_config(n, c) for n, c in PRESETS.items()}
