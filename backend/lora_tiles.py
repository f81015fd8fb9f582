"""The LoRA kernels' tile sizes, apart from both their users (backend/lora.py, which runs
without Triton, and backend/lora_kernels.py), so that neither imports the other at load."""

from __future__ import annotations

from dataclasses import dataclass

TILE_ROWS = 16  # token rows of one kernel tile (tl.dot's smallest M)


@dataclass(frozen=True)
class Tiling:
    """Tile sizes of the tiles-grid kernels; the defaults aim at decode steps (1-4 rows per
    adapter, rank 8-64, K up to 14,336, out up to 28,672).

    Attributes:
        k_per_split: input features per shrink program (split-K: a decode step has few rows
            per adapter, so K is what spreads the work); rounded up to the K tile. 1024: the
            fastest of 256/512/1024 on the H200 (BENCHMARKS.md, issue 34, 2026-12-03).
        expand_block_n: output columns per expand program; None: 8192 // rank within
            [64, 256] (a B tile of rank x block_n elements, 8-16k).
        num_warps: warps per program of both kernels.
    """

    k_per_split: int = 1024
    expand_block_n: int | None = None
    num_warps: int = 4

    def __post_init__(self) -> None:
        n = self.expand_block_n
        if self.k_per_split < 16 or (n is not None and (n < 16 or n & (n - 1))):
            raise ValueError(
                f"lora tiling: k_per_split must be >= 16 and expand_block_n a power of two "
                f">= 16, got {self.k_per_split} and {n}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"lora tiling: num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}"
            )

    def expand_n(self, rank: int) -> int:
        """Output columns per expand program for ``rank`` (a power of two >= 16)."""
        if self.expand_block_n is not None:
            return self.expand_block_n
        return max(64, min(256, 8192 // rank))
