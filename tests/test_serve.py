"""``sched-lab serve``: a real server process on a free port of 127.0.0.1, over the simulator
(the digital twin) and over the engine with a tiny random model on the CPU; the official
``openai`` client and raw HTTP; concurrent clients; a client that leaves mid-stream; bad
requests; ``/metrics`` read with prometheus-client's parser; SIGTERM drains.

Every client call has a timeout; every server is killed in its fixture's teardown.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

pytest.importorskip("aiohttp", reason="needs the serve extra: pip install -e '.[serve,test]'")
pytest.importorskip("prometheus_client", reason="needs prometheus-client")
openai = pytest.importorskip("openai", reason="needs the openai client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TIMEOUT_S = 20.0  # any one client call
START_TIMEOUT_S = 60.0  # a server's start (the engine imports torch)
SIM_MAX_MODEL_LEN = 256
SERVE = "from sched_lab.cli import main; raise SystemExit(main())"


def sim_config(tmp_path, **scheduler) -> str:
    """A small simulated Qwen3-0.6B: 64 KV blocks of 16 tokens, 8 sequences."""
    raw = {
        "name": "serve_sim",
        "backend": "sim",
        "trace": {"format": "synthetic", "num_requests": 1},  # not read by serve
        "model": "qwen3-0.6b",
        "hardware": "h100-sxm",
        "kv_cache": {"block_size": 16, "num_gpu_blocks": 64},
        "scheduler": {"max_num_seqs": 8, "max_model_len": SIM_MAX_MODEL_LEN, **scheduler},
        "policies": ["fcfs", "priority"],
    }
    path = tmp_path / "serve_sim.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


class ServerProcess:
    """``sched-lab serve`` in a child process; ``url`` once it prints its address."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("serving "):
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        found.wait(START_TIMEOUT_S)
        start = [x for x in self.lines if x.startswith("serving ")]
        if not start:
            self.close()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self.url = start[0].split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=TIMEOUT_S,
                             max_retries=0)  # fmt: skip

    def request(self, method: str, path: str, body=None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = resp.status, resp.read()
        conn.close()
        return out

    def stream(self, body: dict):
        """POST ``body`` to /v1/completions and return the response, unread (its connection
        stays open while the test reads the stream)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        return conn.getresponse()

    def metrics(self) -> dict[str, float]:
        """Each sample's value by name and labels other than model_name."""
        status, body = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")  # fmt: skip
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_metrics(self, done, timeout_s: float = TIMEOUT_S) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if done(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory):
    # --speed 0.2: the twin's clock at a fifth of real time, so a long stream lasts seconds
    cfg = sim_config(tmp_path_factory.mktemp("serve"))
    server = ServerProcess([cfg, "--model-name", "twin", "--speed", "0.2"])
    yield server
    server.close()


def sse_events(body: bytes) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded, ``[DONE]`` kept as is."""
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------------- the digital twin


def test_openai_client_completion(sim_server):
    """Non-streamed: exactly max_tokens placeholder tokens; usage counts the prompt's words."""
    out = sim_server.client().completions.create(
        model="twin", prompt="one two three four", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == " tok" * 7
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        4, 7, 11,
    )  # fmt: skip


def test_openai_client_chat_stream_with_usage(sim_server):
    """Streamed chat: a role chunk, one chunk per token, the finish, then the usage chunk.
    The prompt without a chat template: ``user: hi there\\nassistant:`` = 4 words."""
    stream = sim_server.client().chat.completions.create(
        model="twin",
        messages=[{"role": "user", "content": "hi there"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 5
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 5)


def test_raw_http_stream_and_whole(sim_server):
    """Raw HTTP: SSE ``data:`` lines ending in ``[DONE]``; a token-id prompt; a chat answer."""
    status, body = sim_server.request(
        "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    )
    assert status == 200
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " tok" * 3
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    status, body = sim_server.request(
        "POST", "/v1/chat/completions",
        {"model": "twin", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2},
    )  # fmt: skip
    out = json.loads(body)
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": " tok tok"}
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    status, body = sim_server.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "twin"
    assert sim_server.request("GET", "/health")[0] == 200


def test_twenty_concurrent_clients(sim_server):
    """20 streams at once (8 run at a time, the rest wait): each gets its own count."""
    client = sim_server.client()

    def one(i: int) -> tuple[int, str, int]:
        stream = client.completions.create(
            model="twin", prompt="w " * (i + 1), max_tokens=i + 1, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return i, text, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for i, text, n in results:
        assert (text, n) == (" tok" * (i + 1), i + 1)


def test_disconnect_mid_stream_frees_blocks(sim_server):
    """A client that closes its connection after the first token: its request is aborted,
    its blocks return (KV use 0) and the queues empty."""
    before = sim_server.metrics()
    conn = http.client.HTTPConnection("127.0.0.1", sim_server.port, timeout=TIMEOUT_S)
    body = {"prompt": "x " * 10, "max_tokens": 240, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "  # the first chunk has come
    held = sim_server.metrics()
    assert held["vllm:kv_cache_usage_perc"] > 0 and held["vllm:num_requests_running"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    key = "vllm:request_success_total{finished_reason=abort}"
    m = sim_server.wait_metrics(
        lambda m: m.get(key, 0) > before.get(key, 0) and m["vllm:kv_cache_usage_perc"] == 0
    )
    assert m[key] == before.get(key, 0) + 1
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:generation_tokens_total"] < before["vllm:generation_tokens_total"] + 240


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", {"model": "gpt-x", "prompt": "a"}, 404, "model", "gpt-x"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -3}, 400, "max_tokens", ">= 1"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ("/v1/completions", {"prompt": "a " * 300}, 400, "prompt", "max_model_len"),
        ("/v1/completions", {"prompt": "a " * 200, "max_tokens": 100}, 400, "max_tokens",
         "300 tokens"),
        ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n", "n=1"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt", "token ids"),
        ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature", "number"),
        ("/v1/completions", {"prompt": "a", "stop": [1]}, 400, "stop", "strings"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content",
         "expected a string"),
        ("/v1/completions", [1, 2], 400, None, "JSON object"),
        # from a break-it pass: each was a 500
        ("/v1/completions", b'{"prompt": "hi \\ud800 there"}', 400, "prompt", "not UTF-8"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
         400, "messages", "not UTF-8"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
         "not valid JSON"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None,
         "RecursionError"),
        # from the second break-it pass: silently accepted, or the wrong status or name
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, "b"]}]}, 400, "messages[0].content[1]", "text part"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": 5}]}]}, 400, "messages[0].content[0].text", "a string"),
        ("/v1/completions", {"model": 5, "prompt": "a"}, 400, "model", "expected a string"),
        ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {
            "include_usage": "yes"}}, 400, "stream_options.include_usage", "true or false"),
        ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p", "[0, 1]"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", "[0, 2]"),
        ("/v1/completions", {"prompt": "a", "seed": 1.5}, 400, "seed", "integer"),
    ],
)  # fmt: skip
def test_bad_requests_are_openai_errors(sim_server, path, body, status, param, words):
    got, raw = sim_server.request("POST", path, body)
    err = json.loads(raw)["error"]
    assert got == status, err
    assert err["code"] == status and err["param"] == param
    assert words in err["message"] and "Traceback" not in err["message"]
    assert len(err["message"].splitlines()) == 1


