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
    :func:`with_kv_dtype`); ``quantization`` of the layer projections (None, fp8, int8, awq,
    gptq; see :func:`with_quantization` and :data:`WEIGHT_BYTES`)."""

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
    quantization: str | None = None

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
    def projection_params_per_layer(self) -> int:
        """Weights of one layer's q, k, v, o, gate, up and down projections (no norms)."""
        return self.params_per_layer - 2 * self.hidden_size

    @property
    def projection_rows_per_layer(self) -> int:
        """Output channels of one layer's projections (one weight scale each for fp8, int8)."""
        h, d = self.hidden_size, self.head_dim
        q_kv = (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        return q_kv + h + 2 * self.intermediate_size + h

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights; quantized projections at :data:`WEIGHT_BYTES` per weight
        plus their per-channel or per-group scales (embedding, norms, LM head unquantized)."""
        if self.quantization is None:
            return self.num_params * self.dtype_bytes
        layers = self.num_hidden_layers
        projections = layers * self.projection_params_per_layer
        other = (self.num_params - projections) * self.dtype_bytes
        per_weight, per_group, group = WEIGHT_BYTES[self.quantization]
        if group is None:  # per output channel
            scales = layers * self.projection_rows_per_layer * per_group
        else:
            scales = projections // group * per_group
        return other + round(projections * per_weight) + scales

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


#: method -> (bytes per projection weight, bytes per scale group, inputs per group; None:
#: one group per output channel), as the checkpoints of backend/quant_formats.py store them:
#: fp8/int8 one float32 scale per channel; awq/gptq 4 bits, per 128 inputs a float16 scale and
#: a 4-bit zero point.
WEIGHT_BYTES: dict[str, tuple[float, float, int | None]] = {
    "fp8": (1.0, 4.0, None),
    "int8": (1.0, 4.0, None),
    "awq": (0.5, 2.5, 128),
    "gptq": (0.5, 2.5, 128),
}


def with_quantization(model: ModelSpec, quantization: str | None) -> ModelSpec:
    """``model`` with its projections quantized (the top-level ``quantization`` key); None
    returns ``model`` itself."""
    if quantization is None:
        return model
    return dataclasses.replace(model, quantization=quantization)


#: The simulator's model presets, from the public config.json values in lab/core/model_presets.py
#: (e.g. llama-3.1-8b: 8.03 B parameters; qwen3-0.6b: head_dim 128 > hidden / heads, tied
#: embeddings).
MODELS: dict[str, ModelSpec] = {n: ModelSpec.from_config(n, c) for n, c in PRESETS.items()}
