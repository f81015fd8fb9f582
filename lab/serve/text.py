"""Text to token ids and back, per backend.

* :class:`ModelText`: the engine's model has a tokenizer (Hugging Face files in its folder):
  prompts are tokenized with it, chat messages go through its chat template, output ids are
  decoded with it, and its EOS ids end a request.
* :class:`IdText`: an engine model without a tokenizer (a random checkpoint): prompts must be
  token ids; output text is the ids written out (``" 17 4 201"``).
* :class:`PlaceholderText`: the simulator (digital twin): a prompt's tokens are its
  whitespace-separated words (ids from a stable hash, so equal prefixes share cache
  blocks); every output token is the text ``" tok"``; nothing ends a request early.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from sched_lab.serve.protocol import ApiError

PLACEHOLDER = " tok"  # the text of one simulated output token
PLACEHOLDER_ID = 0
WORD_VOCAB = 1 << 30  # id range of PlaceholderText's words


def join_messages(messages: list[dict[str, str]]) -> str:
    """Chat without a template: one ``role: content`` line per message, then
    ``assistant:`` (documented in docs/serving.md)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class PlaceholderText:
    """The digital twin's tokens (module docstring)."""

    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % WORD_VOCAB for w in text.split()]

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(join_messages(messages))

    def decode(self, ids: list[int]) -> str:
        return PLACEHOLDER * len(ids)

    def check_ids(self, ids: list[int]) -> None:
        """Any id is a token here."""


class IdText:
    """An engine model without a tokenizer: token ids in, ids written out."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids

    def encode(self, text: str) -> list[int]:
        raise ApiError(
            "prompt: this model has no tokenizer (no tokenizer.json in its folder); send the "
            "prompt as a list of token ids",
            "prompt",
        )

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        raise ApiError(
            "messages: this model has no tokenizer (no tokenizer.json in its folder); use "
            "/v1/completions with token ids",
            "messages",
        )

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)

    def check_ids(self, ids: list[int]) -> None:
        check_vocab(ids, self.vocab_size)


class ModelText:
    """The engine model's own tokenizer and chat template (transformers, imported here)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = vocab_size
        extra = self.tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids | ({extra} if isinstance(extra, int) else set())

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the chat template; ApiError (400) when the template refuses
        them (``raise_exception``: roles that do not alternate, as vLLM answers it)."""
        if getattr(self.tokenizer, "chat_template", None):
            from jinja2 import TemplateError

            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except TemplateError as e:
                raise ApiError(
                    f"messages: the model's chat template refused them: {e}".splitlines()[0],
                    "messages",
                ) from None
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self.encode(join_messages(messages))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check_ids(self, ids: list[int]) -> None:
        check_vocab(ids, self.vocab_size)


def check_vocab(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise ApiError(
            f"prompt: token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})",
            "prompt",
        )


def engine_text(model_dir: Path) -> ModelText | IdText:
    """The text of an engine model folder: its tokenizer if it has one, else ids."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    vocab = int(config["vocab_size"])
    if (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists():
        return ModelText(model_dir, vocab, eos_ids)
    return IdText(vocab, eos_ids)