def test_a_wrong_method_and_an_unknown_charset_are_client_errors(sim_server):
    got, raw = sim_server.request("GET", "/v1/completions")
    assert got == 405 and json.loads(raw)["error"]["type"] == "BadRequestError"
    conn = http.client.HTTPConnection("127.0.0.1", sim_server.port, timeout=TIMEOUT_S)
    headers = {"Content-Type": "application/json; charset=bogus"}
    conn.request("POST", "/v1/completions", b'{"prompt": "a"}', headers)
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 400 and "bogus" in err["message"]


def test_a_body_shorter_than_its_content_length_gets_408(tmp_path, monkeypatch):
    """A client that promises more bytes than it sends is answered once BODY_TIMEOUT_S has
    passed (in process, the timeout shortened), not held for ever."""
    import asyncio

    from aiohttp import web

    from sched_lab.config import load_config
    from sched_lab.serve import app as serve_app
    from sched_lab.serve.build import build

    monkeypatch.setattr(serve_app, "BODY_TIMEOUT_S", 0.2)
    server = serve_app.Server(build(load_config(sim_config(tmp_path)), None, "twin"), 1.0, 8)

    async def ask() -> bytes:
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b'application/json\r\nContent-Length: 100\r\n\r\n{"prompt": ')  # fmt: skip
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
            body = await asyncio.wait_for(reader.read(1000), TIMEOUT_S)
            writer.close()
            return head + body
        finally:
            await runner.cleanup()

    raw = asyncio.run(ask())
    assert raw.startswith(b"HTTP/1.1 408")
    err = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == 408 and "100 bytes" in err["message"]


