"""The one YAML loader of the lab: experiment files and ``prompts`` trace files.

Plain ``yaml.safe_load`` reads YAML 1.1, whose implicit types surprise: ``0100`` is 64,
``1:30`` is 90, ``no`` is False, ``2024-01-01`` is a date, ``1e9`` is a string, and an
alias bomb (anchors referring to anchors) expands to gigabytes from a few hundred bytes.
This loader reads plain scalars as YAML 1.2's core schema does, and refuses what would be
read differently by the two versions:

- ``true``/``false`` (any case style) are booleans; ``yes``, ``no``, ``on``, ``off`` are
  plain strings (a key that wants a boolean then says "expected true or false");
- integers: ``123``, ``-5``, ``0x1f``, ``0o17``; a decimal with a leading zero (``0100``:
  octal 64 in YAML 1.1) is refused;
- floats: ``1.5``, ``.5``, ``1e9``, ``1.0e-9``, ``.inf``, ``-.inf``, ``.nan``;
- base-60 numbers (``1:30``, 90 in YAML 1.1) are refused;
- ``null``, ``~`` and an empty value are None; dates stay strings;
- anchors (``&a``) and aliases (``*a``) are refused (so ``<<`` merges nothing); so are a key given twice
  in one mapping (plain YAML keeps the last silently), a key that is a list or mapping,
  and nesting deeper than :data:`MAX_DEPTH`;
- Python tags (``!!python/...``) are refused, as by ``yaml.SafeLoader``.

Quote a value (``'0100'``, ``"1:30"``) to keep it a string. Every refusal is one line
naming the file, the line, the key path and what was expected; values shown in messages
are cut by :func:`short_repr`.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

import yaml

from lab.core.errors import ConfigError, UserError

MAX_DEPTH = 64  # levels of nesting; an experiment YAML needs 4
MAX_SHOWN_CHARS = 80  # a value quoted in an error message is cut to this

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 2, 4, 6, 6
_REPR.maxstring = _REPR.maxother = MAX_SHOWN_CHARS


def short_repr(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, without building the whole repr
    of a huge value (a long string or a deep list costs no more than a short one)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_AMBIGUOUS = "tag:sched-lab,2026:ambiguous"
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_OCTAL_LOOKING = re.compile(r"^[-+]?0[0-9_]+$")
_BASE_60 = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class _Loader(yaml.SafeLoader):
    """A SafeLoader with YAML 1.2 core-schema scalars and the refusals listed above."""

    yaml_implicit_resolvers: dict = {}  # filled below, instead of SafeLoader's YAML 1.1 set

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.key_path: list[str] = []

    def compose_node(self, parent, index):
        pushed = isinstance(index, (yaml.ScalarNode, int))
        if pushed:
            self.key_path.append(index.value if isinstance(index, yaml.Node) else f"[{index}]")
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise self.refusal(
                event.start_mark, "anchors and aliases (&, *) are not accepted; write the value out"
            )
        if len(self.key_path) > MAX_DEPTH:
            raise self.refusal(event.start_mark, f"nested more than {MAX_DEPTH} levels deep")
        node = super().compose_node(parent, index)
        if node.tag == _AMBIGUOUS:
            raise self.refusal(node.start_mark, _ambiguity(node.value))
        if isinstance(node, yaml.MappingNode):
            self.check_keys(node)
        if pushed:
            self.key_path.pop()
        return node

    def check_keys(self, node: yaml.MappingNode) -> None:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.refusal(
                    key_node.start_mark,
                    "a mapping key must be a plain value, not a list or mapping",
                )
            if key_node.value in seen:
                self.key_path.append(key_node.value)
                raise self.refusal(
                    key_node.start_mark,
                    f"key {short_repr(key_node.value)} "
                    "appears twice in one mapping (the first value would be lost)",
                )
            seen.add(key_node.value)

    def refusal(self, mark, message: str) -> yaml.MarkedYAMLError:
        where = ".".join(self.key_path).replace(".[", "[")
        if len(where) > MAX_SHOWN_CHARS:
            where = where[: MAX_SHOWN_CHARS - 3] + "..."
        return yaml.constructor.ConstructorError(
            None, None, f"{where}: {message}" if where else message, mark
        )


def _ambiguity(value: str) -> str:
    if ":" in value:
        return (
            f"{short_repr(value)} is a base-60 number in YAML 1.1 and a string in "
            "YAML 1.2; write the number in one unit, or quote the string"
        )
    return (
        f"{short_repr(value)} is an octal number in YAML 1.1 and a decimal one in "
        "YAML 1.2; write it without the leading zero, or quote it"
    )


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    v = node.value
    if v.startswith("0o"):
        return int(v[2:], 8)
    return int(v, 16) if v.startswith("0x") else int(v)


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    v = node.value.lower()
    if v.endswith(".inf"):
        return float("-inf") if v.startswith("-") else float("inf")
    return float("nan") if v == ".nan" else float(v)


for _tag, _regexp, _first in (
    ("tag:yaml.org,2002:bool", _BOOL, "tTfF"),
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    (_AMBIGUOUS, _OCTAL_LOOKING, "-+0"),
    (_AMBIGUOUS, _BASE_60, "-+0123456789"),
    ("tag:yaml.org,2002:int", _INT, "-+0123456789"),
    ("tag:yaml.org,2002:float", _FLOAT, "-+.0123456789"),
):
    _Loader.add_implicit_resolver(_tag, _regexp, list(_first))
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def parse_yaml(text: str) -> Any:
    """Parse YAML text with this module's rules.

    Raises:
        yaml.YAMLError: with a ``problem_mark`` (line) and a ``problem`` naming the key path.
    """
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_yaml_file(
    path: str | Path, what: str = "an experiment YAML", error: type[UserError] = ConfigError
) -> Any:
    """Read and parse a YAML file; every failure is one ``error`` naming ``path``.

    Args:
        what: what the file should be, for messages ("a prompts file").
        error: the UserError subclass raised (ConfigError, TraceError).

    Raises:
        ``error``: not a regular file, missing, unreadable, not UTF-8, or not valid YAML
            (naming the line and key path).
    """
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO would block
        raise error(f"{path}: not a regular file, expected {what} file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected {what} file") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return parse_yaml(text)
    except RecursionError:
        raise error(f"{path}: nested too deeply to be {what}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = (getattr(e, "problem", None) or str(e)).splitlines()[0][:300]
        raise error(f"{path}:{line} is not valid YAML ({problem})") from None
