"""sched-lab bench against a fake OpenAI-compatible streaming server (aiohttp, localhost,
a free port), and sched-lab compare on hand-made results folders.

The fake server streams ``max_tokens`` placeholder tokens as SSE chunks and a usage chunk
(prompt tokens: the prompt's words + 1, as a tokenizer adding BOS would count). It answers
400 to prompts longer than :data:`TOO_LONG` words and stalls on ``max_tokens ==``
:data:`STALL`, so those requests are the aborted ones; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pandas as pd
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web

from sched_lab.client import bench, compare, http

TOO_LONG = 1000  # words: the fake server answers 400
STALL = 7  # max_tokens: the fake server never answers (the client's --timeout ends it)
CUT = 9  # max_tokens: the fake server ends the stream after 2 chunks, without [DONE]


class FakeServer:
    """An OpenAI-compatible streaming server in a thread of its own. ``peak``: the most
    streams open at once; ``hold``: the first streams wait (at most 5 s) until that many are
    open at once, the later ones not."""

    def __init__(self, hold: int = 0, usage: dict | None = None, chunk: bytes = b"") -> None:
        self.hold, self.usage, self.chunk = hold, usage, chunk
        self.open = self.peak = 0
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.enough = asyncio.Event()
        self.stop = asyncio.Event()
        self.ready.set()
        self.loop.run_until_complete(self.stop.wait())
        self.loop.run_until_complete(self.runner.cleanup())

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        words = len(prompt.split())
        if words > TOO_LONG:
            return web.json_response(
                {"error": {"message": f"prompt of {words} tokens is too long", "code": 400}},
                status=400,
            )
        if body["max_tokens"] == STALL:
            await asyncio.sleep(2)  # past the client's timeout; the server stays bounded
            return web.json_response({"error": {"message": "late"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            if self.hold:
                if self.open >= self.hold:
                    self.enough.set()
                await asyncio.wait_for(self.enough.wait(), 5)
            for _ in range(2 if body["max_tokens"] == CUT else body["max_tokens"]):
                piece = {"text": " tok"} if not chat else {"delta": {"content": " tok"}}
                chunk = {"choices": [{"index": 0, **piece, "finish_reason": None}]}
                data = self.chunk or json.dumps(chunk).encode()
                await resp.write(b"data: " + data + b"\n\n")
                await asyncio.sleep(0.001)
            if body["max_tokens"] == CUT:
                return resp
            usage = self.usage or {
                "prompt_tokens": words + 1,
                "completion_tokens": body["max_tokens"],
            }
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.open -= 1
        return resp

    def __enter__(self) -> FakeServer:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def azure_yaml(tmp_path, rows: list[tuple[int, int]], gap_s: float = 0.01) -> str:
    """An experiment YAML over an azure2023 CSV of (prompt, output) rows ``gap_s`` apart."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i, (p, o) in enumerate(rows):
        lines.append(f"2023-11-16 18:15:{i * gap_s:010.7f},{p},{o}")
    (tmp_path / "trace.csv").write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("name: exp\ntrace:\n  format: azure2023\n  path: trace.csv\n")
    return str(cfg)


def run_bench(cfg: str, server: FakeServer, out, *flags: str) -> int:
    argv = [cfg, "--base-url", server.url, "--out", str(out), "--no-progress", *flags]
    return bench.main(argv)


def test_bench_writes_a_results_folder_matching_the_trace(tmp_path, capsys):
    # Row 3 has 0 output tokens: the trace loader drops it (never sent, status dropped).
    rows = [(5, 3), (12, 1), (30, 4), (8, 0), (2, 6)]
    cfg = azure_yaml(tmp_path, rows)
    out = tmp_path / "served"
    with FakeServer() as server:
        assert run_bench(cfg, server, out) == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req["request_id"]) == [0, 1, 2, 3, 4]
    assert list(req["status"]) == ["finished"] * 3 + ["dropped", "finished"]
    assert list(req["prompt_tokens"]) == [5, 12, 30, 8, 2]
    assert list(req["output_tokens"]) == [3, 1, 4, 0, 6]
    assert list(req["num_generated_tokens"]) == [3, 1, 4, 0, 6]
    assert list(req["server_prompt_tokens"].fillna(-1)) == [6, 13, 31, -1, 3]  # words + BOS
    assert req["policy"].unique().tolist() == ["served"]
    # Prompts of the trace's lengths, output pinned by max_tokens and ignore_eos.
    sent = sorted((len(b["prompt"].split()), b["max_tokens"]) for b in server.bodies)
    assert sent == sorted((p, o) for p, o in rows if o)
    assert all(b["ignore_eos"] and b["stream_options"]["include_usage"] for b in server.bodies)
    # The trace's arrival order is honoured: 10 ms apart, sent in that order.
    sent_s = req.loc[req["status"] != "dropped", "arrival_s"].to_numpy()
    assert (sent_s[1:] >= sent_s[:-1]).all()
    fin = req[req["status"] == "finished"]
    assert (fin["ttft_s"] > 0).all() and (fin["e2e_s"] >= fin["ttft_s"]).all()
    assert fin["tpot_s"].isna().tolist() == [False, True, False, False]  # 1 token: no TPOT
    summary = json.loads((out / "summary.json").read_text())["served"]
    assert summary["num_prompts"] == 4 and summary["completed"] == 4
    assert summary["dropped"] == 1 and summary["failed"] == 0
    assert summary["server_prompt_tokens"] == 6 + 13 + 31 + 3
    assert summary["num_preemptions"] is None and summary["mean_kv_cache_usage"] is None
    assert summary["served"]["model"] == "fake-model"
    assert summary["p50_ttft_ms"] > 0 and summary["output_throughput"] > 0
    steps = pd.read_csv(out / "steps.csv")
    assert len(steps) == 0
    vllm = json.loads(next(out.glob("served-*qps-fake-model.json")).read_text())
    assert vllm["completed"] == 4 and vllm["total_output_tokens"] == 3 + 1 + 4 + 6
    assert vllm["backend"] == "openai"
    report = (out / "report.md").read_text()
    assert "A served run has no engine steps" in report
    assert "`steps.csv` (empty: no engine steps)" in report
    assert (out / "report.html").is_file() and (out / "latency_cdf.png").is_file()
    assert not (out / "over_time.png").exists()
    assert "4 of 4 requests finished" in capsys.readouterr().out


def test_errors_and_timeouts_are_recorded_aborted_with_reasons(tmp_path):
    rows = [(4, 2), (TOO_LONG + 1, 3), (6, STALL), (3, 2), (5, CUT)]
    cfg = azure_yaml(tmp_path, rows, gap_s=0.0)
    out = tmp_path / "served"
    with FakeServer() as server:
        assert run_bench(cfg, server, out, "--timeout", "0.5", "--endpoint", "chat") == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req["status"]) == ["finished", "aborted", "aborted", "finished", "aborted"]
    assert req.loc[1, "reason"] == f"HTTP 400: prompt of {TOO_LONG + 1} tokens is too long"
    assert req.loc[1, "http_status"] == 400
    assert req.loc[2, "reason"] == "timeout: no complete answer within 0.5 s (--timeout)"
    assert req.loc[4, "reason"] == "the stream ended before data: [DONE]"
    assert list(req["num_generated_tokens"]) == [2, 0, 0, 2, 2]  # the cut one: 2 received
    assert req.loc[[1, 2, 4], "ttft_s"].isna().all()
    summary = json.loads((out / "summary.json").read_text())["served"]
    assert (summary["completed"], summary["aborted"], summary["failed"]) == (2, 3, 3)
    assert "messages" in server.bodies[0]


