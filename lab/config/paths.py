"""Where a path written in a YAML file points: the rule, written once.

``~`` expands and an absolute path is used as is; a relative path is taken from the YAML's
folder, else, if something exists there, under :data:`DATA_ROOT` (the bundled
``traces/data/``, ``experiments/``, ``profiles/``). A path found in neither place resolves
to the first, for the error message.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# The folder holding the bundled experiments/, profiles/ and traces/ (packages of sched_lab):
# the repository root in a checkout or an editable install, sched_lab/ in a wheel.
DATA_ROOT = Path(str(files("sched_lab.profiles"))).parent


def candidates(value: str | Path, base_dir: Path) -> list[Path]:
    """The places ``value`` may point to, in the order they are tried (absolute paths)."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return [path]
    return [Path(base_dir).absolute() / path, DATA_ROOT / path]


def resolve(value: str | Path, base_dir: Path) -> Path:
    """The absolute path ``value`` names: the first candidate that exists, else the first."""
    places = candidates(value, base_dir)
    return next((p for p in places if p.exists()), places[0])


def looked_in(value: str | Path, base_dir: Path) -> str:
    """Where :func:`resolve` looked, for a message: ``/a/x.csv or /lab/root/x.csv``."""
    return " or ".join(str(p) for p in candidates(value, base_dir))


def portable(path: str | Path, base_dir: Path) -> str:
    """``path`` (absolute) as a YAML anywhere can name it: relative to :data:`DATA_ROOT` for
    bundled data (a relative path resolves there from any folder that does not hold one of
    its own), else absolute. For config.yaml, which is read again from the results folder."""
    path = Path(path)
    try:
        rel = path.relative_to(DATA_ROOT)
    except ValueError:
        return str(path)
    return rel.as_posix() if resolve(rel, base_dir) == path else str(path)


def shown(path: str | Path, base_dir: Path) -> str:
    """``path`` (absolute) as a report names it: relative to the YAML's folder ``base_dir``
    when it lies under it, else as :func:`portable` writes it."""
    path = Path(path)
    try:
        return path.relative_to(Path(base_dir).absolute()).as_posix()
    except ValueError:
        return portable(path, base_dir)
