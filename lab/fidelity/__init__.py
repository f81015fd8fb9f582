"""Held-out simulator fidelity: ``sched-lab fidelity --engine`` (GPU) and ``--sim`` (CPU).

    sched-lab fidelity --engine --out /tmp/fidelity --archive docs/fidelity/heldout_engine.tar.gz
    sched-lab fidelity --sim --archive docs/fidelity/heldout_engine.tar.gz   # docs/fidelity.md
    sched-lab fidelity --engine --split first --out /tmp/f --archive A.tar.gz   # device call 1
    sched-lab fidelity --engine --split repeat --out /tmp/f --archive A.tar.gz  # call 2: A_repeat

The protocol is one YAML (``benchmarks/fidelity_heldout.yaml``, read by :mod:`.protocol`):
trace windows, loads as fractions of the engine's measured capacity, the engine experiment,
time limits. :mod:`.engine_side` profiles the engine, replays calibration workloads and runs
every (window, load, policy) twice, each step a process under a time limit, and packs an
archive (:mod:`.archive`). :mod:`.sim_side` replays each archived run in the simulator
calibrated from the archive's profile and calibration replays alone, and writes the doc
(:mod:`.markdown`) with its table and plots (:mod:`.plots`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

import yaml

from sched_lab.config.load import MAX_SEEDS
from sched_lab.core.errors import OneLineParser, short_repr
from sched_lab.fidelity.archive import PACKED, notes_path, pack, repeat_archive, unpack
from sched_lab.fidelity.compare import (
    METRICS,
    PCTS,
    RANKED,
    predicted_durations,
    rank_agreement,
    rel,
    step_kind,
    step_noise,
)
from sched_lab.fidelity.engine_side import check_device, engine, engine_pass
from sched_lab.fidelity.markdown import error_target
from sched_lab.fidelity.protocol import (
    ARCHIVE,
    DOC,
    PROTOCOL,
    PROTOCOL_KEYS,
    ROOT,
    calibration_config,
    capacity_run,
    check_runs,
    engine_config,
    folder_name,
    load_config,
    load_protocol,
    pass_estimate_s,
    profile_geometry,
    scale_folder_name,
    slice_config,
    window_loads,
    window_rate_scales,
)
from sched_lab.fidelity.sim_side import plan_alike_replay, plans_alike, sim

__all__ = [
    "ARCHIVE", "METRICS", "PACKED", "PCTS", "PROTOCOL", "PROTOCOL_KEYS", "RANKED", "ROOT",
    "calibration_config", "capacity_run", "check_device", "check_runs", "engine",
    "engine_config", "engine_pass", "error_target", "folder_name", "load_config",
    "load_protocol", "main", "notes_path", "pack", "pass_estimate_s", "plan_alike_replay",
    "plans_alike", "predicted_durations", "profile_geometry", "rank_agreement", "rel",
    "repeat_archive", "scale_folder_name", "sim", "slice_config", "window_loads",
    "window_rate_scales", "step_kind", "step_noise", "unpack",
]  # fmt: skip


def main(argv: list[str] | None = None, prog: str = "sched-lab fidelity") -> int:
    """The command line of both sides; returns the exit status (2 for a one-line error)."""
    ap = OneLineParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="examples:\n" + "\n".join(__doc__.split("\n\n")[1].splitlines()),
    )
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--engine", action="store_true", help="GPU side: profile, runs, repeats")
    side.add_argument("--sim", action="store_true", help="CPU side: docs/fidelity.md")
    side.add_argument("--engine-pass", choices=("calibration", "first", "repeat"),
                      help=argparse.SUPPRESS)  # fmt: skip
    ap.add_argument("--protocol", type=Path, default=PROTOCOL, help="protocol YAML")
    ap.add_argument("--out", type=Path, default=Path("/tmp/sched-lab-fidelity"),
                    help="engine side: working folder (default /tmp/sched-lab-fidelity)")  # fmt: skip
    ap.add_argument("--archive", type=Path, default=None,
                    help=f"engine side: .tar.gz to write; sim side: to read (default {ARCHIVE.relative_to(ROOT)})")  # fmt: skip
    ap.add_argument("--doc", type=Path, default=None,
                    help="sim side: the markdown DIR/NAME.md to write, with its table and plots "
                    "in DIR/NAME/ (default in a source checkout: docs/fidelity.md); a file "
                    "there is replaced only if sched-lab wrote it")  # fmt: skip
    ap.add_argument("--seeds", type=int, metavar="N",
                    help="sim side: N seeded replicas of every simulated run, and the coverage "
                    "of their 90%% band (docs/fidelity.md)")  # fmt: skip
    ap.add_argument("--split", choices=("first", "repeat"),
                    help="engine side in two device calls: 'first' = checkpoint, profile, "
                    "calibration, first pass into --archive; 'repeat' = the repeat pass of "
                    "the runs in --archive (the first call's), into its _repeat archive "
                    "beside it; --sim reads the two as one")  # fmt: skip
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except SystemExit as e:  # the one-line errors above: bad input, exit status 2
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise


def _main(args: argparse.Namespace) -> int:
    if args.engine_pass:
        engine_pass(args.engine_pass, args.protocol, args.out, args.deadline or float("inf"))
        return 0
    from sched_lab.core.errors import UserError

    if args.split and not args.engine:
        print("error: --split: only with --engine", file=sys.stderr)
        return 2
    if args.seeds is not None and args.engine:
        print("error: --seeds: only with --sim (the engine side measures its steps)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.engine:
        try:  # the checkpoint folder in the way, an archive that cannot be written
            return engine(args.protocol, args.out, args.archive, args.split)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    archive = args.archive or ARCHIVE
    doc = args.doc or DOC
    if not doc.parent.is_dir() and args.doc is None:  # an installed copy has no docs/
        print("error: --doc: expected the markdown file to write (the default, "
              "docs/fidelity.md, is a source checkout's)", file=sys.stderr)  # fmt: skip
        return 2
    if args.seeds is not None and not 2 <= args.seeds <= MAX_SEEDS:
        print(f"error: --seeds: expected an integer in [2, {MAX_SEEDS:,}] (a band needs two "
              f"replicas at least), got {args.seeds}", file=sys.stderr)  # fmt: skip
        return 2
    try:
        sim(archive, doc, args.seeds)
    except (OSError, EOFError, tarfile.TarError, json.JSONDecodeError, yaml.YAMLError,
            UserError) as e:  # fmt: skip
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {archive}: a damaged archive ({type(e).__name__}: {short_repr(why, 200)[1:-1]})",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0