def test_a_servers_odd_usage_counts_are_left_out(tmp_path):
    """Usage counts that are not non-negative integers (a float, a string, past int64) are
    left out, the chunks counted instead (was: a traceback after the replay, nothing
    written)."""
    odd = {"prompt_tokens": 5.5, "completion_tokens": "3",
           "prompt_tokens_details": {"cached_tokens": 10**30}}  # fmt: skip
    cfg = azure_yaml(tmp_path, [(4, 2), (5, 3)])
    out = tmp_path / "served"
    with FakeServer(usage=odd) as server:
        assert run_bench(cfg, server, out) == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req["status"]) == ["finished", "finished"]
    assert list(req["num_generated_tokens"]) == [2, 3]  # the chunks with text
    assert req["server_prompt_tokens"].isna().all() and req["num_cached_tokens"].isna().all()


@pytest.mark.parametrize(
    "chunk, why",
    [
        ({"choices": [{"delta": "t"}]}, 'choices[0].delta: expected an object, got "t"'),
        ({"choices": [{"delta": {"content": 5}}]}, "choices[0] content: expected a string, got 5"),
        ({"choices": [{"text": ["t"]}]}, 'choices[0] text: expected a string, got ["t"]'),
        ({"choices": "t"}, 'choices: expected a list of objects, got "t"'),
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError: maximum recursion depth exceeded"),
    ],
)
def test_a_chunk_of_the_wrong_shape_aborts_its_request(tmp_path, chunk, why):
    """A stream chunk not of OpenAI's shape, or nested past the recursion limit, ends its
    request as a bad chunk and the bench goes on (was: AttributeError, TypeError or
    RecursionError out of the replay, a traceback, nothing written)."""
    cfg = azure_yaml(tmp_path, [(4, 2)])
    out = tmp_path / "served"
    data = chunk if isinstance(chunk, bytes) else json.dumps(chunk).encode()
    with FakeServer(chunk=data) as server:
        assert run_bench(cfg, server, out) == 1  # none finished
    reason = pd.read_csv(out / "requests.csv").loc[0, "reason"]
    assert reason.startswith(f"bad stream chunk: {why}")
    assert http._chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""


def test_a_served_runs_duration_is_until_every_request_returned():
    """vLLM's benchmark duration runs until every request has returned, failed ones too: a
    finished request (3 chunks, last at 2 s) beside one that timed out at 10 s gives
    duration 10 s, request throughput 1 / 10 and output throughput 3 / 10 (was 2 s, 0.5
    and 1.5: the duration ended at the last finish)."""
    from sched_lab.client.measure import ServedRun, served_run
    from sched_lab.core.request import Request

    rows = [Request("a", 0.0, 4, 3), Request("b", 0.0, 4, 10)]
    measured = {
        "a": http.Measured("a", 0.0, [0.5, 1.0, 2.0], status="finished", completion_tokens=3),
        "b": http.Measured("b", 0.0, [0.5, 1.0], status="aborted", reason="timeout"),
    }
    run = ServedRun("x", "served", 1.0, {}, {"model": "m", "endpoint": "completions"})
    v = served_run(run, rows, measured, 10.0, {}, (50.0, 99.0)).vllm
    assert (v["duration"], v["completed"], v["failed"]) == (10.0, 1, 1)
    assert v["request_throughput"] == pytest.approx(0.1)
    assert v["output_throughput"] == pytest.approx(0.3)


def test_max_concurrency_is_honoured(tmp_path):
    """Eight requests at once with --max-concurrency 3: the server never sees more than
    three streams open, and (each stream waiting until three are open) sees three."""
    cfg = azure_yaml(tmp_path, [(4, 3)] * 8)
    out = tmp_path / "served"
    with FakeServer(hold=3) as server:
        assert run_bench(cfg, server, out, "--max-concurrency", "3", "--model", "fake-model") == 0
        peak = server.peak
    assert peak == 3
    req = pd.read_csv(out / "requests.csv")
    assert (req["status"] == "finished").all() and len(req) == 8
    served = json.loads((out / "summary.json").read_text())["served"]["served"]
    assert served["max_concurrency"] == 3 and served["arrivals"] == "max_concurrency"
    assert served["model"] == "fake-model"


