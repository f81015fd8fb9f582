"""Engine tools: model presets and random-weight checkpoints."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

from sched_lab.backend.config import ModelConfig
from sched_lab.backend.loader import INDEX_FILE, checkpoint_index, checkpoint_shapes
from sched_lab.backend.runner import ModelRunner, SeqInput
from sched_lab.backend.tools.__main__ import main
from sched_lab.backend.tools.random_checkpoint import MARKER_FILE, write_random_checkpoint
from sched_lab.core.model_presets import PRESETS

# Parameter counts published for the real checkpoints (the model cards / safetensors totals).
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-2-7b": 6_738_415_616,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b-v0.3": 7_248_023_552,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_give_the_published_parameter_count(name):
    shapes = checkpoint_shapes(ModelConfig.from_dict(PRESETS[name]))
    assert sum(math.prod(s) for s in shapes.values()) == PUBLISHED_PARAMS[name]


TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 200,
    "max_position_embeddings": 128,
}


def test_random_checkpoint_shards_and_loads(tmp_path):
    write_random_checkpoint(TINY, tmp_path, dtype="bf16", max_shard_bytes=40_000, name="tiny")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / MARKER_FILE).read_text())["preset"] == "tiny"
    runner = ModelRunner(
        tmp_path, dtype="auto", block_size=16, num_gpu_blocks=4, swap_space_bytes=0
    )
    assert runner.dtype == torch.bfloat16
    (logits,) = runner.execute_logits([SeqInput(list(range(40)), 0, [3, 0, 2], True)])
    assert logits.isfinite().all() and logits.std() > 0


def test_cli_lists_presets(capsys):
    assert main(["list-presets"]) == 0
    assert capsys.readouterr().out.split() == sorted(PRESETS)


def test_an_output_folder_under_a_file_is_one_line(tmp_path, capsys):
    """``--out`` below a plain file cannot be made: exit 2 and one line naming the path,
    no traceback."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "ckpt"
    assert main(["make-random-checkpoint", "--preset", "smollm2-135m", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {out}") and err.endswith(": Not a directory"), err
    assert "\n" not in err


def test_a_rewritten_random_checkpoint_keeps_no_shard_of_the_one_before(tmp_path):
    """Writing into an earlier random checkpoint replaces it whole: its shards and index
    would otherwise stay, and the loader (the index first) would read the old weights."""
    write_random_checkpoint(TINY, tmp_path, dtype="bf16", max_shard_bytes=40_000, seed=0)
    write_random_checkpoint(TINY, tmp_path, dtype="bf16", seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "model.safetensors", MARKER_FILE,
    ]  # fmt: skip
    files = {info.file for info in checkpoint_index(tmp_path).values()}
    assert files == {tmp_path / "model.safetensors"}


def test_a_random_checkpoint_stopped_while_writing_can_be_written_again(tmp_path, monkeypatch):
    """Ctrl-C while the shards are written leaves a folder the tool knows as its own (its
    marker is written first), so the same command can run again."""
    import sched_lab.backend.tools.random_checkpoint as random_checkpoint

    saved = []

    def stop_at_the_second_shard(tensors, path, **kwargs):
        if saved:
            raise KeyboardInterrupt
        saved.append(real(tensors, path, **kwargs))

    real = random_checkpoint.save_file
    with monkeypatch.context() as m:
        m.setattr(random_checkpoint, "save_file", stop_at_the_second_shard)
        with pytest.raises(KeyboardInterrupt):
            write_random_checkpoint(TINY, tmp_path, dtype="bf16", max_shard_bytes=40_000)
    assert not (tmp_path / "config.json").exists()  # no loadable half checkpoint
    write_random_checkpoint(TINY, tmp_path, dtype="bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "model.safetensors", MARKER_FILE,
    ]  # fmt: skip
