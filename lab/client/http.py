"""Streamed requests to an OpenAI-compatible endpoint, timed on the client (the only module
that imports aiohttp).

Each request asks for ``max_tokens`` tokens with ``ignore_eos: true`` (vLLM's benchmark
option, so that the output length is the trace's), ``stream: true`` and
``stream_options.include_usage`` (the server's token counts arrive in a last chunk). Its
prompt is synthetic text of the trace's prompt length in words (:func:`prompt_text`); the
server's tokenizer decides the real count, which the usage chunk reports.

Timing follows ``vllm bench serve`` (vllm/benchmarks/lib/endpoint_request_func.py): a
request's clock starts when it is sent; every SSE chunk that carries output text is one
arrival (first: TTFT; the gaps between the others: ITL, per chunk). Nothing is lost: an
HTTP error, an error inside the stream, a broken connection or a timeout ends the request
``aborted`` with the reason. SIGINT, SIGTERM or SIGHUP during a replay stops it
(:class:`ReplayStopped`): the requests that ended keep their measurements, the others end
``aborted`` with the signal named.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sched_lab.core.errors import UserError
from sched_lab.run.signals import STOP_SIGNALS

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT_WORD = "hello"  # one token in common BPE vocabularies, with or without a leading space


class ReplayStopped(KeyboardInterrupt):
    """A replay stopped by signal ``signum``: ``measured`` holds every request of the
    replay in order (those that had not ended: aborted, the signal named in their reason),
    ``wall_s`` the time it ran."""

    def __init__(self, signum: int, measured: list[Measured], wall_s: float) -> None:
        super().__init__(signum)
        self.signum, self.measured, self.wall_s = signum, measured, wall_s

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def require_aiohttp():
    """The aiohttp module; UserError naming the extra when it is missing."""
    try:
        import aiohttp
    except ImportError:
        raise UserError(
            "sched-lab bench needs aiohttp: pip install -e '.[serve]' in the lab's folder"
        ) from None
    return aiohttp


@dataclass(frozen=True)
class Target:
    """Where requests go: ``base_url`` without ``/v1``, the model name, the endpoint
    (``completions`` or ``chat``) and a whole request's time limit in seconds."""

    base_url: str
    model: str
    endpoint: str = "completions"
    timeout_s: float = 300.0

    @property
    def url(self) -> str:
        return base(self.base_url) + ENDPOINTS[self.endpoint]


@dataclass
class Measured:
    """One request as the client saw it. Times are seconds since the bench started.

    Attributes:
        sent_s: when the request was sent.
        chunk_s: when each chunk carrying output text arrived, in order.
        status: ``finished`` (the stream ended with ``data: [DONE]``) or ``aborted``.
        reason: why it was aborted (HTTP status and message, timeout, connection error).
        http_status: the response's status code; None if none came.
        prompt_tokens, completion_tokens, cached_tokens: the server's usage counts
            (``usage.prompt_tokens_details.cached_tokens`` for the last); None if absent.
    """

    request_id: str
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)
    status: str = "aborted"
    reason: str = ""
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def num_output_tokens(self) -> int:
        """The server's completion token count, else the chunks with text received."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_s)


def base(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: ``http://h:8000/v1/`` -> ``http://h:8000``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def prompt_text(num_words: int) -> str:
    """``num_words`` words of synthetic prompt: ``hello hello ...``."""
    return " ".join([PROMPT_WORD] * num_words)


def request_body(target: Target, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """The JSON body of one streamed request with a prompt of ``prompt_len`` words."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text(prompt_len)}]
    else:
        body["prompt"] = prompt_text(prompt_len)
    return body


