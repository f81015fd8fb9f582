"""Model configuration read from a Hugging Face ``config.json``: one frozen dataclass for the
Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm). Reads
both ``rope_theta`` + ``rope_scaling`` and transformers >= 5's ``rope_parameters``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sched_lab.backend.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and flags of a Llama-family decoder.

    Args:
        architecture: one of ``SUPPORTED_ARCHITECTURES``.
        num_kv_heads: key/value heads (GQA when fewer than ``num_heads``).
        head_dim: per head; Qwen3 sets it explicitly (not ``hidden_size // num_heads``).
        rope_scaling: None or a dict with ``rope_type`` in ``SUPPORTED_ROPE_TYPES``.
        qkv_bias: q/k/v projections have a bias (Qwen2; Llama with ``attention_bias``).
        o_bias: the output projection has a bias (Llama with ``attention_bias``).
        qk_norm: RMSNorm on each q and k head before RoPE (Qwen3).
        sliding_window: window in tokens, or None; not implemented (the runner refuses a
            ``max_model_len`` above it).
        torch_dtype: dtype the checkpoint was saved in, if stated.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        """num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``; raises CheckpointError if absent or malformed."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a config.json dict; ``source`` names the file in error messages."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            return _parse(raw, arch, source)
        except KeyError as e:
            raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from e


def _parse(raw: dict[str, Any], arch: str, source: str) -> ModelConfig:
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {raw['hidden_act']!r}; only 'silu'")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope_settings(raw, source)
    attention_bias = bool(raw.get("attention_bias", False))
    uses_window = arch == "MistralForCausalLM" or bool(raw.get("use_sliding_window", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch == "LlamaForCausalLM" and attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=raw.get("sliding_window") if uses_window else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def _rope_settings(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling of the config."""
    params = raw.get("rope_parameters")
    if params:  # transformers >= 5: theta and scaling in one dict
        theta = float(params.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = rope_type
    return theta, scaling