def test_a_content_length_over_the_limit_gets_413_at_once(sim_server):
    """A Content-Length past MAX_BODY_BYTES is refused before the body is waited for (was:
    408 after BODY_TIMEOUT_S, 30 s, when the client sent less)."""
    import socket

    with socket.create_connection(("127.0.0.1", sim_server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000000000000\r\n\r\n{}")  # fmt: skip
        raw = b""
        while b"}}" not in raw:
            more = sock.recv(4096)
            assert more, raw
            raw += more
    assert raw.startswith(b"HTTP/1.1 413")
    err = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["message"] == (
        "the body is 1000000000000 bytes (its Content-Length); at most 67108864 are read"
    )


def test_openai_client_raises_on_unknown_model(sim_server):
    with pytest.raises(openai.NotFoundError):
        sim_server.client().completions.create(model="nope", prompt="a", max_tokens=1)


def test_metrics_parse_with_vllm_names(sim_server):
    sim_server.client().completions.create(model="twin", prompt="a b c", max_tokens=4)
    m = sim_server.metrics()
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):  # fmt: skip
        assert name in m, name
    assert m["vllm:generation_tokens_total"] >= 4
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert not any(k.startswith("vllm:spec_decode") for k in m)  # speculation is off


def test_sigterm_drains_in_flight_then_exits_0(tmp_path):
    """SIGTERM while a stream runs: the stream ends whole, new requests get 503, exit 0."""
    server = ServerProcess([sim_config(tmp_path), "--policy", "priority", "--speed", "0.2"])
    try:
        resp = server.stream({"prompt": "x", "max_tokens": 150, "stream": True, "priority": 1})
        assert resp.read(6) == b"data: "
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # answered until the signal is handled, then refused
            status, raw = server.request(
                "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}
            )
            if status == 503 or time.monotonic() > deadline:
                break
        assert status == 503 and "shutting down" in json.loads(raw)["error"]["message"]
        events = sse_events(b"data: " + resp.read())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        tokens = sum(1 for e in events[:-1] if e["choices"][0]["text"])
        assert tokens == 150
        assert server.proc.wait(TIMEOUT_S) == 0
    finally:
        server.close()


def test_a_second_sigterm_ends_the_streams_in_flight(tmp_path):
    """A second SIGTERM while a slow stream drains ends it at once (its last chunk the error
    object, then [DONE]) and the server exits 143 (was: ignored; the server ran on for as
    long as the stream took, up to DRAIN_TIMEOUT_S)."""
    server = ServerProcess([sim_config(tmp_path), "--speed", "0.02"])
    try:
        resp = server.stream({"prompt": "x", "max_tokens": 200, "stream": True})
        assert resp.read(6) == b"data: "
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        while server.request("POST", "/v1/completions", {"prompt": "a"})[0] != 503:
            assert time.monotonic() - t0 < TIMEOUT_S  # the first signal is handled
        server.proc.send_signal(signal.SIGTERM)
        events = sse_events(b"data: " + resp.read())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == "the request was aborted: the server is stopping"
        assert sum(1 for e in events[:-2] if e["choices"][0]["text"]) < 200
        assert server.proc.wait(TIMEOUT_S) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 10
        assert any(x.startswith("error: a second SIGTERM: stopping with 1 requests in flight")
                   for x in server.lines)  # fmt: skip
    finally:
        server.close()


def test_a_huge_prompt_does_not_stall_the_streams_in_flight(tmp_path):
    """A 20 MB prompt (10 M words, refused: over max_model_len) is parsed and tokenized off
    the event loop: a stream in flight keeps getting its chunks meanwhile (was: none for
    the ~1.5 s the server spent on it; each chunk comes every ~55 ms at --speed 0.05)."""
    server = ServerProcess([sim_config(tmp_path), "--speed", "0.05"])
    try:
        resp = server.stream({"prompt": "x", "max_tokens": 240, "stream": True})
        gaps, done = [], threading.Event()

        def read() -> None:
            last = time.monotonic()
            while not done.is_set():
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        huge = json.dumps({"prompt": "a " * 10_000_000, "max_tokens": 1}).encode()
        time.sleep(0.3)
        status, raw = server.request("POST", "/v1/completions", huge)
        done.set()
        reader.join(TIMEOUT_S)
        assert status == 400 and "10000000 tokens" in json.loads(raw)["error"]["message"]
        assert len(gaps) > 10 and max(gaps) < 0.9, max(gaps)
    finally:
        server.close()


def test_a_request_that_outgrows_the_kv_cache_ends_with_its_reason(tmp_path):
    """4 KV blocks of 16 tokens: a 50-word prompt with max_tokens 100 outgrows them while
    running alone and is aborted: a whole answer is 503 naming why, a stream's last chunk
    before [DONE] is the error object, with no usage chunk after it, and every token before
    it (was: the client hung until another request came; a stream then sent its usage
    after the error, and lost the tokens delivered together with the abort: 13 of 14)."""
    path = sim_config(tmp_path)
    raw = yaml.safe_load(open(path))
    raw["kv_cache"]["num_gpu_blocks"] = 4
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    server = ServerProcess([path])
    why = "the request was aborted: outgrew the KV cache: needs more than the 4 GPU blocks"
    try:
        body = {"prompt": "a " * 50, "max_tokens": 100}
        status, answer = server.request("POST", "/v1/completions", body)
        assert status == 503 and json.loads(answer)["error"]["message"].startswith(why)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        status, answer = server.request("POST", "/v1/completions", body)
        events = sse_events(answer)
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["message"].startswith(why)
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == " tok" * 14  # 64 tokens
    finally:
        server.close()


def test_server_full_answers_503(tmp_path):
    """One sequence at a time, one waiting allowed: a third request is refused with 503
    while the first runs and the second waits."""
    # --speed 0.01: the first request's 200 tokens would take seconds; it is still running
    server = ServerProcess(
        [sim_config(tmp_path, max_num_seqs=1), "--max-waiting", "1", "--speed", "0.01"]
    )
    try:
        conns = []
        for running, waiting in ((1, 0), (1, 1)):  # one at a time: the first is admitted
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
            body = {"prompt": "x", "max_tokens": 200, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            conns.append(conn)
            want = (running, waiting)
            m = server.wait_metrics(
                lambda m, want=want: (
                    (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == want
                )
            )
            assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == want
        status, raw = server.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1})
        err = json.loads(raw)["error"]
        assert status == 503 and "--max-waiting" in err["message"] and err["code"] == 503
    finally:
        server.close()


def test_readme_client_snippet_runs(sim_server, capsys):
    """The README's openai snippet, against the twin (its port in place of 8000)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    first = "# the official openai client (pip install openai) against the server started above"
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if b.startswith(first))
    exec(code.replace("127.0.0.1:8000", f"127.0.0.1:{sim_server.port}"), {})
    text, use = capsys.readouterr().out.splitlines()
    assert text == " tok" * 16
    assert "completion_tokens=16" in use and "prompt_tokens=4" in use  # user: Say hello assistant:


def test_bench_against_the_twin_matches_the_trace(sim_server, tmp_path):
    """``sched-lab bench`` (lab/client/) replays a trace against the twin: its results folder
    has every request finished with the trace's prompt and output token counts."""
    import pandas as pd

    from sched_lab.client import bench

    rows = [(5, 3), (12, 1), (30, 4), (2, 6), (9, 2)]
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i * 0.01:010.7f},{p},{o}" for i, (p, o) in enumerate(rows)]
    (tmp_path / "trace.csv").write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("name: exp\ntrace:\n  format: azure2023\n  path: trace.csv\n")
    out = tmp_path / "served"
    argv = [str(cfg), "--base-url", sim_server.url, "--out", str(out), "--no-progress"]
    assert bench.main(argv) == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req["status"]) == ["finished"] * 5
    assert list(req["output_tokens"]) == [o for _, o in rows]
    assert list(req["num_generated_tokens"]) == [o for _, o in rows]
    assert list(req["server_prompt_tokens"]) == [p for p, _ in rows]  # one word, one token


