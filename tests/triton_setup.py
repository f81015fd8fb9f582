"""Shared setup of the Triton tests: on a machine without CUDA, run kernels in Triton's CPU
interpreter (``TRITON_INTERPRET=1``, set before triton is first imported, since Triton reads
it when a kernel is decorated) and patch one numpy incompatibility of that interpreter.

Import this module before anything that imports triton.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch_threads  # noqa: F401  (one torch thread unless OMP_NUM_THREADS says otherwise)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from sched_lab.backend.attention.triton_backend import interpreting  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar (a shape-(1,) array) into a loop bound with
    ``int(array)``, which numpy >= 2.4 rejects (triton-lang/triton#9171, fixed after 3.6).
    Re-patch that one conversion so kernels with runtime loop bounds interpret."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_for_numpy_2_4()

#: Skip a test module when triton was imported elsewhere first without the interpreter.
needs_triton = pytest.mark.skipif(
    not HAS_CUDA and not interpreting(), reason="triton was imported without TRITON_INTERPRET=1"
)


def batch(specs, block_size, num_blocks, seed=0):
    """SeqInputs for (start_pos, num_tokens) specs, each with its own scattered blocks."""
    from sched_lab.backend.inputs import SeqInput

    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs = []
    for start, n in specs:
        need = -(-(start + n) // block_size)
        seqs.append(SeqInput(list(range(n)), start, blocks[:need], sample=True))
        blocks = blocks[need:]
    return seqs


#: A tiny Qwen3 (q/k norm, GQA 2:1, tied embeddings) for runner-level kernel tests.
QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def tiny_engine_config(model, blocks, policies, caching=False, speculative=None):
    """A validated CPU engine experiment over checkpoint ``model`` for tests that pass their
    own requests (``run_experiment(cfg, False, requests)``): ``blocks`` KV blocks of 4
    tokens, a small swap space, max_num_seqs 8, max_model_len 128."""
    from sched_lab.config import validate

    raw = {
        "name": "engine_tiny",
        "backend": "engine",
        "trace": {"format": "synthetic", "num_requests": 1},  # replaced by requests=
        "engine": {"model_path": str(model), "device": "cpu", "dtype": "float32"},
        "kv_cache": {
            "block_size": 4,
            "num_gpu_blocks": blocks,
            "swap_space_gib": 0.001,
            "enable_prefix_caching": caching,
        },  # fmt: skip
        "scheduler": {"max_num_seqs": 8, "max_model_len": 128},
        "policies": policies,
    }
    if speculative is not None:
        raw["speculative"] = speculative
    return validate(raw)
