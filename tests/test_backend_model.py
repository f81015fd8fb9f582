"""The engine's model against Hugging Face transformers on tiny random checkpoints (CPU, fp32).

For each supported architecture a tiny config in the public config.json format is turned into
a transformers model with a fixed seed (every weight random, norms and biases included), saved
as safetensors and loaded by the runner. Logits must match transformers' full-sequence forward
within TOL for a full prefill, a chunked prefill over a cached prefix, and decodes mixed with
another sequence's prefill chunks, all through scattered block tables (block_size 4).
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine,test]'")
import torch_threads  # noqa: E402, F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from sched_lab.backend.config import SUPPORTED_ARCHITECTURES, ModelConfig  # noqa: E402
from sched_lab.backend.errors import CheckpointError, DeviceError, UnsupportedModelError  # noqa: E402
from sched_lab.backend.runner import ModelRunner, SeqInput  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402

# fp32 logits of magnitude ~1; observed differences are ~1e-6 (fused matmuls sum in another order).
TOL = dict(atol=1e-4, rtol=1e-4)
BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_MODEL_LEN = 128

_BASE = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
CONFIGS = {
    "llama": {**_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "llama-3.1": {
        **_BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_type": "llama3",
        },
    },
    "qwen2": {
        **_BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 32,
    },
    "qwen3": {
        **_BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,  # not hidden_size / heads, as in the real Qwen3 configs
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
    "mistral": {
        **_BASE,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 128,
    },
}


def write_hf_checkpoint(out: Path, config: dict, seed: int = 0, max_shard_size: str | None = None):
    """Save a transformers model with random weights (norms ~1, biases random) and return it.

    config.json is rewritten afterwards in the public format (rope_theta / rope_scaling), so
    the loader reads the same spelling as the real checkpoints.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    hf_config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    (out / "config.json").write_text(json.dumps(config))
    return model


def make_runner(model_dir: Path, **kwargs) -> ModelRunner:
    defaults = dict(
        block_size=BLOCK_SIZE,
        num_gpu_blocks=NUM_BLOCKS,
        swap_space_bytes=1 << 20,
        max_model_len=MAX_MODEL_LEN,
    )
    return ModelRunner(model_dir, **{**defaults, **kwargs})


class Arch:
    """A checkpoint, its transformers model, a runner, and reference logits for three prompts."""

    def __init__(self, root: Path, name: str) -> None:
        self.dir = root / name
        self.hf = write_hf_checkpoint(self.dir, CONFIGS[name])
        self.runner = make_runner(self.dir)
        gen = torch.Generator().manual_seed(1)
        self.tokens = {
            s: torch.randint(0, 300, (n,), generator=gen).tolist()
            for s, n in (("a", 40), ("b", 36), ("c", 20))
        }
        with torch.no_grad():  # logits at every position, (len, vocab)
            self.ref = {
                s: self.hf(torch.tensor([t])).logits[0].float() for s, t in self.tokens.items()
            }
        blocks = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(blocks)  # scattered, out-of-order block tables
        self.tables = {s: blocks[i * 16 : (i + 1) * 16] for i, s in enumerate(self.tokens)}

    def feed(self, seq: str, start: int, end: int, sample: bool = True) -> SeqInput:
        return SeqInput(self.tokens[seq][start:end], start, self.tables[seq], sample)


@pytest.fixture(scope="module", params=list(CONFIGS))
def arch(request, tmp_path_factory) -> Arch:
    return Arch(tmp_path_factory.mktemp("ckpt"), request.param)


def test_full_prefill_matches_transformers(arch):
    (logits,) = arch.runner.execute_logits([arch.feed("a", 0, 40)])
    torch.testing.assert_close(logits, arch.ref["a"][39], **TOL)


def test_chunked_prefill_attends_to_cached_prefix(arch):
    assert arch.runner.execute_logits([arch.feed("a", 0, 13, sample=False)]) == [None]
    (logits,) = arch.runner.execute_logits([arch.feed("a", 13, 31)])
    torch.testing.assert_close(logits, arch.ref["a"][30], **TOL)


def test_decodes_mixed_with_prefill_chunks(arch):
    run = arch.runner.execute_logits
    first = run([arch.feed("a", 0, 24), arch.feed("c", 0, 12)])
    torch.testing.assert_close(first[0], arch.ref["a"][23], **TOL)
    torch.testing.assert_close(first[1], arch.ref["c"][11], **TOL)
    # b arrives in chunks of 10 while a and c decode one token a step; c's decode sits between.
    for step in range(4):
        a_pos, c_pos, b_start = 24 + step, 12 + step, 10 * step
        b_end = min(b_start + 10, 36)
        out = run([arch.feed("a", a_pos, a_pos + 1), arch.feed("b", b_start, b_end, sample=b_end == 36),
                   arch.feed("c", c_pos, c_pos + 1)])  # fmt: skip
        torch.testing.assert_close(out[0], arch.ref["a"][a_pos], **TOL)
        torch.testing.assert_close(out[2], arch.ref["c"][c_pos], **TOL)
        if b_end == 36:
            torch.testing.assert_close(out[1], arch.ref["b"][35], **TOL)
        else:
            assert out[1] is None


def test_greedy_tokens_are_argmax(arch):
    tokens = arch.runner.execute([arch.feed("a", 0, 40), arch.feed("c", 0, 20, sample=False)])
    assert tokens == [int(arch.ref["a"][39].argmax()), None]


# --- loading: sharded checkpoints and errors -------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(out, CONFIGS["llama"])
    return out


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads(tmp_path):
    hf = write_hf_checkpoint(tmp_path, CONFIGS["qwen2"], max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    runner = make_runner(tmp_path)
    tokens = list(range(1, 18))
    (logits,) = runner.execute_logits([SeqInput(tokens, 0, list(range(5)), True)])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(logits, ref, **TOL)


def test_missing_shard_is_named(tmp_path):
    write_hf_checkpoint(tmp_path, CONFIGS["qwen2"], max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}.*missing"):
        make_runner(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**_BASE, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(UnsupportedModelError) as err:
        make_runner(tmp_path)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_named():
    config = {**CONFIGS["llama"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="'yarn'.*default, linear, llama3"):
        ModelConfig.from_dict(config)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    ckpt = copy_of(llama_dir, tmp_path)
    tensors = safetensors_torch.load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    ):
        make_runner(ckpt)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    ckpt = copy_of(llama_dir, tmp_path)
    tensors = safetensors_torch.load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    safetensors_torch.save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"k_proj\.weight' has shape \[16, 64\], expected \[32, 64\]"
    ):
        make_runner(ckpt)


def test_truncated_file_is_named(llama_dir, tmp_path):
    ckpt = copy_of(llama_dir, tmp_path)
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        make_runner(ckpt)


def test_no_weights_is_named(llama_dir, tmp_path):
    ckpt = copy_of(llama_dir, tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        make_runner(ckpt)


def test_float16_on_cpu_is_refused(llama_dir):
    with pytest.raises(DeviceError, match="float16 on CPU"):
        make_runner(llama_dir, dtype="float16")


def test_sliding_window_beyond_max_model_len_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["mistral"]))
    with pytest.raises(UnsupportedModelError, match="sliding-window.*max_model_len <= 128"):
        make_runner(tmp_path, max_model_len=256)


def test_block_table_too_short_is_a_value_error(llama_dir):
    runner = make_runner(llama_dir)
    with pytest.raises(ValueError, match="seq 0: block_table has 2 blocks, 3 needed"):
        runner.execute([SeqInput(list(range(9)), 0, [0, 1], True)])


def test_bfloat16_runs_close_to_float32(llama_dir):
    tokens = list(range(3, 30))
    fp32 = make_runner(llama_dir).execute_logits([SeqInput(tokens, 0, list(range(7)), True)])[0]
    bf16 = make_runner(llama_dir, dtype="bfloat16").execute_logits(
        [SeqInput(tokens, 0, list(range(7)), True)]
    )[0]
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.05)


def test_unknown_attention_backend_lists_known(llama_dir):
    with pytest.raises(
        ConfigError, match="unknown attention backend 'flash'; known: torch, triton, flash_attn"
    ):
        make_runner(llama_dir, attention_backend="flash")


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed"
)
def test_flash_attn_without_the_package_is_a_clear_error(llama_dir):
    with pytest.raises(
        DeviceError,
        match="'flash_attn' needs a package that is not importable.*pip install flash-attn",
    ):
        make_runner(llama_dir, attention_backend="flash_attn")
