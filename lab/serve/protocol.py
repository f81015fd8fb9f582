"""The OpenAI wire format: request bodies checked into :class:`Sampling`, errors, and the
JSON of answers and stream chunks (``/v1/completions``, ``/v1/chat/completions``).

Plain Python (no aiohttp): the server (lab/serve/app.py) calls these. A bad body raises
:class:`ApiError`, whose :meth:`ApiError.body` is OpenAI's error object naming the field.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_STOP_STRINGS = 16  # body keys not read here are accepted and ignored (docs/serving.md)


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object.

    Args:
        message: one line naming the field and what was expected.
        param: the body field at fault, or None.
        status: 400 bad request, 404 unknown model, 503 server full or stopping.
    """

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    # a wrong method, a body that did not arrive in time, a body too big
    TYPES |= {405: "BadRequestError", 408: "BadRequestError", 413: "BadRequestError"}

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; vLLM's types)."""
        kind = self.TYPES.get(self.status, "InternalServerError")
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }  # fmt: skip
        }


@dataclass(frozen=True)
class Sampling:
    """One request's parameters, checked.

    Attributes:
        prompt: text, or token ids (completions); None for chat.
        messages: chat messages (``role``, ``content`` text), or None for completions.
        max_tokens: output tokens at most; None = up to max_model_len.
        temperature, top_p, seed: the request's sampling (lab/core/request.py
            ``SamplingParams``); temperature None = the server's (the YAML's
            ``engine.temperature``).
        ignore_eos: generate exactly ``max_tokens`` (vLLM's benchmark switch).
        stop: strings that end the output (not included in it).
        stream, include_usage: SSE chunks; a last chunk with ``usage``.
        priority: vLLM's field; lower is served first by priority policies.
    """

    model: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int


def _number(
    body: Mapping[str, Any], key: str, default: float | None, lo: float, hi: float
) -> float | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi):
        raise ApiError(f"{key}: expected a number in [{lo:g}, {hi:g}], got {_short(v)}", key)
    if math.isnan(v):
        raise ApiError(f"{key}: expected a number, got NaN", key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, lo: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # 3.0 is 3, as vLLM's (pydantic's) integer fields take it
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"{key}: expected an integer, got {_short(v)}", key)
    if lo is not None and v < lo:
        raise ApiError(f"{key}: expected an integer >= {lo}, got {v}", key)
    return v


def _bool(body: Mapping[str, Any], key: str, where: str = "") -> bool:
    """``body[key]``; errors name ``where + key`` (OpenAI's dotted path of a nested field)."""
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(f"{where}{key}: expected true or false, got {_short(v)}", where + key)
    return v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP_STRINGS
    ):
        raise ApiError(
            f"stop: expected a non-empty string or a list of at most {MAX_STOP_STRINGS} "
            f"non-empty strings, got {v!r}",
            "stop",
        )
    return tuple(stops)


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    v = body.get("prompt")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    if isinstance(v, str) and v:
        return v
    if (
        isinstance(v, list)
        and v
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)
    ):
        return list(v)
    raise ApiError(
        "prompt: expected a non-empty string or a non-empty list of token ids (one prompt; "
        f"n=1), got {_short(v)}",
        "prompt",
    )


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise ApiError(f"messages: expected a non-empty list, got {_short(v)}", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ApiError(f"{where}: expected an object with a string role", where)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text ones only
            content = "".join(_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
        if not isinstance(content, str):
            raise ApiError(
                f"{where}.content: expected a string or a list of text parts, got {_short(content)}",
                f"{where}.content",
            )
        out.append({"role": m["role"], "content": content})
    return out


def _text_part(part: Any, where: str) -> str:
    """The text of one content part ``{"type": "text", "text": "..."}``."""
    if not isinstance(part, Mapping) or part.get("type") != "text":
        raise ApiError(
            f'{where}: expected a text part {{"type": "text", "text": ...}} (only text parts '
            f"are supported), got {_short(part)}",
            where,
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise ApiError(f"{where}.text: expected a string, got {_short(text)}", f"{where}.text")
    return text


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def parse(body: Any, chat: bool, model_name: str, adapters: tuple[str, ...] = ()) -> Sampling:
    """Check a request body (already parsed JSON) of ``/v1/completions`` (``chat`` False) or
    ``/v1/chat/completions``. ``model`` may name the base model or one of the LoRA
    ``adapters`` (vLLM's convention); left out, null or "" is the base model. Raises
    ApiError naming the field (404 for another model)."""
    if not isinstance(body, Mapping):
        raise ApiError(f"the body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"model: expected a string, got {_short(model)}", "model")
    model = model or None  # "": the served model, as vLLM takes it
    if model is not None and model != model_name and model not in adapters:
        raise ApiError(f"The model `{model}` does not exist.", "model", 404)
    n = _int(body, "n")
    if n is not None and n != 1:
        raise ApiError(f"n: only n=1 is supported, got {n}", "n")
    if body.get("best_of") not in (None, 1):
        raise ApiError(f"best_of: only 1 is supported, got {_short(body['best_of'])}", "best_of")
    # chat: max_completion_tokens, else (absent or null) max_tokens, as vLLM reads them
    key = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    max_tokens = _int(body, key)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"{key}: expected an integer >= 1, got {max_tokens}", key)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise ApiError(
            f"stream_options: expected an object, got {_short(options)}", "stream_options"
        )
    include_usage = _bool(options or {}, "include_usage", "stream_options.")
    stream = _bool(body, "stream")
    if options is not None and not stream:
        raise ApiError("stream_options: allowed only with stream: true", "stream_options")
    return Sampling(
        model=model,
        prompt=None if chat else _prompt(body),
        messages=_messages(body) if chat else None,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", None, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=_int(body, "seed"),
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
        priority=_int(body, "priority") or 0,
    )


# ------------------------------------------------------------------ answers


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens found in the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def answer(
    rid: str, chat: bool, model: str, text: str, finish: str, use: dict[str, int]
) -> dict[str, Any]:
    """A whole (non-streamed) answer."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    rid: str,
    chat: bool,
    model: str,
    text: str | None,
    finish: str | None = None,
    include_usage: bool = False,
    role: bool = False,
) -> dict[str, Any]:
    """One stream chunk with a text delta (``role``: chat's first chunk, naming the role)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(rid: str, chat: bool, model: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": use,
    }
