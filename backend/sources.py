"""The engine's own sources as hashes: the ``backend_sources*`` keys of an engine fingerprint
(:mod:`sched_lab.core.fingerprint`). Torch-free, so the simulator's callers can ask for them.

``backend_sources`` covers the files every engine step runs. The files that only an engine
option runs (:data:`OPTION_SOURCES`: quantized weights, LoRA, speculation, tensor
parallelism) have a key of their own, ``backend_sources_<option>``, present only in the
fingerprint of an engine that ran the option: a profile measured without quantized weights
stays current when the quantized kernels change (tests/test_fidelity.py checks that a plain
engine run calls no function of those files). The offline tools under ``backend/tools/``
(checkpoint makers, the quantizer, converters) never run inside a timed step and are in no
hash."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

BACKEND_DIR = Path(__file__).resolve().parent

# option -> the files (relative to backend/) only an engine with that option runs
OPTION_SOURCES: dict[str, tuple[str, ...]] = {
    "quantization": ("quant_gemv.py", "quant_kernels.py", "quant_linear.py"),
    "lora": ("lora_kernels.py", "lora_tiles.py"),
    "speculative": ("spec_decode.py", "verify.py"),
    "tensor_parallel": ("tp_engine.py",),
    "prefill_exp2": ("attention/prefill_exp2.py",),
}
KEY = "backend_sources"  # the core files' key; an option's is f"{KEY}_{option}"


def backend_sources_hash(backend_dir: Path = BACKEND_DIR, option: str | None = None) -> str | None:
    """sha256 (hex) of the engine's files (relative paths and bytes, in path order): with
    ``option`` None, ``backend_dir/**/*.py`` but ``tools/`` and every option's files; else
    that option's files (a key of :data:`OPTION_SOURCES`; KeyError otherwise). None when the
    folder is absent."""
    if not backend_dir.is_dir():
        return None
    by_option = {name for names in OPTION_SOURCES.values() for name in names}
    wanted = set(OPTION_SOURCES[option]) if option is not None else None
    digest = hashlib.sha256()
    for path in sorted(backend_dir.rglob("*.py")):
        rel = path.relative_to(backend_dir)
        if "__pycache__" in rel.parts or rel.parts[0] == "tools":
            continue
        name = rel.as_posix()
        if (name not in wanted) if wanted is not None else (name in by_option):
            continue
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def sources_fingerprint(options: Iterable[str] = (), backend_dir: Path = BACKEND_DIR) -> dict:
    """The ``backend_sources*`` keys of an engine that ran ``options`` (keys of
    :data:`OPTION_SOURCES`), or {} when ``backend_dir`` is absent."""
    core = backend_sources_hash(backend_dir)
    if core is None:
        return {}
    out = {KEY: core}
    for option in sorted(set(options)):
        out[f"{KEY}_{option}"] = backend_sources_hash(backend_dir, option)
    return out


def checkout_engine() -> dict[str, str]:
    """This checkout's engine sources hashes, the core files' and every option's (the
    ``engine`` argument of :func:`sched_lab.sim.calibrated.staleness`, which compares an
    option's key only where the profile has it)."""
    return sources_fingerprint(OPTION_SOURCES)
