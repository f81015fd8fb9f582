"""The engine fingerprint of a profile, and comparing two.

A fingerprint is a flat JSON dict: ``backend_sources`` (sha256 of ``backend/**/*.py``, path
and bytes in path order), ``torch``, ``triton``, ``gpu``, ``dtype``, ``attention`` and
``options`` (engine options that change step times).
"""

from __future__ import annotations

from typing import Any

HEADER_PREFIX = "# fingerprint "  # the profile header line that holds it, then JSON


def differences(profile: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    """Keys where ``profile`` differs from ``engine``, as phrases (``"gpu 'A' vs 'B'"``); keys
    missing from ``engine`` are skipped, missing from ``profile`` differ."""
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
