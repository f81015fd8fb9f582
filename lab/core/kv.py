"""Paged KV cache bookkeeping: GPU and CPU block pools and per-request block tables.

The block manager counts blocks, never tokens: how many tokens a request needs is the
scheduler's business (lab/core/scheduler.py). Each block has exactly one owner. A request's
``block_table`` lists GPU block ids while it runs and CPU block ids while it is swapped out
(``Request.status`` tells which pool).

Free blocks are kept on a stack: the block freed last is reused first (LIFO), which keeps a
small working set of blocks hot, as vLLM's free-block queue does. Blocks never used yet are
handed out in id order after the freed ones, without a list of them (a pool of millions of
blocks costs nothing until its blocks are used).
"""

from __future__ import annotations

import math

from lab.core.request import Request, RequestStatus


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Free block ids ``[0, size)`` of one pool: a LIFO stack of freed blocks, then the
    blocks never used yet in ascending order (``next_unused`` onwards)."""

    __slots__ = ("size", "freed", "next_unused", "num_free")

    def __init__(self, size: int) -> None:
        self.size = size
        self.freed: list[int] = []
        self.next_unused = 0
        self.num_free = size  # len(freed) + size - next_unused, kept as a plain attribute

    def __len__(self) -> int:
        return self.num_free

    def take(self, n: int) -> list[int]:
        """``n`` free ids, the most recently freed first (the caller checks ``num_free``)."""
        freed = self.freed
        self.num_free -= n
        if n == 1 and freed:  # the common case: one block for a decode
            return [freed.pop()]
        k = min(n, len(freed))
        out = freed[: -k - 1 : -1] if k else []
        if k:
            del freed[-k:]
        if n > k:
            start = self.next_unused
            out.extend(range(start, start + n - k))
            self.next_unused = start + n - k
        return out

    def put(self, blocks: list[int]) -> None:
        """Free ``blocks``; the first of them is handed out first again."""
        self.freed.extend(reversed(blocks))
        self.num_free += len(blocks)

    def free_ids(self) -> list[int]:
        """Every free id (for integrity checks; O(pool size))."""
        return self.freed + list(range(self.next_unused, self.size))


class BlockManager:
    """GPU and CPU (swap space) block pools.

    Args:
        num_gpu_blocks: blocks of KV cache on the accelerator (>= 1).
        num_cpu_blocks: blocks of swap space in host memory (>= 0).
        block_size: tokens per block (>= 1).
        watermark: fraction of GPU blocks kept free when admitting new work, so running
            requests can grow without immediate preemption (vLLM V0's default is 0.01).
    """

    def __init__(
        self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, watermark: float = 0.01
    ) -> None:
        if num_gpu_blocks < 1 or num_cpu_blocks < 0 or block_size < 1:
            raise ValueError("need num_gpu_blocks >= 1, num_cpu_blocks >= 0, block_size >= 1")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = math.floor(watermark * num_gpu_blocks)
        # Block 0 is handed out first (readable block tables in tests).
        self._free_gpu = BlockPool(num_gpu_blocks)
        self._free_cpu = BlockPool(num_cpu_blocks)

    # ----------------------------------------------------------------------- queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self._free_gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._free_cpu.num_free

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self._free_gpu.num_free

    @property
    def num_used_cpu_blocks(self) -> int:
        return self.num_cpu_blocks - self._free_cpu.num_free

    def can_allocate(self, num_blocks: int, use_watermark: bool = True) -> bool:
        """True if ``num_blocks`` GPU blocks can be handed out (keeping the watermark free)."""
        reserve = self.watermark_blocks if use_watermark else 0
        return self._free_gpu.num_free - num_blocks >= reserve

    # ----------------------------------------------------------------------- mutations
    def allocate(self, request: Request, num_blocks: int) -> None:
        """Append ``num_blocks`` GPU blocks to ``request.block_table``.

        Raises:
            RuntimeError: not enough free GPU blocks (callers check first).
        """
        if num_blocks > self._free_gpu.num_free:
            raise RuntimeError(
                f"request {request.request_id}: {num_blocks} blocks asked, "
                f"{self._free_gpu.num_free} free"
            )
        request.block_table.extend(self._free_gpu.take(num_blocks))

    def free(self, request: Request) -> None:
        """Return all blocks of ``request`` to the pool it is in (GPU, or CPU if swapped)."""
        pool = self._free_cpu if request.status is RequestStatus.SWAPPED else self._free_gpu
        pool.put(request.block_table)
        request.block_table = []

    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_table) <= self._free_cpu.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to CPU swap space.

        Returns:
            (gpu_block, cpu_block) pairs to copy, in block-table order. The caller sets the
            request's status to SWAPPED.
        """
        cpu = self._free_cpu.take(len(request.block_table))
        mapping = list(zip(request.block_table, cpu))
        self._free_gpu.put(request.block_table)
        request.block_table = cpu
        return mapping

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks back to the GPU; returns (cpu_block, gpu_block) pairs."""
        gpu = self._free_gpu.take(len(request.block_table))
        mapping = list(zip(request.block_table, gpu))
        self._free_cpu.put(request.block_table)
        request.block_table = gpu
        return mapping

    # ----------------------------------------------------------------------- invariants
    def check_integrity(self, requests: list[Request]) -> None:
        """Check that every block has exactly one owner and used + free = total, per pool.

        Args:
            requests: every request that may hold blocks (running and swapped ones).

        Raises:
            AssertionError: naming the broken invariant.
        """
        owners: dict[tuple[str, int], str] = {}
        for pool, free in (("gpu", self._free_gpu), ("cpu", self._free_cpu)):
            for b in free.free_ids():
                key = (pool, b)
                assert key not in owners, f"{pool} block {b} is free twice"
                owners[key] = "free"
        for r in requests:
            pool = "cpu" if r.status is RequestStatus.SWAPPED else "gpu"
            for b in r.block_table:
                key = (pool, b)
                assert key not in owners, (
                    f"{pool} block {b} of request {r.request_id} is also {owners[key]}"
                )
                owners[key] = r.request_id
        for pool, total in (("gpu", self.num_gpu_blocks), ("cpu", self.num_cpu_blocks)):
            n = sum(1 for p, _ in owners if p == pool)
            assert n == total, f"{pool}: used + free = {n}, total = {total}"
            bad = [b for p, b in owners if p == pool and not 0 <= b < total]
            assert not bad, f"{pool}: block ids out of range: {bad[:5]}"
