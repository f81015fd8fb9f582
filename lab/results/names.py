"""One name per metric: the machine-readable names of summary.json, the sweep and capacity
tables, the vLLM-format file and every ``metric:`` a YAML names, with their units and the
labels the terminal prints.

Names are those of ``vllm bench serve --save-result`` where vLLM has one
(vllm/benchmarks/serve.py): ``{stat}_{metric}_ms`` for latencies, ``stat`` one of ``mean``,
``median``, ``std``, ``max`` or ``p{P}`` (P as vLLM writes a percentile: ``99``, ``99.9``),
``metric`` one of ``ttft``, ``tpot``, ``itl``, ``e2el`` (end-to-end latency) or the lab's own
``queue`` (arrival to first scheduled). The lab's other metrics follow the same pattern.

Older names are accepted on input only (:func:`canonical`): ``ttft_s_p99`` and ``ttft_s.p99``
(seconds), ``goodput``, ``finished``, ``preemptions_recompute``, ... ; :func:`upgrade_summary`
reads a summary.json entry written with them.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# latency metric -> (terminal title, requests.csv column in seconds)
LATENCIES = {
    "ttft": ("TTFT", "ttft_s"),
    "tpot": ("TPOT", "tpot_s"),
    "itl": ("ITL", None),  # pooled gaps, not a request column
    "e2el": ("E2E", "e2e_s"),
    "queue": ("queue", "queue_s"),
}
STATS = ("mean", "median", "std", "max")  # besides p{P}
_LATENCY = re.compile(r"^(mean|median|std|max|p(\d+(?:\.\d+)?))_(ttft|tpot|itl|e2el|queue)_ms$")
# old: ttft_s_p99, ttft_s.p99, e2e_s_mean, queue_s_max
_OLD_LATENCY = re.compile(r"^(ttft|tpot|itl|e2e|queue)_s[._](mean|max|p(\d+(?:\.\d+)?))$")


@dataclass(frozen=True)
class Metric:
    """A metric that is not a latency statistic: its name, unit, terminal label, whether a
    larger value is better, and the older names accepted on input."""

    name: str
    unit: str
    label: str
    higher_is_better: bool = True
    aliases: tuple[str, ...] = ()


METRICS = {
    m.name: m
    for m in (
        Metric("num_prompts", "requests", "replayed requests", aliases=("num_requests",)),
        Metric("completed", "requests", "finished requests", aliases=("finished",)),
        Metric("failed", "requests", "rejected/aborted/unfinished", False),
        Metric("duration", "s", "duration (s)", aliases=("duration_s",)),
        Metric("request_rate", "req/s", "offered (req/s)"),
        Metric("request_throughput", "req/s", "request throughput (req/s)"),
        Metric("output_throughput", "tok/s", "output throughput (tok/s)"),
        Metric("total_token_throughput", "tok/s", "total token throughput (tok/s)"),
        Metric("request_goodput", "req/s", "goodput (req/s)", aliases=("goodput",)),
        Metric("slo_attainment", "fraction", "SLO attainment (%)"),
        Metric("slo_attainment_finished", "fraction", "SLO attainment of finished (%)"),
        Metric("num_preemptions", "preemptions", "preemptions", False),
        Metric(
            "num_preemptions_recompute",
            "preemptions",
            "preemptions recompute",
            False,
            ("preemptions.recompute", "preemptions_recompute"),
        ),
        Metric(
            "num_preemptions_swap",
            "preemptions",
            "preemptions swap",
            False,
            ("preemptions.swap", "preemptions_swap"),
        ),
        Metric(
            "num_preempted_requests",
            "requests",
            "requests preempted",
            False,
            ("preemptions.requests_preempted", "preemptions_requests_preempted"),
        ),
        Metric(
            "mean_kv_cache_usage",
            "fraction",
            "KV used mean (%)",
            False,
            ("kv_used_fraction.mean", "kv_used_fraction_mean"),
        ),
        Metric(
            "max_kv_cache_usage",
            "fraction",
            "KV used max (%)",
            False,
            ("kv_used_fraction.max", "kv_used_fraction_max"),
        ),
        Metric("num_lora_loads", "loads", "LoRA loads", False),
        Metric("mean_loras_per_step", "adapters", "LoRA adapters per step"),
    )
}
ALIASES = {a: m.name for m in METRICS.values() for a in m.aliases}
COUNT_UNITS = ("requests", "preemptions", "loads")  # a metric in these counts whole things


def is_count(name: str) -> bool:
    """Whether the canonical ``name`` counts whole things (preemptions, requests, LoRA loads),
    so a run's value is an integer."""
    return name in METRICS and METRICS[name].unit in COUNT_UNITS


MISSING = "-"  # how every table prints a statistic that has no value

# Runs with seeded replicas (config key ``seeds``): beside each metric X of replica 0, the
# median of the replicas' X (``X_seed_median``) and their 90% band (``X_band``: [p5, p95]).
BAND_PERCENTILES = (5.0, 95.0)
BAND_SUFFIX, SEED_MEDIAN_SUFFIX = "_band", "_seed_median"


def band_name(name: str) -> str:
    """``p50_ttft_ms_band``: the key of a metric's 90% band over seeded replicas."""
    return name + BAND_SUFFIX


def seed_median_name(name: str) -> str:
    """``p50_ttft_ms_seed_median``: the key of a metric's median over seeded replicas."""
    return name + SEED_MEDIAN_SUFFIX


def is_metric(name: str) -> bool:
    """Whether ``name`` is a canonical metric name (a latency statistic or a :data:`METRICS`
    name)."""
    return name in METRICS or parse_latency(name) is not None


