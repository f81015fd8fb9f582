"""The engine side's archive: what is packed, where the repeat pass goes, and unpacking.

An archive ``NAME.tar.gz`` holds ``profile.csv``, ``protocol.yaml``, ``engine.json`` and the
:data:`PACKED` files of each ``calibration/<name>/`` and ``engine/<window>_<load>/`` folder;
``NAME_repeat.tar.gz`` beside it holds ``engine_repeat/``; ``NAME_notes.md`` beside it is
appended to the doc written from it.
"""

from __future__ import annotations

import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

PACKED = ("config.yaml", "summary.json", "requests.csv", "steps.csv", "timing.json")


def repeat_archive(archive: Path) -> Path:
    """Where the repeat pass is packed, beside ``archive`` (two files, each below the
    device tool's 16 MB per file)."""
    return archive.with_name(archive.name.removesuffix(".tar.gz") + "_repeat.tar.gz")


def notes_path(archive: Path) -> Path:
    """The hand-written notes the sim side appends to ``archive``'s doc: beside it and named
    after it (``NAME.tar.gz``: ``NAME_notes.md``; an unpacked folder: its ``notes.md``), so
    another archive in the same folder does not get them."""
    if archive.is_dir():
        return archive / "notes.md"
    return archive.with_name(archive.name.removesuffix(".tar.gz") + "_notes.md")


def pack(out: Path, archive: Path) -> None:
    """The profile, the protocol, engine.json and the PACKED files of each calibration and
    first-pass folder of ``out`` into ``archive`` (.tar.gz); the repeat pass's into
    :func:`repeat_archive`."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    for path, sides, extra in (
        (archive, ("calibration", "engine"), ("profile.csv", "protocol.yaml", "engine.json")),
        (repeat_archive(archive), ("engine_repeat",), ()),
    ):
        with tarfile.open(path, "w:gz") as tar:
            for name in extra:
                if (out / name).exists():
                    tar.add(out / name, arcname=name)
            for side in sides:
                for folder in sorted((out / side).glob("*")) if (out / side).is_dir() else []:
                    for f in PACKED:
                        if (folder / f).exists():
                            tar.add(folder / f, arcname=f"{side}/{folder.name}/{f}")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)


def unpack(archive: Path) -> Path:
    """The archive's contents (and its repeat archive's) in a new temporary folder, or
    ``archive`` itself if it is a folder; a missing repeat archive is warned about (no
    spreads then).

    Raises:
        SystemExit: one line if ``archive`` does not exist.
    """
    if not archive.exists():
        raise SystemExit(
            f"error: {archive}: no such archive (the default is the source checkout's "
            "docs/fidelity/heldout_engine.tar.gz: run from a clone, or pass --archive)"
        )
    if archive.is_dir():
        return archive
    if not repeat_archive(archive).exists():
        print(
            f"warning: {repeat_archive(archive)} not found: no repeat runs, so no engine "
            "spread (every spread reads '-')",
            file=sys.stderr,
        )
    tmp = Path(tempfile.mkdtemp(prefix="fidelity-"))
    try:
        for path in (archive, repeat_archive(archive)):
            if path.exists():
                with tarfile.open(path) as tar:
                    tar.extractall(tmp, filter="data")
    except BaseException:  # a damaged archive: the caller reports it; no folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp
