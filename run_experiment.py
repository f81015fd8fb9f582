"""Run an experiment YAML and write its results folder.

    python run_experiment.py experiments/quickstart.yaml [--out results/quickstart]

User errors (bad YAML, malformed trace, unknown policy, impossible limits) print one line,
``error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = ROOT / "experiments" / "quickstart.yaml"


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes in one line too (argparse prints its usage first)."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG),
                    help="experiment YAML (default: experiments/quickstart.yaml)")
    ap.add_argument("--out", help="results folder (default: results/<name>)")
    ap.add_argument("--limit", type=int, help="replay only the first N requests of the trace")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")

    from lab.config import load_config
    from lab.core.errors import UserError

    try:
        cfg = load_config(args.config)
        if args.limit is not None:
            if args.limit < 1:
                raise UserError(f"--limit: expected an integer >= 1, got {args.limit}")
            cfg = cfg.with_trace(limit=args.limit)
        if args.out is not None and not args.out.strip():
            raise UserError("--out: expected a folder, got an empty string")
        out = Path(args.out) if args.out is not None else ROOT / "results" / cfg.name
        t0 = time.perf_counter()
        from lab.experiment import run_experiment
        from lab.report import check_out_dir, summary_table, write_results

        out = check_out_dir(out)  # before the replays, so a folder in the way costs no run

        runs = run_experiment(cfg, progress=not args.no_progress)
        decode = None
        if cfg.backend == "engine":
            from lab.engine_setup import text_decoder

            decode = text_decoder(cfg)
        write_results(out, cfg, runs, decode)
    except UserError as e:
        msg = str(e)
        if not msg.startswith(args.config):  # name the experiment file once
            msg = f"{args.config}: {msg}"
        print(f"error: {msg}", file=sys.stderr)
        return 2
    print(summary_table(runs))
    if decode is not None:  # a taste of the real text, first policy only
        finished = [r for r in runs[0].result.requests if r.status.value == "finished"]
        for r in finished[:3]:
            print(f"\n[{runs[0].label} request {r.request_id}] {decode(r.output_token_ids)!r}")
    print(f"\nwrote {out}/ (report.md) in {time.perf_counter() - t0:.1f} s")
    failed = [r for r in runs if r.result.failure]
    if failed:
        which = ", ".join(f"{r.label} ({r.result.failure})" for r in failed)
        print(f"error: {len(failed)} of {len(runs)} runs stopped early: {which} "
              f"(their requests are in {out} with the reason)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