def is_missing(v: Any) -> bool:
    """Whether ``v`` is no value: None, a float NaN or pandas' NA."""
    if v is None:
        return True
    try:
        return bool(v != v)  # NaN and NA only differ from themselves
    except (TypeError, ValueError):  # NA's comparison is NA, whose truth is undefined
        return True


def format_value(v: Any, spec: str = "g") -> str:
    """``v`` formatted with ``spec`` for a table, or :data:`MISSING` when it has no value.

    A whole number (an int, or a float with an integral value under 1e15) prints all its
    digits under a ``g`` spec or ``d`` (``131072``, never ``1.311e+05``); a nonzero number
    that an ``f`` spec would round to zero prints 2 significant digits (``0.31``, ``4e-05``);
    text and booleans print as they are.
    """
    if is_missing(v):
        return MISSING
    if isinstance(v, (str, bool)):
        return str(v)
    whole = isinstance(v, numbers.Integral) or (
        isinstance(v, float) and v.is_integer() and abs(v) < 1e15
    )
    if whole and (spec.endswith("g") or spec == "d"):
        return str(int(v))
    out = format(v, spec)
    if spec.endswith("f") and isinstance(v, numbers.Real) and v and float(out) == 0.0:
        return format(v, ".2g")  # a nonzero value that would read as 0 (0.3 tok/s under .0f)
    return out


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in a key: ``99`` for 99.0, ``99.9`` for 99.9."""
    return str(int(p)) if int(p) == p else str(p)


def latency_name(stat: str | float, metric: str) -> str:
    """``p99_ttft_ms`` for (99, "ttft"); ``mean_ttft_ms`` for ("mean", "ttft")."""
    if not isinstance(stat, str):
        stat = f"p{percentile_word(stat)}"
    return f"{stat}_{metric}_ms"


def parse_latency(name: str) -> tuple[str, str] | None:
    """(stat, metric) of a canonical latency name (``p99.9_itl_ms`` -> ("p99.9", "itl"));
    None for any other name."""
    m = _LATENCY.match(name)
    return None if m is None else (m.group(1), m.group(3))


def canonical(name: str) -> tuple[str, float]:
    """The canonical name of ``name`` (itself, or the metric an older alias names) and the
    factor that turns a value in the alias's unit into the canonical unit (1e3 for an old
    latency in seconds, else 1). Unknown names come back unchanged."""
    m = _OLD_LATENCY.match(name)
    if m is not None:
        metric = "e2el" if m.group(1) == "e2e" else m.group(1)
        return latency_name(m.group(2), metric), 1e3
    return ALIASES.get(name, name), 1.0


def label(name: str) -> str:
    """The terminal's label of a canonical name: ``TTFT p99 (ms)``, ``goodput (req/s)``."""
    lat = parse_latency(name)
    if lat is not None:
        stat, metric = lat
        return f"{LATENCIES[metric][0]} {stat} (ms)"
    return METRICS[name].label if name in METRICS else name


def higher_is_better(name: str) -> bool:
    """Whether a larger value of the canonical ``name`` is better (latencies: no)."""
    return parse_latency(name) is None and (name not in METRICS or METRICS[name].higher_is_better)


def upgrade_summary(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A run's summary.json entry with every metric under its canonical name: an entry
    written with the older names (nested ``ttft_s: {mean, p50, ...}`` in seconds,
    ``preemptions: {recompute, swap}``, ``goodput``, ...) is converted; a canonical one comes
    back as it is. Values are scaled, never recomputed."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        old = re.fullmatch(r"(ttft|tpot|itl|e2e|queue)_s", key)
        if old is not None and isinstance(value, Mapping):
            for stat, v in value.items():
                name, scale = canonical(f"{key}_{stat}")
                out[name] = _scaled(v, scale)
        elif key in ("preemptions", "kv_used_fraction") and isinstance(value, Mapping):
            for sub, v in value.items():
                out[canonical(f"{key}.{sub}")[0]] = v
        elif key in ("classes", "tenants") and isinstance(value, Mapping):
            out[key] = {k: upgrade_summary(v) for k, v in value.items()}
        elif key == "cluster" and isinstance(value, Mapping):
            out[key] = _upgrade_cluster(value)
        else:
            out[canonical(key)[0]] = value
    if (
        "num_preemptions" not in out
        and "num_preemptions_recompute" in out
        and "num_preemptions_swap" in out
    ):
        out["num_preemptions"] = out["num_preemptions_recompute"] + out["num_preemptions_swap"]
    return out


def _upgrade_cluster(cluster: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(cluster)
    if isinstance(cluster.get("replicas"), Mapping):
        out["replicas"] = {}
        for i, rep in cluster["replicas"].items():
            rep = dict(rep)
            if isinstance(rep.get("preemptions"), int):  # a count per replica
                rep["num_preemptions"] = rep.pop("preemptions")
            out["replicas"][i] = upgrade_summary(rep)
    if isinstance(cluster.get("kv_transfer"), Mapping):
        moved = {}
        for key, value in cluster["kv_transfer"].items():
            metric = {"transfer_s": "kv_transfer", "transfer_queue_s": "kv_transfer_queue"}.get(key)
            if metric is None or not isinstance(value, Mapping):
                moved[key] = value
                continue
            for stat, v in value.items():
                moved[latency_name(stat, metric)] = _scaled(v, 1e3)
        out["kv_transfer"] = moved
    return out


def _scaled(v: Any, scale: float) -> Any:
    if v is None or scale == 1.0:
        return v
    return v * scale if math.isfinite(v) else v
