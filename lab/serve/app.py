"""``sched-lab serve CONFIG``: an OpenAI-compatible HTTP server over one backend (aiohttp).

Who does what: this module speaks HTTP (routes, SSE, errors, signals); lab/serve/protocol.py
checks bodies and writes the JSON; lab/serve/loop.py steps the scheduler in its own thread;
lab/serve/build.py makes the scheduler and executor from the YAML; lab/serve/text.py turns
text into token ids and back. docs/serving.md has the details.

Each request gets an asyncio queue; the loop thread hands each step's events to the event
loop in one ``call_soon_threadsafe``. Both threads share the GIL: after a step that gives
some request its first token, the loop thread waits (at most ``HANDOFF_WAIT_S``) until the
event loop has taken the events, rather than plan the next step while the event loop waits
for the GIL (up to ``sys.getswitchinterval()``, 5 ms). A client that goes away (its
connection closed while it waits or streams) cancels its request: the loop aborts it and
frees its blocks. SIGTERM or SIGINT: new requests get 503, requests in flight run to their
end, then the process exits 0; a second signal ends them at once (finish ``abort``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from sched_lab.config import load_config
from sched_lab.core.errors import OneLineParser, UserError
from sched_lab.core.request import Request, SamplingParams
from sched_lab.serve.build import Served, build
from sched_lab.serve.loop import ABORT, STOP, ServingLoop, Stream, StreamEvent
from sched_lab.serve.metrics import CONTENT_TYPE, ServeMetrics
from sched_lab.serve.protocol import (
    ApiError,
    Sampling,
    answer,
    chunk,
    new_id,
    parse,
    usage,
    usage_chunk,
)
from sched_lab.sweeps.sweep import is_sweep, read_yaml

log = logging.getLogger("sched_lab.serve")

EPILOG = """example:
  sched-lab serve experiments/quickstart.yaml --policy chunked_prefill --speed 10
  sched-lab serve experiments/smollm2_cpu.yaml --port 8001

