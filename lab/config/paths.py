"""Where a path written in a YAML file points: the rule, written once.

A path in an experiment YAML (``trace.path``, ``trace.tokenizer``, ``cost_model.profile``,
``cost_model.replay_steps``, ``engine.model_path``):

1. ``~`` expands to the home folder; an absolute path is used as it is;
2. a relative path is taken relative to the folder of the YAML file that holds it;
3. if nothing exists there, the same relative path under :data:`DATA_ROOT` is used when
   something exists there: the bundled data (``traces/data/``, ``experiments/``,
   ``profiles/``), found next to the ``lab`` package in a checkout and in an install.

So ``trace: {path: traces/data/azure2023_conv.csv}`` works from a YAML anywhere, and a YAML
next to its own trace writes the file name alone. A path that exists in neither place
resolves to the first (the YAML's folder), for the error message of whoever needs it.
A YAML built in code (no file) takes its ``base_dir`` from its caller.
"""

from __future__ import annotations

from pathlib import Path

DATA_ROOT = Path(__file__).resolve().parents[2]  # holds lab/, traces/data/, profiles/


def candidates(value: str | Path, base_dir: Path) -> list[Path]:
    """The places ``value`` may point to, in the order they are tried (absolute paths)."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return [path]
    return [Path(base_dir).absolute() / path, DATA_ROOT / path]


def resolve(value: str | Path, base_dir: Path) -> Path:
    """The absolute path ``value`` names (see the module docstring): the first candidate
    that exists, else the first candidate."""
    places = candidates(value, base_dir)
    return next((p for p in places if p.exists()), places[0])


def looked_in(value: str | Path, base_dir: Path) -> str:
    """Where :func:`resolve` looked, for a message: ``/a/x.csv or /lab/root/x.csv``."""
    return " or ".join(str(p) for p in candidates(value, base_dir))
