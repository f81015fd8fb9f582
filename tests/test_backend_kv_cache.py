"""The paged KV cache: layout, swap round trips, capacity arithmetic, and step input building."""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

from sched_lab.backend.attention.base import prefill_tiles
from sched_lab.backend.config import ModelConfig
from sched_lab.backend.errors import KVCacheCapacityError
from sched_lab.backend.inputs import BlockTables, SeqInput, StepLimits, prepare_inputs, stage_step
from sched_lab.backend.kv_cache import KVCache, blocks_in, bytes_per_block
from sched_lab.core.errors import ConfigError

RAW = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
CONFIG = ModelConfig.from_dict(RAW)


def filled_cache(dtype=torch.float32, device: str = "cpu") -> KVCache:
    cache = KVCache(
        CONFIG,
        block_size=4,
        num_gpu_blocks=8,
        num_cpu_blocks=6,
        dtype=dtype,
        device=torch.device(device),
    )
    cache.gpu.copy_(
        torch.randn(cache.gpu.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    )
    return cache


def test_layer_views_have_the_backend_layout():
    cache = filled_cache()
    k, v = cache.layers[1]
    assert k.shape == (8, 4, 2, 16) and k.is_contiguous() and v.is_contiguous()
    assert k.data_ptr() == cache.gpu[0, 1].data_ptr()


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_restores_bytes_exactly(dtype, device):
    # On CUDA: pinned staging, non-blocking copies, swap-outs finished by flush().
    cache = filled_cache(dtype, device)
    before = cache.gpu.clone()
    cache.swap_out([(5, 0), (2, 3), (7, 1)])
    cache.gpu[:, :, [5, 2, 7]] = 0  # reused meanwhile; queued after the copies
    cache.swap_in([(3, 6), (0, 0), (1, 4)])  # back into different device blocks
    for old, new in ((2, 6), (5, 0), (7, 4)):
        assert torch.equal(
            cache.gpu[:, :, new].view(torch.uint8), before[:, :, old].view(torch.uint8)
        )
    untouched = [1, 3]
    assert torch.equal(cache.gpu[:, :, untouched], before[:, :, untouched])


def test_swap_rejects_out_of_range_ids():
    cache = filled_cache()
    with pytest.raises(ValueError, match="destination block ids out of range"):
        cache.swap_out([(0, 6)])
    with pytest.raises(ValueError, match="source block ids out of range"):
        cache.swap_in([(-1, 0)])


def test_capacity_arithmetic():
    # 2 (K and V) x 3 layers x 4 tokens x (2 heads x 16 dims) x 4 bytes = 3072 bytes per block.
    assert bytes_per_block(CONFIG, 4, torch.float32) == 3072
    assert filled_cache().block_bytes == 3072
    assert blocks_in(10_000, 3072, "test") == 3
    with pytest.raises(KVCacheCapacityError, match="does not fit"):
        blocks_in(3000, 3072, "a tiny budget")
    with pytest.raises(KVCacheCapacityError):
        KVCache(CONFIG, 4, 0, 0, torch.float32, torch.device("cpu"))


def test_prepare_inputs_slots_positions_and_metadata():
    seqs = [
        SeqInput(
            [11, 12, 13], start_pos=5, block_table=[7, 2], sample=False
        ),  # a chunk over a prefix
        SeqInput([21], start_pos=4, block_table=[3, 0], sample=True, temperature=0.5),  # a decode
    ]
    inp = prepare_inputs(
        seqs,
        block_size=4,
        num_gpu_blocks=8,
        max_model_len=64,
        vocab_size=100,
        device=torch.device("cpu"),
    )
    assert inp.input_ids.tolist() == [11, 12, 13, 21]
    assert inp.positions.tolist() == [5, 6, 7, 4]
    # position 5 -> block_table[1] = 2 -> slot 2*4 + 1; position 4 of seq 1 -> block 0, slot 0
    assert inp.attn.slot_mapping.tolist() == [9, 10, 11, 0]
    assert inp.attn.query_start_loc.tolist() == [0, 3, 4]
    assert inp.attn.seq_lens.tolist() == [8, 5]
    assert inp.attn.seq_start_loc.tolist() == [0, 8, 13]
    assert inp.attn.decode_seq_idx.tolist() == [1] and inp.attn.prefill_seq_idx.tolist() == [0]
    assert inp.attn.prefill_tiles.tolist() == [[0, 0]]  # 3 rows: one 64-row tile of seq 0
    assert inp.logits_indices.tolist() == [3]
    assert inp.sampled_seqs == [1] and [s.temperature for s in inp.sampled_inputs] == [0.5]


def test_stage_step_pads_token_rows_and_finds_logits_rows():
    # The host arithmetic both paths share: the step of the test above, padded to 6 rows.
    seqs = [SeqInput([11, 12, 13], 5, [7, 2], False), SeqInput([21], 4, [3, 0, 5], True)]
    tables = BlockTables()  # grows to the step: 2 rows, 2 blocks used at most
    step = stage_step(seqs, StepLimits(4, 8, 64, 100), tables, pad_to=6)
    ids, positions, slots, last = step.rows(step.tokens)
    assert ids.tolist() == [11, 12, 13, 21, 0, 0]
    assert positions.tolist() == [5, 6, 7, 4, 0, 0]
    assert slots.tolist() == [9, 10, 11, 0, -1, -1]  # padding rows write nowhere
    assert last.tolist() == [3]  # the sampled seq 1's only row
    assert step.num_tokens == 4 and step.padded_tokens == 6
    assert step.query_start_loc.tolist() == [0, 3, 4] and step.seq_lens.tolist() == [8, 5]
    assert step.block_tables.tolist() == [[7, 2], [3, 0]] and tables.table.shape == (2, 2)
    assert tables.row_lens.tolist() == [2, 2]
    with pytest.raises(ValueError, match="seq 1: block ids must be in"):
        stage_step([seqs[0], SeqInput([1], 4, [3, 8], True)], StepLimits(4, 8, 64, 100), tables)
    assert tables.row_lists == []  # a failed step forgets what the mirror held
    with pytest.raises(ValueError, match="step: no sequences"):
        stage_step([], StepLimits(4, 8, 64, 100))


def test_cpu_threads_rule(monkeypatch):
    from sched_lab.backend.runner import set_cpu_threads

    before = torch.get_num_threads()
    try:
        set_cpu_threads(1)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        set_cpu_threads(None)  # the default: min(4, cores)
        assert torch.get_num_threads() == min(4, os.cpu_count())
        torch.set_num_threads(max(1, min(4, os.cpu_count()) - 1))
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        set_cpu_threads(None)  # the user set OMP_NUM_THREADS: torch's setting stands
        assert torch.get_num_threads() == max(1, min(4, os.cpu_count()) - 1)
        with pytest.raises(ConfigError, match="num_threads must be >= 1"):
            set_cpu_threads(0)
    finally:
        torch.set_num_threads(before)


def test_runner_logs_its_capacity_line(tmp_path, caplog):
    from sched_lab.backend.runner import ModelRunner
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint({**RAW, "max_position_embeddings": 64}, tmp_path, dtype="float32")
    with caplog.at_level(logging.INFO, logger="sched_lab.backend.runner"):
        runner = ModelRunner(tmp_path, block_size=4, num_gpu_blocks=8, swap_space_bytes=3072)
    assert caplog.messages == [
        "KV cache: 8 blocks x 4 tokens = 32 tokens, 0.00 GiB on cpu (torch.float32); "
        "swap space: 1 blocks, 0.00 GiB"
    ]
    assert runner.graphs is None  # no CUDA graphs on the CPU by default


def test_prefill_tiles_cover_every_chunk_row():
    # 64-row tiles: 130 rows -> tiles 0, 1, 2; a decode (1 row) has none; 64 rows -> one.
    assert prefill_tiles([130, 1, 64]).tolist() == [[0, 0], [0, 1], [0, 2], [2, 0]]
    assert prefill_tiles([1, 1]).shape == (0, 2)
    assert prefill_tiles([5, 9], tile=4).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (SeqInput([], 0, [0], True), "no token_ids"),
        (SeqInput([1] * 5, 0, [0], True), "block_table has 1 blocks, 2 needed"),
        (SeqInput([1], 0, [9], True), r"block ids must be in \[0, 8\)"),
        (SeqInput([100], 0, [0], True), r"token ids must be in \[0, 100\)"),
        (SeqInput([1], 63, [0] * 16, True), "exceed max_model_len 63"),
    ],
)
def test_prepare_inputs_rejects_bad_sequences(seq, message):
    with pytest.raises(ValueError, match=message):
        prepare_inputs(
            [seq],
            block_size=4,
            num_gpu_blocks=8,
            max_model_len=63,
            vocab_size=100,
            device=torch.device("cpu"),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capacity_from_free_memory_on_cuda(tmp_path, caplog):
    from sched_lab.backend.runner import ModelRunner
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint({**RAW, "max_position_embeddings": 2048}, tmp_path, dtype="bf16")
    with caplog.at_level(logging.INFO, logger="sched_lab.backend.runner"):
        runner = ModelRunner(tmp_path, device="cuda", dtype="bfloat16",
                             attention_backend="triton", gpu_memory_utilization=0.2,
                             max_num_batched_tokens=4096, swap_space_bytes=1 << 30)  # fmt: skip
    _, total = torch.cuda.mem_get_info()
    used = runner.num_gpu_blocks * runner.kv_cache.block_bytes
    assert 0 < used <= 0.2 * total
    assert f"KV cache: {runner.num_gpu_blocks} blocks" in caplog.text
    assert runner.num_cpu_blocks == (1 << 30) // runner.kv_cache.block_bytes


def test_swaps_make_one_copy_per_run_of_host_blocks(monkeypatch):
    # Host ids 3,4,5 | 9 | 11,12: three copies each way, as the plan's num_swap_runs counts.
    from sched_lab.core.kv import num_swap_runs

    cache = KVCache(CONFIG, 4, 8, 16, torch.float32, torch.device("cpu"))
    cache.gpu.copy_(torch.randn(cache.gpu.shape, generator=torch.Generator().manual_seed(0)))
    before = cache.gpu.clone()
    out = [(0, 3), (1, 4), (2, 5), (6, 9), (7, 11), (5, 12)]
    back = [(c, g) for g, c in out]
    calls = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache.swap_out(out)
    assert len(calls) == 3 == num_swap_runs(out, [])
    cache.gpu.zero_()
    cache.swap_in(back)
    assert len(calls) == 6 == num_swap_runs(out, back)
    monkeypatch.undo()
    ids = [g for g, _ in out]
    assert torch.equal(cache.gpu[:, :, ids], before[:, :, ids])


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_engine_copies_as_many_runs_as_the_plan_counts_under_pressure(block_size, monkeypatch):
    # The swap policy's own swap maps, from a replay short of GPU blocks: each step's swaps
    # on the engine's cache make exactly the plan's num_swap_runs copies.
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.plan import StepResult
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.sim.replay import replay

    gpu_blocks, cpu_blocks = 20, 48
    cache = KVCache(CONFIG, block_size, gpu_blocks, cpu_blocks, torch.float32, torch.device("cpu"))
    calls, steps = [], []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda *a, **k: calls.append(1) or real(*a, **k))

    class SwappingExecutor:
        wall_clock = False

        def execute(self, plan):
            before = len(calls)
            cache.swap_out(plan.swap_out)
            cache.swap_in(plan.swap_in)
            f = plan.features()
            steps.append((f.num_swap_blocks, f.num_swap_runs, len(calls) - before))
            return StepResult(0.01)

    bm = make_block_manager(gpu_blocks, cpu_blocks, block_size, 0.0, False)
    scheduler = get_policy("swap")(SchedulerLimits(256, 1_000_000, 1_000_000), bm)
    b = block_size
    reqs = [Request(str(i), i * 0.003, b * (1 + i % 3) + 3, b * (2 + i % 3)) for i in range(12)]
    result = replay(reqs, scheduler, SwappingExecutor())
    monkeypatch.undo()
    assert result.failure is None
    swaps = [s for s in steps if s[0]]
    assert swaps and all(runs == copies for _, runs, copies in swaps)
    assert any(runs < blocks for blocks, runs, _ in swaps)  # runs of several blocks occur
