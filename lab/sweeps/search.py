"""Capacity search: the largest load that still meets a target, per policy and config (as
capacity in Sarathi-Serve, OSDI'24 §5, and DistServe's goodput, OSDI'24 §2).

    search: {metric: slo_attainment, target: 0.9, over: rate_scale, tolerance: 0.02}

``metric``: ``slo_attainment`` (met when >= ``target`` in (0, 1]; needs ``slo:``) or a
latency statistic by its summary name, ``{mean,median,std,max,p<P>}_{ttft,tpot,itl,e2el,queue}_ms``
(met when <= ``target`` milliseconds; P: a percentile the report holds, 50, 90, 99 and
``report.metric_percentiles``). The older ``ttft_s_p99`` names are accepted with ``target`` in
seconds (:func:`sched_lab.results.names.canonical`).
``over``: the load's key path (default ``trace.rate_scale``), assumed to worsen the metric
as it grows. A run that stops early counts as a miss.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sched_lab.config import ExperimentConfig
from sched_lab.config.keypaths import ALIASES, get_path, parse_path
from sched_lab.config.sections import LIMIT_KEYS
from sched_lab.core.errors import ConfigError, UserError, short_repr
from sched_lab.results.metrics import summary_percentiles
from sched_lab.results.names import canonical, parse_latency

METRIC_HELP = (
    "slo_attainment, or a latency {mean,median,std,max,p<P>}_{ttft,tpot,itl,e2el,queue}_ms "
    "(e.g. p99_ttft_ms)"
)
SEARCH_KEYS = ("metric", "target", "over", "lo", "hi", "tolerance")
DEFAULT_TOLERANCE = 0.02  # relative width of the final bracket
MAX_EXPANSIONS = 12  # doublings or halvings to find a bracket: a factor of 4096 either way


@dataclass(frozen=True)
class SearchSpec:
    """The ``search:`` block, validated."""

    metric: str
    target: float
    over: str = "trace.rate_scale"
    lo: float | None = None
    hi: float | None = None
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "slo_attainment"

    def meets(self, value: float) -> bool:
        """Whether a metric value meets the target (NaN never does)."""
        if value is None or not math.isfinite(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target

    def check(self, cfg, point, where: str) -> None:
        """ConfigError unless a point's config has what this search needs."""
        if self.metric == "slo_attainment" and not any(cfg.slo.to_dict().values()):
            raise ConfigError(
                f"{where}: search.metric: slo_attainment needs an slo: block with at "
                "least one of ttft_s, tpot_s, e2e_s"
            )
        stat = (parse_latency(self.metric) or ("",))[0]
        held = summary_percentiles(cfg.report.metric_percentiles)
        if stat.startswith("p") and float(stat[1:]) not in held:
            raise ConfigError(
                f"{where}: search.metric: {self.metric} needs {stat[1:]} in "
                f"report.metric_percentiles (the summary holds {', '.join(f'{p:g}' for p in held)})"
            )
        if self.lo is None and self.start(cfg, point) is None:
            raise ConfigError(
                f"{where}: search: sweep point {point.name} has no single number at "
                f"{self.over} to start from; give search.lo and search.hi"
            )

    @property
    def integer(self) -> bool:
        """Whether ``over`` holds whole numbers (:func:`whole_number_key`)."""
        return whole_number_key(self.over)

    def start(self, cfg, point) -> float | None:
        """The value the search starts from without ``lo``/``hi``: the config's own (the
        point's, else the default; for ``kv_cache.num_gpu_blocks`` left to a backend with a
        cheap :meth:`~sched_lab.setup.Setup.prepare`, the number it sizes from memory)."""
        if self.over == "trace.rate_scale":
            return cfg.rate_scales[0] if len(cfg.rate_scales) == 1 else None
        v = get_path(point.raw, self.over)
        if v is None:
            v = get_path(cfg.to_dict(), self.over)
        if v is None and self.over == "kv_cache.num_gpu_blocks":
            from sched_lab.setup import setup_for

            setup = setup_for(cfg)
            if setup.cheap_prepare:
                try:
                    setup.prepare()
                    v = setup.num_gpu_blocks
                except UserError:
                    v = None
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        if not (ok and math.isfinite(v)):
            return None
        return int(v) if self.integer and v >= 1 else float(v)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SEARCH_KEYS}


# lo / hi of a search: floats hold every integer up to 2**53 exactly; well past any limit
# (MAX_LIMIT 2**40) or load scale a search could need.
MAX_BOUND = 1 << 53


def whole_number_key(path: str) -> bool:
    """Whether the config key at ``path`` holds whole numbers: a field typed ``int`` of a
    config section's dataclass (``kv_cache.num_gpu_blocks``, ``scheduler.max_num_seqs``:
    lab/config/sections.py; ``lora.max_loras`` of a section that may be absent), a cluster
    pool's ``replicas`` or a policy's limit (``policies.chunked_prefill.max_num_seqs``)."""
    keys = path.replace("[", ".").replace("]", "").split(".")
    if keys[0] == "policies":
        return keys[-1] in LIMIT_KEYS
    if keys[0] == "cluster":  # its pools' replicas (cluster.replicas, cluster.decode.replicas)
        return keys[-1] == "replicas"
    if len(keys) != 2:
        return False
    section = typing.get_type_hints(ExperimentConfig).get(keys[0])
    present = set(typing.get_args(section)) - {type(None)}  # a section that may be absent
    section = present.pop() if len(present) == 1 else section
    if not dataclasses.is_dataclass(section):
        return False
    hint = typing.get_type_hints(section).get(keys[1])
    kinds = set(typing.get_args(hint)) - {type(None)} if typing.get_args(hint) else {hint}
    return kinds == {int}


