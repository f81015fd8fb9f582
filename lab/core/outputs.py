"""Files the side commands write (``fit --out``, ``fidelity --sim --doc``, ``timeline --out``,
``profile --out``): each only where the user said, and an existing file replaced only if
the lab wrote it.

The lab knows its own files by the manifest of their folder, :data:`MANIFEST`, the same file
a results folder has (lab/report/folder.py): ``{"written_by": ..., "files": [names]}``.
Writing a file adds its name there; a file of that name not listed is the user's, and
:func:`check_output` refuses to replace it. A file is written under a temporary name and
renamed into place, so an interrupted command leaves the earlier file whole.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from sched_lab import __version__
from sched_lab.core.errors import UserError

MANIFEST = ".sched-lab-manifest.json"  # the names of the files the lab wrote in a folder


def written_here(folder: Path) -> set[str]:
    """The file names ``folder``'s manifest lists (empty: no readable manifest)."""
    try:
        files = json.loads((Path(folder) / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()


def check_output(path: str | Path, flag: str) -> Path:
    """Check, writing nothing, that ``path`` can take a file the lab writes: it is absent, or a
    file the lab wrote (listed in its folder's manifest); its nearest existing folder is a
    writable folder. Returns ``path`` absolute.

    Raises:
        UserError: one line starting with ``flag`` and ``path``: what is in the way.
    """
    given, path = path, Path(path).expanduser().absolute()
    where = f"{flag} {given}"
    try:
        _check_output(path, where)
    except OSError as e:  # a name too long, a loop of links...
        raise UserError(f"{where}: {e.strerror or e}") from None
    return path


def _check_output(path: Path, where: str) -> None:
    if path.name in ("", ".", "..") or path.name == MANIFEST:
        raise UserError(f"{where}: expected a file name")
    if path.is_symlink() or path.is_dir():
        raise UserError(f"{where}: {'a symbolic link' if path.is_symlink() else 'a folder'}, "
                        "expected a file path")  # fmt: skip
    if path.exists():
        if not path.is_file():
            raise UserError(f"{where}: exists and is not a regular file")
        if path.name not in written_here(path.parent):
            raise UserError(
                f"{where}: exists and was not written by sched-lab (not in "
                f"{path.parent / MANIFEST}); refusing to replace it (move it, or choose "
                "another path)"
            )
    above = next(p for p in path.parents if p.exists())  # the root always exists
    if not above.is_dir():
        raise UserError(f"{where}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"{where}: cannot write in {above} (permission denied)")


def write_output(path: Path, write: Callable[[Path], object] | str | bytes) -> None:
    """Write the file ``path`` (checked by :func:`check_output`) and list it in its folder's
    manifest. ``write``: the text or bytes, or a function that writes a given path.

    Raises:
        UserError: it cannot be written (the message names ``path`` and why).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(  # the suffix kept: writers infer the format
            prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent
        )
        os.close(fd)
    except OSError as e:
        raise UserError(f"{path}: cannot write it ({e.strerror or e})") from None
    tmp = Path(tmp_name)
    try:
        if isinstance(write, str):
            tmp.write_text(write)
        elif isinstance(write, bytes):
            tmp.write_bytes(write)
        else:
            write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; open() would not
        _record(path.parent, [path.name])
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{path}: cannot write it ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _record(folder: Path, names: Iterable[str]) -> None:
    """Add ``names`` to ``folder``'s manifest (made if absent), keeping what it holds."""
    manifest = folder / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        data = {"written_by": f"sched-lab {__version__}", "files": []}
    data["files"] = sorted({f for f in data["files"] if isinstance(f, str)} | set(names))
    fd, tmp = tempfile.mkstemp(prefix=f"{MANIFEST}.", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, manifest)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
