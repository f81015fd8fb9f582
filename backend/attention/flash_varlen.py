"""FlashAttention-2 for prefill chunks that start at position 0, through PyTorch's
``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10 on CUDA; not paged).

A chunk that starts at position 0 attends only to its own tokens, so its attention needs no
KV cache: ``varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len,
window_size=(-1, 0))`` (causal) over the step's own k/v. The triton backend uses it for such
chunks when the rule below says it wins (the k/v are still written into the paged cache
first, for the decodes that follow); chunks over a cached prefix and decodes keep the paged
Triton kernels.

The rule (``prefill_attention: auto``): every sequence fed more than one token starts at
position 0, those sequences come first in the step, and their mean chunk length is at least
``VARLEN_MIN_MEAN_CHUNK`` tokens. On an H200 (random bf16, Qwen3-0.6B and Llama-3.1-8B
heads; BENCHMARKS.md) varlen takes 0.70-0.88x the Triton kernel's time for chunks of 1,024
to 8,192 tokens, 0.92-1.07x at 512 and 1.05-1.13x at 256, so the threshold is 1,024.
``flash_varlen`` uses it for every such step regardless of length; ``triton`` never.

varlen_attn captures into a CUDA graph (its grid depends on ``max_len`` only, and the graph
follows ``cu_seqlens`` in place), but the lab's mixed-step graphs are captured for the
Triton prefill kernel: a step that replays a graph keeps Triton, and varlen runs in eager
steps only (more tokens than the largest mixed graph, or ``mixed_graphs: false``).
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
    """Whether varlen_attn can run here: CUDA (its flash kernel has no CPU version), fp16 or
    bf16, and a torch that has it."""
    return (
        varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
    )


def varlen_prefix(query_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
    """How many leading sequences are prefill chunks from position 0 (fed more than one
    token, ``seq_len == query_len``), provided no later sequence is fed more than one token;
    otherwise 0. Example: query lens [700, 300, 1], seq lens [700, 300, 41] -> 2;
    [700, 5, 1] over [700, 45, 41] -> 0 (the second chunk has a cached prefix)."""
    n = 0
    while n < len(query_lens) and query_lens[n] > 1 and seq_lens[n] == query_lens[n]:
        n += 1
    if n == 0 or any(q > 1 for q in query_lens[n:]):
        return 0
    return n


def choose(mode: str, query_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
    """The number of leading sequences whose attention runs through varlen_attn this step
    (0: the Triton kernels do all of it), by ``mode`` (see the module doc)."""
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
            contiguous (views into the fused projection's output are fine).
        cu_seqlens: (chunks + 1,) int32 token offsets of the chunks.
        max_len: the longest chunk (host int; sets the kernel's grid).
    Returns:
        (tokens, num_heads, head_dim) in q's dtype.
    """
    assert varlen_attn is not None, "torch.nn.attention.varlen is not available"
    kwargs = {"enable_gqa": True} if _ASK_GQA and k.shape[1] != q.shape[1] else {}
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                       window_size=(-1, 0), **kwargs)  # fmt: skip