def parse_search(raw: Any, where: str, swept: tuple[str, ...] = ()) -> SearchSpec:
    """Validate a ``search:`` block; ``over`` must not be one of ``swept``. ConfigError (one
    line naming the key) otherwise."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: search: expected a mapping, got {short_repr(raw)}")
    for k in raw:
        if k not in SEARCH_KEYS:
            raise ConfigError(f"{where}: unknown key search.{k}; allowed: {', '.join(SEARCH_KEYS)}")
    given = raw.get("metric")
    metric, scale = canonical(given) if isinstance(given, str) else (None, 1.0)
    if metric != "slo_attainment" and (metric is None or parse_latency(metric) is None):
        raise ConfigError(
            f"{where}: search.metric: unknown metric {short_repr(given)}; known: {METRIC_HELP}"
        )
    target = raw.get("target")
    number = isinstance(target, (int, float)) and not isinstance(target, bool)
    unit = "seconds" if scale != 1.0 else "milliseconds"
    if metric == "slo_attainment":
        if not number or not 0 < target <= 1:
            raise ConfigError(
                f"{where}: search.target: expected a fraction in (0, 1] for slo_attainment, "
                f"got {short_repr(target)}"
            )
    elif not number or not (math.isfinite(target) and target > 0):
        raise ConfigError(
            f"{where}: search.target: expected {unit} > 0 for {given}, got {short_repr(target)}"
        )
    over = raw.get("over", "trace.rate_scale")
    if not isinstance(over, str):
        raise ConfigError(f"{where}: search.over: expected a key path, got {short_repr(over)}")
    over = ALIASES.get(over, over)
    parse_path(over, f"{where}: search.over")
    if over in swept:
        raise ConfigError(
            f"{where}: search.over: {over} is a sweep key too; the search sets it itself"
        )
    bounds = []
    whole = whole_number_key(over)
    for key in ("lo", "hi"):
        v = raw.get(key)
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and not (number and 0 < v <= MAX_BOUND):
            raise ConfigError(
                f"{where}: search.{key}: expected a number in (0, {MAX_BOUND:,}], "
                f"got {short_repr(v)}"
            )
        if v is not None and whole and v % 1 != 0:
            raise ConfigError(
                f"{where}: search.{key}: {over} holds whole numbers; expected an integer, "
                f"got {short_repr(v)}"
            )
        bounds.append(None if v is None else float(v))
    lo, hi = bounds
    if (lo is None) != (hi is None):
        raise ConfigError(f"{where}: search: give both lo and hi, or neither")
    if lo is not None and not lo < hi:
        raise ConfigError(f"{where}: search: expected lo < hi, got lo {lo:g}, hi {hi:g}")
    tol = raw.get("tolerance", DEFAULT_TOLERANCE)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not 0 < tol < 1:
        raise ConfigError(
            f"{where}: search.tolerance: expected a fraction in (0, 1) (the final bracket's "
            f"width relative to its lower end), got {short_repr(tol)}"
        )
    return SearchSpec(metric, float(target) * scale, over, lo, hi, float(tol))


@dataclass
class Capacity:
    """The outcome of one search. ``status``: ``found`` (threshold in [lo, hi)),
    ``below_range`` (capacity NaN) or ``above_range`` (capacity a lower bound);
    ``samples``: (value, met) in the order tried."""

    capacity: float
    lo: float | None
    hi: float | None
    status: str
    samples: list[tuple[float, bool]] = field(default_factory=list)


def find_capacity(
    meets: Callable[[float], bool],
    spec: SearchSpec,
    start: float | None,
    integer: bool = False,
) -> Capacity:
    """The largest ``x`` with ``meets(x)``: try ``spec.lo`` and ``spec.hi``, else from
    ``start`` double or halve (at most :data:`MAX_EXPANSIONS` times) until one meets and the
    next misses; then bisect until ``hi - lo <= tolerance * lo``. Capacity is ``lo``.

    Args:
        meets: runs the experiment at load ``x``; whether it meets the target.
        integer: search ints >= 1 (floor midpoints; stop at ``max(1, tolerance * lo)``).
    """
    samples: list[tuple[float, bool]] = []
    whole = int if integer else float

    def probe(x: float) -> bool:
        ok = bool(meets(x))
        samples.append((x, ok))
        return ok

    if spec.lo is not None:
        lo, hi = spec.lo, spec.hi
        if integer:
            lo, hi = max(1, int(lo)), math.ceil(hi)
        if not probe(lo):
            return Capacity(math.nan, None, lo, "below_range", samples)
        if probe(hi):
            return Capacity(hi, hi, None, "above_range", samples)
    else:
        x = whole(start)
        if probe(x):
            lo = hi = x
            for _ in range(MAX_EXPANSIONS):
                hi = 2 * lo
                if not probe(hi):
                    break
                lo = hi
            else:
                return Capacity(lo, lo, None, "above_range", samples)
        else:
            hi = x
            for _ in range(MAX_EXPANSIONS):
                lo = hi // 2 if integer else hi / 2
                if lo < 1 and integer:
                    return Capacity(math.nan, None, hi, "below_range", samples)
                if probe(lo):
                    break
                hi = lo
            else:
                return Capacity(math.nan, None, hi, "below_range", samples)
    while hi - lo > (max(1, spec.tolerance * lo) if integer else spec.tolerance * lo):
        mid = (lo + hi) // 2 if integer else (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, lo, hi, "found", samples)
