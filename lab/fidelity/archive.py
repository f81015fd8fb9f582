"""The engine side's archive: ``NAME.tar.gz`` (``profile.csv``, ``protocol.yaml``,
``engine.json`` and the :data:`PACKED` files of each run folder), ``NAME_repeat.tar.gz``
(``engine_repeat/``) and ``NAME_notes.md`` (appended to the doc) beside it."""

from __future__ import annotations

import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

PACKED = ("config.yaml", "summary.json", "requests.csv", "steps.csv", "timing.json")


def repeat_archive(archive: Path) -> Path:
    """Where the repeat pass is packed, beside ``archive``."""
    return archive.with_name(archive.name.removesuffix(".tar.gz") + "_repeat.tar.gz")


def notes_path(archive: Path) -> Path:
    """The notes appended to ``archive``'s doc: ``NAME_notes.md`` beside it, or an unpacked
    folder's ``notes.md``."""
    if archive.is_dir():
        return archive / "notes.md"
    return archive.with_name(archive.name.removesuffix(".tar.gz") + "_notes.md")


def pack(out: Path, archive: Path, parts: tuple[str, ...] = ("first", "repeat")) -> None:
    """Pack ``out``'s profile, protocol, engine.json and first-pass folders into ``archive``
    (.tar.gz; part ``first``), the repeat pass into :func:`repeat_archive` (part ``repeat``,
    with ``engine.json`` as ``engine_repeat/engine.json``); each replaces only a file
    sched-lab wrote (:mod:`sched_lab.core.outputs`)."""
    from sched_lab.core.outputs import write_output

    for part, path, sides, extra in (
        ("first", archive, ("calibration", "engine"),
         ("profile.csv", "protocol.yaml", "engine.json")),
        ("repeat", repeat_archive(archive), ("engine_repeat",), ()),
    ):  # fmt: skip
        if part not in parts:
            continue
        write_output(path, lambda tmp, sides=sides, extra=extra: _tar(out, tmp, sides, extra))
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)


def _tar(out: Path, path: Path, sides: tuple[str, ...], extra: tuple[str, ...]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name in extra:
            if (out / name).exists():
                tar.add(out / name, arcname=name)
        if sides == ("engine_repeat",) and (out / "engine.json").exists():
            tar.add(out / "engine.json", arcname="engine_repeat/engine.json")
        for side in sides:
            for folder in sorted((out / side).glob("*")) if (out / side).is_dir() else []:
                for f in PACKED:
                    if (folder / f).exists():
                        tar.add(folder / f, arcname=f"{side}/{folder.name}/{f}")


def unpack(archive: Path) -> Path:
    """The archive's contents (and its repeat's, warned about if missing) in a new temporary
    folder, or ``archive`` itself if a folder; SystemExit if it does not exist."""
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
    path = archive
    try:
        for path in (archive, repeat_archive(archive)):
            if path.exists():
                with tarfile.open(path) as tar:
                    tar.extractall(tmp, filter="data")
    except (OSError, EOFError, tarfile.TarError) as e:  # a damaged archive: named, no folder left
        shutil.rmtree(tmp, ignore_errors=True)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(f"error: {path}: a damaged archive ({type(e).__name__}: {why})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp
