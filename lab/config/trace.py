"""The ``trace:`` section: :class:`TraceConfig` (one trace spec) or :class:`ClassesConfig`
(workload classes); both answer ``classes``, ``tenants``, ``rate_scales``, ``expected``,
``format``, ``path`` and ``to_dict``."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sched_lab.config import paths
from sched_lab.config.sections import parse_slo
from sched_lab.config.walker import Context, check_int, check_mapping, check_num, existing, fail
from sched_lab.core.errors import ConfigError
from sched_lab.traces.classes import CLASS_KEYS
from sched_lab.traces.table import CACHE_KEYS

# Outside this, arrival times lose float precision (an hour-long trace at 1e-12 spans
# 3.6e15 s, where doubles are 0.5 s apart) or the trace collapses into one instant.
RATE_SCALE_RANGE = (1e-6, 1e6)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+ -]*")  # it names runs in tables and plots
_SHA256 = re.compile(r"[0-9a-f]{64}")


def scale_label(scale: float) -> str:
    """How a rate_scale names its runs when there are several: ``{label}@x{scale_label}``."""
    return f"{scale:g}"


@dataclass(frozen=True)
class TraceConfig:
    """``trace:`` as one trace; ``spec`` goes to :mod:`traces` as written (checked at load).

    Args:
        spec: the block, paths absolute (``rate_scale`` included).
        rate_scales: the offered-load multipliers, one run per policy each (>= 1 entry).
        expected: ``trace_file`` of a results' config.yaml, or None.
    """

    spec: Mapping[str, Any]
    rate_scales: tuple[float, ...] = (1.0,)
    expected: Mapping[str, Any] | None = None

    classes = ()  # no workload classes: see ClassesConfig
    tenants = frozenset()  # of workload classes: none

    @property
    def format(self) -> str | None:
        return self.spec.get("format")

    @property
    def path(self) -> Path | None:
        """The trace file (absolute), or None for generated traces."""
        p = self.spec.get("path")
        return Path(p) if isinstance(p, str) else None

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.spec))


@dataclass(frozen=True)
class ClassesConfig:
    """``trace:`` as workload classes: each a mapping of :data:`sched_lab.traces.classes.CLASS_KEYS`
    plus a trace spec, paths absolute, with one ``rate_scale`` number each, so
    ``rate_scales == (1.0,)``."""

    classes: tuple[Mapping[str, Any], ...]

    rate_scales = (1.0,)
    expected = None  # no trace_file: the classes' files are not checked against one
    path = None
    format = "classes"  # names the workload in messages; no trace format of traces/

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants the workload classes name."""
        return frozenset(c.get("tenant", "") for c in self.classes) - {""}

    def to_dict(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(dict(c)) for c in self.classes]


Workload = TraceConfig | ClassesConfig


def parse_trace(
    ctx: Context, raw: Mapping[str, Any], expected: Mapping[str, Any] | None, key: str = "trace"
) -> TraceConfig:
    """One trace spec: ``rate_scale`` checked, paths made absolute (``path`` must exist)."""
    where = ctx.where
    spec = copy.deepcopy(dict(raw))
    rs = spec.get("rate_scale", 1.0)
    if rs == []:
        raise fail(where, f"{key}.rate_scale", "a number > 0 or a non-empty list of them", rs)
    lo, hi = RATE_SCALE_RANGE
    for v in rs if isinstance(rs, list) else [rs]:
        check_num(where, f"{key}.rate_scale", v, lo=0.0, lo_open=True)
        if not lo <= v <= hi:
            raise fail(
                where,
                f"{key}.rate_scale",
                f"a number in [{lo:g}, {hi:g}] (outside it arrival times lose float precision)",
                v,
            )
    scales = tuple(float(v) for v in (rs if isinstance(rs, list) else [rs]))
    names = [scale_label(v) for v in scales]
    if len(set(names)) != len(names):
        raise fail(
            where,
            f"{key}.rate_scale",
            "distinct values (to 6 significant digits: they name the runs, as 'fcfs@x2')",
            rs,
        )
    if isinstance(spec.get("path"), str) and spec["path"]:
        spec["path"] = str(existing(ctx, f"{key}.path", spec["path"], "file"))
    if isinstance(spec.get("tokenizer"), str) and spec["tokenizer"]:
        spec["tokenizer"] = str(paths.resolve(spec["tokenizer"], ctx.base_dir))
    return TraceConfig(MappingProxyType(spec), scales, expected)


