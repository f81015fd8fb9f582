"""The simulator's tensor-parallel term (lab/sim/cost_model.py), against hand-computed figures."""

from __future__ import annotations

import math

import pytest

from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import StepFeatures
from sched_lab.sim.cost_model import AnalyticCostModel, activation_bytes, num_gpu_blocks
from sched_lab.sim.hardware import HARDWARE
from sched_lab.sim.models import MODELS

LLAMA, H200 = MODELS["llama-3.1-8b"], HARDWARE["h200-sxm"]
DECODE_64 = StepFeatures(0, 0, 0, 0.0, 64, 64 * 1000, 64, 0)  # 64 decodes over 1000 tokens


def test_tp2_halves_the_roofline_and_adds_two_ring_all_reduces_per_layer():
    one = AnalyticCostModel(LLAMA, H200)
    two = AnalyticCostModel(LLAMA, H200, tensor_parallel_size=2)
    overhead = 0.002
    # Per token, per all-reduce: 4096 hidden x 2 bytes; 2 per layer x 32 layers = 524,288 bytes.
    # A ring over 2 GPUs moves 2(2-1)/2 = 1x of it at NVLink 4's 450 GB/s per direction, and
    # takes 2(2-1) = 2 latency hops of 2 us per all-reduce: 64 all-reduces x 4 us = 256 us.
    comm = 64 * 524_288 / 450e9 + 256e-6
    expected = (one.step_time(DECODE_64, 16) - overhead) / 2 + overhead + comm
    assert two.step_time(DECODE_64, 16) == pytest.approx(expected, rel=1e-12)
    assert comm == pytest.approx(330.57e-6, rel=1e-4)


def test_tp2_kv_pool_holds_each_blocks_half_and_half_the_weights():
    act = activation_bytes(LLAMA, 8192, 256)
    # 8 KV heads over 2 GPUs: 4 each, so a GPU holds half of each block's 131,072 bytes/token.
    assert LLAMA.kv_bytes_per_token == 131_072
    free = 141e9 * 0.9 - LLAMA.weight_bytes / 2 - act
    assert num_gpu_blocks(LLAMA, H200, 16, 0.9, 8192, 256, 2) == math.floor(free / (65_536 * 16))
    assert num_gpu_blocks(LLAMA, H200, 16, 0.9, 8192, 256, 2) > 2 * num_gpu_blocks(
        LLAMA, H200, 16, 0.9, 8192, 256
    )


def test_tp_without_link_figures_is_one_line():
    with pytest.raises(ConfigError, match="hardware 'a100-80gb' has none"):
        AnalyticCostModel(LLAMA, HARDWARE["a100-80gb"], tensor_parallel_size=2)
