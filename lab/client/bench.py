"""``sched-lab bench``: replay an experiment's trace against an OpenAI-compatible server
(this lab's, vLLM, SGLang) and write the results folder ``sched-lab run`` writes.

    sched-lab bench experiments/quickstart.yaml --base-url http://127.0.0.1:8000 --limit 200

When requests are sent (one of):

* the trace's arrival times, at the YAML's ``rate_scale`` (each load one run, as in
  ``sched-lab run``) or ``--rate-scale X``;
* ``--request-rate R [--burstiness B]``: vLLM's gamma arrivals (Poisson at B = 1; ``inf``:
  every request at once), drawn with the YAML's seed;
* ``--max-concurrency C`` alone: every request at once, at most C in flight (a closed loop);
  with either of the above it caps the requests in flight, as vLLM's option does.

Prompts are synthetic text of the trace's prompt lengths and ``max_tokens`` is the trace's
output length, with ``ignore_eos`` (lab/client/http.py). User errors are one line (exit 2).
SIGINT, SIGTERM or SIGHUP during a replay stop it: the loads replayed and the requests
that ended are written as partial results, the others aborted with the signal named
(exit 128 + the signal number); before any replay, nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sched_lab.client import http
from sched_lab.client.measure import ServedRun, served_run
from sched_lab.core.errors import OneLineParser, UserError
from sched_lab.core.request import Request, RequestStatus
from sched_lab.run.signals import StopSignals, stop_code, stop_name

EXAMPLE = """example:
  sched-lab serve experiments/quickstart.yaml &            # or vLLM, SGLang, ...
  sched-lab bench experiments/quickstart.yaml --base-url http://127.0.0.1:8000 --limit 200
  sched-lab run experiments/quickstart.yaml --limit 200 --out results/predicted
  sched-lab compare results/predicted results/quickstart_served