def error_message(text: str, limit: int = 200) -> str:
    """The message of an OpenAI-shaped error body (``{"error": {"message": ...}}``), else the
    body's text, on one line and cut to ``limit`` characters."""
    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message", err) if isinstance(err, dict) else err
        text = msg if isinstance(msg, str) else json.dumps(msg)
    except ValueError:
        pass
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The output text a stream chunk carries (completions: ``text``; chat: ``delta``).
    Raises ValueError for a chunk not of that shape (the request ends as a bad chunk)."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
        raise ValueError(f"choices: expected a list of objects, got {_short(choices)}")
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        parts = {"text": c["text"]}
    else:
        delta = c.get("delta") or {}
        if not isinstance(delta, dict):
            raise ValueError(f"choices[0].delta: expected an object, got {_short(delta)}")
        parts = {k: delta.get(k) for k in ("content", "reasoning_content")}
    for key, text in parts.items():
        if text is not None and not isinstance(text, str):
            raise ValueError(f"choices[0] {key}: expected a string, got {_short(text)}")
    return "".join(t for t in parts.values() if t)


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _usage(m: Measured, usage: dict[str, Any]) -> None:
    """The server's counts from a usage object; a count that is not an integer in
    [0, 2**63) (a float, a string: an odd server's) is taken as absent (None)."""
    if "prompt_tokens" in usage:
        m.prompt_tokens = _count(usage["prompt_tokens"])
    if "completion_tokens" in usage:
        m.completion_tokens = _count(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        m.cached_tokens = _count(details["cached_tokens"])


def _count(v: Any) -> int | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63
    return v if ok else None


async def stream_one(
    session, target: Target, request_id: str, body: dict[str, Any], clock: Callable[[], float]
) -> Measured:
    """Send one streamed request and time its chunks; never raises for the server's or the
    network's failures (the request comes back aborted with the reason)."""
    aiohttp = require_aiohttp()
    m = Measured(request_id, clock())
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    done = False
    try:
        async with session.post(target.url, json=body, timeout=timeout) as resp:
            m.http_status = resp.status
            if resp.status != 200:
                m.reason = f"HTTP {resp.status}: {error_message(await resp.text())}"
                return m
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = clock()
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError("a chunk that is not a JSON object")
                if "error" in chunk:
                    m.reason = f"error in the stream: {error_message(json.dumps(chunk))}"
                    return m
                if _chunk_text(chunk):
                    m.chunk_s.append(now)
                if isinstance(chunk.get("usage"), dict):
                    _usage(m, chunk["usage"])
    except asyncio.TimeoutError:
        m.reason = f"timeout: no complete answer within {target.timeout_s:g} s (--timeout)"
        return m
    except aiohttp.ClientError as e:
        m.reason = f"connection error: {type(e).__name__}: {error_message(str(e))}"
        return m
    except (ValueError, RecursionError) as e:  # JSON errors, an over-long line, bad shapes
        why = f"{type(e).__name__}: {e}" if isinstance(e, RecursionError) else str(e)
        m.reason = f"bad stream chunk: {error_message(why)}"
        return m
    if not done:
        m.reason = "the stream ended before data: [DONE]"
    elif not m.chunk_s:
        m.reason = "the stream carried no output text"
    else:
        m.status = "finished"
    return m


async def _replay(
    target: Target,
    sends: list[tuple[str, float, dict[str, Any]]],
    max_concurrency: int | None,
    progress: Callable[[int], None] | None,
) -> tuple[list[Measured], float]:
    aiohttp = require_aiohttp()
    # limit 0: no cap on connections (aiohttp's default of 100 would cap the concurrency)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    ended: dict[int, Measured] = {}
    sent_s: dict[int, float] = {}  # when each request sent so far was sent
    stopped: list[int] = []  # the signal that stopped the replay
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        async def one(k: int, request_id: str, at_s: float, body: dict[str, Any]) -> None:
            if at_s > clock():
                await asyncio.sleep(at_s - clock())
            if slots is None:
                sent_s[k] = clock()
                m = await stream_one(session, target, request_id, body, clock)
            else:
                async with slots:
                    sent_s[k] = clock()
                    m = await stream_one(session, target, request_id, body, clock)
            ended[k] = m
            if progress is not None:
                progress(len(ended))

        tasks = [asyncio.ensure_future(one(k, *send)) for k, send in enumerate(sends)]

        def stop(signum: int) -> None:
            if not stopped:
                stopped.append(signum)
                for t in tasks:
                    t.cancel()

        with _stop_signals(asyncio.get_running_loop(), stop):
            if tasks:
                await asyncio.wait(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        wall_s = clock()
    if not stopped:
        return [ended[k] for k in range(len(sends))], wall_s
    name = signal.Signals(stopped[0]).name
    out = []
    for k, (request_id, at_s, _) in enumerate(sends):
        m = ended.get(k)
        if m is None:
            was_sent = k in sent_s
            m = Measured(request_id, sent_s[k] if was_sent else at_s)  # unsent: when due
            m.reason = f"interrupted by {name} {'in flight' if was_sent else 'before it was sent'}"
        out.append(m)
    raise ReplayStopped(stopped[0], out, wall_s)


class _stop_signals:
    """While active (in the main thread), SIGINT, SIGTERM and SIGHUP call ``stop(signum)``
    on the event loop ``aio``; the handlers before are put back at the end. An ignored
    signal stays ignored."""

    def __init__(self, aio: asyncio.AbstractEventLoop, stop: Callable[[int], None]) -> None:
        self.aio, self.stop = aio, stop
        self.old: dict[int, Any] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in STOP_SIGNALS:
            old = signal.getsignal(s)
            if old is not signal.SIG_IGN:
                self.aio.add_signal_handler(s, self.stop, s)
                self.old[s] = old

    def __exit__(self, *exc) -> None:
        for s, old in self.old.items():
            self.aio.remove_signal_handler(s)
            signal.signal(s, old if old is not None else signal.SIG_DFL)


def replay(
    target: Target,
    sends: list[tuple[str, float, dict[str, Any]]],
    max_concurrency: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Measured], float]:
    """Send each (request id, send time in s, body) at its time, at most ``max_concurrency``
    at once (None: no cap; a request waits for a slot and is sent when it gets one). Returns
    the measurements in the order of ``sends`` and the wall time in seconds. ``progress``
    is called with the number of requests ended so far.

    Raises:
        ReplayStopped: SIGINT, SIGTERM or SIGHUP came (in the main thread); it holds every
            request's measurement, those not ended aborted with the signal named.
    """
    return asyncio.run(_replay(target, sends, max_concurrency, progress))


def check_model(base_url: str, model: str | None, timeout_s: float = 10.0) -> str:
    """The model to ask for, checked before any request: ``model``, or the first one
    ``GET /v1/models`` lists when None. UserError (one line, naming ``--base-url`` or
    ``--model``) when the server cannot be reached, lists no model, or does not serve
    ``model``; a server without ``/v1/models`` (HTTP 404) is taken at its word for a given
    ``model``."""
    aiohttp = require_aiohttp()
    url = base(base_url) + "/v1/models"

    async def get() -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as resp:
                if resp.status == 404 and model is not None:
                    return None
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {error_message(await resp.text())}")
                return await resp.json(content_type=None)

    hint = "; give --model" if model is None else ""
    try:
        data = asyncio.run(get())
    except aiohttp.ClientConnectionError as e:
        raise UserError(f"--base-url {base_url}: cannot connect ({e})") from None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise UserError(f"--base-url {base_url}: GET {url} failed ({why}){hint}") from None
    if data is None:
        return model
    try:
        served = [str(m["id"]) for m in data["data"]]
    except (KeyError, IndexError, TypeError):
        served = []
    if not served:
        raise UserError(
            f"--base-url {base_url}: GET {url} lists no model (expected "
            f'{{"data": [{{"id": ...}}]}}){hint}'
        )
    if model is None:
        return served[0]
    if model not in served:
        raise UserError(
            f"--model {model}: not served by {base_url} (it serves: {', '.join(served)})"
        )
    return model
