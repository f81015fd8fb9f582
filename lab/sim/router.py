"""Routers: which replica of a simulated cluster serves a request, decided at its arrival.

A router sees what a serving router in front of vLLM sees (llm-d's inference scheduler, the
vLLM production-stack router, the SGLang / vLLM router): per replica the requests it holds
(queued, running, swapped, or on their way to it), the prompt tokens of those requests, its
KV cache in use, and the arriving request's prompt length and prefix keys
(``Request.hash_ids``). Never output lengths, never the future. Every router is
deterministic for a given seed; ties go to the lowest replica index.

Every load signal counts what the router has already sent: a request routed to a replica
counts in its load from that instant, before the replica admits it (as vLLM's and llm-d's
routers count their own outstanding requests), so a burst of simultaneous arrivals spreads
instead of piling onto the replica that looked least loaded before it. The signals:
round_robin none; least_outstanding_tokens the prompt tokens of the requests routed there
and not ended; power_of_two, prefix_affinity and lora_affinity their number; least_kv the KV blocks in
use plus those the requests it sent there and the replica has not admitted yet need.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from sched_lab.core.registry import Registry
from sched_lab.core.request import Request, RequestStatus


class ReplicaLoad(Protocol):
    """What a router sees of one replica, at the moment it decides."""

    @property
    def num_requests(self) -> int:
        """Requests it holds: waiting + running + swapped + KV transfers under way to it."""

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens of the requests routed to it that have not ended."""

    @property
    def num_gpu_blocks(self) -> int:
        """GPU KV blocks of the replica."""

    @property
    def num_used_gpu_blocks(self) -> int:
        """GPU KV blocks in use (vLLM's ``gpu_cache_usage_perc`` x ``num_gpu_blocks``)."""

    def blocks_to_admit(self, r: Request) -> int:
        """GPU blocks the replica needs to admit ``r`` (a request holding no KV there)."""

    def lora_residency(self, name: str) -> int:
        """Where LoRA adapter ``name`` is on the replica: 2 a GPU slot, 1 its host LRU, 0
        neither (lab/core/lora.py; 0 without a ``lora:`` section)."""


class Router:
    """Picks a replica index for each arriving request. Subclasses write :meth:`route`.

    Args:
        replicas: the replicas' live loads (read at each decision, never mutated).
        seed: for routers that sample.
        options: the router's own keys (``options`` of the class, with defaults).
    """

    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}

    def __init__(self, replicas: Sequence[ReplicaLoad], seed: int = 0, **options: Any) -> None:
        self.replicas = replicas
        for key, value in {**self.options, **options}.items():
            setattr(self, key, value)

    def route(self, r: Request) -> int:
        """The index of the replica ``r`` goes to (mutates only the router's own state)."""
        raise NotImplementedError

    def least(self, key) -> int:
        """Index of the replica with the smallest ``key(replica)``; ties: the lowest index."""
        return min(range(len(self.replicas)), key=lambda i: (key(self.replicas[i]), i))


ROUTERS: Registry[type[Router]] = Registry("router", "known routers")


def register_router(name: str):
    """Class decorator: register a router under ``name`` (duplicates are an error)."""

    def wrap(cls: type[Router]) -> type[Router]:
        ROUTERS.add(name, cls)
        cls.name = name
        return cls

    return wrap


def router_names() -> list[str]:
    return ROUTERS.names()


def get_router(name: str) -> type[Router]:
    """The router class registered as ``name``; ConfigError listing the known ones."""
    return ROUTERS.get(name)


@register_router("round_robin")
class RoundRobin(Router):
    """Request i goes to replica i mod N (the default of most load balancers)."""

    def __init__(self, replicas: Sequence[ReplicaLoad], seed: int = 0, **options: Any) -> None:
        super().__init__(replicas, seed, **options)
        self._next = 0

    def route(self, r: Request) -> int:
        i, self._next = self._next, (self._next + 1) % len(self.replicas)
        return i


@register_router("least_outstanding_tokens")
class LeastOutstandingTokens(Router):
    """The replica owing the fewest prompt tokens (of requests routed there, not ended).

    The router's own bookkeeping: it knows the prompts it sent and sees responses end, not
    how far each decode has gone (AIBrix's and the vLLM router's least-load family).
    """

    def route(self, r: Request) -> int:
        return self.least(lambda rep: (rep.outstanding_tokens, rep.num_requests))


@register_router("least_kv")
class LeastKV(Router):
    """The replica with the smallest share of its KV cache in use or owed, then the fewest
    requests (llm-d's KV-cache-utilization scorer, with the router's count of what it sent):
    (GPU blocks in use + blocks to admit the requests this router sent there that the
    replica has not admitted yet) / GPU blocks. A request sent is owed until it leaves
    ``waiting`` (admitted, rejected or aborted); queued requests hold no KV, so without
    them a burst arriving before the replica's next step would see the same use."""

    def __init__(self, replicas: Sequence[ReplicaLoad], seed: int = 0, **options: Any) -> None:
        super().__init__(replicas, seed, **options)
        self._sent: list[list[Request]] = [[] for _ in replicas]  # per replica, not admitted

    def route(self, r: Request) -> int:
        loads = []
        for rep, sent in zip(self.replicas, self._sent, strict=True):
            sent[:] = [q for q in sent if q.status is RequestStatus.WAITING]
            owed = sum(rep.blocks_to_admit(q) for q in sent)
            loads.append((rep.num_used_gpu_blocks + owed) / rep.num_gpu_blocks)
        i = min(range(len(loads)), key=lambda k: (loads[k], self.replicas[k].num_requests, k))
        self._sent[i].append(r)
        return i