def test_stop_string_ends_output_before_it(sim_server):
    """``stop``: the text ends before the stop string (`` tok tok`` holds ``k t`` at 3);
    usage counts the tokens the answer used; streamed or not."""
    client = sim_server.client()
    out = client.completions.create(model="twin", prompt="a", max_tokens=50, stop=["k t"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (" to", "stop")
    assert out.usage.completion_tokens == 2
    chunks = list(client.completions.create(model="twin", prompt="a", max_tokens=50,
                                            stop="k t", stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == " to"
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--policy", "nope"], "--policy: no entry 'nope' in policies; the YAML has: fcfs"),
        (["--speed", "0"], "--speed: expected a number > 0"),
        (["--max-waiting", "0"], "--max-waiting: expected an integer >= 1"),
    ],
)
def test_bad_command_line_is_one_line(tmp_path, capsys, args, words):
    from sched_lab.serve import main

    assert main([sim_config(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_missing_extra_is_one_line(monkeypatch, capsys):
    """Without aiohttp the command names the extra to install, in one line."""
    import importlib.util

    from sched_lab.serve import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiohttp" else real(name, *a))  # fmt: skip
    assert main(["whatever.yaml"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "error: sched-lab serve needs aiohttp, not installed: pip install -e '.[serve]' in the "
        "lab's folder\n"
    )


# ---------------------------------------------------------------------- the loop, in-process


class FakeEngine:
    """Samples token 7 for requests named ``eos*``, else 1; steps take no time. With
    ``launch``/``wait`` for async scheduling (the tokens are known at launch here)."""

    wall_clock = True

    def execute(self, plan):
        from sched_lab.core.plan import StepResult

        samplers = [s.request for s in plan.prefill_seqs() if s.sample] + list(plan.decodes)
        return StepResult(0.0, {r: 7 if r.request_id.startswith("eos") else 1 for r in samplers})

    def launch(self, plan):
        return self.execute(plan)

    def wait(self, handle):
        return handle


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_loop_eos_ends_a_request_and_frees_its_blocks(asynchronous):
    """An EOS id (7) ends ``eos`` after its first token, finish "stop", with the EOS token
    counted; ``long`` runs to its 20 tokens; every block returns; no step runs after."""
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.serve.loop import ServingLoop, Stream
    from sched_lab.serve.metrics import ServeMetrics

    scheduler = get_policy("fcfs")(
        SchedulerLimits(4, 256, 128), make_block_manager(32, 0, 4), async_scheduling=asynchronous
    )
    events, done = [], threading.Event()

    def dispatch(batch):
        events.extend(batch)
        if sum(1 for e in events if e[2] is not None) == 2:
            done.set()

    loop = ServingLoop(scheduler, FakeEngine(), ServeMetrics("fake"), dispatch)
    streams = [
        Stream(Request("eos", 0.0, 5, 20, prompt_token_ids=[3] * 5), frozenset({7})),
        Stream(Request("long", 0.0, 6, 20, prompt_token_ids=[4] * 6), frozenset({7})),
    ]
    loop.start()
    try:
        for s in streams:
            loop.submit(s)
        assert done.wait(TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while scheduler.block_manager.num_used_gpu_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    by = {s.request.request_id: [e for e in events if e[0] is s] for s in streams}
    assert [t for e in by["eos"] for t in e[1]] == [7]
    assert by["eos"][-1][2] == "stop"
    assert [t for e in by["long"] for t in e[1]] == [1] * 20
    assert by["long"][-1][2] == "length"
    assert scheduler.block_manager.num_used_gpu_blocks == 0
    assert not scheduler.has_unfinished()
    samples = {
        (s.name, s.labels.get("finished_reason")): s.value
        for f in text_string_to_metric_families(loop.metrics.exposition().decode())
        for s in f.samples
    }
    assert samples[("vllm:request_success_total", "stop")] == 1
    assert samples[("vllm:generation_tokens_total", None)] == 21


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_request_aborted_while_planning_is_told_at_once(asynchronous):
    """A request alone that outgrows the KV cache (4 blocks of 4 tokens; 6 + 20 tokens) is
    aborted by the scheduler while it plans; its end reaches its handler at once, with the
    reason (was: held undelivered while the idle loop waited for another request, so its
    client hung)."""
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.serve.loop import ServingLoop, Stream
    from sched_lab.serve.metrics import ServeMetrics

    scheduler = get_policy("fcfs")(
        SchedulerLimits(4, 256, 128), make_block_manager(4, 0, 4), async_scheduling=asynchronous
    )
    events, done = [], threading.Event()

    def dispatch(batch):
        events.extend(batch)
        if any(e[2] is not None for e in events):
            done.set()

    loop = ServingLoop(scheduler, FakeEngine(), ServeMetrics("fake"), dispatch)
    stream = Stream(Request("big", 0.0, 6, 20, prompt_token_ids=[3] * 6))
    loop.start()
    try:
        loop.submit(stream)
        assert done.wait(5.0)
    finally:
        loop.stop()
    *tokens, end = events
    assert 0 < sum(len(e[1]) for e in tokens) <= 16 - 6  # at most what the 4 blocks held
    assert end[2] == "abort" and "KV" in end[3], end
    assert scheduler.block_manager.num_used_gpu_blocks == 0


def test_a_loop_that_is_never_idle_keeps_its_event_log_bounded(monkeypatch):
    """600 requests at once through 4 slots: the loop is never idle, so the idle reset of
    the scheduler's event log never runs; the log is renewed past MAX_EVENTS (200 here)
    instead (was: it grew with every request served, ~200 bytes each, without bound)."""
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy
    from sched_lab.serve import loop as serve_loop
    from sched_lab.serve.metrics import ServeMetrics

    monkeypatch.setattr(serve_loop, "MAX_EVENTS", 200, raising=False)
    scheduler = get_policy("fcfs")(SchedulerLimits(4, 256, 128), make_block_manager(64, 0, 4))
    sizes, done = [], threading.Event()
    ended = 0

    def dispatch(batch):
        nonlocal ended
        log_ = scheduler.events
        sizes.append(len(log_) + len(log_.waits))
        ended += sum(1 for e in batch if e[2] is not None)
        if ended == 600:
            done.set()

    loop = serve_loop.ServingLoop(scheduler, FakeEngine(), ServeMetrics("m"), dispatch)
    for i in range(600):  # all in the first intake
        loop.submit(serve_loop.Stream(Request(f"r{i}", 0.0, 6, 10, prompt_token_ids=[3] * 6)))
    loop.start()
    try:
        assert done.wait(TIMEOUT_S)
    finally:
        loop.stop()
    assert max(sizes) < 300, max(sizes)  # 200 and one step's (was: ~750)


def serve_in_process(scheduler, executor, requests, metrics=None, speed=1.0, stop_ids=()):
    """Run ``requests`` through a ServingLoop (no HTTP); returns each one's events in order
    and the metrics' samples by (name, finished_reason)."""
    from sched_lab.serve.loop import ServingLoop, Stream
    from sched_lab.serve.metrics import ServeMetrics

    metrics = metrics or ServeMetrics("m")
    events, done = [], threading.Event()

    def dispatch(batch):
        events.extend(batch)
        if sum(1 for e in events if e[2] is not None) == len(requests):
            done.set()

    loop = ServingLoop(scheduler, executor, metrics, dispatch, speed)
    streams = [Stream(r, frozenset(stop_ids)) for r in requests]
    for s in streams:  # all in the first intake
        loop.submit(s)
    loop.start()
    try:
        assert done.wait(TIMEOUT_S)
    finally:
        loop.stop()
    samples = {
        (x.name, x.labels.get("finished_reason")): x.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for x in f.samples
    }
    return {s.request.request_id: [e for e in events if e[0] is s] for s in streams}, samples


@pytest.mark.parametrize("feature", ["async", "spec"])
def test_twin_with_async_scheduling_or_speculation(tmp_path, feature):
    """The twin built from a YAML (lab/serve/build.py) with async scheduling, or with
    synthetic speculation (its counters appear): every request gets exactly its tokens."""
    from sched_lab.config import load_config
    from sched_lab.core.request import Request
    from sched_lab.serve.build import build
    from sched_lab.serve.metrics import ServeMetrics

    raw = yaml.safe_load(open(sim_config(tmp_path)))
    if feature == "async":
        raw["scheduler"]["async_scheduling"] = True
    else:
        raw["speculative"] = {"method": "synthetic", "num_speculative_tokens": 2,
                              "acceptance_rates": [0.8, 0.6], "seed": 0}  # fmt: skip
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(raw))
    served = build(load_config(tmp_path / "f.yaml"), None, None, 100.0)
    assert served.scheduler.async_scheduling is (feature == "async")
    requests = [Request(f"r{i}", 0.0, 10 + i, 5 + 3 * i, prompt_token_ids=[i] * (10 + i))
                for i in range(12)]  # fmt: skip
    metrics = ServeMetrics("m", speculative=feature == "spec")
    by, samples = serve_in_process(served.scheduler, served.executor, requests, metrics, 100.0)
    for i in range(12):
        assert sum(len(e[1]) for e in by[f"r{i}"]) == 5 + 3 * i
        assert by[f"r{i}"][-1][2] == "length"
    assert samples[("vllm:request_success_total", "length")] == 12
    assert samples[("vllm:generation_tokens_total", None)] == sum(5 + 3 * i for i in range(12))
    assert served.scheduler.block_manager.num_used_gpu_blocks == 0
    if feature == "spec":
        accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
        assert 0 < accepted <= samples[("vllm:spec_decode_num_draft_tokens_total", None)]


def test_priority_policy_orders_waiting_requests():
    """priority, one sequence at a time: of three requests handed in together, the lowest
    priority value is served first (vLLM's convention), ties by arrival."""
    from sched_lab.core.kv import make_block_manager
    from sched_lab.core.request import Request
    from sched_lab.core.scheduler import SchedulerLimits
    from sched_lab.policies import get_policy

    scheduler = get_policy("priority")(SchedulerLimits(1, 256, 128), make_block_manager(32, 0, 4))
    requests = [Request(name, 0.0, 4, 3, prompt_token_ids=[2] * 4, priority=p)
                for name, p in (("a", 3), ("b", 5), ("c", 1))]  # fmt: skip
    order = []
    engine = FakeEngine()
    execute = engine.execute

    def recording(plan):
        order.extend(r.request_id for r in plan.prefills)
        return execute(plan)

    engine.execute = recording
    serve_in_process(scheduler, engine, requests)
    assert order == ["c", "a", "b"]


# ---------------------------------------------------------------------- the engine (CPU)


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine]'")
    from sched_lab.backend.tools.random_checkpoint import write_random_checkpoint

    tiny = {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }  # fmt: skip
    root = tmp_path_factory.mktemp("serve_engine")
    write_random_checkpoint(tiny, root / "tiny", dtype="float32", std=0.2)
    raw = {
        "name": "serve_engine",
        "backend": "engine",
        "trace": {"format": "synthetic", "num_requests": 1},
        "engine": {
            "model_path": str(root / "tiny"),
            "device": "cpu",
            "dtype": "float32",
            "attention_backend": "torch",
            "num_threads": 1,
        },  # fmt: skip
        "kv_cache": {"block_size": 4, "num_gpu_blocks": 64, "swap_space_gib": 0.001},
        "scheduler": {"max_num_seqs": 4, "max_model_len": 64},
        "policies": ["fcfs"],
    }
    (root / "engine.yaml").write_text(yaml.safe_dump(raw))
    server = ServerProcess([str(root / "engine.yaml")])
    yield server
    server.close()


def test_engine_greedy_tokens_streamed_and_whole(engine_server):
    """The tiny random model (no tokenizer): token-id prompts; the streamed ids equal the
    whole answer's (greedy), max_tokens of them; text prompts are refused naming the field."""
    client = engine_server.client()
    whole = client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5], max_tokens=6,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.usage.completion_tokens == 6 and whole.usage.prompt_tokens == 5
    ids = whole.choices[0].text.split()
    assert len(ids) == 6 and all(0 <= int(i) < 256 for i in ids)
    stream = client.completions.create(model="tiny", prompt=[1, 2, 3, 4, 5], max_tokens=6,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices).split() == ids
    assert chunks[-1].usage.completion_tokens == 6
    status, raw = engine_server.request("POST", "/v1/completions", {"prompt": "hello"})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "prompt" and "token ids" in err["message"]
    status, raw = engine_server.request("POST", "/v1/completions", {"prompt": [300]})
    assert status == 400 and "vocabulary" in json.loads(raw)["error"]["message"]


def test_engine_per_request_sampling(engine_server):
    """temperature, top_p and seed apply per request (the YAML's engine.temperature is 0):
    temperature 0 and top_p 1e-6 give the greedy tokens; a seed gives the same tokens again,
    alone or beside concurrent requests; another seed other tokens."""
    client = engine_server.client()

    def ids(**sampling) -> list[str]:
        out = client.completions.create(model="tiny", prompt=[7, 8, 9, 10], max_tokens=8,
                                        extra_body={"ignore_eos": True}, **sampling)  # fmt: skip
        return out.choices[0].text.split()

    greedy = ids()
    assert ids(temperature=0) == greedy
    assert ids(temperature=1.0, top_p=1e-6) == greedy
    seeded = ids(temperature=1.0, seed=2024)
    assert seeded != greedy and ids(temperature=1.0, seed=2024) == seeded
    with ThreadPoolExecutor(4) as pool:
        mates = [pool.submit(ids, temperature=1.0) for _ in range(3)]
        again = pool.submit(ids, temperature=1.0, seed=2024)
        assert again.result() == seeded and all(len(m.result()) == 8 for m in mates)
    assert ids(temperature=1.0, seed=2025) != seeded


def test_chat_max_completion_tokens_null_falls_back_to_max_tokens():
    """A chat body with ``max_completion_tokens: null`` and ``max_tokens: 5`` asks for 5
    tokens, as vLLM reads it (was: None, i.e. up to max_model_len); the newer field wins
    when both are set."""
    from sched_lab.serve.protocol import parse

    msgs = [{"role": "user", "content": "hi"}]
    assert parse({"messages": msgs, "max_completion_tokens": None, "max_tokens": 5}, True,
                 "m").max_tokens == 5  # fmt: skip
    assert parse({"messages": msgs, "max_completion_tokens": 3, "max_tokens": 5}, True,
                 "m").max_tokens == 3  # fmt: skip
    assert parse({"messages": msgs}, True, "m").max_tokens is None


def test_whole_number_floats_are_integers():
    """``max_tokens: 3.0`` asks for 3 tokens and ``seed: 7.0`` is seed 7, as vLLM's
    pydantic fields take them (was: 400 "expected an integer"); 2.5 and 1e400 (inf) stay
    400s naming the field."""
    from sched_lab.serve.protocol import ApiError, parse

    got = parse({"prompt": "a", "max_tokens": 3.0, "seed": 7.0, "priority": -2.0}, False, "m")
    assert (got.max_tokens, got.seed, got.priority) == (3, 7, -2)
    assert type(got.max_tokens) is int and type(got.seed) is int
    for bad in (2.5, float("inf"), float("nan")):
        with pytest.raises(ApiError, match="^max_tokens: expected an integer") as e:
            parse({"prompt": "a", "max_tokens": bad}, False, "m")
        assert e.value.param == "max_tokens" and e.value.status == 400
    with pytest.raises(ApiError, match="^max_tokens: expected an integer >= 1, got 0$"):
        parse({"prompt": "a", "max_tokens": 0.0}, False, "m")


def test_an_empty_model_name_is_the_served_model(sim_server):
    """``"model": ""`` asks for the served model, as vLLM takes it (was: 404, "The model ``
    does not exist.")."""
    status, raw = sim_server.request(
        "POST", "/v1/completions", {"model": "", "prompt": "a", "max_tokens": 2}
    )
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["model"] == "twin" and answer["choices"][0]["text"] == " tok tok"


def test_sampling_params_under_speculation_must_be_the_yamls():
    """Speculative decoding samples every request at engine.temperature: a request that
    asks for another temperature, a top_p or a seed is refused naming the field; the
    twin (placeholder tokens) takes them all."""
    import types

    from sched_lab.core.request import SamplingParams
    from sched_lab.serve.app import Server
    from sched_lab.serve.protocol import ApiError, parse

    def params(served, **fields):
        return Server._sampling_params(
            types.SimpleNamespace(served=served), parse({"prompt": "a", **fields}, False, "m")
        )

    cfg = types.SimpleNamespace(engine=types.SimpleNamespace(temperature=0.5))
    spec = types.SimpleNamespace(speculative=object())
    engine = types.SimpleNamespace(cfg=cfg, policy=spec, samples_tokens=True)
    assert params(engine) is None and params(engine, temperature=0.5) == SamplingParams(0.5)
    for key, value in (("temperature", 1.0), ("top_p", 0.9), ("seed", 3)):
        with pytest.raises(ApiError, match=f"^{key}: this server runs speculative") as e:
            params(engine, **{key: value})
        assert e.value.param == key and e.value.status == 400
    twin = types.SimpleNamespace(cfg=cfg, policy=spec, samples_tokens=False)
    assert params(twin, top_p=0.9, seed=3) == SamplingParams(None, 0.9, 3)


def test_engine_concurrent_clients(engine_server):
    client = engine_server.client()

    def one(i: int) -> int:
        out = client.completions.create(model="tiny", prompt=[i + 1] * (i + 2), max_tokens=i + 1)
        return out.usage.completion_tokens

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [1, 2, 3, 4, 5, 6]
    m = engine_server.wait_metrics(lambda m: m["vllm:kv_cache_usage_perc"] == 0)
    assert (m["vllm:num_requests_running"], m["vllm:kv_cache_usage_perc"]) == (0, 0)


def test_a_first_token_is_handed_over_before_the_loop_goes_on():
    """Server._dispatch_threadsafe: events with a request's first token are delivered with
    an event the loop thread waits on (set once they are queued); later tokens are not."""
    import asyncio
    import types

    from sched_lab.core.request import Request
    from sched_lab.serve.app import Server
    from sched_lab.serve.loop import Stream

    calls = []

    def call_soon_threadsafe(fn, *args):  # runs at once: the wait returns without waiting
        calls.append(args[1:])
        fn(*args)

    fake = types.SimpleNamespace(_aio=types.SimpleNamespace(
        is_closed=lambda: False, call_soon_threadsafe=call_soon_threadsafe))  # fmt: skip
    stream = Stream(Request("r", 0.0, 4, 5), context=asyncio.Queue())
    stream.sent = 2  # the loop counted the two tokens it hands over
    Server._dispatch_threadsafe(fake, [(stream, [7, 8], None, "")])
    stream.sent = 3
    Server._dispatch_threadsafe(fake, [(stream, [9], None, "")])
    assert [len(c) for c in calls] == [1, 0] and calls[0][0].is_set()
    got = [stream.context.get_nowait() for _ in range(2)]
    assert got == [([7, 8], None, ""), ([9], None, "")]


def test_tokens_queued_while_the_client_lags_go_out_as_one_chunk():
    """Server._events: token batches of several steps already queued when the handler takes
    one are merged into one text delta (as vLLM's output collector does for a slow consumer);
    the end and its reason come with the last."""
    import asyncio
    import types

    from sched_lab.core.request import Request
    from sched_lab.serve.app import Server
    from sched_lab.serve.loop import LENGTH, Stream
    from sched_lab.serve.text import PlaceholderText

    async def collect():
        stream = Stream(Request("r", 0.0, 4, 5), context=asyncio.Queue())
        fake = types.SimpleNamespace(served=types.SimpleNamespace(text=PlaceholderText()))
        for event in (([1], None, ""), ([2, 3], None, ""), ([4], None, "")):
            stream.context.put_nowait(event)
        out = []
        events = Server._events(fake, stream, types.SimpleNamespace(stop=()))
        out.append(await events.__anext__())  # the three queued batches at once
        stream.context.put_nowait(([5], LENGTH, ""))
        out.append(await events.__anext__())
        return out, stream.received

    (first, last), received = asyncio.run(collect())
    one = PlaceholderText().decode([0])
    assert first == (one * 4, None, "") and last == (one, LENGTH, "") and received == 5


def test_lora_adapters_are_models_of_the_twin(tmp_path):
    """With a ``lora:`` section, /v1/models lists the adapters (parent: the base model, as
    vLLM lists them); ``"model": "lora-1"`` runs with that adapter (vllm:lora loads on the
    twin: a completion finishes) and an adapter beyond num_adapters is a 404."""
    path = sim_config(tmp_path)
    raw = yaml.safe_load(open(path))
    raw["lora"] = {"max_loras": 1, "num_adapters": 2}
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    server = ServerProcess([path, "--model-name", "base", "--speed", "10"])
    try:
        status, body = server.request("GET", "/v1/models")
        assert status == 200
        cards = json.loads(body)["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [
            ("base", None),
            ("lora-0", "base"),
            ("lora-1", "base"),
        ]
        ask = {"model": "lora-1", "prompt": "hi there", "max_tokens": 3, "ignore_eos": True}
        status, body = server.request("POST", "/v1/completions", ask)
        assert status == 200, body
        answer = json.loads(body)
        assert answer["model"] == "lora-1" and answer["usage"]["completion_tokens"] == 3
        status, body = server.request("POST", "/v1/completions", {**ask, "model": "lora-2"})
        assert status == 404 and b"lora-2" in body
    finally:
        server.close()


def test_a_chat_template_that_refuses_the_messages_is_a_400(tmp_path):
    """A chat template's raise_exception (Llama's and Mistral's "roles must alternate") is
    a 400 naming messages, as vLLM answers it (was: jinja2's TemplateError, a 500)."""
    pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[engine]'")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sched_lab.serve.protocol import ApiError
    from sched_lab.serve.text import ModelText

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must "
        "alternate user/assistant') }}{% endif %}{% for m in messages %}{{ m['content'] }} "
        "{% endfor %}"
    )
    tokenizer.save_pretrained(tmp_path)
    text = ModelText(tmp_path, 2, frozenset())
    assert text.chat([{"role": "user", "content": "hi"}]) == [1]
    with pytest.raises(ApiError) as e:
        text.chat([{"role": "assistant", "content": "hi"}])
    assert (e.value.status, e.value.param) == (400, "messages")
    assert e.value.message == (
        "messages: the model's chat template refused them: Conversation roles must alternate "
        "user/assistant"
    )


def test_a_sweep_yaml_is_refused_in_one_line(capsys):
    """A sweep is many experiments; the server serves one: one line says so (exit 2)."""
    from pathlib import Path

    from sched_lab.serve.app import main

    path = str(Path(__file__).resolve().parent.parent / "experiments" / "multi_lora.yaml")
    assert main([path, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {path}: sched-lab serve serves one experiment, and this "
        "YAML is a sweep (sweep: or search:); run it with sched-lab run, or serve a YAML "
        "without those keys"
    )
