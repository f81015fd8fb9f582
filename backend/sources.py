"""The engine's own sources as one hash: the ``backend_sources`` key of an engine fingerprint
(:mod:`sched_lab.core.fingerprint`). Torch-free, so the simulator's callers can ask for it.
The offline tools under ``backend/tools/`` (checkpoint makers, the quantizer, converters)
never run inside a timed step, so a change to them leaves the hash, and a profile's
freshness, as they were."""

from __future__ import annotations

import hashlib
from pathlib import Path

BACKEND_DIR = Path(__file__).resolve().parent


def backend_sources_hash(backend_dir: Path = BACKEND_DIR) -> str | None:
    """sha256 (hex) of ``backend_dir/**/*.py`` but ``tools/`` (relative paths and bytes, in
    path order), or None when the folder is absent."""
    if not backend_dir.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(backend_dir.rglob("*.py")):
        rel = path.relative_to(backend_dir)
        if "__pycache__" in rel.parts or rel.parts[0] == "tools":
            continue
        digest.update(rel.as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def checkout_engine() -> dict[str, str]:
    """This checkout's engine sources hash (the ``engine`` argument of
    :func:`sched_lab.sim.calibrated.staleness`)."""
    digest = backend_sources_hash()
    return {"backend_sources": digest} if digest is not None else {}
