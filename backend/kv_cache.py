"""The paged KV cache on the device and its swap space in host memory.

Device: ``(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)`` (0 = K, 1 = V).
Host swap: block-major ``(num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim)``,
pinned when CUDA is available (torch rounds pinned sizes up to a power of two). Swaps are
stream-ordered before the step's kernels. The dtype is the model's, or ``torch.float8_e4m3fn``
(``kv_cache.dtype: fp8``: one byte an element, so twice the blocks of a bf16 cache in the same
bytes); swaps copy an FP8 cache's bytes as they are (through uint8 views).
"""

from __future__ import annotations

import torch

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.errors import KVCacheCapacityError
from sched_lab.core.kv import contiguous_runs
from sched_lab.core.kv_dtypes import canonical_kv_dtype

GiB = 1 << 30


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for ``kv_cache.dtype`` (auto: the model's; fp8: E4M3)."""
    return torch.float8_e4m3fn if canonical_kv_dtype(kv_cache_dtype) == "fp8" else model_dtype


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    element_bytes = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element_bytes


def blocks_in(budget_bytes: int, block_bytes: int, what: str) -> int:
    """How many blocks fit in ``budget_bytes``; KVCacheCapacityError if not even one."""
    num_blocks = max(0, budget_bytes) // block_bytes
    if num_blocks < 1:
        raise KVCacheCapacityError(
            f"the KV cache does not fit: {what} leaves {budget_bytes / GiB:.3f} GiB, "
            f"one block needs {block_bytes / GiB:.4f} GiB"
        )
    return num_blocks


class KVCache:
    """Device KV blocks plus host swap blocks of the same shape.

    Args:
        num_gpu_blocks: device blocks (>= 1); they live on ``device`` even when it is the CPU.
        num_cpu_blocks: host swap blocks (>= 0).
    """

    def __init__(
        self,
        config: ModelConfig,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_gpu_blocks < 1:
            raise KVCacheCapacityError(
                f"the KV cache needs at least one block (got num_gpu_blocks={num_gpu_blocks})"
            )
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        per_block = (block_size, config.num_kv_heads, config.head_dim)
        # Zeroed so that padding lanes of a kernel never meet NaN garbage.
        self.gpu = torch.zeros(
            (2, config.num_layers, num_gpu_blocks, *per_block), dtype=dtype, device=device
        )
        pin = torch.cuda.is_available()
        self.cpu = torch.empty(
            (num_cpu_blocks, 2, config.num_layers, *per_block), dtype=dtype, pin_memory=pin
        )
        self.layers = [(self.gpu[0, i], self.gpu[1, i]) for i in range(config.num_layers)]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.gpu[:, :, :1].numel() * self.gpu.element_size()

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy [(gpu_block, cpu_block), ...] to the swap space (mutates it; on CUDA read it
        after a sync). Device scratch: ``len(mapping) * block_bytes``."""
        if not mapping:
            return
        gpu_ids, cpu_ids = _checked(sorted(mapping, key=lambda m: m[1]), self.num_gpu_blocks,
                                    self.num_cpu_blocks)  # fmt: skip
        src = torch.tensor(gpu_ids, dtype=torch.long).to(self.device, non_blocking=True)
        # (n, 2, layers, block_size, kv_heads, head_dim): the host layout, on the device
        gathered = _raw(self.gpu).index_select(2, src).permute(2, 0, 1, 3, 4, 5).contiguous()
        cpu = _raw(self.cpu)
        for first, start, stop in contiguous_runs(cpu_ids):
            cpu[first : first + stop - start].copy_(gathered[start:stop], non_blocking=True)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy [(cpu_block, gpu_block), ...] to the device cache (mutates it, stream-ordered).
        Device scratch: ``len(mapping) * block_bytes``."""
        if not mapping:
            return
        cpu_ids, gpu_ids = _checked(sorted(mapping), self.num_cpu_blocks, self.num_gpu_blocks)
        cpu = _raw(self.cpu)
        staged = torch.empty((len(cpu_ids), *cpu.shape[1:]), dtype=cpu.dtype,
                             device=self.device)  # fmt: skip
        for first, start, stop in contiguous_runs(cpu_ids):
            staged[start:stop].copy_(cpu[first : first + stop - start], non_blocking=True)
        dst = torch.tensor(gpu_ids, dtype=torch.long).to(self.device, non_blocking=True)
        _raw(self.gpu).index_copy_(2, dst, staged.permute(1, 2, 0, 3, 4, 5))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes (a uint8 view) for FP8, which has no index_copy_ on CPU."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _checked(
    mapping: list[tuple[int, int]], num_src: int, num_dst: int
) -> tuple[list[int], list[int]]:
    """Split a (src, dst) block mapping into two id lists; ValueError on an id out of range."""
    src = [s for s, _ in mapping]
    dst = [d for _, d in mapping]
    for ids, limit, side in ((src, num_src, "source"), (dst, num_dst, "destination")):
        bad = [i for i in ids if not 0 <= i < limit]
        if bad:
            raise ValueError(f"{side} block ids out of range [0, {limit}): {bad}")
    if len(set(dst)) != len(dst):
        raise ValueError(f"destination blocks repeat: {dst}")
    return src, dst
