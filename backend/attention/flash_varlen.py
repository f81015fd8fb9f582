"""FlashAttention-2 for prefill chunks that start at position 0, through PyTorch's
``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10 on CUDA; not paged).

Such a chunk attends only to its own tokens, so it needs no KV cache. ``auto`` uses it when
those chunks lead the step and average at least ``VARLEN_MIN_MEAN_CHUNK`` tokens;
``flash_varlen`` always; ``triton`` never. Eager steps only (mixed graphs keep Triton).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

PREFILL_ATTENTION = ("auto", "triton", "flash_varlen")
VARLEN_MIN_MEAN_CHUNK = 1024  # tokens: auto uses varlen when the chunks' mean is at least this


def _import_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "window_size" not in inspect.signature(varlen_attn).parameters:
        return None  # older releases spelled causal otherwise
    return varlen_attn


varlen_attn = _import_varlen()
# Newer releases ask for GQA explicitly (enable_gqa); 2.11 takes fewer kv heads as they are.
_ASK_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether varlen_attn can run here: CUDA, fp16 or bf16, and a torch that has it."""
    return (
        varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
    )


def varlen_prefix(query_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
    """How many leading sequences are prefill chunks from position 0 (``seq_len ==
    query_len > 1``), provided no later sequence is fed more than one token; else 0."""
    n = 0
    while n < len(query_lens) and query_lens[n] > 1 and seq_lens[n] == query_lens[n]:
        n += 1
    if n == 0 or any(q > 1 for q in query_lens[n:]):
        return 0
    return n


def choose(mode: str, query_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
    """Leading sequences that run through varlen_attn this step by ``mode`` (0: none)."""
    if mode == "triton":
        return 0
    n = varlen_prefix(query_lens, seq_lens)
    if mode == "auto" and n and sum(query_lens[:n]) < VARLEN_MIN_MEAN_CHUNK * n:
        return 0
    return n


def varlen_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each chunk over its own tokens.

    Args:
        q: (tokens, num_heads, head_dim); k, v: (tokens, num_kv_heads, head_dim), last dim
            contiguous.
        cu_seqlens: (chunks + 1,) int32 token offsets of the chunks.
        max_len: the longest chunk (host int).
    Returns:
        (tokens, num_heads, head_dim) in q's dtype.
    """
    assert varlen_attn is not None, "torch.nn.attention.varlen is not available"
    kwargs = {"enable_gqa": True} if _ASK_GQA and k.shape[1] != q.shape[1] else {}
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                       window_size=(-1, 0), **kwargs)  # fmt: skip
