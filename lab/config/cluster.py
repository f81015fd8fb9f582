"""The ``cluster:`` section (lab/sim/cluster.py): aggregated ``{replicas, router}`` or
disaggregated ``{prefill: {replicas, router}, decode: {replicas, router, host_buffer_gib},
kv_transfer: LINK | {bandwidth_gbps, latency_s}}``; and the spec written back as YAML."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sched_lab.config.walker import Context, check_choice, check_int, check_mapping, check_num, fail
from sched_lab.core.errors import ConfigError
from sched_lab.sim.cluster import DEFAULT_HOST_BUFFER_BYTES, GIB, ClusterSpec, PoolSpec
from sched_lab.sim.hardware import LINKS, Link

CLUSTER_KEYS = ("replicas", "router", "prefill", "decode", "kv_transfer")
MAX_REPLICAS = 4096  # each replica holds its own scheduler and block manager in memory
_DISAGGREGATED_KEYS = ("prefill", "decode", "kv_transfer")
MAX_HOST_BUFFER_GIB = 4096.0  # a decode replica's host buffer (4 TiB: beyond any host's memory)
# A KV-transfer link, between these bounds. Bandwidth: 0.1 Gb/s (Fast Ethernet) to 100,000 Gb/s
# (12.5 TB/s: more than a GPU's own memory reads, 4.8 TB/s on an H200, so no link is faster).
# One-way latency: at most 1 s (an intercontinental path is about 0.1 s).
LINK_GBPS_RANGE = (0.1, 100_000.0)
MAX_LINK_LATENCY_S = 1.0


def parse_cluster(ctx: Context, raw: Any) -> ClusterSpec:
    """``cluster:``; ConfigError if both layouts are mixed, a disaggregated key is missing,
    or a pool or link is bad."""
    where = ctx.where
    d = check_mapping(where, "cluster", raw, CLUSTER_KEYS)
    disaggregated = [k for k in _DISAGGREGATED_KEYS if k in d]
    if not disaggregated:
        return ClusterSpec(pool=_pool(where, "cluster", d))
    if "replicas" in d or "router" in d:
        raise ConfigError(
            f"{where}: cluster: give replicas and router (aggregated) or prefill, decode and "
            f"kv_transfer (disaggregated), not both"
        )
    missing = [k for k in _DISAGGREGATED_KEYS if k not in d]
    if missing:
        raise ConfigError(
            f"{where}: cluster: a disaggregated cluster needs prefill, decode and kv_transfer; "
            f"missing {', '.join(missing)}"
        )
    decode = check_mapping(where, "cluster.decode", d["decode"], _DECODE_KEYS)
    gib = decode.get("host_buffer_gib", DEFAULT_HOST_BUFFER_BYTES / GIB)
    gib = check_num(
        where, "cluster.decode.host_buffer_gib", gib, 0.0, MAX_HOST_BUFFER_GIB, lo_open=True
    )
    return ClusterSpec(
        prefill=_pool(where, "cluster.prefill", d["prefill"]),
        decode=_pool(where, "cluster.decode", decode, _DECODE_KEYS),
        link=_link(where, "cluster.kv_transfer", d["kv_transfer"]),
        host_buffer_bytes=int(gib * GIB),
    )


_POOL_KEYS = ("replicas", "router")
_DECODE_KEYS = (*_POOL_KEYS, "host_buffer_gib")  # host memory of each decode replica for KV


def _pool(where: str, key: str, raw: Any, keys: tuple[str, ...] = _POOL_KEYS) -> PoolSpec:
    from sched_lab.sim.router import get_router

    d = check_mapping(where, key, raw, keys)
    replicas = check_int(where, f"{key}.replicas", d.get("replicas", 1))
    if replicas > MAX_REPLICAS:
        raise fail(where, f"{key}.replicas", f"an integer in [1, {MAX_REPLICAS}]", replicas)
    router = d.get("router", "round_robin")
    spec = {"name": router} if isinstance(router, str) else router
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise fail(where, f"{key}.router", "a router name or a mapping with 'name'", router)
    try:
        cls = get_router(spec["name"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {key}.router: {e}") from None
    check_mapping(where, f"{key}.router", spec, ("name", *cls.options))
    options = {}
    for k, v in spec.items():
        if k == "name":
            continue
        if isinstance(cls.options[k], int):
            options[k] = check_int(where, f"{key}.router.{k}", v)
        else:
            options[k] = check_num(where, f"{key}.router.{k}", v, lo=1.0)
    return PoolSpec(replicas, spec["name"], MappingProxyType(options))


def _link(where: str, key: str, raw: Any) -> Link:
    if isinstance(raw, str):
        return LINKS[check_choice(where, key, raw, LINKS)]
    d = check_mapping(where, key, raw, ("bandwidth_gbps", "latency_s"))
    if "bandwidth_gbps" not in d:
        raise fail(where, key, "a link preset name or {bandwidth_gbps, latency_s}", raw)
    gbps = check_num(where, f"{key}.bandwidth_gbps", d["bandwidth_gbps"], 0.0, lo_open=True)
    lo, hi = LINK_GBPS_RANGE
    if not lo <= gbps <= hi:
        raise fail(
            where,
            f"{key}.bandwidth_gbps",
            f"Gb/s in [{lo:g}, {hi:g}] (Fast Ethernet to beyond a GPU's memory bandwidth)",
            gbps,
        )
    latency = check_num(where, f"{key}.latency_s", d.get("latency_s", 0.0), 0.0)
    if latency > MAX_LINK_LATENCY_S:
        raise fail(
            where,
            f"{key}.latency_s",
            f"seconds in [0, {MAX_LINK_LATENCY_S:g}] (one way; an intercontinental path "
            "takes about 0.1 s)",
            latency,
        )
    return Link("custom", gbps * 1e9 / 8, float(latency), f"{gbps} Gb/s, {latency} s")


def cluster_to_dict(c: ClusterSpec) -> dict[str, Any]:
    """A cluster spec as written in YAML (presets by name)."""

    def pool(p: PoolSpec) -> dict[str, Any]:
        router = {"name": p.router, **p.router_options} if p.router_options else p.router
        return {"replicas": p.replicas, "router": router}

    if c.pool is not None:
        return pool(c.pool)
    link: Any = c.link.name
    if c.link.name not in LINKS:
        link = {"bandwidth_gbps": c.link.bandwidth * 8 / 1e9, "latency_s": c.link.latency_s}
    decode = {**pool(c.decode), "host_buffer_gib": c.host_buffer_bytes / GIB}
    return {"prefill": pool(c.prefill), "decode": decode, "kv_transfer": link}
