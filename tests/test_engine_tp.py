"""Tensor parallelism on the CPU: 2 gloo processes against the single-device engine.

Tiny random models, the torch attention backend, one torch thread per rank. Every test spawns
its own ranks (about a second each), so the file takes well under a minute.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

import run_experiment  # noqa: E402
from sched_lab.backend.config import ModelConfig  # noqa: E402
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402
from sched_lab.backend.tp import TPShard, check_tp_size, kv_head_start, shard_config  # noqa: E402
from sched_lab.backend.tp_engine import (  # noqa: E402
    FAULT_ENV,
    MAX_CPU_RANKS,
    TensorParallelError,
    TensorParallelRunner,
    check_world,
)
from sched_lab.core.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 201,  # odd: the last vocab shard is padded
    "max_position_embeddings": 256,
}
ARCHITECTURES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "attention_bias": True},
    "llama_tied": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True},
    "mistral": {"architectures": ["MistralForCausalLM"], "sliding_window": None},
    "qwen2_one_kv_head": {"architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 1},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "tie_word_embeddings": True},
}
RUNNER = {"device": "cpu", "dtype": "float32", "block_size": 8, "num_gpu_blocks": 16,
          "swap_space_bytes": 1 << 20, "num_threads": 1}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        name: write_random_checkpoint({**BASE, **extra}, root / name, dtype="float32", name=name)
        for name, extra in ARCHITECTURES.items()
    }


def test_shard_rules():
    c = ModelConfig.from_dict(
        {**BASE, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 1}
    )
    local = shard_config(c, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert [kv_head_start(c, TPShard(r, 2)) for r in (0, 1)] == [0, 0]  # one KV head, replicated
    wide = ModelConfig.from_dict(
        {**BASE, "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 4}
    )
    assert [kv_head_start(wide, TPShard(r, 2)) for r in (0, 1)] == [0, 2]
    with pytest.raises(ConfigError, match="3 does not divide the model's 4 attention heads"):
        check_tp_size(c, 3)
    kv3 = ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                 "num_attention_heads": 6, "num_key_value_heads": 3})  # fmt: skip
    with pytest.raises(ConfigError, match="2 does not divide the model's 3 KV heads"):
        check_tp_size(kv3, 2)


def test_more_ranks_than_devices_is_one_line():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="2 ranks need 2 CUDA devices, 0 visible"):
            check_world(2, "cuda")
    with pytest.raises(ConfigError, match=f"at most {MAX_CPU_RANKS}"):
        check_world(MAX_CPU_RANKS + 1, "cpu")
    with pytest.raises(ConfigError, match="set device: cuda"):
        check_world(2, "cuda:1")


STEP = [
    SeqInput(list(range(1, 20)), 0, [0, 1, 2], True),  # a prompt of 19 tokens over 3 blocks
    SeqInput([5, 6, 7], 0, [3], True),
]
DECODE = [SeqInput([9], 19, [0, 1, 2], True), SeqInput([11], 3, [3], True)]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_equal_single_device(models, arch):
    ref = ModelRunner(models[arch], **RUNNER)
    tp = TensorParallelRunner(models[arch], 2, **RUNNER)
    try:
        assert tp.num_gpu_blocks == 16
        for step in (STEP, DECODE):  # the decode reads the KV the prompt step wrote
            for a, b in zip(ref.execute_logits(step), tp.execute_logits(step), strict=True):
                assert a.shape == b.shape == (201,)
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        # a swap round trip on every rank's shard: blocks 0-2 out, back into 4-6
        ref.swap_out([(0, 0), (1, 1), (2, 2)])
        tp.swap_out([(0, 0), (1, 1), (2, 2)])
        ref.swap_in([(0, 4), (1, 5), (2, 6)])
        tp.swap_in([(0, 4), (1, 5), (2, 6)])
        moved = [SeqInput([13], 20, [4, 5, 6], True)]
        torch.testing.assert_close(tp.execute_logits(moved)[0], ref.execute_logits(moved)[0],
                                   rtol=1e-4, atol=1e-5)  # fmt: skip
    finally:
        tp.close()


def test_ctrl_c_on_a_rank_ends_it_with_one_line_not_a_traceback(models, capfd):
    """Ctrl-C in a terminal reaches every rank (one process group): a rank ends quietly and
    tells rank 0, whose next step names it."""
    import os
    import signal

    tp = TensorParallelRunner(models["llama"], 2, **RUNNER)
    try:
        os.kill(tp._procs[0].pid, signal.SIGINT)  # rank 1, waiting for the next step
        with pytest.raises(
            TensorParallelError, match=r"rank 1 failed at its step 0: interrupted \(SIGINT\)"
        ):
            tp.execute(STEP)
    finally:
        tp.close()
    assert "Traceback" not in capfd.readouterr().err


def experiment(tmp_path, model_dir, tp: int, policies: str) -> str:
    path = tmp_path / f"exp_tp{tp}.yaml"
    path.write_text(
        "backend: engine\n"
        # All requests arrive at t = 0: the schedule (and its preemptions) does not depend on
        # the measured step times, so TP=1 and TP=2 make the same plans.
        "trace: {format: synthetic, num_requests: 12, arrival: {process: poisson, rate: .inf},"
        " prompt_len: {uniform: [8, 40]}, output_len: {uniform: [4, 12]}}\n"
        f"engine: {{model_path: {model_dir}, device: cpu, dtype: float32, num_threads: 1,"
        f" tensor_parallel_size: {tp}}}\n"
        "kv_cache: {block_size: 8, num_gpu_blocks: 24, swap_space_gib: 0.001}\n"
        "scheduler: {max_num_seqs: 8}\n"
        f"policies: {policies}\n"
    )
    return str(path)


def tokens(out) -> dict:
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    return {(r["policy"], r["request_id"]): r["output_token_ids"] for r in rows}


def test_greedy_tokens_equal_single_device_with_preemptions_and_swaps(models, tmp_path):
    policies = "[fcfs, swap, {name: chunked_prefill, max_num_batched_tokens: 32}]"
    outs = {}
    for tp in (1, 2):
        outs[tp] = tmp_path / f"out{tp}"
        argv = [experiment(tmp_path, models["qwen3"], tp, policies), "--out", str(outs[tp])]
        # --no-plots: the tables and tokens are compared, not the figures
        assert run_experiment.main([*argv, "--no-progress", "--no-plots"]) == 0
    req = pd.read_csv(outs[2] / "requests.csv")
    assert len(req) == 36 and (req.status == "finished").all()
    assert req.num_preemptions_swap.sum() > 0 and req.num_preemptions_recompute.sum() > 0
    ref, got = tokens(outs[1]), tokens(outs[2])
    assert len(got) == 36 and got == ref


def test_failing_rank_stops_with_one_line_and_partial_results(
    models, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(FAULT_ENV, "1:6")  # rank 1 raises at its 6th step
    out = tmp_path / "out"
    argv = [experiment(tmp_path, models["llama"], 2, "[fcfs, swap]"), "--out", str(out)]
    assert run_experiment.main([*argv, "--no-progress"]) == 1
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "2 of 2 runs stopped early" in line[0]
    assert "tensor-parallel rank 1 failed at its step 6: RuntimeError: injected fault" in line[0]
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 24  # every request of both runs has a status and a reason
    fcfs = req[req.policy == "fcfs"]
    assert (fcfs.status == "finished").sum() < 12 and (fcfs.status == "unfinished").any()
    assert (req[req.policy == "swap"].status == "unfinished").all()  # the group was gone


def test_tp_size_not_dividing_heads_is_one_line(models, tmp_path, capsys):
    path = experiment(tmp_path, models["llama"], 3, "[fcfs]")
    assert run_experiment.main([path, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {path}: engine.tensor_parallel_size: 3 does not divide the model's 4 attention heads"
    )


def _bench():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("tp_decode", ROOT / "benchmarks/tp_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_arguments(capsys):
    bench = _bench()
    args = bench.parse(["--out", "o", "--tiny", "--tp", "2"])
    assert (args.tp_sizes, args.batch_sizes, args.context, args.requests) == ([2], [1, 4], 24, 6)
    gpu = bench.parse(["--out", "o"])
    assert (gpu.tp_sizes, gpu.batch_sizes, gpu.context, gpu.steps) == (
        [1, 2],
        [1, 8, 32, 128],
        1024,
        20,
    )
    for bad in (["--tp", "1,x"], ["--batches", "0"]):
        with pytest.raises(SystemExit):
            bench.parse(["--out", "o", *bad])
    assert "comma-separated integers" in capsys.readouterr().err


def test_benchmark_tiny_gloo_run(tmp_path):
    bench = _bench()
    out = tmp_path / "out"
    argv = ["--tiny", "--tp", "2", "--batches", "2", "--out", str(out), "--work", str(tmp_path)]
    assert bench.main(argv) == 0
    records = json.loads((out / "tp_decode.json").read_text())
    assert [(r["phase"], r["tensor_parallel_size"], r["status"]) for r in records] == [
        ("checkpoint", 1, "ok"), ("decode", 2, "ok"), ("offline", 2, "ok"), ("allreduce", 2, "ok")
    ]  # fmt: skip
    assert records[1]["decode_step_s"]["2"] > 0 and records[2]["finished"] == 6
    assert records[3]["all_reduces_per_step"] == 5  # 2 layers x 2 + the embedding


def test_profile_under_tp_writes_rank_zeros_fingerprint_with_the_size(
    models, tmp_path, monkeypatch
):
    """backend/profile.py --tensor-parallel-size 2 (a small grid, 2 gloo ranks): the
    fingerprint is rank 0's runner's, with the TP sources key and the size, as engine_info
    writes it for a TP run; the calibrated model reads it back."""
    import triton_setup  # noqa: F401  (first: later Triton tests in this process interpret)

    from sched_lab.backend import profile
    from sched_lab.backend.sources import OPTION_SOURCES
    from sched_lab.sim.calibrated import CalibratedCostModel, read_fingerprint

    grid = [("decode", [], [c] * b, 0) for b in (1, 2, 4) for c in (8, 24)]
    grid += [("prefill", [(c, n)], [], 0) for n in (4, 16) for c in (0, 8)]
    monkeypatch.setattr(profile, "shapes", lambda: grid)
    out = tmp_path / "p.csv"
    argv = ["--model-dir", str(models["llama"]), "--out", str(out), "--attention", "torch",
            "--dtype", "float32", "--repeat", "1", "--passes", "1",
            "--tensor-parallel-size", "2", "--max-model-len", "128", "--num-gpu-blocks", "64"]  # fmt: skip
    assert profile.main(argv) == 0
    fp = read_fingerprint(out)
    assert fp["tensor_parallel_size"] == 2 and fp["gpu"] == "cpu"
    keys = {k for k in fp if k.startswith("backend_sources_")}
    assert keys == {"backend_sources_tensor_parallel"} and set(OPTION_SOURCES) > {"tensor_parallel"}
    assert "tensor_parallel_size 2 (heads per rank)" in out.read_text().splitlines()[1]
    assert len(pd.read_csv(out, comment="#")) == len(grid)
    CalibratedCostModel(out)
