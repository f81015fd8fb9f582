"""Tensor parallelism for the decoder of :mod:`sched_lab.backend.model` (Shoeybi et al. 2019,
"Megatron-LM", §3): column-parallel q/k/v and gate/up, row-parallel o_proj and down (one
all-reduce each), a vocab-parallel embedding (vocab padded to a multiple of N) and an
all-gathered LM head.

N must divide num_heads and intermediate_size, and either divide num_kv_heads or be a
multiple of it (each KV head then replicated on N / num_kv_heads ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sched_lab.backend.attention import AttentionBackend
from sched_lab.backend.config import ModelConfig
from sched_lab.backend.loader import (
    _read_parameter,
    _Reader,
    _store_layer_weights_kn,
    checkpoint_index,
)
from sched_lab.backend.model import Transformer
from sched_lab.backend.rope import rope_table
from sched_lab.core.errors import ConfigError


@dataclass(frozen=True)
class TPShard:
    """This process's place in the tensor-parallel group (torch.distributed's default group)."""

    rank: int
    size: int


def check_tp_size(
    config: ModelConfig, size: int, where: str = "engine.tensor_parallel_size"
) -> None:
    """ConfigError (one line) unless ``size`` splits the model (module doc rules)."""
    if size < 1:
        raise ConfigError(f"{where}: expected an integer >= 1, got {size}")
    heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % size:
        raise ConfigError(f"{where}: {size} does not divide the model's {heads} attention heads")
    if size <= kv and kv % size:
        raise ConfigError(f"{where}: {size} does not divide the model's {kv} KV heads")
    if size > kv and size % kv:
        raise ConfigError(
            f"{where}: {size} ranks > {kv} KV heads must be a multiple of them (each KV head "
            f"is replicated on size / KV heads ranks)"
        )
    if inter % size:
        raise ConfigError(f"{where}: {size} does not divide the MLP width {inter}")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shapes (KV heads at least 1); ``vocab_size`` stays the full vocabulary."""
    return replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
    )


def kv_head_start(config: ModelConfig, shard: TPShard) -> int:
    """First KV head rank ``shard.rank`` holds."""
    return shard.rank * config.num_kv_heads // shard.size


def vocab_shard_rows(vocab_size: int, size: int) -> int:
    """Rows of one vocab shard: the vocab padded up to a multiple of ``size``, / size."""
    return -(-vocab_size // size)


class RowParallelLinear(nn.Linear):
    """A row-parallel projection: this rank's input columns; the partial sums are
    all-reduced, then the (replicated) bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the padded embedding; ids outside embed to 0."""

    def __init__(self, rows: int, hidden_size: int, start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.start, self.rows = start, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(x)
        return x


class TPTransformer(Transformer):
    """:class:`sched_lab.backend.model.Transformer` sharded for one rank; ``config`` is the rank's
    :func:`shard_config`."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, shard: TPShard) -> None:
        super().__init__(config, backend)
        self.shard = shard
        hidden, rows = config.hidden_size, vocab_shard_rows(config.vocab_size, shard.size)
        self.embed_tokens = VocabParallelEmbedding(rows, hidden, shard.rank * rows)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(hidden, rows, bias=False)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(config.q_size, hidden, bias=config.o_bias)
            mlp.down_proj = RowParallelLinear(config.intermediate_size, hidden, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (n, hidden_size) -> logits (n, vocab_size) float32, the same on every rank."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        local = F.linear(hidden, weight).float().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]


def shard_parameter(
    name: str, full: torch.Tensor, config: ModelConfig, shard: TPShard
) -> torch.Tensor:
    """This rank's slice of one full (fused) parameter of the unsharded model."""
    r, n, hd = shard.rank, shard.size, config.head_dim
    if ".qkv_proj." in name:
        q, k, v = full.split([config.q_size, config.kv_size, config.kv_size], dim=0)
        q_rows = config.q_size // n
        kv_rows = max(1, config.num_kv_heads // n) * hd
        kv0 = kv_head_start(config, shard) * hd
        return torch.cat([q[r * q_rows : (r + 1) * q_rows], k[kv0 : kv0 + kv_rows],
                          v[kv0 : kv0 + kv_rows]])  # fmt: skip
    if ".gate_up_proj." in name:
        gate, up = full.chunk(2, dim=0)
        rows = config.intermediate_size // n
        return torch.cat([gate[r * rows : (r + 1) * rows], up[r * rows : (r + 1) * rows]])
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        cols = full.shape[1] // n
        return full[:, r * cols : (r + 1) * cols]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = vocab_shard_rows(config.vocab_size, n)
        out = full.new_zeros(rows, full.shape[1])
        part = full[r * rows : (r + 1) * rows]
        out[: part.shape[0]] = part
        return out
    return full  # norms, the o_proj bias: replicated


def load_tp_model(
    model_dir: str | Path,
    config: ModelConfig,
    shard: TPShard,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    kn_weights: bool = False,
) -> TPTransformer:
    """:func:`sched_lab.backend.loader.load_model` for rank ``shard.rank`` of the full ``config``:
    each full tensor is read and checked, then only its slice kept."""
    model_dir = Path(model_dir)
    index = checkpoint_index(model_dir)
    with torch.device("meta"):
        full_shapes = {
            n: tuple(p.shape) for n, p in Transformer(config, backend).named_parameters()
        }
        model = TPTransformer(shard_config(config, shard.size), backend, shard)
    model = model.to(dtype=dtype).to_empty(device=device)
    with _Reader() as reader:
        for name, param in model.named_parameters():
            full = _read_parameter(name, full_shapes[name], config, index, reader, model_dir)
            param.data.copy_(shard_parameter(name, full, config, shard))
    if kn_weights and device.type == "cuda":
        _store_layer_weights_kn(model)
    model.rope_cos, model.rope_sin = rope_table(config, max_model_len, device)
    return model.eval()


def agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the group's ranks."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
