"""The ``sched-lab`` command: run an experiment, fit a cost model, profile the engine, tools.

    sched-lab run experiments/quickstart.yaml [--out DIR] [--limit N] [--format parquet]
    sched-lab explain results/quickstart --run fcfs --request 4711
    sched-lab report results/quickstart   (the plots of a run made with --no-plots)
    sched-lab run experiments/sweep_quick.yaml [--jobs N] [--ray | --ray-address ADDR]
    sched-lab fit h200_qwen3-0.6b --out /tmp/qwen3.fit.json
    sched-lab profile --model-dir checkpoints/qwen3-0.6b --out profiles/h200_qwen3-0.6b.csv
    sched-lab tools make-random-checkpoint --preset qwen3-0.6b --out checkpoints/qwen3-0.6b
    sched-lab prefix-bound experiments/mooncake.yaml
    sched-lab fidelity --sim
    sched-lab bench experiments/quickstart.yaml --base-url http://127.0.0.1:8000
    sched-lab compare results/quickstart results/quickstart_served
    sched-lab serve experiments/quickstart.yaml --policy chunked_prefill

``fit``, ``profile``, ``tools``, ``fidelity``, ``bench``, ``compare`` and ``serve`` hand their
arguments to ``sched_lab.sim.calibrated``, ``sched_lab.backend.profile``,
``sched_lab.backend.tools``, ``sched_lab.fidelity``, ``sched_lab.client`` and ``sched_lab.serve``
(``python -m`` of those still works); ``prefix-bound`` is :func:`prefix_bound` here. User
errors print one line, ``error: ...``, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from sched_lab import __version__
from sched_lab.core.errors import OneLineParser
from sched_lab.run.signals import Interrupted, StopSignals, stop_code, stop_name

# Where bundled data lives, in a checkout and in an installed copy alike: experiments/,
# traces/data/ and profiles/ are installed beside lab/ (pyproject.toml).
DEFAULT_CONFIG = "experiments/quickstart.yaml"
EXIT_CODES = """exit status:
  0    ok
  1    a run stopped early (its partial results are written), a sweep's point failed
       (the others' results are written), or the results could not be put in place
       (the message says where they are)
  2    bad input: one line, error: ..., naming the file, row or key (a run that
       refuses after others completed: theirs are written as partial results)
  130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM, 129 by SIGHUP: completed runs kept as
       partial results (a sweep keeps the points, or searches, that had finished)"""
RUN_EXAMPLE = """example:
  sched-lab run experiments/quickstart.yaml --limit 500 --out /tmp/quick
  sched-lab run experiments/sweep_quick.yaml --jobs 2    # a sweep (docs/sweeps.md)

A config path that does not exist is looked up among the bundled ones, so the example
experiments run from any folder. Results go to ./results/<name> unless --out; an existing
folder there is replaced only if the lab wrote everything in it (.sched-lab-manifest.json)."""
DELEGATED = {  # subcommand: (module[:function, default main] taking (argv, prog), what it does)
    "fit": ("sched_lab.sim.calibrated", "fit the calibrated step-time model to an engine profile"),
    "profile": (
        "sched_lab.backend.profile",
        "time the engine over a grid of step shapes (needs torch)",
    ),
    "tools": (
        "sched_lab.backend.tools.__main__",
        "engine tools: make-random-checkpoint, make-random-lora, convert-smollm2, quantize, "
        "list-presets (needs torch)",
    ),
    "fidelity": (
        "sched_lab.fidelity",
        "held-out simulator fidelity: --engine (GPU: profile, runs, repeats), --sim (CPU: "
        "docs/fidelity.md)",
    ),
    "bench": (
        "sched_lab.client.bench",
        "replay an experiment's trace against an OpenAI-compatible server; a results folder",
    ),
    "compare": (
        "sched_lab.client.compare",
        "relative errors per metric of one results folder against another",
    ),
    "serve": ("sched_lab.serve", "an OpenAI-compatible server over the engine or the simulator"),
    "prefix-bound": (
        "sched_lab.cli:prefix_bound",
        "the infinite-cache upper bound of a trace's prefix hit rate, from its hash ids",
    ),
}
ENGINE_MODULES = {"torch", "triton", "transformers", "safetensors", "gguf", "accelerate"}


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30)


def _memory_guarded(fn):
    """``fn`` (an entry point returning an exit status), with MemoryError turned into one
    line and status 1: a run, sweep or trace larger than this machine's memory."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs) -> int:
        try:
            return fn(*args, **kwargs)
        except MemoryError:
            print(
                "error: out of memory: the trace, sweep or run is larger than this process "
                "may allocate (try trace.limit, fewer sweep points, or more memory)",
                file=sys.stderr,
            )
            return 1

    return guarded


@_memory_guarded
def main(argv: list[str] | None = None) -> int:
    """``sched-lab``'s entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    ap = OneLineParser(
        prog="sched-lab",
        description="An LLM-serving scheduler lab: run an experiment, "
        "fit a cost model, profile the engine, engine tools.",
        formatter_class=_formatter,
        epilog="examples:\n"
        + "\n".join(__doc__.split("\n\n")[1].splitlines())
        + "\n\n"
        + EXIT_CODES,
    )
    ap.add_argument("--version", action="version", version=f"sched-lab {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run an experiment YAML and write its results folder",
        description="Run an experiment YAML and write its results folder.",
        formatter_class=_formatter,
        epilog=f"{RUN_EXAMPLE}\n\n{EXIT_CODES}",
    )
    _add_run_args(run)
    explain = sub.add_parser(
        "explain",
        help="tell one request's life in a results folder: waits and why, chunks, preemptions",
        description="Print a request's life from a results folder's events.csv: when it "
        "waited and why, its admission and prefill chunks, decode spans, preemptions, "
        "swaps and its end.",
        formatter_class=_formatter,
    )
    explain.add_argument("results", help="a results folder (sched-lab run --out)")
    explain.add_argument("--request", required=True, help="the request id (requests.csv)")
    explain.add_argument("--run", help="the run's label (summary.json); needed with several")
    tl = sub.add_parser(
        "timeline",
        help="draw a Gantt picture of chosen requests of a results folder",
        description="Draw the timeline of chosen requests of a run (waiting, prefill chunks, "
        "decode, preempted, swapped out; step boundaries above) as a PNG.",
        formatter_class=_formatter,
    )
    tl.add_argument("results", help="a results folder (sched-lab run --out)")
    tl.add_argument("--run", help="the run's label (summary.json); needed with several")
    tl.add_argument("--requests", help="comma-separated request ids")
    tl.add_argument("--slowest", type=int, default=12, help="the N slowest (default 12)")
    tl.add_argument("--by", choices=("e2e", "ttft"), default="e2e", help="slowest by")
    tl.add_argument(
        "--window", type=float, nargs=2, metavar=("T0", "T1"), help="requests in flight then (s)"
    )
    tl.add_argument(
        "--out",
        help="the picture (.png, .pdf or .svg; default: in the results folder, "
        "timeline_<run>_<choice>.png, e.g. timeline_fcfs_slowest12_e2e.png)",
    )
    rep = sub.add_parser(
        "report",
        help="draw the plots of a results folder written with --no-plots",
        description="Draw the PNGs and interactive timelines of a results folder written "
        "with `sched-lab run --no-plots`, and rewrite its report.md and report.html as a run "
        "with plots writes them.",
        formatter_class=_formatter,
    )
    rep.add_argument("results", help="a results folder (sched-lab run --no-plots --out)")
    for name, (_, what) in DELEGATED.items():
        sub.add_parser(name, help=what, add_help=False)  # listed here, parsed by the module
    args = ap.parse_args(argv)
    if args.command in ("explain", "timeline"):
        return _explain(args)
    if args.command == "report":
        return _draw_report(Path(args.results))
    return _run(args)


def _explain(args: argparse.Namespace) -> int:
    from sched_lab.core.errors import UserError
    from sched_lab.report.timeline import explain, picture

    try:
        if args.command == "explain":
            print(explain(Path(args.results), args.request, args.run))
        else:
            ids = [x for x in (args.requests or "").split(",") if x]
            if args.slowest < 1:
                raise UserError(f"--slowest: expected an integer >= 1, got {args.slowest}")
            window = tuple(args.window) if args.window else None
            if window is not None and window[1] <= window[0]:
                raise UserError(f"--window: expected T0 < T1, got {window[0]:g} {window[1]:g}")
            out = Path(args.out) if args.out is not None else None
            print(picture(Path(args.results), out, args.run, ids, args.slowest, args.by,
                          window))  # fmt: skip
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _draw_report(folder: Path) -> int:
    """``sched-lab report RESULTS``: the plots of a --no-plots folder (lab/report/later.py)."""
    from sched_lab.core.errors import UserError
    from sched_lab.report.later import draw_later

    t0 = time.perf_counter()
    try:
        written = draw_later(folder)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pngs = sum(name.endswith(".png") for name in written)
    print(f"drew {pngs} PNGs into {folder}/ (report.md, report.html) in "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0


@_memory_guarded
def run_main(argv: list[str] | None = None, prog: str = "sched-lab run") -> int:
    """``sched-lab run`` alone (``run_experiment.py`` calls it); returns the exit status."""
    ap = OneLineParser(
        prog=prog,
        description="Run an experiment YAML and write its results folder.",
        formatter_class=_formatter,
        epilog=f"{RUN_EXAMPLE}\n\n{EXIT_CODES}",
    )
    _add_run_args(ap)
    return _run(ap.parse_args(argv))


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "config",
        nargs="?",
        default=DEFAULT_CONFIG,
        help=f"experiment YAML (default: {DEFAULT_CONFIG})",
    )
    ap.add_argument("--out", help="results folder (default: ./results/<name>)")
    ap.add_argument("--limit", type=int, help="replay only the first N requests of the trace")
    ap.add_argument(
        "--seeds",
        type=int,
        metavar="N",
        help="simulator: N replicas of every run (and sweep point) with step times drawn "
        "around the cost model's; tables show median [p5, p95] (the YAML's seeds:; "
        "docs/simulator.md, Bands)",
    )
    ap.add_argument(
        "--format",
        choices=("csv", "parquet"),
        default="csv",
        help="file format of requests and steps (parquet needs pyarrow)",
    )
    ap.add_argument(
        "--metric-percentiles",
        help="comma-separated percentiles of the vLLM-format results and the summary, as "
        "vLLM's option (default: the YAML's report.metric_percentiles, 50,90,99,99.9); of "
        "a sweep, every point's, and the latency columns of its table (default there: 50,99)",
    )
    ap.add_argument(
        "--no-plots",
        action="store_true",
        help="draw no PNG and no interactive timeline (report.md and report.html say so); "
        "the tables and summaries are the same; of a sweep, every point's (the sweep's own "
        "figures are drawn)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    ap.add_argument(
        "-q", "--quiet", action="store_true", help="log warnings only (no phase timing lines)"
    )
    sweep = ap.add_argument_group("sweeps (a YAML with sweep: or search:)")
    sweep.add_argument(
        "--jobs",
        type=int,
        help="points run at once in a local process pool (default: the CPU count; 1: serially)",
    )
    sweep.add_argument(
        "--max-points",
        type=int,
        metavar="N",
        help="accept a sweep of up to N points, at most 1000000 (default: the YAML's "
        "sweep.max_points, else 10000)",
    )
    where = sweep.add_mutually_exclusive_group()
    where.add_argument("--ray", action="store_true", help="run the points on a local Ray")
    where.add_argument(
        "--ray-address", metavar="ADDR", help="run the points on the Ray cluster at ADDR"
    )


def _delegate(command: str, argv: list[str]) -> int:
    module_name, _, function = DELEGATED[command][0].partition(":")
    try:
        module = importlib.import_module(module_name)
        extra = {}
        if command == "fit":  # the fit compares the profile with this checkout's engine sources
            from sched_lab.backend.sources import checkout_engine

            extra["engine"] = checkout_engine()
        run = getattr(module, function or "main")
        if command != "tools":
            return run(argv, prog=f"sched-lab {command}", **extra) or 0
        with StopSignals():  # a signal stops a tool as Ctrl-C does: its cleanup runs
            try:
                return run(argv, prog=f"sched-lab {command}", **extra) or 0
            except KeyboardInterrupt as e:
                tool = " ".join(["sched-lab tools", *argv[:1]])
                print(f"error: {tool}: interrupted by {stop_name(e)}", file=sys.stderr)
                return stop_code(e)
    except ModuleNotFoundError as e:  # the commands import the engine's packages when run
        if (e.name or "").split(".")[0] not in ENGINE_MODULES:
            raise
        print(
            f"error: sched-lab {command} needs the engine's packages (no module {e.name}): "
            "pip install -e '.[engine]' in the lab's folder, with torch's CPU index "
            "(docs/install.md)",
            file=sys.stderr,
        )
        return 2


def prefix_bound(argv: list[str] | None = None, prog: str = "sched-lab prefix-bound") -> int:
    """Print the infinite-cache prefix hit-rate bound (:func:`sched_lab.traces.prefix_bound.
    prefix_hit_bound`) of an experiment's trace; user errors are one line (exit 2)."""
    ap = OneLineParser(
        prog=prog,
        description="The infinite-cache upper bound of the prefix hit rate of an "
        "experiment's trace, from its hash ids alone (traces/prefix_bound.py).",
    )
    ap.add_argument("config", help="experiment YAML (its trace and kv_cache.block_size)")
    ap.add_argument("--limit", type=int, help="only the first N requests of the trace")
    ap.add_argument("--block-size", type=int, help="KV block size (default: the config's)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        help="skip requests whose prompt + output exceed N (default: the config's "
        "scheduler.max_model_len, if it gives one)",
    )
    args = ap.parse_args(argv)
    from sched_lab.config import load_config
    from sched_lab.core.errors import UserError, one_line
    from sched_lab.traces import load_trace
    from sched_lab.traces.prefix_bound import prefix_hit_bound

    try:
        cfg = load_config(args.config)
        for flag in ("limit", "block_size", "max_model_len"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                name = flag.replace("_", "-")
                raise UserError(f"--{name}: expected an integer >= 1, got {value}")
        if args.limit is not None:
            cfg = cfg.with_trace(limit=args.limit)
        block = args.block_size or cfg.kv_cache.block_size
        if cfg.trace.classes:  # every class, merged as a run replays them
            from sched_lab.traces.classes import load_classes

            requests, _ = load_classes(cfg.trace.classes, cfg.base_dir, cfg.seed, cfg.slo.ttft_s)
        else:
            spec = {"seed": cfg.seed, **cfg.trace.spec, "rate_scale": 1.0}
            requests = load_trace(spec, cfg.base_dir)
        max_len = args.max_model_len or cfg.scheduler.max_model_len
        bound = prefix_hit_bound(requests, block, max_len)
    except (UserError, ValueError) as e:
        print(f"error: {args.config}: {one_line(str(e))}", file=sys.stderr)
        return 2
    print(
        f"{cfg.name}: {len(bound.request_ids):,} requests ({bound.num_with_hash_ids:,} with "
        f"hash ids), {bound.prompt_tokens:,} prompt tokens; with an infinite prefix cache at "
        f"KV block size {block}: {bound.total_cached_tokens:,} cached, hit rate "
        f"{bound.hit_rate:.4f}"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from sched_lab.config import check_seeds_flag, load_config, with_seeds
    from sched_lab.core.errors import UserError
    from sched_lab.report.folder import ResultsNotPlaced

    runs: list = []
    cfg = out = writer = None
    with StopSignals() as signals:
        try:
            from sched_lab.sweeps.sweep import is_sweep, read_yaml

            path, raw = read_yaml(args.config)
            if is_sweep(raw):
                return _run_sweep(args, path, raw)
            if (
                any(v is not None for v in (args.jobs, args.max_points, args.ray_address))
                or args.ray
            ):
                raise UserError(
                    "--jobs, --max-points, --ray and --ray-address are for a YAML with "
                    "sweep: or search:"
                )
            if args.seeds is not None:  # an engine experiment refuses it before all else
                check_seeds_flag(args.config, raw, args.seeds)
            cfg = load_config(args.config)
            if args.limit is not None:
                if args.limit < 1:
                    raise UserError(f"--limit: expected an integer >= 1, got {args.limit}")
                cfg = cfg.with_trace(limit=args.limit)
            if args.seeds is not None:
                cfg = with_seeds(cfg, args.seeds)
            if args.metric_percentiles is not None:
                cfg = _with_percentiles(cfg, args.metric_percentiles)
            if args.out is not None and not args.out.strip():
                raise UserError("--out: expected a folder, got an empty string")
            if args.format == "parquet" and importlib.util.find_spec("pyarrow") is None:
                raise UserError(
                    "--format parquet needs pyarrow: pip install -e '.[parquet]' in the lab's folder"
                )
            out = Path(args.out) if args.out is not None else Path.cwd() / "results" / cfg.name
            t0 = time.perf_counter()
            from sched_lab.report.folder import ResultsWriter
            from sched_lab.run.experiment import iter_runs

            # before the replays, so a folder in the way costs no run
            writer = ResultsWriter(out, cfg, fmt=args.format, plots=not args.no_plots)
            out = writer.out_dir
            for run in iter_runs(cfg, progress=not args.no_progress):
                signals.deferring = True  # a first signal lets the run's rows be written
                writer.add(run)  # its rows and timeline written, its steps and table freed
                runs.append(run)
                signals.deferring = False
                if signals.pending is not None:
                    raise Interrupted(signals.pending)
            decode = _decoder(cfg)
            signals.deferring = True  # every run is done: a first signal lets the writing end
            writer.finish(runs, decode)
        except UserError as e:
            msg = str(e)
            if not msg.startswith(args.config):  # name the experiment file once
                msg = f"{args.config}: {msg}"
            if runs and not signals.deferring:  # a later run refused: keep the earlier ones
                return _keep_runs_before(msg, signals, cfg, runs, writer)
            print(f"error: {msg}", file=sys.stderr)
            return 2
        except ResultsNotPlaced as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            if signals.deferring:  # the second signal while writing
                print(
                    f"error: interrupted by {stop_name(e)} twice while writing the results; "
                    "nothing written",
                    file=sys.stderr,
                )
                return stop_code(e)
            return _keep_partial(e, signals, cfg, runs, writer)
        finally:
            if writer is not None:
                signals.closing = True  # a signal now would leave the temporary folder
                writer.abort()  # unless finished: the temporary folder of a failed run
    if signals.pending is not None:
        name = signal.Signals(signals.pending).name
        print(
            f"error: interrupted by {name} while writing the results; all runs had "
            f"finished and {out}/ holds them in full",
            file=sys.stderr,
        )
        return 128 + signals.pending
    return _report(runs, decode, out, time.perf_counter() - t0, cfg)


def _with_percentiles(cfg, text: str):
    import dataclasses

    pcts = _percentiles(text)
    return dataclasses.replace(cfg, report=dataclasses.replace(cfg.report, metric_percentiles=pcts))


def _percentiles(text: str) -> tuple[float, ...]:
    """``--metric-percentiles`` (``50,90,99``) as numbers; UserError unless each is in (0, 100]."""
    from sched_lab.core.errors import UserError

    try:
        pcts = tuple(float(x) for x in text.split(","))
    except ValueError:
        pcts = ()
    if not pcts or not all(0 < p <= 100 for p in pcts):
        raise UserError(
            f"--metric-percentiles: expected numbers in (0, 100] separated by commas, "
            f"got {text[:80]!r}"
        )
    return pcts


def _run_sweep(args: argparse.Namespace, path: Path, raw) -> int:
    """``sched-lab run`` of a sweep (lab/sweeps/sweep.py): every point, one results folder.
    Raises UserError for bad input; a signal stops the points and writes those finished as
    partial results (one line; 128 + the signal number)."""
    import os

    from sched_lab.core.errors import UserError
    from sched_lab.sweeps.run import SweepStopped, run_sweep
    from sched_lab.sweeps.sweep import check_max_points, load_sweep

    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit: expected an integer >= 1, got {args.limit}")
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs: expected an integer >= 1, got {args.jobs}")
    if args.max_points is not None:
        check_max_points("--max-points", args.max_points)
    if args.out is not None and not args.out.strip():
        raise UserError("--out: expected a folder, got an empty string")
    if args.format == "parquet" and importlib.util.find_spec("pyarrow") is None:
        raise UserError(
            "--format parquet needs pyarrow: pip install -e '.[parquet]' in the lab's folder"
        )
    from sched_lab.sweeps.terminal import PERCENTILES, folder_text

    shown = PERCENTILES
    if args.seeds is not None:  # every point's, as in the YAML
        raw = {**raw, "seeds": args.seeds}
    if args.metric_percentiles is not None:  # every point's, as run's flag sets one config's
        shown = _percentiles(args.metric_percentiles)
        report = raw.get("report")
        report = dict(report) if isinstance(report, Mapping) else {}
        raw = {**raw, "report": {**report, "metric_percentiles": list(shown)}}
    t0 = time.perf_counter()
    sweep = load_sweep(path, args.limit, raw, max_points=args.max_points)
    out = Path(args.out) if args.out is not None else Path.cwd() / "results" / sweep.name
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    try:
        out, results = run_sweep(
            sweep,
            out,
            jobs=jobs,
            ray=args.ray,
            ray_address=args.ray_address,
            fmt=args.format,
            progress=not args.no_progress,
            plots=not args.no_plots,
        )
    except SweepStopped as e:
        print(f"error: {e.message}", file=sys.stderr)
        return stop_code(e)
    except KeyboardInterrupt as e:
        print(
            f"error: interrupted by {stop_name(e)} before any "
            f"{'search' if sweep.search else 'point'} finished; nothing written",
            file=sys.stderr,
        )
        return stop_code(e)
    print(folder_text(out, sweep, shown), end="\n\n")
    # A search's probe that stopped early is a miss that bounds its bracket, not a failure.
    bad = [
        r
        for r in results
        if r.error or (not sweep.search and any(row.get("error") for row in r.rows))
    ]
    print(f"wrote {out}/ (report.md): {len(results) - len(bad)} of {len(results)} "
          f"{'searches' if sweep.search else 'points'} ok in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    if bad:
        print(
            f"error: {len(bad)} of {len(results)} failed or stopped early (report.md and "
            "the results table say why)",
            file=sys.stderr,
        )
        return 1
    return 0


def _keep_partial(e: KeyboardInterrupt, signals: StopSignals, cfg, runs: list, writer) -> int:
    """Write the completed runs (added to ``writer``) as partial results; one line; 128 +
    the signal number."""
    if not runs:
        print(
            f"error: interrupted by {stop_name(e)} before any run finished; nothing written",
            file=sys.stderr,
        )
        return stop_code(e)
    from sched_lab.core.errors import UserError
    from sched_lab.report.folder import ResultsNotPlaced

    total = len(cfg.rate_scales) * len(cfg.policies)
    partial = f"interrupted by {stop_name(e)} after {len(runs)} of {total} runs"
    last = runs[-1].summary
    if last.get("seeds_requested"):  # its replicas were cut short (run/experiment.py _run)
        partial += (
            f", the last ({runs[-1].label}) with {last['seeds']} of {last['seeds_requested']} "
            "seeded replicas"
        )
    signals.deferring, signals.pending = True, None
    out = writer.out_dir
    try:
        writer.finish(runs, _decoder(cfg), partial=partial)
    except KeyboardInterrupt:
        print(
            f"error: {partial}, and twice again while writing them; nothing written",
            file=sys.stderr,
        )
        return stop_code(e)
    except (UserError, ResultsNotPlaced) as e2:
        print(f"error: {partial}; {e2}", file=sys.stderr)
        return stop_code(e)
    print(f"error: {partial}; wrote them to {out}/ as partial results", file=sys.stderr)
    return stop_code(e)


def _keep_runs_before(msg: str, signals: StopSignals, cfg, runs: list, writer) -> int:
    """A user error (``msg``, one line) raised by a run after ``runs`` had completed: those
    are written as partial results; one line; 2."""
    from sched_lab.core.errors import UserError
    from sched_lab.report.folder import ResultsNotPlaced

    total = len(cfg.rate_scales) * len(cfg.policies)
    partial = f"stopped by an error after {len(runs)} of {total} runs"
    signals.deferring = True
    try:
        writer.finish(runs, _decoder(cfg), partial=partial)
    except (UserError, ResultsNotPlaced) as e2:
        print(f"error: {msg}; {partial}, not written: {e2}", file=sys.stderr)
        return 2
    before = "the run before it is" if len(runs) == 1 else f"the {len(runs)} runs before it are"
    print(f"error: {msg}; {before} in {writer.out_dir}/ as partial results", file=sys.stderr)
    return 2


def _decoder(cfg):
    from sched_lab.setup import setup_for

    return setup_for(cfg).text_decoder()


def _report(runs: list, decode, out: Path, wall_s: float, cfg) -> int:
    from sched_lab.report.terminal import summary_text, warnings_text

    print(summary_text(runs, cfg.report.metric_percentiles))
    if warned := warnings_text(runs):
        print(f"\n{warned}")
    from sched_lab.report.replicas import cluster_text

    if cluster := cluster_text(runs):
        print(f"\n{cluster}")
    if decode is not None:  # a taste of the real text, first policy only
        finished = [r for r in runs[0].result.requests if r.status.value == "finished"]
        for r in finished[:3]:
            print(f"\n[{runs[0].label} request {r.request_id}] {decode(r.output_token_ids)!r}")
    print(f"\nwrote {out}/ (report.md, report.html) in {wall_s:.1f} s")
    failed = [r for r in runs if r.result.failure]
    if failed:
        which = ", ".join(f"{r.label} ({r.result.failure})" for r in failed)
        print(
            f"error: {len(failed)} of {len(runs)} runs stopped early: {which} "
            f"(their requests are in {out} with the reason)",
            file=sys.stderr,
        )
        return 1
    return 0


def console_main() -> int:
    """The ``sched-lab`` script's entry point: :func:`main`'s exit status, the heap then
    frozen (:func:`gc.freeze`) so that the interpreter's exit does not traverse it. For the
    process's end only; a caller that goes on calls :func:`main`. A reader of stdout that
    leaves early (``sched-lab explain ... | head``) ends it with status 1, no traceback: what
    the command writes to files is written before it prints."""
    try:
        status = main()
        sys.stdout.flush()  # a broken pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error
        return 1
    gc.freeze()
    return status


if __name__ == "__main__":
    sys.exit(console_main())
