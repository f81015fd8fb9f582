"""Speculative decoding: the ``speculative:`` option, parsed and validated.

Keys (vLLM's names where vLLM has one):

* ``method``: ``ngram`` (prompt lookup), ``draft`` (a smaller model, same tokenizer) or
  ``synthetic`` (acceptance from ``acceptance_rates``: a timing device only).
* ``num_speculative_tokens``: k, drafts per step, in [1, 64].
* ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram): 1 <= min <= max; one given sets
  the other, neither gives :data:`DEFAULT_PROMPT_LOOKUP`.
* ``model`` (draft, required): the draft checkpoint folder.
* ``acceptance_rates``: [p_1 .. p_k], p_i = P(draft i accepted | drafts 1..i-1 were), each
  in [0, 1]; required for ``synthetic`` unless ``acceptance_from``; the simulator's rates.
* ``acceptance_from``: a results run folder whose measured acceptance the simulator uses;
  not with ``acceptance_rates``.
* ``seed``: of the acceptance draws and synthetic proposals (>= 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sched_lab.core.errors import ConfigError

METHODS = ("ngram", "draft", "synthetic")
KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "acceptance_rates",
    "acceptance_from",
    "seed",
)
#: n-gram lengths when neither bound is given (vLLM's default for prompt lookup).
DEFAULT_PROMPT_LOOKUP = 5
#: The largest k taken: every verify step carries per-position metrics for k positions, and
#: published setups stay far below it (vLLM's examples use 2-10).
MAX_SPECULATIVE_TOKENS = 64


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated ``speculative:`` section (see the module docstring for each key)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    acceptance_rates: tuple[float, ...] | None = None
    acceptance_from: str | None = None
    seed: int = 0

    @classmethod
    def from_mapping(cls, raw: Any, key: str = "speculative") -> SpeculativeConfig:
        """Validate a parsed ``speculative:`` mapping; ConfigError (one line) naming the key."""

        def fail(sub: str, expected: str, value: Any) -> ConfigError:
            return ConfigError(f"{key}.{sub}: expected {expected}, got {_short(value)}")

        def integer(sub: str, lo: int) -> int | None:
            v = raw.get(sub)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise fail(sub, f"an integer >= {lo}", v)
            return v

        if not isinstance(raw, Mapping):
            raise ConfigError(f"{key}: expected a mapping with 'method', got {_short(raw)}")
        for k in raw:
            if k not in KEYS:
                raise ConfigError(f"{key}: unknown key {_short(k)}; allowed: {', '.join(KEYS)}")
        method = raw.get("method")
        if method not in METHODS:
            raise fail("method", "one of " + ", ".join(METHODS), method)
        if "num_speculative_tokens" not in raw:
            raise fail("num_speculative_tokens", "an integer >= 1 (required)", None)
        k = integer("num_speculative_tokens", 1)
        if k > MAX_SPECULATIVE_TOKENS:
            raise fail("num_speculative_tokens", f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]", k)
        lo, hi = integer("prompt_lookup_min", 1), integer("prompt_lookup_max", 1)
        if method == "ngram":
            lo = lo if lo is not None else hi if hi is not None else DEFAULT_PROMPT_LOOKUP
            hi = hi if hi is not None else lo
            if lo > hi:
                raise ConfigError(
                    f"{key}.prompt_lookup_min: expected <= prompt_lookup_max {hi}, got {lo}"
                )
        elif lo is not None or hi is not None:
            sub = "prompt_lookup_min" if lo is not None else "prompt_lookup_max"
            raise ConfigError(f"{key}.{sub}: only for method ngram, got method {method!r}")
        model = raw.get("model")
        if method == "draft":
            if not isinstance(model, str) or not model:
                raise fail("model", "the draft model's checkpoint folder (method draft)", model)
        elif model is not None:
            raise ConfigError(f"{key}.model: only for method draft, got method {method!r}")
        rates = raw.get("acceptance_rates")
        if rates is not None:
            if not isinstance(rates, (list, tuple)) or len(rates) != k:
                raise fail(
                    "acceptance_rates", f"a list of {k} probabilities (one per draft)", rates
                )
            for i, p in enumerate(rates):
                ok = isinstance(p, (int, float)) and not isinstance(p, bool)
                if not ok or not (0.0 <= p <= 1.0) or math.isnan(p):
                    raise fail(f"acceptance_rates[{i}]", "a probability in [0, 1]", p)
            rates = tuple(float(p) for p in rates)
        source = raw.get("acceptance_from")
        if source is not None:
            if not isinstance(source, str) or not source:
                raise fail("acceptance_from", "a results run folder", source)
            if rates is not None:
                raise ConfigError(
                    f"{key}: acceptance_rates and acceptance_from both given; expected one"
                )
        if method == "synthetic" and rates is None and source is None:
            raise fail("acceptance_rates", f"a list of {k} probabilities (method synthetic)", None)
        seed = raw.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise fail("seed", "an integer >= 0", seed)
        return cls(method, k, lo, hi, model, rates, source, seed)

    def to_dict(self) -> dict[str, Any]:
        """The keys that are set, as plain types (what ``from_mapping`` reads back)."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.k}
        for name in KEYS[2:]:
            v = getattr(self, name)
            if v is not None and name != "seed":
                out[name] = list(v) if isinstance(v, tuple) else v
        out["seed"] = self.seed
        return out

    @property
    def k(self) -> int:
        """``num_speculative_tokens``."""
        return self.num_speculative_tokens


def draft_vocab_error(model: str, draft_vocab: int, target_vocab: int) -> str | None:
    """The one-line error for a draft vocabulary that is not the target's, or None."""
    if draft_vocab == target_vocab:
        return None
    return (
        f"speculative.model: expected a draft model with the target's vocabulary "
        f"({target_vocab} tokens), got {_short(model)} with {draft_vocab} tokens"
    )
