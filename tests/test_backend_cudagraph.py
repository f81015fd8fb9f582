"""CUDA graphs for decode-only and mixed steps (backend/cuda_graphs.py, with the triton
backend's graph metadata, backend/attention/triton_graphs.py).

Without CUDA: the size choice, the padded staging of the static buffers, the store kernel's
skipping of negative slots, and the whole padded static-buffer forward (``cuda_graphs=True``
on CPU runs it without capture) against the eager path, all under ``TRITON_INTERPRET=1``.
With CUDA (``-m gpu``): captured graphs against eager, tokens and logits.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

from triton_setup import DEVICE, HAS_CUDA, QWEN3_TINY, interpreting, needs_triton, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

from sched_lab.backend.attention import triton_kernels  # noqa: E402
from sched_lab.backend.attention.triton_graphs import mixed_splits  # noqa: E402
from sched_lab.backend.cuda_graphs import (  # noqa: E402
    DEFAULT_GRAPH_SIZES,
    DEFAULT_TOKEN_SIZES,
    StepGraphs,
    graph_sizes,
    pick_size,
)
from sched_lab.backend.inputs import SeqInput  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402

SMOLLM2_TINY = {  # SmolLM2's architecture (Llama, tied embeddings, GQA 3:1), tiny
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
BLOCK_SIZE = 4
# Padding rows of both graph families compute on whatever memory held (backend/cuda_graphs.py);
# under the interpreter numpy may warn about overflows and NaNs there. Real rows are checked
# against eager.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
NUM_BLOCKS = 64


# -- sizes -------------------------------------------------------------------------------------


def test_graph_sizes_cut_at_max_num_seqs():
    assert graph_sizes(256) == list(DEFAULT_GRAPH_SIZES)
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]
    assert graph_sizes(1) == [1]
    assert graph_sizes(1000) == list(DEFAULT_GRAPH_SIZES)  # larger batches run eagerly
    assert graph_sizes(6, [4, 2]) == [2, 4]
    assert graph_sizes(3, [4, 2]) == [2, 3]
    with pytest.raises(ValueError):
        graph_sizes(0)
    assert graph_sizes(8192, DEFAULT_TOKEN_SIZES) == list(DEFAULT_TOKEN_SIZES)
    assert graph_sizes(2000, DEFAULT_TOKEN_SIZES)[-3:] == [1920, 1984, 2000]  # budget 2000 fits
    assert graph_sizes(128, DEFAULT_TOKEN_SIZES) == [16, 32, 64, 96, 128]
    assert graph_sizes(1200, DEFAULT_TOKEN_SIZES)[16:21] == [512, 544, 576, 608, 640]
    assert graph_sizes(16384, DEFAULT_TOKEN_SIZES)[-1] == 8192  # larger steps run eagerly
    assert graph_sizes(100, ()) == []  # no mixed graphs


def test_mixed_splits_bound_the_decode_grid():
    # The largest power of two with rows * kv heads * splits <= 4096, at most 16.
    assert [mixed_splits(rows, 8, 16) for rows in (1, 32, 64, 256, 512, 600)] == [
        16,
        16,
        8,
        2,
        1,
        1,
    ]
    assert mixed_splits(1, 8, 4) == 4


def test_pick_size_is_the_smallest_that_fits():
    sizes = [1, 2, 4, 8, 16, 32]
    assert [pick_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 17, 32)] == [1, 2, 4, 4, 8, 16, 32, 32]
    assert pick_size(33, sizes) is None


# -- the store kernel --------------------------------------------------------------------------


@needs_triton
def test_store_kv_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(4, 2, 16, generator=gen).to(DEVICE)
    k_cache = torch.zeros(3, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros(3, 4, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 0, -1], dtype=torch.long, device=DEVICE)
    triton_kernels.store_kv(k, v, k_cache, v_cache, slots)
    expect_k = torch.zeros(12, 2, 16, device=DEVICE)
    expect_v = torch.zeros(12, 2, 16, device=DEVICE)
    expect_k[5], expect_k[0] = k[0], k[2]
    expect_v[5], expect_v[0] = v[0], v[2]
    assert torch.equal(k_cache.view(12, 2, 16), expect_k)
    assert torch.equal(v_cache.view(12, 2, 16), expect_v)


# -- staging and the padded forward --------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tiny")
    write_random_checkpoint(QWEN3_TINY, path, dtype="float32", std=0.2)
    return path


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2_tiny")
    write_random_checkpoint(SMOLLM2_TINY, path, dtype="float32", std=0.2)
    return path


def make_runner(model_dir, cuda_graphs, dtype="float32", max_num_seqs=8, max_tokens=128, **kw):
    return ModelRunner(model_dir, device=str(DEVICE), dtype=dtype, attention_backend="triton",
                       block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, swap_space_bytes=0,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                       cuda_graphs=cuda_graphs, **kw)  # fmt: skip


@needs_triton
def test_stage_pads_to_the_size(qwen3_dir):
    runner = make_runner(qwen3_dir, cuda_graphs=True)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.max_blocks == 256 // BLOCK_SIZE
    seqs = [
        SeqInput([7], 0, [3], True),
        SeqInput([8], 9, [5, 6, 9, 1], True),  # table longer than needed (3 blocks)
        SeqInput([9], 4, [2, 4], False),
    ]
    assert graphs.size_for(seqs) == 4
    assert graphs.size_for(seqs + [SeqInput([1, 2], 0, [0], True)]) is None  # a prefill chunk
    assert graphs.size_for([SeqInput([1], 0, [0], True)] * 9) is None  # larger than 8
    graphs.stage(seqs, 4)
    assert graphs.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert graphs.positions[:4].tolist() == [0, 9, 4, 0]
    assert graphs.attn.slot_mapping[:4].tolist() == [12, 9 * 4 + 1, 4 * 4 + 0, -1]
    assert graphs.attn.seq_lens[:4].tolist() == [1, 10, 5, 0]  # padding: no context, no work
    assert graphs.attn.seq_start_loc[:5].tolist() == [0, 1, 11, 16, 16]
    assert graphs.attn.block_tables[:4, :3].tolist() == [[3, 0, 0], [5, 6, 9], [2, 4, 0], [0, 0, 0]]
    meta = graphs.attn.decode_metadata(4)
    assert meta.decode_seq_idx.tolist() == [0, 1, 2, 3] and meta.prefill_seq_idx.numel() == 0
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Work items (cut on the device at replay): 4 rows x 2 kv heads want 66 splits a row,
    # 16 at most: 4 x 16 + 1 items. Each context fits one 64-position tile: one item a
    # sequence; the padding row none.
    assert meta.decode_work.shape == (65, 3)
    triton_kernels.decode_work_device(
        meta.seq_lens, meta.decode_seq_idx, meta.decode_work, meta.decode_work_loc
    )
    assert meta.decode_work[:4].tolist() == [[0, 0, 1], [1, 0, 10], [2, 0, 5], [-1, 0, 0]]
    assert (meta.decode_work[3:] == -1).sum() == 62 and meta.decode_work[3:, 1:].eq(0).all()
    assert meta.decode_work_loc.tolist() == [0, 1, 2, 3, 3]


@needs_triton
def test_stage_mixed_pads_to_the_token_size(qwen3_dir):
    graphs = make_runner(qwen3_dir, cuda_graphs=True).graphs
    assert graphs.token_sizes == [16, 32, 64, 96, 128] and graphs.max_seqs == 8
    seqs = [
        SeqInput([1, 2, 3], 5, [7, 2], True),  # a chunk over a 5-token prefix
        SeqInput([21], 4, [3, 0], False),  # a decode, not sampled
        SeqInput([5, 6], 0, [9], True),  # a new prompt
    ]
    assert graphs.token_size_for(seqs) == 16 and graphs.size_for(seqs) is None
    assert graphs.token_size_for([SeqInput([1] * 65, 0, [0] * 17, True)]) == 96
    assert graphs.token_size_for([SeqInput([1] * 129, 0, [0] * 33, True)]) is None
    assert graphs.token_size_for([SeqInput([1], 0, [0], True)] * 9) is None  # 9 > 8 seqs
    last_rows = graphs.stage_mixed(seqs, 16)
    assert last_rows.tolist() == [2, 5]  # last fed rows of seqs 0 and 2
    assert graphs.input_ids[:8].tolist() == [1, 2, 3, 21, 5, 6, 0, 0]
    assert graphs.positions[:8].tolist() == [5, 6, 7, 4, 0, 1, 0, 0]
    # seq 0: positions 5-7 in block 2 (slots 9-11); seq 1: position 4 in block 0 (slot 0);
    # seq 2: positions 0-1 in block 9 (slots 36-37); padding rows write nowhere.
    assert graphs.attn.slot_mapping[:16].tolist() == [9, 10, 11, 0, 36, 37] + [-1] * 10
    assert graphs.attn.mixed_query_start_loc.tolist() == [0, 3, 4, 6, 6, 6, 6, 6, 6]
    assert graphs.attn.seq_lens[:3].tolist() == [8, 5, 2]
    assert graphs.attn.block_tables[:2, :2].tolist() == [[7, 2], [3, 0]]
    assert graphs.attn.block_tables[2, 0].item() == 9  # one block; the next column is never read
    meta = graphs.attn.mixed_metadata(16)
    assert meta.decode_seq_idx.tolist() == [1] + [-1] * 7  # min(16 tokens, 8 seqs) rows
    assert meta.prefill_tiles.tolist() == [[0, 0], [2, 0]] + [[-1, -1]] * 7  # 1 + min(8, 16 // 2)
    # 8 decode rows x 2 kv heads x 16 splits (the cap) + 8 // 4: 130 items; one is used.
    assert meta.decode_work.shape == (130, 3)
    triton_kernels.decode_work_device(
        meta.seq_lens, meta.decode_seq_idx, meta.decode_work, meta.decode_work_loc
    )
    assert meta.decode_work[:2].tolist() == [[1, 0, 5], [-1, 0, 0]]
    assert meta.decode_work_loc.tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1]


@needs_triton
def test_mixed_steps_with_few_decodes_take_the_many_split_variant(qwen3_dir):
    runner = make_runner(qwen3_dir, cuda_graphs=True, max_num_seqs=64, max_tokens=96)
    graphs = runner.graphs
    assert graphs.attn.decode_rows(16) == [16] and graphs.attn.decode_rows(96) == [32, 64]
    # Work items: rows x 16 splits (32 or 64 rows x 2 kv heads x 16 <= 4096) + rows // 4.
    assert graphs.attn.mixed_metadata(96, 32).decode_work.shape == (32 * 16 + 8, 3)
    assert graphs.attn.mixed_metadata(96, 64).decode_work.shape == (64 * 16 + 16, 3)
    assert mixed_splits(64, 8, 16) == 8  # with Qwen3-0.6B's 8 kv heads: fewer
    rows, stage_mixed = [], graphs.stage_mixed
    graphs.stage_mixed = lambda seqs, n, r: (rows.append((n, r)), stage_mixed(seqs, n, r))[1]
    graphs._replay = lambda key: graphs.hidden[: key[1]]  # no forward: only the choice counts
    prompt = SeqInput(list(range(20)), 0, [63, 62, 61, 60, 59], True)
    for decodes in (3, 32, 33):  # one token at position 0 of block i each
        runner.execute([prompt] + [SeqInput([i], 0, [i], True) for i in range(decodes)])
    assert rows == [(32, 32), (64, 32), (64, 64)]  # 23 tokens (3 decodes), 52 (32), 53 (33)


@needs_triton
def test_slots_beyond_int32(qwen3_dir):
    # Block ids fit int32 but block * block_size may not (found by a reviewer: the slot
    # wrapped negative, so the store kernel skipped the token). A cache object with 2**28
    # blocks of 16: block 2**27 starts at slot 2**31.
    runner = make_runner(qwen3_dir, cuda_graphs=True)

    class BigCache:
        gpu, layers, num_gpu_blocks = runner.kv_cache.gpu, runner.kv_cache.layers, 2**28

    graphs = StepGraphs(runner.model, BigCache(), 16, 256, 256, [1], [16], 1, capture=False)
    graphs.stage([SeqInput([1], 0, [2**27], True)], 1)
    assert graphs.attn.slot_mapping[0].item() == 2**31
    graphs.stage_mixed([SeqInput([1, 2], 0, [2**27], True)], 16)
    assert graphs.attn.slot_mapping[:3].tolist() == [2**31, 2**31 + 1, -1]


@needs_triton
def test_capture_line_without_decode_sizes(qwen3_dir, caplog):
    # Only mixed graphs (found by a reviewer: the start-up line indexed the decode sizes).
    runner = ModelRunner(qwen3_dir, device=str(DEVICE), attention_backend="triton",
                         block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS, swap_space_bytes=0,
                         max_num_seqs=8, max_num_batched_tokens=64, cuda_graphs=True,
                         cuda_graph_sizes=())  # fmt: skip
    assert runner.graphs.sizes == [] and runner.graphs.token_sizes == [16, 32, 64]
    runner.graphs.capture_all = lambda: None  # what a capture that succeeded returns
    with caplog.at_level(logging.INFO, logger="sched_lab.backend.runner"):
        runner._capture_graphs()
    assert "CUDA graphs: 3 token counts 16..64 captured in" in caplog.text
    assert runner.execute([SeqInput([5], 0, [1], True)])[0] is not None  # a mixed graph runs it


@needs_triton
def test_stage_converts_only_what_changed(qwen3_dir):
    # Block tables are staged incrementally (a host mirror keyed by the list objects of the
    # last step): whatever the rows did in between, the device tables must hold every
    # sequence's current entries.
    graphs = make_runner(qwen3_dir, cuda_graphs=True).graphs
    a, b, c = [1, 2], [3], [4, 5, 6]

    def stage_and_check(seqs):
        graphs.stage(seqs, 2)
        for row, s in enumerate(seqs):
            need = s.start_pos // BLOCK_SIZE + 1
            assert graphs.attn.block_tables[row, :need].tolist() == s.block_table[:need]
            slot = s.block_table[s.start_pos // BLOCK_SIZE] * BLOCK_SIZE + s.start_pos % BLOCK_SIZE
            assert graphs.attn.slot_mapping[row].item() == slot

    stage_and_check([SeqInput([1], 5, a, True), SeqInput([1], 2, b, True)])
    a.append(7)  # a gains its third block (position 8)
    stage_and_check([SeqInput([1], 8, a, True), SeqInput([1], 3, b, True)])
    assert graphs.tables.row_lens[:2].tolist() == [3, 1]
    stage_and_check([SeqInput([1], 9, c, True), SeqInput([1], 9, a, True)])  # b left, c joined
    c[:] = [8, 9]  # rewritten in place and shorter: converted whole, not trusted
    stage_and_check([SeqInput([1], 4, c, True), SeqInput([1], 9, a, True)])
    c[:] = [10, 11]  # rewritten in place, same length (outside the contract): last entry moved
    stage_and_check([SeqInput([1], 4, c, True), SeqInput([1], 9, a, True)])
    c[1] = NUM_BLOCKS  # and an id rewritten out of range is still refused
    with pytest.raises(ValueError, match="seq 0: block ids must be in"):
        graphs.stage([SeqInput([1], 4, c, True), SeqInput([1], 9, a, True)], 2)
    c[1] = 2**63  # beyond int64, in the entry the last-entry check reads
    with pytest.raises(ValueError, match="seq 0: block ids must be in"):
        graphs.stage([SeqInput([1], 4, c, True), SeqInput([1], 9, a, True)], 2)
    c[1] = 11
    with pytest.raises(ValueError, match="seq 0: block ids must be in"):
        graphs.stage([SeqInput([1], 9, [1, NUM_BLOCKS, 2], True)], 1)
    assert graphs.tables.row_lists == []  # a failed step forgets the mirror
    stage_and_check([SeqInput([1], 9, a, True), SeqInput([1], 4, c, True)])
    assert graphs.attn.block_tables[0, :3].tolist() == [1, 2, 7]


@needs_triton
@pytest.mark.parametrize(("bad", "message"), [
    (SeqInput([8], 9, [5, 6], True), "seq 1: block_table has 2 blocks, 3 needed"),
    (SeqInput([8], 9, [5, 6, NUM_BLOCKS], True), "seq 1: block ids must be in"),
    (SeqInput([8], 256, [5] * 65, True), "seq 1: positions up to 257 exceed max_model_len 256"),
    (SeqInput([300], 9, [5, 6, 9], True), r"seq 1: token ids must be in \[0, 256\)"),
    (SeqInput([2**63], 9, [5, 6, 9], True), r"seq 1: token ids must be in \[0, 256\)"),
    (SeqInput([8], 9, [5, 2**31, 9], True), r"seq 1: block ids must be in \[0, 64\)"),
    (SeqInput([8], 9, [5, 6, 9], True, temperature=-1.0), "seq 1: temperature -1.0 < 0"),
    (SeqInput([8], -100, [5], True), "seq 1: start_pos -100 < 0"),
    (SeqInput([8], 10**11, [5], True), "seq 1: positions up to 100000000001 exceed"),
])  # fmt: skip
def test_stage_validates_like_check_seq(qwen3_dir, bad, message):
    # The padded path raises what the eager path's check_seq raises, naming the sequence,
    # before it sizes anything by a bad value (found by a reviewer: a negative temperature
    # ran greedy, a huge position allocated its block table first).
    graphs = make_runner(qwen3_dir, cuda_graphs=True).graphs
    seqs = [SeqInput([7], 0, [3], True), bad, SeqInput([9], 4, [2, 4], True)]
    with pytest.raises(ValueError, match=message):
        graphs.stage(seqs, 4)
    with pytest.raises(ValueError, match=message.replace("seq 1", "seq 0")):
        graphs.stage([bad], 1)  # alone: no valid row to size the tables by
    # The mixed path, with a prompt in the step, the same.
    seqs.append(SeqInput([1, 2, 3], 0, [11], True))
    with pytest.raises(ValueError, match=message):
        graphs.stage_mixed(seqs, 64)
    bad_chunk = SeqInput([1] + bad.token_ids, bad.start_pos - 1, bad.block_table, True,
                         bad.temperature)  # fmt: skip
    with pytest.raises(ValueError):
        graphs.stage_mixed([bad_chunk], 64)


@needs_triton
def test_stage_mixed_refuses_an_empty_chunk(qwen3_dir):
    graphs = make_runner(qwen3_dir, cuda_graphs=True).graphs
    with pytest.raises(ValueError, match="seq 1: no token_ids to feed"):
        graphs.stage_mixed([SeqInput([1, 2], 0, [3], True), SeqInput([], 4, [2, 4], True)], 64)


def test_cuda_graphs_need_the_triton_backend(qwen3_dir):
    with pytest.raises(ConfigError, match="triton"):
        ModelRunner(qwen3_dir, attention_backend="torch", block_size=BLOCK_SIZE,
                    num_gpu_blocks=NUM_BLOCKS, swap_space_bytes=0, cuda_graphs=True)  # fmt: skip


@needs_triton
def test_mixed_graphs_off_keeps_only_decode_graphs(qwen3_dir):
    graphs = make_runner(qwen3_dir, cuda_graphs=True, mixed_graphs=False).graphs
    assert graphs.sizes == [1, 2, 4, 8] and graphs.token_sizes == []
    assert graphs.keys() == [("decode", 8, 8), ("decode", 4, 4), ("decode", 2, 2),
                             ("decode", 1, 1)]  # fmt: skip
    prompt = SeqInput([1, 2], 0, [3], True)
    assert graphs.run([prompt]) is None  # a step with prompt tokens runs eagerly


def test_cuda_graphs_default_off_on_cpu(qwen3_dir):
    runner = ModelRunner(qwen3_dir, attention_backend="torch", block_size=BLOCK_SIZE,
                         num_gpu_blocks=NUM_BLOCKS, swap_space_bytes=0)  # fmt: skip
    assert runner.graphs is None


# Tables: a = 9 blocks, b = 6, c = 3 (lengths differ); decode steps of 3 seqs pad to 4, of 1
# stay at 1, of 2 at 2; one decode is not sampled.
A = [5, 60, 7, 33, 2, 41, 19, 50, 55]
B = [8, 1, 63, 12, 30, 44]
C = [10, 11, 13]
USED = set(A) | set(B) | set(C)
STEPS = [
    [SeqInput(list(range(30)), 0, A, True), SeqInput(list(range(9, 20)), 0, B, False)],
    [SeqInput([5], 30, A, True), SeqInput(list(range(40, 50)), 11, B, True),
     SeqInput([1, 2, 3, 4], 0, C, True)],
    [SeqInput([6], 31, A, True), SeqInput([7], 21, B, True), SeqInput([8], 4, C, True)],
    [SeqInput([9], 32, A, True), SeqInput([10], 22, B, False), SeqInput([11], 5, C, True)],
    [SeqInput([12], 33, A, True)],
    [SeqInput([13], 23, B, True), SeqInput([14], 6, C, True)],
]  # fmt: skip


def run_steps(runner):
    """Logits of every sampled sequence of every step, and greedy tokens from them."""
    logits = [x for step in STEPS for x in runner.execute_logits(step) if x is not None]
    return logits, [int(x.argmax()) for x in logits]


def assert_padding_wrote_nothing(runner):
    """Blocks no sequence owns are still all zeros (padding rows write nowhere)."""
    free = [b for b in range(NUM_BLOCKS) if b not in USED]
    assert not runner.kv_cache.gpu[:, :, free].any()


@needs_triton
@pytest.mark.parametrize("which", ["qwen3", "smollm2"])
def test_padded_paths_match_eager(which, qwen3_dir, smollm2_dir):
    # On CPU cuda_graphs=True runs the padded static-buffer forward without capture.
    model_dir = qwen3_dir if which == "qwen3" else smollm2_dir
    eager_logits, eager_tokens = run_steps(make_runner(model_dir, cuda_graphs=False))
    padded = make_runner(model_dir, cuda_graphs=True)
    sizes, stage = [], padded.graphs.stage
    padded.graphs.stage = lambda seqs, size: (sizes.append(size), stage(seqs, size))
    tokens, stage_mixed = [], padded.graphs.stage_mixed
    padded.graphs.stage_mixed = lambda seqs, n, r: (tokens.append(n), stage_mixed(seqs, n, r))[1]
    padded_logits, padded_tokens = run_steps(padded)
    assert sizes == [4, 4, 1, 2]  # the decode-only steps took the padded decode path
    assert tokens == [64, 16]  # the steps with prompt tokens (41 and 15) the mixed one
    assert padded_tokens == eager_tokens
    for got, ref in zip(padded_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert_padding_wrote_nothing(padded)


@needs_triton
def test_execute_tokens_match_with_padding(qwen3_dir):
    steps = STEPS[:3]
    eager = make_runner(qwen3_dir, cuda_graphs=False)
    padded = make_runner(qwen3_dir, cuda_graphs=True)
    assert [eager.execute(s) for s in steps] == [padded.execute(s) for s in steps]


# -- GPU: captured graphs ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("which", ["qwen3", "smollm2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_match_eager_on_gpu(which, dtype, qwen3_dir, smollm2_dir):
    model_dir = qwen3_dir if which == "qwen3" else smollm2_dir
    eager = make_runner(model_dir, cuda_graphs=False, dtype=dtype)
    assert eager.graphs is None
    eager_logits, eager_tokens = run_steps(eager)
    graphed = make_runner(model_dir, cuda_graphs=True, dtype=dtype)
    assert graphed.graphs is not None, "capture failed (see the logged warning)"
    assert sorted(graphed.graphs.graphs) == [
        ("decode", 1, 1), ("decode", 2, 2), ("decode", 4, 4), ("decode", 8, 8),
        ("mixed", 16, 8), ("mixed", 32, 8), ("mixed", 64, 8), ("mixed", 96, 8), ("mixed", 128, 8),
    ]  # fmt: skip
    graphed_logits, graphed_tokens = run_steps(graphed)
    assert_padding_wrote_nothing(graphed)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for got, ref in zip(graphed_logits, eager_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    if dtype == "float32":
        assert graphed_tokens == eager_tokens
    else:  # bf16: a different GEMM for a padded batch may flip a near tie only
        pairs = zip(eager_logits, graphed_tokens, eager_tokens, strict=True)
        for ref, g, e in pairs:
            top2 = ref.topk(2).values
            if top2[0] - top2[1] > 2 * tol:
                assert g == e


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_captured_graphs_with_default_sizes_on_gpu(qwen3_dir):
    # All default sizes up to 64 captured; a 33-seq decode batch pads to 48 and matches eager.
    runner = make_runner(qwen3_dir, cuda_graphs=True, max_num_seqs=64)
    assert runner.graphs is not None
    assert sorted(k[1] for k in runner.graphs.graphs if k[0] == "decode") == [
        1,
        2,
        4,
        8,
        16,
        32,
        48,
        64,
    ]
    # Mixed graphs: up to 32 decode rows (16 splits) and up to 64 (fewer), from 64 tokens.
    assert {k[1:] for k in runner.graphs.graphs if k[0] == "mixed" and k[1] <= 96} == {
        (16, 16),
        (32, 32),
        (64, 32),
        (64, 64),
        (96, 32),
        (96, 64),
    }
    eager = make_runner(qwen3_dir, cuda_graphs=False, max_num_seqs=64)
    seqs = [SeqInput([i % 200], i % 4, [i], True) for i in range(33)]  # block i, position < 4
    prefill = [SeqInput(list(range(s.start_pos)) or [0], 0, s.block_table, False) for s in seqs]
    prefill = [p for p, s in zip(prefill, seqs, strict=True) if s.start_pos > 0]
    for r in (runner, eager):
        r.execute(prefill)
    got = runner.execute_logits(seqs)
    ref = eager.execute_logits(seqs)
    for g, e in zip(got, ref, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert runner.execute(seqs[:1]) == eager.execute(seqs[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_kn_weight_layout_matches_on_gpu(qwen3_dir):
    # kn_weights=True keeps the layers' projection weights in (K, N) memory order: the same
    # logical weights, another cuBLAS operand layout.
    ref_logits, ref_tokens = run_steps(make_runner(qwen3_dir, cuda_graphs=True))
    runner = make_runner(qwen3_dir, cuda_graphs=True, kn_weights=True)
    assert runner.graphs is not None, "capture failed (see the logged warning)"
    w = runner.model.layers[0].mlp.gate_up_proj.weight
    assert w.stride() == (1, w.shape[0])  # column-major storage of the (N, K) weight
    assert runner.model.embed_tokens.weight.is_contiguous()  # embedding / LM head untouched
    logits, tokens = run_steps(runner)
    for got, ref in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert tokens == ref_tokens