exit status:
  0    stopped by SIGTERM or SIGINT once the requests in flight had ended
  130, 143  a second SIGINT or SIGTERM ended the requests in flight (finish_reason abort)
  2    bad input: one line, error: ..., naming the file, key or option"""
DEFAULT_MAX_WAITING = 1024
DRAIN_TIMEOUT_S = 600.0  # SIGTERM: how long requests in flight may take to finish
FORCED_STOP_S = 5.0  # a second signal: how long their handlers may take to answer
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this (its Content-Length promised)
MAX_BODY_BYTES = 64 << 20  # a larger request body is 413
HANDOFF_WAIT_S = 0.002  # a step with first tokens: the most the loop thread waits for delivery
INLINE_BODY_CHARS = 1 << 16  # a body longer is parsed and tokenized in a worker thread


class Server:
    """The HTTP side of one served instance (module docstring)."""

    def __init__(self, served: Served, speed: float, max_waiting: int) -> None:
        self.served, self.max_waiting = served, max_waiting
        self.model = served.model_name
        self.metrics = ServeMetrics(self.model, served.policy.speculative is not None)
        self.loop = ServingLoop(
            served.scheduler, served.executor, self.metrics, self._dispatch_threadsafe, speed
        )
        self.draining = False
        self.in_flight = 0  # handlers running a generation
        self._aio: asyncio.AbstractEventLoop | None = None
        self._next_id = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    # ------------------------------------------------------------------ threads
    def _dispatch_threadsafe(self, events: list[StreamEvent]) -> None:
        """From the loop thread: one call per step onto the event loop; with a first token
        among the events, returns once they are delivered (or after HANDOFF_WAIT_S)."""
        aio = self._aio
        if aio is None or aio.is_closed():
            return
        if not any(s.sent == len(ids) and ids for s, ids, _, _ in events):
            aio.call_soon_threadsafe(_deliver, events)
            return
        delivered = threading.Event()
        aio.call_soon_threadsafe(_deliver, events, delivered)
        delivered.wait(HANDOFF_WAIT_S)  # releases the GIL to the event loop

    # ------------------------------------------------------------------ routes
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Every error as OpenAI's JSON: ApiError as it says, HTTP errors with their status,
        anything else 500 with one line (logged with its traceback)."""
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ApiError(f"{request.method} {request.path}: {e.reason}", None, e.status)
            return web.json_response(err.body(), status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:
            log.exception("%s %s failed", request.method, request.path)
            err = ApiError(f"internal error: {type(e).__name__}: {e}".splitlines()[0], None, 500)
            return web.json_response(err.body(), status=500)

    async def health(self, request: web.Request) -> web.Response:
        if self.loop.failure:
            return web.Response(status=503, text=self.loop.failure)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sched-lab",
            "root": self.model,
            "parent": None,
            "max_model_len": self.served.limits.max_model_len,
        }
        # LoRA adapters as vLLM lists them: one card each, parent = the base model
        cards = [card] + [
            {**card, "id": a, "root": a, "parent": self.model} for a in self.served.adapters
        ]
        return web.json_response({"object": "list", "data": cards})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        size = request.content_length
        if size is not None and size > MAX_BODY_BYTES:  # refused before waiting for it
            raise ApiError(
                f"the body is {size} bytes (its Content-Length); at most {MAX_BODY_BYTES} are read",
                None,
                413,
            )
        try:  # a Content-Length larger than the body sent would wait for ever
            await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ApiError(
                f"the body did not arrive within {BODY_TIMEOUT_S:g} s (its Content-Length "
                f"is {request.content_length} bytes)",
                None,
                408,
            ) from None
        try:
            raw = await request.text()  # the body read above, decoded by its charset
        except (UnicodeDecodeError, LookupError) as e:  # an unknown charset in the Content-Type
            raise ApiError(f"the body is not valid JSON: {e}".splitlines()[0]) from None
        if len(raw) > INLINE_BODY_CHARS:  # off the event loop: the streams in flight go on
            sampling, prompt_ids = await asyncio.to_thread(self._prompt, raw, chat)
        else:
            sampling, prompt_ids = self._prompt(raw, chat)
        max_tokens = self._check_lengths(len(prompt_ids), sampling.max_tokens)
        if self.draining or self.loop.failure:
            why = self.loop.failure or "the server is shutting down"
            raise ApiError(f"not accepting requests: {why}", None, 503)
        if self.loop.num_waiting() >= self.max_waiting:
            raise ApiError(
                f"the server is full: {self.max_waiting} requests wait already (--max-waiting)",
                None,
                503,
            )
        self._next_id += 1
        r = Request(
            f"{self._next_id}",
            0.0,
            len(prompt_ids),
            max_tokens,
            prompt_token_ids=list(prompt_ids),
            priority=sampling.priority,
            sampling_params=self._sampling_params(sampling),
            lora_name=sampling.model if sampling.model in self.served.adapters else "",
        )
        why = self.served.scheduler.rejection_reason(r)  # reads limits and capacity only
        if why:
            raise ApiError(f"prompt: {why}", "prompt")
        stop_ids = frozenset() if sampling.ignore_eos else self.served.text.eos_token_ids
        queue: asyncio.Queue = asyncio.Queue()
        stream = Stream(r, stop_ids, queue)
        self.in_flight += 1
        self.loop.submit(stream)
        try:
            if sampling.stream:
                return await self._stream(request, stream, sampling, chat)
            return await self._whole(stream, sampling, chat)
        finally:
            self.in_flight -= 1
            if not stream.ended:  # the client went away, or an error
                self.loop.cancel(stream, ABORT)

    def _prompt(self, raw: str, chat: bool) -> tuple[Sampling, list[int]]:
        """(the checked body, the prompt's token ids) of a request body's text; ApiError
        naming the field. Thread-safe: a large body's is made in a worker thread (as vLLM
        tokenizes off its event loop), which a 60 MB prompt kept busy for seconds."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            # JSON errors, integers of over 4,300 digits, nesting past the recursion limit
            why = f"{type(e).__name__}: {e}" if isinstance(e, RecursionError) else str(e)
            raise ApiError(f"the body is not valid JSON: {why}".splitlines()[0]) from None
        sampling = parse(body, chat, self.model, self.served.adapters)
        text = self.served.text
        if chat:
            prompt_ids = _encoded(text.chat, sampling.messages, "messages")
        elif isinstance(sampling.prompt, str):
            prompt_ids = _encoded(text.encode, sampling.prompt, "prompt")
        else:
            prompt_ids = sampling.prompt
            text.check_ids(prompt_ids)
        if not prompt_ids:
            raise ApiError("prompt: it has no tokens", "messages" if chat else "prompt")
        return sampling, prompt_ids

    def _echo(self, sampling: Sampling) -> str:
        """The ``model`` of an answer: the adapter asked for, else the served model."""
        return sampling.model if sampling.model in self.served.adapters else self.model

    def _sampling_params(self, sampling: Sampling) -> SamplingParams | None:
        """The request's sampling for the engine; None when it sets none of it. Speculative
        decoding samples every request at the YAML's ``engine.temperature``: other values
        are ApiError naming the field."""
        params = SamplingParams(sampling.temperature, sampling.top_p, sampling.seed)
        if params == SamplingParams():
            return None
        if self.served.policy.speculative is None or not self.served.samples_tokens:
            return params
        temp = self.served.cfg.engine.temperature
        for key, bad in (
            ("temperature", params.temperature not in (None, temp)),
            ("top_p", params.top_p != 1.0),
            ("seed", params.seed is not None),
        ):
            if bad:
                raise ApiError(
                    f"{key}: this server runs speculative decoding, which samples every "
                    f"request at engine.temperature {temp:g} with top_p 1 and no seed; "
                    f"leave {key} out",
                    key,
                )
        return params

    def _check_lengths(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_tokens (default: what max_model_len leaves); ApiError if the prompt is too long."""
        limit = self.served.limits.max_model_len
        if prompt_len >= limit:
            raise ApiError(
                f"prompt: {prompt_len} tokens; this model's maximum context length is {limit} "
                "tokens (max_model_len), prompt and output together",
                "prompt",
            )
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise ApiError(
                f"max_tokens: {max_tokens} with a prompt of {prompt_len} tokens is "
                f"{prompt_len + max_tokens} tokens; this model's maximum context length is "
                f"{limit} tokens (max_model_len)",
                "max_tokens",
            )
        return max_tokens

    async def _events(self, stream: Stream, sampling: Sampling):
        """Yield (text delta, finish reason or None, error) as tokens come (the tokens of
        every step queued by then in one delta); stop strings end the output (not included)
        and cancel the request."""
        decoder = _Detokenizer(self.served.text, sampling.stop)
        queue: asyncio.Queue = stream.context
        while True:
            ids, finish, message = await queue.get()
            while finish is None and not queue.empty():
                # Steps came faster than this client took them: their tokens go out as one
                # chunk (as vLLM's per-request output collector merges), so a lagging event
                # loop does less per token and leaves the engine thread the GIL.
                more, finish, message = queue.get_nowait()
                ids = ids + more
            stream.received += len(ids)
            delta, stopped = decoder.add(ids, final=finish is not None)
            if stopped:
                self.loop.cancel(stream, STOP)
                stream.ended = True
                yield delta, STOP, ""
                return
            if finish is not None:
                stream.ended = True
                yield delta, finish, message
                return
            if delta:
                yield delta, None, ""

    async def _whole(self, stream: Stream, sampling: Sampling, chat: bool) -> web.Response:
        parts, finish = [], None
        async for delta, finish, message in self._events(stream, sampling):
            parts.append(delta)
            if finish == ABORT and message:
                raise ApiError(f"the request was aborted: {message}", None, 503)
        r = stream.request
        use = usage(r.prompt_len, stream.received, r.num_cached_tokens)
        return web.json_response(
            answer(new_id(chat), chat, self._echo(sampling), "".join(parts), finish, use)
        )

    async def _stream(
        self, request: web.Request, stream: Stream, sampling: Sampling, chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        rid, first = new_id(chat), True
        with_usage, model = sampling.include_usage, self._echo(sampling)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        try:
            async for delta, finish, message in self._events(stream, sampling):
                if chat and first:
                    await send(chunk(rid, chat, model, None, None, with_usage, role=True))
                    first = False
                if finish == ABORT and message:  # the last chunk before [DONE], as vLLM's
                    if delta:  # tokens merged into the same delivery as the abort
                        await send(chunk(rid, chat, model, delta, None, with_usage))
                    await send(ApiError(f"the request was aborted: {message}", None, 503).body())
                    with_usage = False
                    break
                if delta or finish is not None:
                    await send(chunk(rid, chat, model, delta, finish, with_usage))
            if with_usage:
                r = stream.request
                use = usage(r.prompt_len, stream.received, r.num_cached_tokens)
                await send(usage_chunk(rid, chat, model, use))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client left mid-stream: cancelled as the handler leaves
            log.debug("stream %s: the client went away", rid)
        return resp


def _encoded(encode: Callable[[Any], list[int]], value: Any, field: str) -> list[int]:
    """``encode(value)``; a text that is not UTF-8 (a lone surrogate, which JSON's
    ``\\ud800`` escapes can make) is ApiError naming ``field``."""
    try:
        return encode(value)
    except UnicodeEncodeError as e:
        raise ApiError(
            f"{field}: the text is not UTF-8 ({e.reason}: {e.object[e.start : e.end]!r})", field
        ) from None


def _deliver(events: list[StreamEvent], delivered: threading.Event | None = None) -> None:
    """On the event loop: each event to its request's queue; then sets ``delivered``."""
    for s, ids, finish, message in events:
        s.context.put_nowait((ids, finish, message))
    if delivered is not None:
        delivered.set()


class _Detokenizer:
    """Incremental text of one output. Each step decodes only the ids since the last
    emitted text plus the ones before them (for tokenizers whose text depends on the
    previous token), as vLLM and TGI do; it waits while the text ends in an unfinished UTF-8
    character (``\ufffd``). With stop strings it holds back the last ``len(longest) - 1``
    characters (a stop string may be arriving)."""

    def __init__(self, text, stop: tuple[str, ...]) -> None:
        self.text, self.stop = text, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the context of the next decode
        self.out = ""  # the output's text so far
        self.sent = 0  # characters of ``out`` sent

    def add(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """(new text, whether a stop string ended it)."""
        self.ids.extend(ids)
        before = self.text.decode(self.ids[self.prefix : self.read])
        now = self.text.decode(self.ids[self.prefix :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.out += now[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        out = self.out
        if self.stop:
            found = [i for i in (out.find(s, max(0, self.sent - self.hold)) for s in self.stop)
                     if i >= 0]  # fmt: skip
            if found:
                cut = min(found)
                delta, self.sent = out[self.sent : cut], max(self.sent, cut)
                return delta, True
        end = len(out) if final else max(self.sent, len(out) - self.hold)
        delta, self.sent = out[self.sent : end], end
        return delta, False


# ---------------------------------------------------------------------- command line


def main(argv: list[str] | None = None, prog: str = "sched-lab serve") -> int:
    """``sched-lab serve``; returns the exit status (2: bad input, one line)."""
    ap = OneLineParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Serve one policy of an experiment YAML over an OpenAI-compatible HTTP "
        "API: the engine (backend: engine) or the simulator as a digital twin (backend: "
        "sim, placeholder tokens at simulated times). docs/serving.md",
    )
    ap.add_argument("config", help="experiment YAML (its trace is not read)")
    ap.add_argument("--policy", help="the policies entry to serve, by label or name "
                    "(default: the first)")  # fmt: skip
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    ap.add_argument("--speed", type=float, default=1.0,
                    help="sim only: the twin's clock runs this many times faster than the "
                    "wall clock (default 1)")  # fmt: skip
    ap.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                    help="requests waiting for admission past which new ones get 503 "
                    f"(default {DEFAULT_MAX_WAITING})")  # fmt: skip
    ap.add_argument("--model-name", help="the model name of the API (default: the YAML's "
                    "model, or the engine's model folder name)")  # fmt: skip
    ap.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        if not (args.speed > 0 and args.speed < float("inf")):
            raise UserError(f"--speed: expected a number > 0, got {args.speed}")
        if args.max_waiting < 1:
            raise UserError(f"--max-waiting: expected an integer >= 1, got {args.max_waiting}")
        if not 0 <= args.port < 65536:
            raise UserError(f"--port: expected 0..65535, got {args.port}")
        if is_sweep(read_yaml(args.config)[1]):
            raise UserError(
                "sched-lab serve serves one experiment, and this YAML is a sweep (sweep: or "
                "search:); run it with sched-lab run, or serve a YAML without those keys"
            )
        served = build(load_config(args.config), args.policy, args.model_name, args.speed)
    except UserError as e:
        msg = str(e)
        if not msg.startswith((args.config, str(Path(args.config).expanduser().resolve()))):
            msg = f"{args.config}: {msg}"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    server = Server(served, args.speed, args.max_waiting)
    try:
        return asyncio.run(_serve(server, args.host, args.port))
    except OSError as e:  # the port is taken, the address is not ours
        print(f"error: --host/--port: cannot listen on {args.host}:{args.port} ({e.strerror})",
              file=sys.stderr)  # fmt: skip
        return 2


async def _serve(server: Server, host: str, port: int) -> int:
    """Listen until SIGTERM or SIGINT; then refuse new requests, let those in flight end,
    stop (0). A second signal while they run ends them now (finish ``abort``, the stream's
    error object) and stops (128 + its number). Prints ``serving MODEL on
    http://HOST:PORT`` once listening."""
    server._aio = aio = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals: list[int] = []

    def on_signal(sig: int) -> None:
        signals.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, on_signal, sig)
    runner = web.AppRunner(server.app(), handle_signals=False, access_log=None,
                           handler_cancellation=True)  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    server.loop.start()
    s = server.served
    print(f"serving {server.model} ({s.cfg.backend}, policy {s.policy.label}) on "
          f"http://{host}:{bound}", flush=True)  # fmt: skip
    await stop.wait()
    server.draining = True
    stop.clear()
    log.info("stopping: %d requests in flight to finish first%s", server.in_flight,
             " (a second signal ends them now)" if server.in_flight else "")  # fmt: skip
    deadline, forced = time.monotonic() + DRAIN_TIMEOUT_S, 0
    while server.in_flight and time.monotonic() < deadline and not server.loop.failure:
        if stop.is_set() and not forced:  # a second signal: end the requests in flight, as aborted
            forced = signals[-1]
            n, name = server.in_flight, signal.Signals(forced).name
            print(f"error: a second {name}: stopping with {n} requests in flight (they end "
                  "with finish_reason abort)", file=sys.stderr, flush=True)  # fmt: skip
            await asyncio.to_thread(server.loop.stop)  # each handler gets its end, answers
            deadline = min(deadline, time.monotonic() + FORCED_STOP_S)
            stop.clear()
        await asyncio.sleep(0.05)
    await runner.cleanup()
    server.loop.stop()
    return 128 + forced if forced else 0
