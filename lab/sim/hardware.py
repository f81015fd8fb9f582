"""Accelerator presets for the analytic cost model. ``kind``: "datasheet" (vendor peak, dense)
or "measured" (timed on a real device with PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
# Seconds one host <-> device copy costs beyond its bytes (cudaMemcpyAsync submission, DMA
# setup, PCIe round trip), an assumed figure: Wu et al. 2026, "DualPath" (arXiv 2602.21548),
# §5.2, measure 5-7 us of submission overhead per cudaMemcpyAsync of a small chunk; rounded
# up to 10 us for the DMA start. benchmarks/swap_profile.py measures it on a GPU.
HOST_COPY_LATENCY_S = 10e-6


@dataclass(frozen=True)
class Hardware:
    """peak_flops (bf16 FLOP/s), mem_bandwidth (HBM bytes/s), host_link_bandwidth (host<->device
    bytes/s, one direction), memory_bytes (device), tp_link (the :data:`LINKS` preset between
    GPUs of one host; None: no tensor parallelism on this preset), host_link_latency_s
    (seconds per host <-> device copy on top of its bytes; :data:`HOST_COPY_LATENCY_S`),
    peak_flops_fp8 (dense FP8 tensor-core FLOP/s, the datasheet's sparse figure halved; None:
    no FP8 tensor cores or not given)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    host_link_bandwidth: float
    memory_bytes: float
    kind: str
    source: str
    tp_link: str | None = None
    host_link_latency_s: float = HOST_COPY_LATENCY_S
    peak_flops_fp8: float | None = None


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware(
            "h100-sxm",
            989e12,
            3.35e12,
            64 * GB,
            80 * GB,
            "datasheet",
            "NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS dense BF16, 3.35 TB/s "
            "HBM3, 80 GB; PCIe Gen5 x16 64 GB/s per direction; FP8 3,958 TFLOPS with "
            "sparsity, 1,979 dense",
            "nvlink4",
            peak_flops_fp8=1979e12,
        ),
        Hardware(
            "h200-sxm",
            989e12,
            4.8e12,
            64 * GB,
            141 * GB,
            "datasheet",
            "NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOPS dense BF16, 4.8 TB/s "
            "HBM3e, 141 GB; PCIe Gen5 x16 64 GB/s per direction; FP8 3,958 TFLOPS with "
            "sparsity, 1,979 dense",
            "nvlink4",
            # The datasheet's tensor-core figures are with 2:4 sparsity (its footnote): BF16
            # 1,979 -> 989 dense, FP8 3,958 -> 1,979 dense.
            peak_flops_fp8=1979e12,
        ),
        Hardware(
            "h200-sxm-measured",
            796e12,
            4.27e12,
            55.5 * GB,
            141 * GB,
            "measured",
            "this lab's H200 with PyTorch, 2026-11: bf16 8192^3 matmul "
            "796 TFLOP/s, device copy 4.27 TB/s (read + write), pinned H2D/D2H 55.5 GB/s",
            "nvlink4",
        ),
        Hardware(
            "a100-80gb",
            312e12,
            2.039e12,
            32 * GB,
            80 * GB,
            "datasheet",
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOPS dense BF16, "
            "2,039 GB/s HBM2e; PCIe Gen4 x16 32 GB/s per direction",
        ),
    ]
}


@dataclass(frozen=True)
class Link:
    """A KV-transfer link between prefill and decode replicas: bandwidth (bytes/s, one
    direction), latency_s (one-way; an assumed figure, not a datasheet one), source."""

    name: str
    bandwidth: float
    latency_s: float
    source: str


GBIT = 1e9 / 8  # bytes/s of one Gb/s

LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        Link(
            "nvlink4",
            450 * GB,
            2e-6,
            "NVIDIA H100 / H200 Tensor Core GPU datasheets: NVLink 900 GB/s per GPU "
            "(bidirectional), 450 GB/s per direction; latency assumed",
        ),
        Link(
            "ib-ndr",
            400 * GBIT,
            5e-6,
            "NVIDIA ConnectX-7 datasheet: InfiniBand NDR 400 Gb/s per port; latency assumed "
            "(one-way RDMA)",
        ),
        Link(
            "eth-400g",
            400 * GBIT,
            10e-6,
            "IEEE 802.3bs 400 Gb/s Ethernet (NVIDIA ConnectX-7: 400GbE); latency assumed (RoCE)",
        ),
        Link(
            "eth-100g",
            100 * GBIT,
            10e-6,
            "IEEE 802.3ba / 802.3cd 100 Gb/s Ethernet; latency assumed (RoCE)",
        ),
    ]
}
