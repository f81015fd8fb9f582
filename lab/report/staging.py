"""Temporary folders the lab writes in before renaming them into place, marked so that one
left behind by a killed process (SIGKILL, a power cut: no cleanup ran) can be told from
anything else and removed by the next run.

A marked folder holds :data:`MARKER`, ``{"pid": ..., "host": ...}`` of the process that
made it. :func:`remove_stale` removes a folder only when all of these hold: its name starts
with the prefix asked for, it is a real folder (not a link), its marker reads as written
here, the host is this one and that process is gone. Anything else is left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

MARKER = ".sched-lab-staging"  # in a temporary folder: which process made it

log = logging.getLogger("sched_lab.report.staging")


def make_marked(parent: Path, prefix: str) -> Path:
    """A new empty folder in ``parent`` named ``prefix`` + random characters, holding only
    :data:`MARKER` (this process and host). Raises OSError."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        mark = {"pid": os.getpid(), "host": socket.gethostname()}
        (folder / MARKER).write_text(json.dumps(mark) + "\n")
    except BaseException:  # a signal raised here (a sweep's stopped worker) leaves no folder
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def unmark(folder: Path) -> None:
    """Remove ``folder``'s marker (it becomes a folder of results)."""
    (folder / MARKER).unlink(missing_ok=True)


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove the marked folders in ``parent`` whose name starts with ``prefix`` and whose
    process is gone (made on this host); returns them. Never raises: a folder that cannot
    be read or removed is left, and an unreadable ``parent`` gives ``[]``."""
    removed = []
    try:
        entries = [p for p in Path(parent).iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    for p in entries:
        if p.is_symlink() or not p.is_dir() or not _orphaned(p):
            continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
    if removed:
        names = ", ".join(p.name for p in removed[:3]) + (" ..." if len(removed) > 3 else "")
        log.info(
            "removed %d temporary folder(s) in %s left by sched-lab processes that were killed: %s",
            len(removed),
            parent,
            names,
        )
    return removed


def _orphaned(folder: Path) -> bool:
    """Whether ``folder``'s marker names a process of this host that no longer runs."""
    try:
        mark = json.loads((folder / MARKER).read_text())
        pid, host = mark["pid"], mark["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no marker: not ours to remove
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return False
    if host != socket.gethostname():
        return False  # a process elsewhere (a shared file system): it may still run
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False  # alive (or its number reused: left, to be safe)