@register_router("power_of_two")
class PowerOfTwo(Router):
    """Two distinct replicas sampled uniformly (seeded), the one with fewer requests wins;
    a tie goes to the first sampled (Mitzenmacher, "The Power of Two Choices in Randomized
    Load Balancing", IEEE TPDS 2001; a policy of the SGLang / vLLM router)."""

    def __init__(self, replicas: Sequence[ReplicaLoad], seed: int = 0, **options: Any) -> None:
        super().__init__(replicas, seed, **options)
        self._rng = random.Random(seed)

    def route(self, r: Request) -> int:
        if len(self.replicas) == 1:
            return 0
        a, b = self._rng.sample(range(len(self.replicas)), 2)
        return b if self.replicas[b].num_requests < self.replicas[a].num_requests else a


@register_router("prefix_affinity")
class PrefixAffinity(Router):
    """Requests that share their first ``prefix_blocks`` hash ids go to the same replica, so
    its prefix cache can serve the shared prompt; within a load bound.

    Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018):
    each replica owns ``VIRTUAL_NODES`` points of a hash ring; the key (the first
    ``prefix_blocks`` ids of ``Request.hash_ids``) hashes to a point, and the request goes to
    the first replica clockwise whose request count is below
    ceil(``load_factor`` x (requests in the cluster + 1) / replicas). Consistent hashing
    keeps keys in place when replicas come and go; the bound caps a hot prefix. The idea is
    that of the prefix-aware routing of the vLLM production stack and Ray Serve, the
    cache-aware policy of the SGLang router (prefix match, then load balance past a
    threshold) and llm-d's prefix-cache scorer; they match prefixes in a tree of what each
    replica saw, this router hashes a fixed-length prefix. A request without hash ids goes
    to the replica with the fewest requests.

    Mooncake traces give every request the same first id (a system prompt), so the default
    key is two ids long.
    """

    options: ClassVar[dict[str, Any]] = {"prefix_blocks": 2, "load_factor": 1.25}
    VIRTUAL_NODES = 64  # ring points per replica: spreads keys evenly

    def __init__(self, replicas: Sequence[ReplicaLoad], seed: int = 0, **options: Any) -> None:
        super().__init__(replicas, seed, **options)
        points = sorted(
            (_hash64(f"replica-{i}-{v}".encode()), i)
            for i in range(len(replicas))
            for v in range(self.VIRTUAL_NODES)
        )
        self._ring = [p for p, _ in points]
        self._owner = [i for _, i in points]

    def route(self, r: Request) -> int:
        if not r.hash_ids:
            return self.least(lambda rep: rep.num_requests)
        key = ",".join(str(h) for h in r.hash_ids[: self.prefix_blocks]).encode()
        total = sum(rep.num_requests for rep in self.replicas)
        bound = math.ceil(self.load_factor * (total + 1) / len(self.replicas))
        start = bisect.bisect(self._ring, _hash64(key))
        for k in range(len(self._ring)):  # some replica is below the mean, hence the bound
            i = self._owner[(start + k) % len(self._ring)]
            if self.replicas[i].num_requests < bound:
                return i
        raise AssertionError("no replica under the load bound")  # load_factor >= 1


@register_router("lora_affinity")
class LoRAAffinity(Router):
    """A request goes where its LoRA adapter already is, within a load bound; else to the
    replica with the fewest requests.

    Candidates by tier: replicas with the adapter in a GPU slot or that this router sent a
    request of it that the replica has not admitted yet (it will load it; so a burst of one
    adapter stays together), then those holding it in their host LRU; within a tier the
    fewest requests, then the lowest index. A candidate must hold fewer than
    ceil(``load_factor`` x (requests in the cluster + 1) / replicas) requests (the bound of
    ``prefix_affinity``), so a popular adapter spills over instead of piling up. A request
    of the base model, or none under the bound: the fewest requests. The idea of the LoRA
    affinity of llm-d's inference scheduler and of the vLLM production stack's router.
    """

    options: ClassVar[dict[str, Any]] = {"load_factor": 1.25}

    def __init__(self, replicas: Sequence[ReplicaLoad], seed: int = 0, **options: Any) -> None:
        super().__init__(replicas, seed, **options)
        self._sent: list[list[Request]] = [[] for _ in replicas]  # per replica, not admitted

    def route(self, r: Request) -> int:
        name = r.lora_name
        if not name:
            return self.least(lambda rep: rep.num_requests)
        total = sum(rep.num_requests for rep in self.replicas)
        bound = math.ceil(self.load_factor * (total + 1) / len(self.replicas))
        best = None
        for i, (rep, sent) in enumerate(zip(self.replicas, self._sent, strict=True)):
            sent[:] = [q for q in sent if q.status is RequestStatus.WAITING]
            where = rep.lora_residency(name)
            if any(q.lora_name == name for q in sent):
                where = 2
            if where and rep.num_requests < bound:
                key = (-where, rep.num_requests, i)
                best = key if best is None or key < best else best
        i = best[2] if best is not None else self.least(lambda rep: rep.num_requests)
        self._sent[i].append(r)
        return i


def _hash64(data: bytes) -> int:
    """A stable 64-bit hash (Python's ``hash`` of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
