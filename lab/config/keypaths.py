"""Dotted key paths into an experiment mapping: ``kv_cache.num_gpu_blocks``,
``policies.chunked_prefill.max_num_batched_tokens`` (a policy by label), ``policies[2].x``
(by index); ``rate_scale`` is short for ``trace.rate_scale`` (:data:`ALIASES`). Sweeps
(:mod:`sched_lab.sweeps.sweep`) and the capacity search (:mod:`sched_lab.sweeps.search`) set values through them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sched_lab.config.policy_entries import DEFAULT_POLICIES
from sched_lab.core.errors import ConfigError, short_repr

ALIASES = {"rate_scale": "trace.rate_scale"}
_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_+-]*)((?:\[[0-9]+\])*)$")
_INDEX = re.compile(r"\[([0-9]+)\]")

Key = str | int  # a path segment: a mapping key (or a policy label), or a list index


def parse_path(path: str, where: str) -> list[Key]:
    """``policies[2].max_num_seqs`` -> ``["policies", 2, "max_num_seqs"]``."""
    out: list[Key] = []
    for seg in path.split("."):
        m = _SEGMENT.match(seg)
        if not m:
            raise ConfigError(
                f"{where}: {short_repr(path)}: expected a dotted key path such as "
                "kv_cache.num_gpu_blocks or policies[0].max_num_seqs"
            )
        out.append(m.group(1))
        out.extend(int(i) for i in _INDEX.findall(m.group(2)))
    return out


def set_path(raw: dict, path: str, value: Any, where: str) -> None:
    """Set ``value`` at the dotted key ``path`` of an experiment mapping, in place, creating
    missing mappings; in ``policies`` a name segment picks the entry of that label (or
    name), turning a plain name into a mapping.

    Raises:
        ConfigError: a step through a non-container, an index beyond a list, or no policy
            of that label.
    """
    path = ALIASES.get(path, path)
    keys = parse_path(path, where)
    node: Any = raw
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        done = _show_path(keys[:i])
        if isinstance(node, list) and last and _every_class(node, k, done):
            _set_in_every_class(node, k, value)
        elif isinstance(node, list):
            j = _list_index(node, k, done, path, where)
            if last:
                node[j] = value
            else:
                if isinstance(node[j], str) and done == "policies":
                    node[j] = {"name": node[j]}
                node[j] = _descend(node[j], f"{done}[{j}]", path, where)
                node = node[j]
        elif isinstance(node, dict):
            if not isinstance(k, str):
                raise ConfigError(f"{where}: {path}: {done or 'the top level'} is a mapping, "
                                  f"not a list")  # fmt: skip
            if last:
                node[k] = value
            else:
                if k not in node and k == "policies":
                    node[k] = list(DEFAULT_POLICIES)
                node[k] = _descend(node.get(k), _show_path(keys[: i + 1]), path, where)
                node = node[k]


def _every_class(node: list, k: Key, done: str) -> bool:
    """``trace.KEY`` on a trace given as workload classes (KEY not a class's name): a key
    of every class."""
    return done == "trace" and isinstance(k, str) and k not in [_entry_label(e) for e in node]


def _set_in_every_class(classes: list, k: str, value: Any) -> None:
    """``rate_scale`` multiplies each class's own (the mix of classes is kept); ``limit`` is
    shared among the classes (as ``ExperimentConfig.with_trace`` shares it); any other key
    is set in each."""
    for i, c in enumerate(classes):
        c = classes[i] = dict(c) if isinstance(c, Mapping) else c
        if not isinstance(c, dict):
            continue  # the config's check names the bad entry
        if k == "rate_scale" and isinstance(value, (int, float)) and not isinstance(value, bool):
            own = c.get("rate_scale", 1.0)
            c[k] = own * value if isinstance(own, (int, float)) else value
        elif k == "limit" and isinstance(value, int) and not isinstance(value, bool):
            c[k] = max(1, value // len(classes))
        else:
            c[k] = value


def _descend(node: Any, at: str, path: str, where: str) -> Any:
    if node is None or (isinstance(node, Mapping) and not isinstance(node, dict)):
        node = {} if node is None else dict(node)
    if not isinstance(node, (dict, list)):
        raise ConfigError(
            f"{where}: {path}: {at} is {short_repr(node)}, not a mapping or list to set a key in"
        )
    return node


def _list_index(node: list, k: Key, done: str, path: str, where: str) -> int:
    if isinstance(k, int):
        if k >= len(node):
            raise ConfigError(f"{where}: {path}: {done} has {len(node)} entries, no [{k}]")
        return k
    names = [_entry_label(e) for e in node]
    if k not in names:
        raise ConfigError(
            f"{where}: {path}: no entry of {done} is labelled {k!r}; labels: "
            + ", ".join(str(n) for n in names)
        )
    return names.index(k)


def _entry_label(entry: Any) -> Any:
    if isinstance(entry, Mapping):
        return entry.get("label", entry.get("name"))
    return entry


def _show_path(keys: list[Key]) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else (f".{k}" if i else k)
                   for i, k in enumerate(keys))  # fmt: skip


def get_path(raw: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted key path of a mapping, or None where it is absent."""
    node: Any = raw
    for k in parse_path(ALIASES.get(path, path), path):
        if isinstance(node, list) and isinstance(k, str):
            names = [_entry_label(e) for e in node]
            node = node[names.index(k)] if k in names else None
        elif isinstance(node, list):
            node = node[k] if k < len(node) else None
        elif isinstance(node, Mapping):
            node = node.get(k)
        else:
            return None
    return node