def parse_classes(ctx: Context, raw: list) -> ClassesConfig:
    """``trace:`` as a list of workload classes (one ``rate_scale`` number each)."""
    where = ctx.where
    if not raw:
        raise fail(where, "trace", "a mapping, or a non-empty list of workload classes", raw)
    classes, names = [], set()
    for i, c in enumerate(raw):
        key = f"trace[{i}]"
        if not isinstance(c, Mapping):
            raise fail(where, key, "a workload class: a mapping with name and a trace spec", c)
        name = c.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in names:
            why = "a name used by no other class" if name in names else "a class name"
            raise fail(where, f"{key}.name", f"{why} (letters, digits, '.', '_', '-')", name)
        names.add(name)
        prio = c.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise fail(where, f"{key}.priority", "an integer (lower runs first)", prio)
        tenant = c.get("tenant", "")
        if not isinstance(tenant, str) or (tenant and not LABEL.fullmatch(tenant)):
            raise fail(where, f"{key}.tenant", "a tenant name (letters, digits, ._+- )", tenant)
        cache_names = {k: c[k] for k in CACHE_KEYS if k in c}
        for k, v in cache_names.items():
            if not isinstance(v, str) or not v:
                raise fail(where, f"{key}.{k}", "a non-empty string", v)
        slo = parse_slo(ctx, c.get("slo", {}), f"{key}.slo")
        periods = parse_periods(where, f"{key} (class {name!r}).periods", c.get("periods"))
        spec = {k: v for k, v in c.items() if k not in CLASS_KEYS}
        if "format" not in spec:
            raise ConfigError(
                f"{where}: {key}: class {name!r} has no trace: give its 'format' and the "
                "format's keys, as for a single trace"
            )
        if isinstance(spec.get("rate_scale"), list):
            raise fail(
                where, f"{key}.rate_scale", "a number (one load per class)", spec["rate_scale"]
            )
        one = parse_trace(ctx, spec, None, key)
        own = {"name": name, "priority": prio, "tenant": tenant, **cache_names}
        if "slo" in c:
            own["slo"] = {k: v for k, v in slo.to_dict().items() if v is not None}
        if periods is not None:
            own["periods"] = periods
        classes.append(MappingProxyType({**own, **one.spec}))
    return ClassesConfig(tuple(classes))


def parse_periods(where: str, key: str, raw: Any) -> list[list[float | None]] | None:
    """A class's ``periods``: a non-empty list of ``[on_s, off_s]`` pairs on the run's clock,
    0 <= on_s < off_s, sorted and disjoint; only the last ``off_s`` may be null (on to the
    end). None when absent."""
    if raw is None:
        return None
    expected = (
        "a non-empty list of [start_s, end_s] pairs in seconds of the run, "
        "0 <= start_s < end_s, sorted and disjoint (the last end_s may be null: open)"
    )
    if not isinstance(raw, list) or not raw:
        raise fail(where, key, expected, raw)
    out, last_end = [], 0.0
    for i, pair in enumerate(raw):
        ok = isinstance(pair, list) and len(pair) == 2
        ok = ok and all(_number(v) for v in pair[:1]) and (_number(pair[1]) or pair[1] is None)
        if not ok:
            raise fail(
                where, f"{key}[{i}]", "[start_s, end_s], two numbers (end_s may be null)", pair
            )
        on, off = float(pair[0]), None if pair[1] is None else float(pair[1])
        if on < last_end or (off is not None and off <= on) or (off is None and i < len(raw) - 1):
            raise fail(where, f"{key}[{i}]", expected, pair)
        out.append([on, off])
        last_end = off if off is not None else on
    return out


def _number(v: Any) -> bool:
    """A finite real number (bools are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_workload(ctx: Context, raw: Mapping[str, Any]) -> Workload:
    """The ``trace:`` section (and ``trace_file:``) of a top-level mapping, either variant."""
    trace = raw.get("trace")
    if "trace" not in raw or not isinstance(trace, (Mapping, list)):
        raise fail(
            ctx.where, "trace", "a mapping with at least 'format', or a list of classes", trace
        )
    expected = parse_trace_file(ctx, raw["trace_file"]) if "trace_file" in raw else None
    if isinstance(trace, list):
        return parse_classes(ctx, trace)
    return parse_trace(ctx, trace, expected)


def parse_trace_file(ctx: Context, raw: Any) -> Mapping[str, Any]:
    d = check_mapping(ctx.where, "trace_file", raw, ("path", "sha256", "rows"))
    sha = d.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256.fullmatch(sha)):
        raise fail(ctx.where, "trace_file.sha256", "64 hexadecimal digits or null", sha)
    check_int(ctx.where, "trace_file.rows", d.get("rows"), lo=0, optional=True)
    return MappingProxyType(dict(d))


def with_keys(ctx: Context, trace: Workload, keys: Mapping[str, Any]) -> Workload:
    """``trace`` with spec keys replaced (see :meth:`ExperimentConfig.with_trace`)."""
    if isinstance(trace, ClassesConfig):
        n = len(trace.classes)
        if "limit" in keys and isinstance(keys["limit"], int) and keys["limit"] >= 1:
            keys = {**keys, "limit": max(1, keys["limit"] // n)}
        return parse_classes(ctx, [{**c, **keys} for c in trace.classes])
    expected = None if {"path", "format"} & set(keys) else trace.expected
    return parse_trace(ctx, {**trace.spec, **keys}, expected)
