"""The ``prompts`` format: a YAML list of ``{prompt, output_len, arrival_s}`` (arrival_s
default 0, non-decreasing; optional ``lora_name`` and ``cache_salt``, strings in the prefix
cache's key), tokenized with ``tokenizer`` (a Hugging Face model directory); ``chat: true``
applies the chat template. Imports ``transformers`` only when used."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sched_lab.core.errors import TraceError, short_repr
from sched_lab.traces.readers import load_yaml_file
from sched_lab.traces.registry import register_format
from sched_lab.traces.spec import WHERE, require, resolve_path
from sched_lab.traces.table import CACHE_KEYS, TraceTable
from sched_lab.traces.validate import MAX_TOKENS

_ITEM_KEYS = ("prompt", "output_len", "arrival_s")


@register_format("prompts", keys=("path", "tokenizer", "chat"))
def load_prompts(spec: Mapping[str, Any], base_dir: Path, seed: int) -> TraceTable:
    path = resolve_path(spec, base_dir, WHERE)
    items = load_yaml_file(path, "a prompts file", TraceError)
    if not isinstance(items, list) or not items:
        raise TraceError(f"{path}: expected a non-empty list of {{prompt, output_len, arrival_s}}")
    chat = spec.get("chat", False)
    if not isinstance(chat, bool):
        raise TraceError(f"{WHERE}.chat: expected true or false, got {short_repr(chat)}")
    prompts, outputs, arrivals = [], [], []
    names: dict[str, list[str]] = {key: [] for key in CACHE_KEYS}
    for i, item in enumerate(items):  # every item checked before the tokenizer loads
        where = f"{path}: item {i + 1}"
        if not isinstance(item, dict) or set(item) - {*_ITEM_KEYS, *CACHE_KEYS}:
            raise TraceError(
                f"{where}: expected keys {', '.join(_ITEM_KEYS)} (and optional "
                f"{', '.join(CACHE_KEYS)}); got {short_repr(item)}"
            )
        for key, values in names.items():
            v = item.get(key)
            if v is not None and (not isinstance(v, str) or not v):
                raise TraceError(
                    f"{where}: {key}: expected a non-empty string, got {short_repr(v)}"
                )
            values.append(v or "")
        prompt, out, t = item.get("prompt"), item.get("output_len"), item.get("arrival_s", 0.0)
        if not isinstance(prompt, str) or not prompt:
            raise TraceError(
                f"{where}: prompt: expected a non-empty string, got {short_repr(prompt)}"
            )
        if isinstance(out, bool) or not isinstance(out, int) or not 1 <= out <= MAX_TOKENS:
            raise TraceError(
                f"{where}: output_len: expected an integer in 1..{MAX_TOKENS:,}, "
                f"got {short_repr(out)}"
            )
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
            raise TraceError(
                f"{where}: arrival_s: expected a finite number >= 0, got {short_repr(t)}"
            )
        if arrivals and t < arrivals[-1]:
            raise TraceError(f"{where}: arrival_s {t} is before the previous item's {arrivals[-1]}")
        prompts.append(prompt)
        outputs.append(out)
        arrivals.append(float(t))
    tokenizer = _tokenizer(Path(str(require(spec, "tokenizer", WHERE))).expanduser(), base_dir)
    ids = []
    for prompt in prompts:
        if chat:
            tokens = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            tokens = list(tokens["input_ids"] if isinstance(tokens, Mapping) else tokens)
        else:
            tokens = tokenizer(prompt)["input_ids"]
        ids.append(list(tokens))
    return TraceTable(
        row=np.arange(len(items)),
        arrival_s=np.asarray(arrivals),
        prompt_len=np.asarray([len(t) for t in ids]),
        output_len=np.asarray(outputs),
        prompt_token_ids=ids,
        **{k: np.asarray(v, dtype=object) if any(v) else None for k, v in names.items()},
    )


def _tokenizer(path: Path, base_dir: Path):
    if not path.is_absolute():
        path = base_dir / path
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TraceError(
            "the prompts format needs transformers: pip install transformers"
        ) from None
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise TraceError(
            f"{WHERE}.tokenizer: no tokenizer files in {path} (for SmolLM2 run "
            f"`python -m sched_lab.backend.tools convert-smollm2`)"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign tokenizer folder
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise TraceError(f"{WHERE}.tokenizer: {path} cannot be loaded ({why})") from None
