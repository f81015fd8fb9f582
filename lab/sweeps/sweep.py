"""Sweeps: one experiment YAML expanded into many points (``sweep: {grid:, points:}``), each
a whole experiment validated before anything runs. Layout and order: docs/sweeps.md.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sched_lab.config import MAX_NAME_CHARS, SWEEP_KEYS, TOP_KEYS, check_name, paths, validate
from sched_lab.config.keypaths import ALIASES, get_path, parse_path, set_path  # noqa: F401 (get_path: re-exported)
from sched_lab.config.walker import check_mapping
from sched_lab.core.errors import ConfigError, UserError, short_repr
from sched_lab.sweeps.search import parse_search
from sched_lab.traces.readers import load_yaml_file

# Points a sweep may have unless sweep.max_points or --max-points says more: each point is
# validated (about a millisecond) and kept in memory before the first runs.
MAX_POINTS = 10_000
# The most points either may raise it to: a million points take about 5 GB and 8 minutes to
# make and check before the first one runs; beyond that a sweep would exhaust memory.
MAX_POINTS_CEILING = 1_000_000
NOT_SWEPT = ("name", "sweep", "search", "trace_file")  # keys a point cannot set


@dataclass(frozen=True)
class Point:
    """One point: its name (``p003``), the values it sets (dotted path -> value) and its
    experiment mapping."""

    name: str
    values: Mapping[str, Any]
    raw: Mapping[str, Any]

    def describe(self) -> str:
        """``kv_cache.num_gpu_blocks=1024, trace.rate_scale=2`` (values cut short)."""
        return ", ".join(f"{k}={short_repr(v, 40)}" for k, v in self.values.items()) or "base"


@dataclass(frozen=True)
class Sweep:
    """A sweep YAML. ``keys``: swept key paths in column order (grid keys after point keys);
    ``raw``: the YAML as read."""

    name: str
    source: str
    base_dir: Path
    points: tuple[Point, ...]
    keys: tuple[str, ...]
    raw: Mapping[str, Any]
    search: Any = None  # sched_lab.sweeps.search.SearchSpec or None
    configs: Mapping[str, Any] = field(default_factory=dict)  # point name -> ExperimentConfig


def is_sweep(raw: Any) -> bool:
    """Whether a parsed YAML is a sweep (has ``sweep:`` or ``search:``)."""
    return isinstance(raw, Mapping) and any(k in raw for k in SWEEP_KEYS)


def read_yaml(path: str | Path) -> tuple[Path, Any]:
    """The YAML file (resolved as :func:`sched_lab.config.load_config` does) and its content."""
    path = Path(path).expanduser()
    if not path.exists():
        bundled = paths.resolve(path, Path.cwd())
        path = bundled if bundled.is_file() else path
    return path, load_yaml_file(path)


def load_sweep(
    path: str | Path,
    limit: int | None = None,
    raw: Any = None,
    check_traces: bool = True,
    max_points: int | None = None,
) -> Sweep:
    """Read a sweep YAML and validate every point.

    Args:
        limit: replay only the first ``limit`` requests of each trace (``--limit``).
        raw: the parsed YAML, if read already.
        check_traces: load each distinct trace spec once to check it.
        max_points: the most points accepted (``--max-points``); default the YAML's
            ``sweep.max_points``, else :data:`MAX_POINTS`.

    Raises:
        ConfigError: one line naming the file, the point and the key.
    """
    if raw is None:
        path, raw = read_yaml(path)
    path = Path(path)
    where = str(path)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys at the top level")
    check_mapping(where, "", raw, (*TOP_KEYS, *SWEEP_KEYS))  # once, not at every point
    if raw.get("name") is not None:
        name = check_name(where, "name", raw["name"])
    else:
        name = check_name(where, "name (from the file name)", path.stem)
    base = {k: copy.deepcopy(v) for k, v in raw.items() if k not in SWEEP_KEYS}
    combos, keys = expand(raw.get("sweep"), where, max_points)
    width = max(3, len(str(len(combos) - 1)))
    points = []
    for i, values in enumerate(combos):
        pname = f"p{i:0{width}d}"
        praw = copy.deepcopy(base)
        for key, value in values.items():
            set_path(praw, key, copy.deepcopy(value), f"{where}: sweep point {pname}")
        if limit is not None:  # after the point's values, which may set the trace
            praw["trace"] = _with_limit(praw.get("trace"), limit)
        praw["name"] = f"{name[: MAX_NAME_CHARS - len(pname) - 1]}-{pname}"
        points.append(Point(pname, values, praw))
    search = None
    if "search" in raw:
        search = parse_search(raw["search"], where, keys)
    base_dir = path.absolute().parent
    configs = {}
    traces = _TraceChecks(base_dir)
    for p in points:
        cfg = _validate_point(p, where, base_dir)
        configs[p.name] = cfg
        if search is not None:
            search.check(cfg, p, where)
        else:  # a search's probes set its key themselves; one the config refuses is a miss
            _check_before_runs(cfg, p, where)
        if check_traces:
            try:
                traces.check(cfg)
            except UserError as e:
                msg = str(e).removeprefix(f"{cfg.name}: ")
                raise ConfigError(
                    f"{where}: sweep point {p.name} ({p.describe()}): {msg}"
                ) from None
    return Sweep(name, where, base_dir, tuple(points), keys, raw, search, configs)


def _with_limit(trace: Any, limit: int) -> Any:
    """A point's ``trace`` with ``limit`` (``--limit``) in place of its own; with workload
    classes, shared among them as :meth:`ExperimentConfig.with_trace` shares it (anything
    else is left to the point's validation)."""
    if isinstance(trace, list) and trace and all(isinstance(c, Mapping) for c in trace):
        share = max(1, limit // len(trace))
        return [{**c, "limit": share} for c in trace]
    return {**trace, "limit": limit} if isinstance(trace, Mapping) else trace


class _TraceChecks:
    """Each distinct trace of a sweep's points (by spec and seed) loaded once, and with the
    prefix cache on, its prefix identity checked as the runs will (before any runs); with a
    cluster pool routed by prefix, its hash ids too."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.seen: set[str] = set()
        self.checked: set[tuple[str, int, bool]] = set()
        self.routed: set[str] = set()  # traces whose hash ids a prefix router was checked on
        self.last: tuple[str | None, Any] = (None, None)  # the latest trace loaded

    def check(self, cfg: Any) -> None:
        """UserError if ``cfg``'s trace cannot be read, cannot be cached as it asks, or gives
        a prefix router no hash ids."""
        from sched_lab.run.experiment import (
            check_prefix_identity,
            check_router_keys,
            prefix_routed_pools,
        )
        from sched_lab.setup import setup_class

        if cfg.trace.classes:
            spec: Any = [dict(c) for c in cfg.trace.classes]
        else:
            spec = {k: v for k, v in cfg.trace.spec.items() if k != "rate_scale"}
        ident = json.dumps({"seed": cfg.seed, "trace": spec}, sort_keys=True, default=str)
        caching = any(pol.prefix_caching(cfg.kv_cache) for pol in cfg.policies)
        token_ids = setup_class(cfg.backend).token_ids
        routed = bool(prefix_routed_pools(cfg))
        key = (ident, cfg.kv_cache.block_size, token_ids)
        if (
            ident in self.seen
            and (not caching or key in self.checked)
            and (not routed or ident in self.routed)
        ):
            return
        loaded = self._load(cfg, ident)
        if caching or routed:
            requests = loaded if isinstance(loaded, list) else loaded.to_requests()
            self.last = (ident, requests)
        if caching:
            check_prefix_identity(requests, cfg, token_ids)
            self.checked.add(key)
        if routed:
            check_router_keys(requests, cfg)
            self.routed.add(ident)

    def _load(self, cfg: Any, ident: str) -> Any:
        """The trace's requests (workload classes) or table."""
        from sched_lab.traces import load_table
        from sched_lab.traces.classes import load_classes

        if self.last[0] == ident:
            return self.last[1]
        if cfg.trace.classes:
            loaded, _ = load_classes(cfg.trace.classes, self.base_dir, cfg.seed, cfg.slo.ttft_s)
        else:
            loaded, _ = load_table({"seed": cfg.seed, **cfg.trace.spec}, self.base_dir)
        self.seen.add(ident)
        self.last = (ident, loaded)
        return loaded


def _check_before_runs(cfg: Any, p: Point, where: str) -> None:
    from sched_lab.run.experiment import check_before_runs

    try:
        check_before_runs(cfg)
    except UserError as e:
        msg = str(e).removeprefix(f"{where}: ")
        raise ConfigError(f"{where}: sweep point {p.name} ({p.describe()}): {msg}") from None


def _validate_point(p: Point, where: str, base_dir: Path):
    try:
        return validate(p.raw, where, base_dir)
    except UserError as e:
        msg = str(e).removeprefix(f"{where}: ")
        raise ConfigError(f"{where}: sweep point {p.name} ({p.describe()}): {msg}") from None


def point_config(sweep: Sweep, point: Point, **changes: Any):
    """The validated :class:`~sched_lab.config.ExperimentConfig` of ``point``, with ``changes``
    (key path -> value) set first."""
    raw = copy.deepcopy(dict(point.raw))
    for key, value in changes.items():
        set_path(raw, key, value, sweep.source)
    return validate(raw, sweep.source, sweep.base_dir)


# ---------------------------------------------------------------------------- expansion
def expand(
    spec: Any, where: str, max_points: int | None = None
) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The points of a ``sweep:`` block (None: one empty point; explicit points in turn,
    each with every grid combination, last grid key fastest) and the swept key paths.
    The points are counted before they are made.

    Args:
        max_points: the most points accepted; None: ``sweep.max_points``, else
            :data:`MAX_POINTS`.

    Raises:
        ConfigError: a malformed block, a key given twice or one that cannot be swept, or
            more points than ``max_points``.
    """
    if spec is None:
        return [{}], ()
    if not isinstance(spec, Mapping) or not spec:
        raise ConfigError(
            f"{where}: sweep: expected a mapping with grid and/or points, got {short_repr(spec)}"
        )
    for k in spec:
        if k not in ("grid", "points", "max_points"):
            raise ConfigError(f"{where}: unknown key sweep.{k}; allowed: grid, points, max_points")
    if "max_points" in spec:
        own = spec["max_points"]
        check_max_points(f"{where}: sweep.max_points", own)
        if max_points is None:
            max_points = own
    if max_points is None:
        max_points = MAX_POINTS
    check_max_points(f"{where}: max_points", max_points)
    if not any(k in spec for k in ("grid", "points")):
        raise ConfigError(
            f"{where}: sweep: expected a mapping with grid and/or points, got {short_repr(spec)}"
        )
    grid = spec.get("grid", {})
    if not isinstance(grid, Mapping) or ("grid" in spec and not grid):
        raise ConfigError(
            f"{where}: sweep.grid: expected a mapping of key paths to non-empty lists of "
            f"values, got {short_repr(grid)}"
        )
    axes = []
    for key, values in grid.items():
        path = _key(key, f"{where}: sweep.grid")
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{where}: sweep.grid.{key}: expected a non-empty list of values, "
                f"got {short_repr(values)}"
            )
        if path in (a for a, _ in axes):
            raise ConfigError(f"{where}: sweep.grid: {path} is given twice")
        axes.append((path, values))
    explicit = spec.get("points", [{}])
    if not isinstance(explicit, list) or not explicit:
        raise ConfigError(
            f"{where}: sweep.points: expected a non-empty list of mappings, "
            f"got {short_repr(explicit)}"
        )
    point_keys: list[str] = []
    rows = []
    for i, p in enumerate(explicit):
        if not isinstance(p, Mapping) or (not p and "points" in spec):
            raise ConfigError(
                f"{where}: sweep.points[{i}]: expected a non-empty mapping of key paths to "
                f"values, got {short_repr(p)}"
            )
        row = {}
        for key, value in p.items():
            path = _key(key, f"{where}: sweep.points[{i}]")
            if path in row:
                raise ConfigError(f"{where}: sweep.points[{i}]: {path} is given twice")
            if path in (a for a, _ in axes):
                raise ConfigError(
                    f"{where}: sweep.points[{i}]: {path} is a grid key too; give it in one place"
                )
            row[path] = value
            if path not in point_keys:
                point_keys.append(path)
        rows.append(row)
    count = len(rows) * math.prod(len(v) for _, v in axes)
    if count > max_points:
        factors = [len(rows)] * (len(rows) > 1) + [len(v) for _, v in axes]
        product = " x ".join(map(str, factors)) + " = " if len(factors) > 1 else ""
        if count > MAX_POINTS_CEILING:
            raise ConfigError(
                f"{where}: sweep: {product}{count:,} points, more than any sweep may have "
                f"({MAX_POINTS_CEILING:,}: every point is made and checked in memory before "
                "the first runs); split it into smaller sweeps"
            )
        raise ConfigError(
            f"{where}: sweep: {product}{count:,} points, more than the limit of "
            f"{max_points:,}; raise it with sweep.max_points or --max-points if you mean it"
        )
    combos = [
        {**row, **dict(zip([a for a, _ in axes], values))}
        for row in rows
        for values in itertools.product(*(v for _, v in axes))
    ]
    return combos, (*point_keys, *(a for a, _ in axes))


def check_max_points(where: str, value: Any) -> None:
    """ConfigError (``where``: the file and key, or the flag) unless ``value`` is an integer
    in [1, :data:`MAX_POINTS_CEILING`]."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_POINTS_CEILING
    ):
        raise ConfigError(
            f"{where}: expected an integer in [1, {MAX_POINTS_CEILING:,}] (every point is made "
            f"and checked in memory before the first runs), got {short_repr(value)}"
        )


def _key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: expected a key path such as kv_cache.num_gpu_blocks, got "
                          f"{short_repr(key)}")  # fmt: skip
    key = ALIASES.get(key, key)
    parse_path(key, where)
    if key.split(".")[0].split("[")[0] in NOT_SWEPT:
        raise ConfigError(f"{where}: {key}: cannot be swept (each point is named after the sweep)")
    return key