Results go to ./results/<name>_<policy-label> unless --out (docs/bench.md)."""


def parser(prog: str) -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog=prog,
        description="Replay an experiment's trace against an OpenAI-compatible endpoint "
        "and write a results folder like sched-lab run's.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLE,
    )
    ap.add_argument("config", help="experiment YAML (its trace:, slo: and report:)")
    ap.add_argument(
        "--base-url", required=True, help="the server, without /v1 (http://127.0.0.1:8000)"
    )
    ap.add_argument("--model", help="the model name to request (default: GET /v1/models' first)")
    ap.add_argument(
        "--policy-label",
        default="served",
        help="the run's name in the results (default: served), e.g. vllm-fcfs",
    )
    ap.add_argument("--out", help="results folder (default: ./results/<name>_<policy-label>)")
    ap.add_argument("--limit", type=int, help="send only the first N requests of the trace")
    when = ap.add_mutually_exclusive_group()
    when.add_argument(
        "--rate-scale", type=float, help="the trace's arrivals at X times its rate (one run)"
    )
    when.add_argument(
        "--request-rate",
        type=float,
        help="arrivals drawn at R requests/s (inf: all at once) instead of the trace's",
    )
    ap.add_argument(
        "--burstiness",
        type=float,
        help="with --request-rate: gamma shape (1: Poisson, the default; < 1 burstier)",
    )
    ap.add_argument(
        "--max-concurrency",
        type=int,
        help="at most C requests in flight; alone: every request at once, C at a time",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a request may take in all before it is aborted (default 300)",
    )
    ap.add_argument("--endpoint", choices=tuple(http.ENDPOINTS), default="completions")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None, prog: str = "sched-lab bench") -> int:
    """``sched-lab bench``'s entry point; returns the exit status (0; 1 when no request
    finished; 2 for bad input; 128 + the signal number when a signal stopped it)."""
    args = parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from sched_lab.report.folder import ResultsNotPlaced

    with StopSignals() as signals:  # SIGTERM and SIGHUP raise as SIGINT does
        try:
            return _bench(args, signals)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ResultsNotPlaced as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            print(f"error: interrupted by {stop_name(e)}; nothing written", file=sys.stderr)
            return stop_code(e)


def check_args(args: argparse.Namespace) -> None:
    """UserError naming the first flag out of range."""
    positive = ("limit", "max_concurrency", "rate_scale", "timeout", "burstiness")
    for flag in positive:
        v = getattr(args, flag)
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise UserError(f"--{flag.replace('_', '-')}: expected a number > 0, got {v:g}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise UserError(f"--request-rate: expected a number > 0 or inf, got {args.request_rate:g}")
    if args.burstiness is not None and args.request_rate is None:
        raise UserError("--burstiness: only with --request-rate (the gamma process's shape)")
    if not args.base_url.startswith(("http://", "https://")):
        raise UserError(f"--base-url: expected http://HOST:PORT, got {args.base_url!r}")


def _bench(args: argparse.Namespace, signals) -> int:
    """The command; ``signals`` (a StopSignals) defers a first signal while the
    results are written."""
    from sched_lab.config import load_config
    from sched_lab.config.trace import scale_label
    from sched_lab.report.folder import check_out_dir, write_results
    from sched_lab.report.terminal import summary_text

    check_args(args)
    http.require_aiohttp()
    try:
        cfg = load_config(args.config)
        if args.limit is not None:
            cfg = cfg.with_trace(limit=args.limit)
    except UserError as e:
        raise UserError(
            f"{args.config}: {e}" if not str(e).startswith(args.config) else e
        ) from None
    if cfg.trace.classes and args.rate_scale is not None:  # their arrivals are not rescaled
        raise UserError(
            f"--rate-scale: {args.config} has workload classes (trace: as a list), each with "
            "its own rate_scale; set those, or use --request-rate"
        )
    out = Path(args.out) if args.out else Path.cwd() / "results" / f"{cfg.name}_{args.policy_label}"
    out = check_out_dir(out)  # before any request: a folder in the way costs no replay
    model = http.check_model(args.base_url, args.model)
    target = http.Target(args.base_url, model, args.endpoint, args.timeout)
    loads = _loads(cfg, args)
    runs, stopped = [], None
    for scale, rows, info in loads:
        label = args.policy_label
        if len(loads) > 1:  # as ExperimentConfig.run_label names a load
            label += f"@x{scale_label(scale)}"
        run, stopped = _one_run(cfg, args, target, label, scale, rows, info)
        runs.append(run)
        if stopped is not None:
            break
    partial = None
    if stopped is not None:
        partial = (
            f"interrupted by {stopped.name} during run {runs[-1].label} ({len(runs)} of "
            f"{len(loads)} runs); its requests that had not ended are aborted"
        )
    signals.deferring = True  # a first signal lets the writing end; a second stops it
    write_results(out, cfg, runs, fmt="csv", bars=not args.no_progress, partial=partial)
    signals.deferring = False
    print(summary_text(runs, cfg.report.metric_percentiles))
    sent = sum(r.summary["num_prompts"] for r in runs)
    done = sum(r.summary["completed"] for r in runs)
    print(f"\nwrote {out}/ (report.md, report.html): {done} of {sent} requests finished")
    if stopped is not None:
        print(f"error: {partial}; wrote them to {out}/ as partial results", file=sys.stderr)
        return 128 + stopped.signum
    if signals.pending is not None:
        name = signal.Signals(signals.pending).name
        print(f"error: interrupted by {name} while writing the results; all requests had "
              f"ended and {out}/ holds them in full", file=sys.stderr)  # fmt: skip
        return 128 + signals.pending
    if done < sent:
        reasons = [
            f"{why} ({n})"
            for r in runs
            for why, n in r.requests.loc[r.requests["status"] == "aborted", "reason"]
            .value_counts()
            .head(3)
            .items()
        ]
        print(f"aborted: {'; '.join(reasons)} (requests.csv: status, reason)", file=sys.stderr)
    if sent and not done:
        print("error: no request finished", file=sys.stderr)
        return 1
    return 0


def _loads(cfg, args) -> list[tuple[float, list[Request], dict[str, Any]]]:
    """Per load: (rate_scale, the trace's requests with their send times as arrival_s,
    trace info). One load with --rate-scale, --request-rate or --max-concurrency alone."""
    from sched_lab.run.experiment import sha256_of, trace_info
    from sched_lab.traces import load_table, scale_table

    if cfg.trace.classes:
        from sched_lab.traces.classes import load_classes

        requests, n = load_classes(cfg.trace.classes, cfg.base_dir, cfg.seed, cfg.slo.ttft_s)
        tables = None
        info: dict[str, Any] = {"path": None, "sha256": None, "rows": n}
    else:
        before = sha256_of(cfg.trace.path)
        table, n = load_table({"seed": cfg.seed, **cfg.trace.spec}, cfg.base_dir)
        tables = table
        info = trace_info(cfg, n, before)
    closed = args.max_concurrency is not None and args.request_rate is args.rate_scale is None
    if args.rate_scale is not None:
        scales = (args.rate_scale,)
    elif args.request_rate is not None or closed or tables is None:
        scales = (1.0,)
    else:
        scales = cfg.rate_scales
    out = []
    for scale in scales:
        rows = requests if tables is None else scale_table(tables, scale).to_requests()
        if args.request_rate is not None or closed:
            _redraw_arrivals(rows, args.request_rate or math.inf, args.burstiness or 1.0, cfg.seed)
        out.append((scale, rows, info))
    return out


def _redraw_arrivals(rows: list[Request], rate: float, burstiness: float, seed: int) -> None:
    """Replace the replayed rows' arrival times with vLLM's gamma process (in trace order)."""
    from sched_lab.traces.arrivals import ArrivalProcess

    live = [r for r in rows if r.status is not RequestStatus.DROPPED]
    times = ArrivalProcess(rate, burstiness).sample(len(live), np.random.default_rng(seed))
    for r, t in zip(live, times):
        r.arrival_s = float(t)


def _one_run(cfg, args, target: http.Target, label: str, scale: float, rows, info):
    """(the Run of one load, the :class:`http.ReplayStopped` that cut it short or None)."""
    from sched_lab.report.progress import Phase

    live = [r for r in rows if r.status is not RequestStatus.DROPPED]
    sends = []
    for r in live:
        body = http.request_body(target, r.prompt_len, r.output_len)
        if r.priority:
            body["priority"] = r.priority  # vLLM's request field
        sends.append((r.request_id, r.arrival_s, body))
    mode = (
        "request_rate"
        if args.request_rate is not None
        else "max_concurrency"
        if args.max_concurrency is not None and args.rate_scale is None
        else "trace"
    )
    served = {
        "base_url": http.base(target.base_url),
        "model": target.model,
        "endpoint": target.endpoint,
        "arrivals": mode,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness if args.request_rate is not None else None,
        "max_concurrency": args.max_concurrency,
        "timeout_s": target.timeout_s,
    }
    stopped = None
    with Phase(f"{label}: {len(live):,} requests to {target.url}", len(live), "req",
               not args.no_progress) as phase:  # fmt: skip
        try:
            measured, wall_s = http.replay(target, sends, args.max_concurrency, phase.set)
        except http.ReplayStopped as e:
            stopped, measured, wall_s = e, e.measured, e.wall_s
    run = served_run(
        ServedRun(label, args.policy_label, scale, info, served),
        rows,
        {m.request_id: m for m in measured},
        wall_s,
        cfg.slo.to_dict(),
        cfg.report.metric_percentiles,
    )
    return run, stopped
