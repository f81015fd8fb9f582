"""N concurrent streaming clients against the simulator served as a digital twin, on localhost.

Starts ``sched-lab serve CONFIG`` (unless ``--url`` names a running server), opens ``--clients``
streaming completions at once (aiohttp), each asking for exactly ``--max-tokens`` tokens
(``ignore_eos``) after a prompt of ``--prompt-words`` words, and checks that nothing is lost:
every request answered 200, with all its tokens, a finish reason and ``[DONE]``. Prints the
requests per second (wall clock, first request sent to last answer) and client-side TTFT
p50 / p99 (request sent to the first token's chunk), then the server's vLLM metrics.

    python benchmarks/serve_load.py                      # 1000 clients, quickstart's H200 twin
    python benchmarks/serve_load.py --clients 200 --speed 10

Exit status 1 if a request was lost or short.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0


async def one(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> dict:
    """One streamed completion: its status, tokens, finish reason, TTFT and end (seconds)."""
    t0 = time.perf_counter()
    out = {"status": 0, "tokens": 0, "finish": None, "done": False, "ttft_s": None, "error": ""}
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(timeout_s)) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = (await resp.text())[:200]
                return out
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    out["done"] = True
                    break
                choice = json.loads(data)["choices"][0]
                if choice["text"]:
                    if out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    out["tokens"] += choice["text"].count(" tok")
                out["finish"] = choice["finish_reason"] or out["finish"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["end_s"] = time.perf_counter()
    return out


async def load(url: str, clients: int, prompt_words: int, max_tokens: int, timeout_s: float):
    body = {"prompt": "w " * prompt_words, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one(session, f"{url}/v1/completions", body, timeout_s) for _ in range(clients))
        )
        async with session.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    return t0, results, metrics


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-c", "from sched_lab.cli import main; raise SystemExit(main())",
           "serve", args.config, "--port", "0", "--speed", str(args.speed),
           "--max-waiting", str(args.clients + 1)]  # fmt: skip
    if args.policy:
        cmd += ["--policy", args.policy]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("serving "):
            print(line.strip())
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("error: the server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "experiments/quickstart.yaml"))
    ap.add_argument("--policy", help="the policies entry to serve (default: the first)")
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speed", type=float, default=1.0, help="the twin's clock factor")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        t0, results, metrics = asyncio.run(
            load(url, args.clients, args.prompt_words, args.max_tokens, args.timeout)
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    ok = [r for r in results if r["status"] == 200 and r["done"] and r["finish"] == "length"
          and r["tokens"] == args.max_tokens]  # fmt: skip
    lost = len(results) - len(ok)
    wall = max(r["end_s"] for r in results) - t0
    ttft = np.array([r["ttft_s"] for r in ok]) * 1e3
    print(f"{args.clients} clients, {args.prompt_words}-word prompts, {args.max_tokens} tokens "
          f"each, speed {args.speed:g}")  # fmt: skip
    print(f"answered whole: {len(ok)} / {len(results)} (lost or short: {lost})")
    print(f"wall {wall:.2f} s: {len(ok) / wall:.1f} requests/s, "
          f"{len(ok) * args.max_tokens / wall:.0f} tokens/s")  # fmt: skip
    if len(ttft):
        print(
            f"client TTFT p50 {np.percentile(ttft, 50):.1f} ms, p99 {np.percentile(ttft, 99):.1f} ms"
        )
    for line in metrics.splitlines():
        if line.startswith(("vllm:num_requests", "vllm:kv_cache", "vllm:num_preemptions_total",
                            "vllm:request_success_total", "vllm:generation_tokens_total")):  # fmt: skip
            print("  " + line)
    for r in results:
        if r not in ok:
            print(f"  lost: {r}")
            break
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
