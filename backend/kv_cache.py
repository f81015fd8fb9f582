"""The paged KV cache on the device and its swap space in host memory.

Layout: one tensor per side, ``(2, num_layers, num_blocks, block_size, num_kv_heads,
head_dim)`` (index 0 = K, 1 = V), so each layer's K or V is the contiguous
``(num_blocks, block_size, num_kv_heads, head_dim)`` the attention backends expect, and one
index op over dim 2 moves a set of blocks for all layers at once. The host side has the same
layout, in pinned memory when CUDA is available (pinned pages make the transfers asynchronous;
torch's pinned allocator rounds the request up to a power of two, so size the swap space
accordingly: 4 GiB costs 4 GiB, 5 GiB costs 8).

Swapping is batched: one gather on the source, one transfer, one scatter on the destination.
``swap_in`` is fully asynchronous on CUDA (host gather into pinned staging, non-blocking copy,
device scatter queued on the stream). ``swap_out`` queues the device gather and a
non-blocking device-to-host copy into pinned staging; the host-side scatter into the swap
space must wait for that copy, so it is deferred to :meth:`KVCache.flush`, which the runner
calls after each step's sync and ``swap_in`` calls first. The copies are stream-ordered before
the step's kernels, so a block swapped out may be overwritten by the same step.

Capacity (``num_gpu_blocks``) is decided by the runner (see ``ModelRunner``); this module only
turns bytes into blocks.
"""

from __future__ import annotations

import torch

from backend.config import ModelConfig
from backend.errors import KVCacheCapacityError

GiB = 1 << 30


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
        config: the model (layers, kv heads, head_dim).
        block_size: tokens per block.
        num_gpu_blocks: device blocks (>= 1).
        num_cpu_blocks: host swap blocks (>= 0).
        dtype: dtype of the model.
        device: where the model runs; the "GPU" blocks live there even when it is the CPU.
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
            (2, config.num_layers, num_cpu_blocks, *per_block), dtype=dtype, pin_memory=pin
        )
        self.layers = [(self.gpu[0, i], self.gpu[1, i]) for i in range(config.num_layers)]
        # swap-outs whose host-side scatter waits for their copy: (event, cpu block ids, staged)
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.gpu[:, :, :1].numel() * self.gpu.element_size()

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``mapping`` is [(gpu_block, cpu_block), ...].

        Mutates the swap space (on CUDA, once the copy lands: see :meth:`flush`).
        """
        if not mapping:
            return
        gpu_ids, cpu_ids = _checked(mapping, self.num_gpu_blocks, self.num_cpu_blocks)
        src = torch.tensor(gpu_ids, dtype=torch.long, device=self.device)
        dst = torch.tensor(cpu_ids, dtype=torch.long)
        gathered = self.gpu.index_select(2, src)  # (2, layers, n, block_size, kv_heads, head_dim)
        if self.device.type != "cuda":
            self.cpu.index_copy_(2, dst, gathered)
            return
        staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staged.copy_(gathered, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((done, dst, staged))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: ``mapping`` is [(cpu_block, gpu_block), ...].

        Mutates the device cache (asynchronously on CUDA, ordered before later kernels).
        """
        if not mapping:
            return
        self.flush()
        cpu_ids, gpu_ids = _checked(mapping, self.num_cpu_blocks, self.num_gpu_blocks)
        src = torch.tensor(cpu_ids, dtype=torch.long)
        dst = torch.tensor(gpu_ids, dtype=torch.long, device=self.device)
        if self.device.type != "cuda":
            self.gpu.index_copy_(2, dst, self.cpu.index_select(2, src))
            return
        shape = (*self.cpu.shape[:2], len(mapping), *self.cpu.shape[3:])
        staged = torch.empty(shape, dtype=self.cpu.dtype, pin_memory=True)
        torch.index_select(self.cpu, 2, src, out=staged)
        self.gpu.index_copy_(2, dst, staged.to(self.device, non_blocking=True))

    def flush(self) -> None:
        """Finish pending swap-outs: wait for each copy, then scatter it into the swap space."""
        for done, dst, staged in self._pending:
            done.synchronize()
            self.cpu.index_copy_(2, dst, staged)
        self._pending.clear()


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