def test_request_rate_replaces_the_arrivals(tmp_path):
    cfg = azure_yaml(tmp_path, [(4, 1)] * 3, gap_s=5.0)  # 10 s of trace, sent at once
    out = tmp_path / "served"
    with FakeServer() as server:
        assert run_bench(cfg, server, out, "--request-rate", "inf") == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req["scheduled_s"]) == [0.0, 0.0, 0.0]


def test_each_rate_scale_of_the_yaml_is_a_run(tmp_path, capsys):
    cfg = azure_yaml(tmp_path, [(4, 2)] * 3, gap_s=0.02)
    with open(cfg, "a") as f:
        f.write("  rate_scale: [1, 2]\n")
    out = tmp_path / "served"
    with FakeServer() as server:
        assert run_bench(cfg, server, out) == 0
    req = pd.read_csv(out / "requests.csv")
    assert list(req["policy"]) == ["served"] * 6
    assert list(req["rate_scale"]) == [1.0] * 3 + [2.0] * 3
    assert list(req["scheduled_s"]) == pytest.approx([0, 0.02, 0.04, 0, 0.01, 0.02])
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["served@x1", "served@x2"]
    assert (out / "latency_vs_load.png").is_file()
    # A served folder compares like any other: with itself, no error anywhere.
    capsys.readouterr()
    assert compare.main([str(out), str(out), "--run", "served@x2"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| served@x2"))
    assert row.count("0.0%") == 13


def test_a_signal_mid_replay_keeps_what_ended(tmp_path, capsys):
    """SIGTERM while request 1 stalls in flight and request 2 is not due yet: the results
    folder is written as partial results, every request with a status and a reason, exit
    143 (was: killed by the signal, nothing written)."""
    cfg = azure_yaml(tmp_path, [(4, 2), (6, STALL), (5, 3)], gap_s=1.0)
    out = tmp_path / "served"

    def signal_once_stalled(server: FakeServer) -> None:
        deadline = time.monotonic() + 10
        while len(server.bodies) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    with FakeServer() as server:
        threading.Thread(target=signal_once_stalled, args=(server,), daemon=True).start()
        t0 = time.monotonic()
        assert run_bench(cfg, server, out, "--timeout", "30") == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 1.9  # request 2 (due at 2 s) was never sent
        assert len(server.bodies) == 2
    req = pd.read_csv(out / "requests.csv")
    assert list(req["status"]) == ["finished", "aborted", "aborted"]
    assert list(req["reason"].fillna("")) == [
        "",
        "interrupted by SIGTERM in flight",
        "interrupted by SIGTERM before it was sent",
    ]
    assert req.loc[2, "arrival_s"] == 2.0  # not sent: when it was due
    summary = json.loads((out / "summary.json").read_text())["served"]
    assert (summary["num_prompts"], summary["completed"], summary["failed"]) == (3, 1, 2)
    why = "interrupted by SIGTERM during run served (1 of 1 runs)"
    assert summary["partial"].startswith(why)
    assert f"**Partial results**: {why}" in (out / "report.md").read_text()
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"error: {why}; its requests that had not ended are aborted; wrote them to {out}/ "
        "as partial results"
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_a_signal_while_writing_lets_the_results_be_written(tmp_path, capsys, monkeypatch):
    """SIGTERM as the results are written, every request ended: the folder is written in
    full, exit 143 (was: "nothing written", every measurement lost)."""
    from sched_lab.report import folder

    write = folder.write_results

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(*args, **kwargs)

    monkeypatch.setattr(folder, "write_results", signalled)
    cfg = azure_yaml(tmp_path, [(4, 2), (5, 3)])
    out = tmp_path / "served"
    with FakeServer() as server:
        assert run_bench(cfg, server, out) == 128 + signal.SIGTERM
    summary = json.loads((out / "summary.json").read_text())["served"]
    assert summary["completed"] == 2 and "partial" not in summary
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: interrupted by SIGTERM while writing the results; all requests had ended "
        f"and {out}/ holds them in full"
    )


def test_bad_flags_are_one_line(tmp_path, capsys):
    cfg = azure_yaml(tmp_path, [(4, 1)])
    for flags, msg in (
        (["--max-concurrency", "0"], "--max-concurrency: expected a number > 0, got 0"),
        (["--burstiness", "2"], "--burstiness: only with --request-rate"),
    ):
        assert bench.main([cfg, "--base-url", "http://127.0.0.1:9", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {msg}") and err.count("\n") == 1
    assert bench.main([cfg, "--base-url", "127.0.0.1:9"]) == 2
    assert "--base-url: expected http://HOST:PORT" in capsys.readouterr().err


def test_rate_scale_with_workload_classes_is_one_line(tmp_path, capsys):
    """--rate-scale with workload classes is refused before any request (was: replayed at
    the classes' own rates, the results labelled with the flag's scale)."""
    azure_yaml(tmp_path, [(4, 1)])
    cfg = tmp_path / "classes.yaml"
    cfg.write_text("name: c\ntrace:\n  - {name: a, format: azure2023, path: trace.csv}\n")
    with FakeServer() as server:
        assert run_bench(str(cfg), server, tmp_path / "o", "--rate-scale", "10") == 2
        assert not server.bodies
    assert capsys.readouterr().err == (
        f"error: --rate-scale: {cfg} has workload classes (trace: as a list), each with its "
        "own rate_scale; set those, or use --request-rate\n"
    )
    assert not (tmp_path / "o").exists()


def test_no_server_is_one_line(tmp_path, capsys):
    cfg = azure_yaml(tmp_path, [(4, 1)])
    with FakeServer() as server:
        url = server.url  # a port that was free a moment ago, now closed
    for model in ([], ["--model", "m"]):  # checked before any request, model given or not
        assert bench.main([cfg, "--base-url", url, "--out", str(tmp_path / "o"), *model]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --base-url {url}: cannot connect (") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_a_model_the_server_does_not_list_is_one_line(tmp_path, capsys):
    cfg = azure_yaml(tmp_path, [(4, 1)])
    with FakeServer() as server:
        args = [cfg, "--base-url", server.url, "--model", "gpt-4", "--out", str(tmp_path / "o")]
        assert bench.main(args) == 2
        assert not server.bodies  # no request was sent
    err = capsys.readouterr().err
    assert err == f"error: --model gpt-4: not served by {server.url} (it serves: fake-model)\n"


def _folder(path, runs: dict) -> str:
    path.mkdir()
    (path / "summary.json").write_text(json.dumps(runs))
    return str(path)


def _summary(scale: float) -> dict:
    """A summary whose every compared statistic is ``scale`` x a round value."""
    out = {"completed": 10, "num_prompts": 10, "output_throughput": 1000.0 * scale}
    for m, base_ms in (("ttft", 100.0), ("tpot", 20.0), ("itl", 20.0), ("e2el", 2000.0)):
        for p, f in (("p50", 1.0), ("p90", 2.0), ("p99", 4.0)):
            out[f"{p}_{m}_ms"] = base_ms * f * scale
    return out


def test_compare_gives_hand_computed_errors(tmp_path, capsys):
    a = _folder(tmp_path / "a", {"fcfs": _summary(1.0), "sjf": _summary(2.0)})
    b_summary = _summary(1.0)
    b_summary["p50_ttft_ms"] = 104.0  # 4.0%: within the 5% target
    b_summary["p99_ttft_ms"] = 340.0  # |340 - 400| / 400 = 15.0%: past the 10% target
    b_summary["output_throughput"] = 980.0  # 2.0%
    b = _folder(tmp_path / "b", {"served": b_summary})
    out = tmp_path / "cmp.md"
    assert compare.main([a, b, "--run", "fcfs", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    table = [ln for ln in text.splitlines() if ln.startswith("| fcfs | served |")]
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert cells[2:5] == ["4.0%", "0.0%", "15.0% ✗"]  # TTFT p50, p90, p99
    assert cells[5:14] == ["0.0%"] * 9 and cells[14] == "2.0%"
    assert "| TTFT p99 (ms) | 400 | 340 | -15.0% |" in text
    assert "| output throughput (tok/s) | 1000 | 980 | -2.0% |" in text
    # sjf is twice fcfs: B (= fcfs but three cells) is 50% off almost everywhere
    assert compare.main([a, b, "--run", "sjf"]) == 0
    assert "| TTFT p90 (ms) | 400 | 200 | -50.0% |" in capsys.readouterr().out


def test_compare_notes_different_workloads_and_partial_runs(tmp_path, capsys):
    """Runs of another trace, request count or load, or a partial run, still compare, with
    a note under the title (was: the same table with no hint that the errors compare
    different loads)."""

    def run(sha: str, n: int, scale: float, **extra) -> dict:
        trace = {"path": "t.csv", "sha256": sha, "rows": n}
        return {**_summary(1.0), "num_prompts": n, "rate_scale": scale, "trace": trace, **extra}

    a = _folder(tmp_path / "a", {"fcfs": run("aa" * 32, 10, 1.0)})
    same = _folder(tmp_path / "same", {"served": run("aa" * 32, 10, 1.0)})
    assert compare.main([a, same]) == 0
    assert "**" not in capsys.readouterr().out
    why = "interrupted by SIGINT during run served (1 of 1 runs)"
    b = _folder(tmp_path / "b", {"served": run("bb" * 32, 4, 2.0, partial=why)})
    assert compare.main([a, b]) == 0
    text = capsys.readouterr().out
    assert (
        "**Different workloads** (trace, requests, rate scale): A replayed 10 requests of "
        "`t.csv` (sha256 aaaaaaaaaaaa) at rate scale 1.0, B 4 requests of `t.csv` (sha256 "
        "bbbbbbbbbbbb) at rate scale 2.0; the errors compare different loads."
    ) in text
    assert f"**B is a partial run**: {why}." in text


def test_compare_bad_input_is_one_line(tmp_path, capsys):
    a = _folder(tmp_path / "a", {"fcfs": _summary(1.0), "sjf": _summary(1.0)})
    b = _folder(tmp_path / "b", {"served": _summary(1.0)})
    assert compare.main([a, b]) == 2
    assert capsys.readouterr().err == (
        f"error: {a}/summary.json: holds runs fcfs, sjf; name one with --run\n"
    )
    assert compare.main([a, b, "--run", "x"]) == 2
    assert "--run x: not a run of" in capsys.readouterr().err
    assert compare.main([a, str(tmp_path / "none"), "--run", "fcfs"]) == 2
    assert "summary.json: cannot be read" in capsys.readouterr().err


def test_no_aiohttp_is_one_line(tmp_path, capsys, monkeypatch):
    import sys

    cfg = azure_yaml(tmp_path, [(4, 1)])
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp: ImportError
    assert bench.main([cfg, "--base-url", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == (
        "error: sched-lab bench needs aiohttp: pip install -e '.[serve]' in the lab's folder\n"
    )


def test_prompt_text_and_base_url():
    assert http.prompt_text(3) == "hello hello hello"
    assert http.base("http://h:8000/v1/") == "http://h:8000"
    assert http.Target("http://h:1", "m", "chat").url == "http://h:1/v1/chat/completions"
    assert http.error_message('{"error": {"message": "bad  max_tokens\\n"}}') == "bad max_tokens"
