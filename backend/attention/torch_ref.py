"""Reference paged attention in plain torch, the oracle the other backends are tested
against: a Python loop over sequences, scores and softmax in float32."""

from __future__ import annotations

import torch

from sched_lab.backend.attention.base import AttentionBackend, AttentionMetadata, dequantize


class TorchAttention(AttentionBackend):
    name = "torch"
    supports_fp8_kv = True  # dequantized to float32 before the scores

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for query_len, seq_len, blocks in zip(
            meta.query_lens, meta.seq_lens_host, meta.block_tables_host, strict=True
        ):
            end = start + query_len
            keys = gather_sequence(k_cache, blocks, seq_len)  # (seq_len, num_kv_heads, head_dim)
            values = gather_sequence(v_cache, blocks, seq_len)
            if k_cache.dtype == torch.float8_e4m3fn:
                keys, values = dequantize(keys, self.k_scale), dequantize(values, self.v_scale)
            out[start:end] = attend(q[start:end], keys, values, scale)
            start = end
        return out


def gather_sequence(cache: torch.Tensor, blocks: list[int], seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached positions of a sequence, (seq_len, num_kv_heads, head_dim)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    index = torch.tensor(blocks[:num_blocks], dtype=torch.long, device=cache.device)
    return cache.index_select(0, index).flatten(0, 1)[:seq_len]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of a sequence over all of its keys.

    Args:
        q: (query_len, num_heads, head_dim); query i sits at position seq_len - query_len + i.
        keys, values: (seq_len, num_kv_heads, head_dim).
    Returns:
        (query_len, num_heads, head_dim) in q's dtype.
    """
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads  # query heads sharing one kv head (GQA)
    keys = keys.float().repeat_interleave(group, dim=1)  # (seq_len, num_heads, head_dim)
    values = values.float().repeat_interleave(group, dim=1)
    scores = (
        torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    )  # (num_heads, query_len, seq_len)
    q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
