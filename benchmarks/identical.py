"""Check that every simulator experiment in experiments/ gives the same results as before.

    python benchmarks/identical.py                 # compare with benchmarks/identical_ref.json
    python benchmarks/identical.py --write         # record the current results as the reference
    python benchmarks/identical.py --base main     # compare with another commit, additively

Runs each ``backend: sim`` YAML of experiments/ into a temporary folder and compares the
sha256 of its ``requests.csv``, ``steps.csv`` and ``summary.json`` with the reference (made
at the commit named in it). Exit status 1 on any difference, naming the file.

``summary.json`` is compared without the ``"trace"`` key of each run (the trace file's
path, sha256 and row count, added after the reference was made; the path depends on the
checkout): the rest is re-serialized as the lab writes it (``json.dumps(indent=2)``), so
the comparison still proves every other byte identical.

``--base REV`` runs the same experiments at commit REV (in a temporary git worktree, with a
venv of its own holding REV's editable install) and
compares additively, for changes that add columns or keys but must not change any result:
every CSV column of REV's files must exist with the same values in the same rows, and every
key of REV's ``summary.json`` must hold the same value (new columns and keys are listed, not
refused). REV's summary is read with the metric names of now
(:func:`sched_lab.results.names.upgrade_summary`: ``ttft_s.p99`` in seconds is compared as
``p99_ttft_ms``, the same number times 1000), so a rename alone is no difference.
Experiments that exist on one side only are skipped with a note.

``--only NAME ...`` checks those experiments alone; a name that is not one of the
simulator experiments checked here (unknown, a sweep, an engine experiment) is refused in
one line, exit status 2, before anything runs.

The reference names the CPU it was recorded on (whether it has AVX-512). The calibrated cost
model is fitted at run time by LAPACK/OpenBLAS, whose kernels differ by CPU, so a fit can
differ in its last bits on another CPU: ``requests.csv`` (full float precision) and
``summary.json`` of calibrated experiments may then differ while ``steps.csv`` (9 digits)
does not. Seen on 2026-12-03: quickstart and spec_ngram, on a CPU without AVX-512 against a
reference of unknown CPU. On a CPU unlike the reference's, prove a change with ``--base``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sched_lab.results.names import upgrade_summary  # noqa: E402

REF = Path(__file__).with_name("identical_ref.json")
FILES = ("requests.csv", "steps.csv", "summary.json")


def sim_experiments() -> list[Path]:
    """``backend: sim`` YAMLs that are one experiment (a sweep's points are experiments
    like these; its own files are checked by tests/test_sweep.py)."""
    out = []
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        if raw.get("backend", "sim") == "sim" and not ({"sweep", "search"} & set(raw)):
            out.append(path)
    return out


def check_only(names: list[str]) -> str | None:
    """Why ``--only`` cannot check one of ``names`` (one line: the first such name, and the
    names it can check), or None when every name is a simulator experiment of this checkout."""
    known = [p.stem for p in sim_experiments()]
    for name in names:
        if name in known:
            continue
        path = ROOT / "experiments" / f"{name}.yaml"
        plain = "/" not in name and "\\" not in name and not name.endswith(".yaml")
        raw = (yaml.safe_load(path.read_text()) or {}) if plain and path.is_file() else None
        if not plain:
            why = "expected an experiment's name (quickstart), not a path"
        elif raw is None:
            why = "no such experiment in experiments/"
        elif {"sweep", "search"} & set(raw):
            why = "a sweep (its points' files are checked by tests/test_sweep.py, not here)"
        else:
            why = f"backend: {raw.get('backend')}, not the simulator"
        return f"identical.py: --only {name[:80]}: {why}; expected one of: {', '.join(known)}"
    return None


def python_for(root: Path, tmp: Path) -> str:
    """A Python that runs ``root``'s code. A checkout that installs as ``sched_lab`` (its
    folders mapped by pyproject's package-dir) gets a venv of its own with an editable
    install, since the running interpreter's ``sched_lab`` is this checkout's; an older one
    (plain folder imports beside run_experiment.py) runs with this interpreter."""
    if "sched_lab" not in (root / "pyproject.toml").read_text():
        return sys.executable
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    install = [py, "-m", "pip", "install", "-q", "--no-deps", "-e"]
    subprocess.run([*install, str(root)], check=True, stdout=subprocess.DEVNULL)
    check_imports(py, root)
    return py


def check_imports(python: str, root: Path) -> None:
    """Exit with one line unless ``python`` imports ``sched_lab`` from ``root``."""
    where = subprocess.run(
        [python, "-c", "import sched_lab; print(sched_lab.__file__)"],
        capture_output=True, text=True, cwd="/",
    ).stdout.strip()  # fmt: skip
    if not where or not Path(where).resolve().is_relative_to(root.resolve()):
        raise SystemExit(
            f"identical.py: {python} imports sched_lab from {where or 'nowhere'}, not from "
            f"{root}: install this checkout (pip install --no-deps -e .) or use its venv"
        )


def run(root: Path, path: Path, out: Path, python: str = sys.executable) -> None:
    cmd = [
        python,
        str(root / "run_experiment.py"),
        str(path),
        "--out",
        str(out),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, cwd=root, stdout=subprocess.DEVNULL)


def digests(path: Path, out: Path) -> dict[str, str]:
    run(ROOT, path, out)
    return {f: hashlib.sha256(comparable(out / f)).hexdigest() for f in FILES}


def csv_subset(old: Path, new: Path) -> tuple[list[str], list[str]]:
    """(problems, added columns): every column of ``old`` must be in ``new``, row for row."""
    with old.open(newline="") as f:
        a = list(csv.reader(f))
    with new.open(newline="") as f:
        b = list(csv.reader(f))
    if len(a) != len(b):
        return [f"{len(a) - 1} rows before, {len(b) - 1} now"], []
    if not a:
        return [], []
    where = {name: i for i, name in enumerate(b[0])}
    missing = [c for c in a[0] if c not in where]
    if missing:
        return [f"columns gone: {missing[:5]}"], []
    idx = [where[c] for c in a[0]]
    for n, (ra, rb) in enumerate(zip(a[1:], b[1:]), start=1):
        got = [rb[i] for i in idx]
        if got != ra:
            col = next(c for c, x, y in zip(a[0], ra, got) if x != y)
            return [f"row {n}, column {col!r} differs"], []
    return [], [c for c in b[0] if c not in set(a[0])]


def json_subset(old, new, where: str = "") -> tuple[list[str], list[str]]:
    """(problems, added keys): every key of ``old`` must hold the same value in ``new``."""
    if isinstance(old, dict) and isinstance(new, dict):
        problems, added = [], [f"{where}/{k}" for k in new if k not in old]
        for k, v in old.items():
            if k not in new:
                problems.append(f"{where}/{k} gone")
                continue
            p, a = json_subset(v, new[k], f"{where}/{k}")
            problems += p
            added += a
        return problems, added
    return ([] if old == new else [f"{where} differs"]), []


def compare_with_base(rev: str, only: list[str] | None) -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT, check=True
        )
        try:
            base_python = python_for(base, Path(tmp))
            base_names = {p.stem for p in (base / "experiments").glob("*.yaml")}
            for path in sim_experiments():
                if only and path.stem not in only:
                    continue
                if path.stem not in base_names:
                    print(f"{path.stem}: new (not at {rev}), skipped")
                    continue
                a, b = Path(tmp) / "a" / path.stem, Path(tmp) / "b" / path.stem
                run(base, base / "experiments" / path.name, a, base_python)
                run(ROOT, path, b)
                problems, added = [], []
                for f in ("requests.csv", "steps.csv"):
                    p, c = csv_subset(a / f, b / f)
                    problems += [f"{f}: {x}" for x in p]
                    added += [f"{f}:{x}" for x in c]
                old, new = (json.loads((d / "summary.json").read_text()) for d in (a, b))
                old = {k: upgrade_summary(v) for k, v in old.items()}
                for run_ in (*old.values(), *new.values()):
                    run_.pop("trace", None)
                p, c = json_subset(old, new)
                problems += [f"summary.json: {x}" for x in p]
                added += [f"summary.json:{x}" for x in c]
                bad += bool(problems)
                verdict = "DIFFERENT: " + "; ".join(problems[:5]) if problems else "identical"
                extra = f" (added: {', '.join(sorted(set(added))[:8])})" if added else ""
                print(f"{path.stem}: {verdict}{extra}")
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
            )
    return 1 if bad else 0


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
    ap.add_argument("--base", metavar="REV", help="compare additively with commit REV")
    args = ap.parse_args(argv)
    # SIGTERM (timeout, kill) as an exception, so the temporary folders are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.only and (why := check_only(args.only)):
        print(why, file=sys.stderr)
        return 2
    check_imports(sys.executable, ROOT)
    if args.base:
        return compare_with_base(args.base, args.only)
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
        ref = {"commit": commit, "avx512": _avx512(), "experiments": got}
        REF.write_text(json.dumps(ref, indent=2) + "\n")
        return 0
    if bad:
        print("different: " + ", ".join(bad), file=sys.stderr)
        if ref.get("avx512") != _avx512():
            recorded = {True: "with", False: "without", None: "unknown"}[ref.get("avx512")]
            print(
                f"note: the reference was recorded on a CPU {recorded} AVX-512 "
                f"({'with' if _avx512() else 'without'} here): calibrated fits may differ in "
                "their last bits; compare with --base REV on this machine",
                file=sys.stderr,
            )
        return 1
    return 0


def _avx512() -> bool | None:
    """Whether this CPU has AVX-512 (None where /proc/cpuinfo cannot tell)."""
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
