"""What an engine profile describes: the engine fingerprint, and comparing two of them.

A fingerprint is a flat dict of plain values (JSON): ``backend_sources`` (sha256 over the
engine's Python sources and Triton kernels, ``backend/**/*.py``, path and bytes of each in
path order), ``torch``, ``triton`` (versions), ``gpu`` (device name), ``dtype``,
``attention`` (backend name) and ``options`` (engine options that change step times:
block size, CUDA graphs, mixed graphs, weight layout). ``backend/profile.py`` writes it in
the profile's header; the simulator compares it with the engine a run claims to predict.
Pure stdlib: the simulator reads fingerprints without importing torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

BACKEND_DIR = Path(__file__).resolve().parent.parent.parent / "backend"
HEADER_PREFIX = "# fingerprint "  # the profile header line that holds it, then JSON


def backend_sources_hash(backend_dir: Path = BACKEND_DIR) -> str | None:
    """sha256 (hex) of ``backend_dir/**/*.py`` (relative path and bytes of each file, in
    path order), or None when the folder is absent (an install without the engine)."""
    if not backend_dir.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(backend_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(backend_dir).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def differences(profile: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    """The fingerprint keys in which ``profile`` differs from ``engine``, as phrases
    (``"gpu 'NVIDIA H100' vs 'NVIDIA H200'"``); keys missing from ``engine`` are skipped
    (it names only what it knows, e.g. a checkout's sources), missing from ``profile``
    count as a difference."""
    out = []
    for key, want in engine.items():
        have = profile.get(key)
        if have != want:
            if key == "backend_sources":
                out.append(
                    f"backend sources {str(have)[:12]} vs {str(want)[:12]} "
                    "(the engine's code changed since the profile)"
                )
            else:
                out.append(f"{key} {have!r} vs {want!r}")
    return out
