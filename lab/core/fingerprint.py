"""The engine fingerprint of a profile, and comparing two.

A fingerprint is a flat JSON dict: ``backend_sources`` (sha256 of the engine's files every
step runs, path and bytes in path order), ``backend_sources_<option>`` (those only an option
runs, e.g. ``quantization``; present when the engine ran it), ``torch``, ``triton``, ``gpu``,
``dtype``, ``attention`` and ``options`` (engine options that change step times).
Made by :mod:`sched_lab.backend.sources` and ``sched_lab.backend.profile.engine_fingerprint``.
"""

from __future__ import annotations

from typing import Any

HEADER_PREFIX = "# fingerprint "  # the profile header line that holds it, then JSON
OPTION_KEY_PREFIX = "backend_sources_"  # then an option (sched_lab.backend.sources)


def differences(profile: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    """Keys where ``profile`` differs from ``engine``, as phrases (``"gpu 'A' vs 'B'"``); keys
    missing from ``engine`` are skipped, missing from ``profile`` differ, but an option's
    sources key (``backend_sources_<option>``), compared only where ``profile`` has it: a
    profile made without the option never ran those files."""
    out = []
    for key, want in engine.items():
        if key.startswith(OPTION_KEY_PREFIX) and key not in profile:
            continue
        have = profile.get(key)
        if have != want:
            if key == "backend_sources":
                out.append(
                    f"backend sources {str(have)[:12]} vs {str(want)[:12]} "
                    "(the engine's code changed since the profile)"
                )
            elif key.startswith(OPTION_KEY_PREFIX):
                option = key.removeprefix(OPTION_KEY_PREFIX)
                out.append(
                    f"{option} sources {str(have)[:12]} vs {str(want)[:12]} "
                    f"(the engine's {option} code changed since the profile)"
                )
            else:
                out.append(f"{key} {have!r} vs {want!r}")
    return out
