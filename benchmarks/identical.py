"""Check that every simulator experiment in experiments/ gives the same results as before.

    python benchmarks/identical.py                 # compare with benchmarks/identical_ref.json
    python benchmarks/identical.py --write         # record the current results as the reference

Runs each ``backend: sim`` YAML of experiments/ into a temporary folder and compares the
sha256 of its ``requests.csv``, ``steps.csv`` and ``summary.json`` with the reference (made
at the commit named in it). Exit status 1 on any difference, naming the file.

``summary.json`` is compared without the ``"trace"`` key of each run (the trace file's
path, sha256 and row count, added after the reference was made; the path depends on the
checkout): the rest is re-serialized as the lab writes it (``json.dumps(indent=2)``), so
the comparison still proves every other byte identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
REF = Path(__file__).with_name("identical_ref.json")
FILES = ("requests.csv", "steps.csv", "summary.json")


def sim_experiments() -> list[Path]:
    out = []
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        if (yaml.safe_load(path.read_text()) or {}).get("backend", "sim") == "sim":
            out.append(path)
    return out


def digests(path: Path, out: Path) -> dict[str, str]:
    cmd = [
        sys.executable,
        str(ROOT / "run_experiment.py"),
        str(path),
        "--out",
        str(out),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return {f: hashlib.sha256(comparable(out / f)).hexdigest() for f in FILES}


def comparable(path: Path) -> bytes:
    """The file's bytes; for summary.json, without each run's ``"trace"`` key."""
    data = path.read_bytes()
    if path.name != "summary.json":
        return data
    summary = json.loads(data)
    for run in summary.values():
        run.pop("trace", None)
    return json.dumps(summary, indent=2).encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the reference")
    ap.add_argument("--only", nargs="*", help="experiment names (default: all sim ones)")
    args = ap.parse_args(argv)
    ref = json.loads(REF.read_text()) if REF.exists() else {"experiments": {}}
    got, bad = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for path in sim_experiments():
            if args.only and path.stem not in args.only:
                continue
            got[path.stem] = digests(path, Path(tmp) / path.stem)
            want = ref["experiments"].get(path.stem)
            for f in FILES:
                same = want is not None and want.get(f) == got[path.stem][f]
                if not args.write and not same:
                    bad.append(f"{path.stem}/{f}")
            print(
                f"{path.stem}: "
                + (
                    "recorded"
                    if args.write
                    else "identical"
                    if not any(b.startswith(path.stem + "/") for b in bad)
                    else "DIFFERENT"
                )
            )
    if args.write:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        REF.write_text(json.dumps({"commit": commit, "experiments": got}, indent=2) + "\n")
        return 0
    if bad:
        print("different: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
