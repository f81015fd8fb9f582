"""What an engine profile describes: the engine fingerprint, and comparing two of them.

A fingerprint is a flat dict of plain values (JSON): ``backend_sources`` (sha256 over the
engine's Python sources and Triton kernels, ``backend/**/*.py``, path and bytes of each in
path order), ``torch``, ``triton`` (versions), ``gpu`` (device name), ``dtype``,
``attention`` (backend name) and ``options`` (engine options that change step times:
block size, CUDA graphs, mixed graphs, weight layout). ``backend/profile.py`` writes it in
the profile's header; the simulator compares it with the engine a run claims to predict
(this checkout's sources: ``backend/sources.py``, asked for by the caller). Pure data, no I/O.
"""

from __future__ import annotations

from typing import Any

HEADER_PREFIX = "# fingerprint "  # the profile header line that holds it, then JSON


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
