"""Faults in the engine path, through the real CLI and a tiny random-weight model (CPU)."""

from __future__ import annotations

import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")

import run_experiment  # noqa: E402
from sched_lab.backend.runner import ModelRunner  # noqa: E402
from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 200,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(TINY, path, dtype="float32", name="tiny")
    return path


def experiment(tmp_path, model_dir, policies="[fcfs, swap]", swap_gib=0.001) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(
        "backend: engine\n"
        # All requests arrive at t = 0, so the schedule (and its preemptions) does not
        # depend on the measured step times.
        "trace: {format: synthetic, num_requests: 12, arrival: {process: poisson, rate: .inf},"
        " prompt_len: {uniform: [8, 40]}, output_len: {uniform: [4, 12]}}\n"
        f"engine: {{model_path: {model_dir}, device: cpu, dtype: float32}}\n"
        f"kv_cache: {{block_size: 8, num_gpu_blocks: 24, swap_space_gib: {swap_gib:.7f}}}\n"
        "scheduler: {max_num_seqs: 8}\n"
        f"policies: {policies}\n"
    )
    return str(path)


def test_engine_runs_and_preempts(tiny_model, tmp_path):
    out = tmp_path / "out"
    argv = [experiment(tmp_path, tiny_model), "--out", str(out), "--no-progress", "--no-plots"]
    assert run_experiment.main(argv) == 0  # the tables are checked, not the figures
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 24 and (req.status == "finished").all()
    assert req.num_preemptions.sum() > 0  # 24 blocks of 8 tokens: the cache is tight
    assert (out / "tokens.jsonl").exists()


def test_out_of_memory_mid_run_stops_with_partial_results(
    tiny_model, tmp_path, monkeypatch, capsys
):
    calls = {"n": 0}
    real = ModelRunner.execute

    def flaky(self, seqs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, seqs)

    monkeypatch.setattr(ModelRunner, "execute", flaky)
    out = tmp_path / "out"
    assert (
        run_experiment.main([experiment(tmp_path, tiny_model), "--out", str(out), "--no-progress"])
        == 1
    )
    err = capsys.readouterr().err
    assert "error: 1 of 2 runs stopped early: fcfs (OutOfMemoryError: CUDA out of memory" in err
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 24  # every request of both runs: the swap run ran after fcfs failed
    fcfs, swap = req[req.policy == "fcfs"], req[req.policy == "swap"]
    stopped = fcfs[fcfs.status == "unfinished"]
    assert len(stopped) > 0 and stopped.reason.str.contains("OutOfMemoryError").all()
    assert (swap.status == "finished").all()


def test_truncated_checkpoint_is_one_line(tiny_model, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    out = tmp_path / "out"
    assert (
        run_experiment.main([experiment(tmp_path, broken), "--out", str(out), "--no-progress"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "model.safetensors: truncated" in err
    assert "\n" not in err and not out.exists()


def test_swap_space_exhausted_falls_back_to_recompute(tiny_model, tmp_path):
    # A block of this model is 2 (K, V) x 2 layers x 8 tokens x 2 heads x 16 dims x 4 bytes
    # = 2 KiB; 4e-6 GiB of swap space holds 2 blocks, fewer than any victim holds, so every
    # swap preemption falls back to recompute and the run still finishes.
    out = tmp_path / "out"
    assert (
        run_experiment.main(
            [
                experiment(tmp_path, tiny_model, "[swap]", swap_gib=4e-6),
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    req = pd.read_csv(out / "requests.csv")
    assert (req.status == "finished").all()
    assert req.num_preemptions_recompute.sum() > 0 and req.num_preemptions_swap.sum() == 0
