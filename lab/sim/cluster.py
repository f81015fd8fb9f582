"""A cluster of replicas in one SimPy environment: routers, and prefill/decode disaggregation.

Every replica is a serving instance of its own: a scheduler (a fresh policy instance with
its block manager, i.e. its KV cache) and an executor (its cost model), stepped by a
replay loop of its own (:class:`sched_lab.sim.replay.ReplayLoop`). One arrival process routes
each request at its arrival (lab/sim/router.py); the replicas share nothing else.

**Aggregated** (``cluster: {replicas: N, router: R}``): a request is served whole by the
replica the router picks. One replica gives the same steps and requests as no cluster.

**Disaggregated** (``cluster: {prefill: {replicas: P}, decode: {replicas: D}, kv_transfer:
LINK}``; DistServe, OSDI'24; Splitwise, ISCA'24; Mooncake, FAST'25). Replicas 0..P-1 prefill,
P..P+D-1 decode. The rules:

* A request is checked against the decode replicas' limits at arrival (rejected there with
  their reason), then routed to a prefill replica, which runs its prompt and samples its
  first token (it holds a copy of the request with one output token: its policy sees a
  one-token job, so length-aware policies such as sjf order prefills by that). A request
  of one output token ends there.
* At the end of that step the decode router picks a decode replica and the prompt's KV
  (prompt_len x the model's K+V bytes per token) is sent over the prefill replica's link:
  one link per prefill replica, transfers FIFO on it, each occupying it for bytes /
  bandwidth; the KV lands ``latency_s`` after its last byte leaves. The prefill replica's
  blocks are freed when the transfer starts (its copy of the KV is the transfer's).
* The KV lands in the decode replica's host buffer (``host_buffer_bytes`` of host memory per
  decode replica): a transfer starts only when the buffer has room for its bytes (reserved
  from the start, FIFO per decode replica behind earlier transfers waiting for room). Until
  then the prefill replica holds the request's GPU blocks (back-pressure: they count as used
  there, so the prefill replica admits less). A request whose prompt's KV exceeds the buffer
  is rejected at arrival.
* When the KV lands, the request joins the decode replica's ``waiting`` queue with all but
  its prompt's last token computed: its policy admits it like any request, allocating its
  blocks then (prompt + 1 tokens' worth: the KV that landed and the first token's slot), and
  its first step recomputes the prompt's last token, which samples output token 1 (as vLLM's
  KV connectors do: the prefill replica's token is not sent to the client). A decode replica
  without room keeps it waiting, FIFO behind earlier arrivals, its KV in the host buffer; it
  is admitted when blocks free up, and its buffer space is free at the end of the step that
  admits it. Preempted on the decode replica, it is recomputed there (its KV is gone).
* TTFT is where the client sees the first token, the decode replica: it includes queueing
  in both pools, the prefill, the transfer (and any wait for the link or for buffer room)
  and the decode replica's first step; TPOT and E2E follow from the decode replica's tokens.
  The prefill replica's own time to its token is reported apart (``prefill_ttft_s``). A
  request of one output token is served whole by its prefill replica (its TTFT is there).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import simpy

from sched_lab.core.errors import ConfigError
from sched_lab.core.plan import Executor, SchedulerOutput
from sched_lab.core.request import EMPTY, Request, RequestStatus
from sched_lab.core.scheduler import Scheduler
from sched_lab.sim.hardware import Link
from sched_lab.sim.records import ENDED, ReplayResult
from sched_lab.sim.replay import ReplayLoop, SimEnvironment, arrival_timeout, run_to_end
from sched_lab.sim.router import Router, get_router

ROLES = ("both", "prefill", "decode")
GIB = 1 << 30
# Host memory of a decode replica for KV that landed and waits for its GPU blocks: a quarter
# of what an 8-GPU H200 server (2 TiB of host memory) gives each GPU.
DEFAULT_HOST_BUFFER_BYTES = 64 * GIB


@dataclass(frozen=True)
class PoolSpec:
    """Replicas of one role and the router that spreads requests over them."""

    replicas: int
    router: str = "round_robin"
    router_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class ClusterSpec:
    """Aggregated (``pool``) or disaggregated (``prefill``, ``decode``, ``link`` and each
    decode replica's ``host_buffer_bytes``)."""

    pool: PoolSpec | None = None
    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    link: Link | None = None
    host_buffer_bytes: int = DEFAULT_HOST_BUFFER_BYTES

    @property
    def disaggregated(self) -> bool:
        return self.pool is None

    @property
    def num_replicas(self) -> int:
        if self.pool is not None:
            return self.pool.replicas
        return self.prefill.replicas + self.decode.replicas


@dataclass(frozen=True)
class _Pending:
    """A finished prefill whose KV waits for room in a decode replica's host buffer."""

    request: Request
    copy: Request  # the prefill replica's copy, holding its GPU blocks
    prefill: Replica
    ready_s: float  # when the prefill ended
    nbytes: int


class Replica(ReplayLoop):
    """One serving instance: a replay loop, and what a router sees of it
    (:class:`sched_lab.sim.router.ReplicaLoad`). Requests reach it by ``take`` then ``add``."""

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        role: str,
        scheduler: Scheduler,
        executor: Executor,
        check_invariants: bool = False,
    ) -> None:
        super().__init__(env, scheduler, executor, check_invariants)
        self.index, self.role = index, role
        self.requests: list[Request] = []  # every request routed here, in routing order
        self.num_incoming = 0  # KV transfers under way to it
        self._open: list[Request] = []  # routed here, not ended (pruned when read)
        self._open_tokens = 0
        # Decode replica: its host buffer (KV under way or landed, not admitted yet).
        self.buffered: dict[Request, int] = {}  # request -> bytes reserved
        self.buffer_bytes = 0
        self.buffer_peak_bytes = 0
        self.buffer_peak_requests = 0
        self.pending: deque[_Pending] = deque()  # transfers waiting for room, FIFO

    @property
    def num_requests(self) -> int:
        return self.scheduler.num_unfinished + self.num_incoming

    @property
    def outstanding_tokens(self) -> int:
        if len(self._open) != self.num_requests:  # some ended since the last look
            self._open = [r for r in self._open if r.status not in ENDED]
            self._open_tokens = sum(r.prompt_len for r in self._open)
        return self._open_tokens

    @property
    def num_gpu_blocks(self) -> int:
        return self.scheduler.block_manager.num_gpu_blocks

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.scheduler.block_manager.num_used_gpu_blocks

    def blocks_to_admit(self, r: Request) -> int:
        return self.scheduler.blocks_to_admit(r)

    def lora_residency(self, name: str) -> int:
        lora = self.scheduler.lora
        return 0 if lora is None else lora.residency(name)

    def take(self, r: Request) -> None:
        """Count ``r`` as routed here (its KV may still be on the way)."""
        self.requests.append(r)
        self._open.append(r)
        self._open_tokens += r.prompt_len


@dataclass
class ClusterResult(ReplayResult):
    """A cluster replay: :class:`ReplayResult` over all replicas, plus each replica's own.

    ``steps`` holds every replica's steps ordered by start time (stable: replica order on
    ties), with a ``replica`` column; ``num_gpu_blocks`` is one replica's (they are equal)
    and ``tick_steps`` is empty (each replica's are in ``replica_results``).

    Attributes:
        replica_results: per replica, its steps and the requests routed to it.
        roles: per replica, "both", "prefill" or "decode".
        replica_of: the replica that produced each request's last token.
        first_token: disaggregated requests of 2+ tokens: (prefill replica, step index) of
            the prefill replica's token (not sent to the client; ``prefill_ttft_s``).
        transfers: (KV ready s, transfer start s, KV landed s, bytes) per transferred request.
        host_buffer_peak: per decode replica index, the most bytes and requests its host
            buffer held at once.
        host_buffer_bytes: each decode replica's host buffer (disaggregated), else 0.
        num_back_pressured: transfers that waited for room in a host buffer (their prefill replica
            held the KV meanwhile).
    """

    replica_results: list[ReplayResult] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    replica_of: dict[Request, int] = field(default_factory=dict)
    first_token: dict[Request, tuple[int, int]] = field(default_factory=dict)
    transfers: dict[Request, tuple[float, float, float, int]] = field(default_factory=dict)
    host_buffer_peak: dict[int, tuple[int, int]] = field(default_factory=dict)
    host_buffer_bytes: int = 0
    num_back_pressured: int = 0

    def token_times(self, r: Request) -> np.ndarray:
        return self.replica_results[self.replica_of[r]].token_times(r)

    def prefill_token_s(self, r: Request) -> float:
        """When the prefill replica sampled ``r``'s token (s): the end of its prefill there
        (for a request served whole by one replica, its first token's time); NaN when ``r``
        got none."""
        if r in self.first_token:
            p, step = self.first_token[r]
            return float(self.replica_results[p].step_end_s[step])
        if r.prefill_token_steps and r in self.replica_of:
            rr = self.replica_results[self.replica_of[r]]
            return float(rr.step_end_s[r.prefill_token_steps[0]])
        return math.nan

    def num_tokens_received(self, r: Request) -> int:
        """:meth:`num_token_times`: a replica's step and tick indices are its own."""
        return self.num_token_times(r)


class _Cluster:
    """The replicas, routers and links of one replay, and the moves between them."""

    def __init__(
        self,
        env: simpy.Environment,
        spec: ClusterSpec,
        make_replica: Callable[[], tuple[Scheduler, Executor]],
        kv_bytes_per_token: int,
        seed: int,
        check_invariants: bool = False,
    ) -> None:
        self.env, self.spec, self.kv_bytes_per_token = env, spec, kv_bytes_per_token
        pools = (
            [("both", spec.pool)]
            if spec.pool is not None
            else [("prefill", spec.prefill), ("decode", spec.decode)]
        )
        self.replicas: list[Replica] = []
        self.pools: list[list[Replica]] = []
        self.routers: list[Router] = []
        for role, pool in pools:
            reps = []
            for _ in range(pool.replicas):
                rep = Replica(env, len(self.replicas), role, *make_replica(), check_invariants)
                if role == "prefill":  # a finished prefill's KV moves on, or waits there
                    rep.scheduler.on_finish = functools.partial(self.prefill_done, rep)
                    rep.on_step = functools.partial(self.prefill_step, rep)
                elif role == "decode":  # admitted requests leave the host buffer
                    rep.on_step = functools.partial(self.decode_step, rep)
                reps.append(rep)
                self.replicas.append(rep)
            self.pools.append(reps)
            self.routers.append(get_router(pool.router)(reps, seed, **pool.router_options))
        self.num_arrived = 0
        self.replica_of: dict[Request, int] = {}
        self.first_token: dict[Request, tuple[int, int]] = {}
        self.transfers: dict[Request, tuple[float, float, float, int]] = {}
        self._real: dict[Request, Request] = {}  # a prefill replica's copy -> the request
        self._link_free_s = [0.0] * len(self.replicas)  # per prefill replica's link
        self.num_back_pressured = 0

    def arrive(self, r: Request) -> None:
        """Route an arriving request (aggregated: to its replica; else to a prefill one)."""
        self.num_arrived += 1
        if self.spec.pool is None:
            reason = self.pools[1][0].scheduler.rejection_reason(r)
            nbytes = r.prompt_len * self.kv_bytes_per_token
            if not reason and r.output_len > 1 and nbytes > self.spec.host_buffer_bytes:
                reason = (
                    f"its prompt's KV ({nbytes / GIB:.3g} GiB) exceeds a decode replica's "
                    f"host buffer ({self.spec.host_buffer_bytes / GIB:.3g} GiB, "
                    "cluster.decode.host_buffer_gib)"
                )
            if reason:
                r.status, r.reason, r.finish_s = RequestStatus.REJECTED, reason, self.env.now
                return
            if r.output_len > 1:
                copy = _prefill_copy(r)  # routed as what the prefill replica holds
                self._real[copy] = r
                self._place(copy, self.pools[0][self.routers[0].route(copy)])
                return
        self._place(r, self.pools[0][self.routers[0].route(r)])

    def _place(self, r: Request, rep: Replica) -> None:
        rep.take(r)
        self.replica_of[self._real.get(r, r)] = rep.index
        rep.add(r)

    def prefill_done(self, p: Replica, copy: Request, now: float) -> bool:
        """``copy`` finished on prefill replica ``p`` (its ``on_finish``): a decode replica
        is picked and the KV sent, or queued there for buffer room. True keeps the copy's
        blocks on ``p`` (queued); False for a sent one, or a request of one token."""
        r = self._real.pop(copy, None)
        if r is None:
            return False
        r.first_scheduled_s = copy.first_scheduled_s
        r.num_preemptions_recompute += copy.num_preemptions_recompute
        r.num_preemptions_swap += copy.num_preemptions_swap
        r.num_cached_tokens = copy.num_cached_tokens  # the prefill replica's cache hits
        r.num_resumed_cached_tokens += copy.num_resumed_cached_tokens
        self.first_token[r] = (p.index, copy.prefill_token_steps[-1])
        d = self.pools[1][self.routers[1].route(r)]
        d.num_incoming += 1
        d.take(r)
        self.replica_of[r] = d.index
        job = _Pending(r, copy, p, now, r.prompt_len * self.kv_bytes_per_token)
        if d.pending or d.buffer_bytes + job.nbytes > self.spec.host_buffer_bytes:
            d.pending.append(job)
            self.num_back_pressured += 1
            return True
        self._send(job, d, now)
        return False

    def prefill_step(self, rep: Replica, plan: SchedulerOutput, now: float) -> None:
        """After a prefill replica's step: a copy aborted there aborts its request."""
        for copy in plan.aborted:
            r = self._real.pop(copy, None)
            if r is not None:
                r.status, r.reason, r.finish_s = copy.status, copy.reason, copy.finish_s

    def decode_step(self, d: Replica, plan: SchedulerOutput, now: float) -> None:
        """After a decode replica's step: requests it admitted (or aborted) leave its host
        buffer, and transfers waiting for room start, FIFO, while they fit."""
        for r in (*plan.prefills, *plan.aborted):
            nbytes = d.buffered.pop(r, None)
            if nbytes is not None:
                d.buffer_bytes -= nbytes
        self._drain(d, now)

    def _drain(self, d: Replica, now: float) -> None:
        """Start the transfers waiting for room in ``d``'s host buffer, FIFO, while they fit."""
        while d.pending and d.buffer_bytes + d.pending[0].nbytes <= self.spec.host_buffer_bytes:
            job = d.pending.popleft()
            job.prefill.scheduler.release_held(job.copy)
            job.prefill.wake()
            self._send(job, d, now)

    def _send(self, job: _Pending, d: Replica, now: float) -> None:
        """Start the KV transfer of ``job`` to ``d`` (its buffer room reserved now)."""
        r, link, nbytes = job.request, self.spec.link, job.nbytes
        d.buffered[r] = nbytes
        d.buffer_bytes += nbytes
        d.buffer_peak_bytes = max(d.buffer_peak_bytes, d.buffer_bytes)
        d.buffer_peak_requests = max(d.buffer_peak_requests, len(d.buffered))
        p = job.prefill.index
        start = max(now, self._link_free_s[p])  # FIFO on the prefill replica's link
        self._link_free_s[p] = start + nbytes / link.bandwidth
        landed = start + nbytes / link.bandwidth + link.latency_s
        self.transfers[r] = (job.ready_s, start, landed, nbytes)
        event = self.env.timeout(landed - now)
        event.callbacks.append(lambda _event: self._land(r, d))

    def _land(self, r: Request, d: Replica) -> None:
        """The KV of ``r`` is on decode replica ``d``: it waits there, all of its prompt
        but the last token computed (its first step recomputes that one, sampling token 1)."""
        d.num_incoming -= 1
        r.num_computed_tokens, r.num_output_tokens = r.prompt_len - 1, 0
        d.add(r)
        if r.status is not RequestStatus.WAITING and r in d.buffered:  # rejected at add
            d.buffer_bytes -= d.buffered.pop(r)
            self._drain(d, self.env.now)


def _prefill_copy(r: Request) -> Request:
    """A fresh copy of ``r`` with one output token, for its prefill replica (every
    runtime list reset: the shared read-only EMPTY, never a list of ``r``'s)."""
    copy = dataclasses.replace(r, output_len=1)
    for f in dataclasses.fields(Request):
        if f.default is EMPTY:
            setattr(copy, f.name, EMPTY)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(copy, f.name, f.default_factory())
    return copy


def arrival_process(
    env: simpy.Environment, requests: list[Request], cluster: _Cluster, progress
) -> Iterator[simpy.Event]:
    """Route ``requests`` (sorted by arrival) at their arrival times."""
    for i, r in enumerate(requests):
        if r.arrival_s > env.now:
            yield arrival_timeout(env, r.arrival_s - env.now)
        cluster.arrive(r)
        if progress is not None and i % 4096 == 4095:
            unfinished = sum(rep.num_requests for rep in cluster.replicas)
            progress(max(cluster.num_arrived - unfinished, 0), env.now)


def replay_cluster(
    requests: list[Request],
    spec: ClusterSpec,
    make_replica: Callable[[], tuple[Scheduler, Executor]],
    kv_bytes_per_token: int = 0,
    seed: int = 0,
    check_invariants: bool = False,
    progress=None,
) -> ClusterResult:
    """Replay ``requests`` (mutated in place) through a cluster; the contract of
    :func:`sched_lab.sim.replay.replay` (a failing step stops the run, every request not ended
    is ``unfinished`` with a reason naming the failure, ``failure`` holds it).

    Args:
        make_replica: a fresh (scheduler, executor) per call; every replica gets its own.
        kv_bytes_per_token: K and V bytes of one token over all layers (disaggregated).
        seed: for routers that sample.
    """
    frozen_by_caller = gc.get_freeze_count() > 0
    gc.freeze()  # as replay() does: earlier objects are not rescanned by the collector
    try:
        return _replay(
            requests, spec, make_replica, kv_bytes_per_token, seed, check_invariants, progress
        )
    finally:
        if not frozen_by_caller:
            gc.unfreeze()


def _replay(requests, spec, make_replica, kv_bytes_per_token, seed, check_invariants, progress):
    t0 = time.perf_counter()
    if any(r.status is RequestStatus.DROPPED for r in requests):
        raise ValueError("replay_cluster: dropped trace rows are not replayed")
    requests = sorted(requests, key=lambda r: r.arrival_s)
    env = SimEnvironment()
    cluster = _Cluster(env, spec, make_replica, kv_bytes_per_token, seed, check_invariants)
    if any(rep.scheduler.async_scheduling for rep in cluster.replicas):
        raise ConfigError(
            "replay_cluster: the cluster simulator runs synchronous replicas only "
            "(scheduler.async_scheduling: false)"
        )
    env.process(arrival_process(env, requests, cluster, progress))
    for rep in cluster.replicas:
        env.process(rep.run())  # never ends on its own (KV may still come): no event left ends it
    schedulers = [rep.scheduler for rep in cluster.replicas]
    failure = run_to_end(env, requests, schedulers, lambda: cluster.num_arrived, check_invariants)
    wall = time.perf_counter() - t0
    results = []
    for rep in cluster.replicas:
        steps, ticks = rep.recorder.columns()
        blocks = rep.scheduler.block_manager.num_gpu_blocks
        results.append(ReplayResult(rep.requests, steps, ticks, wall, blocks, failure))
    return ClusterResult(
        requests,
        _merged_steps(results),
        np.zeros(0, dtype=np.int64),
        wall,
        results[0].num_gpu_blocks,
        failure,
        replica_results=results,
        roles=[rep.role for rep in cluster.replicas],
        replica_of=cluster.replica_of,
        first_token=cluster.first_token,
        transfers=cluster.transfers,
        host_buffer_peak={
            rep.index: (rep.buffer_peak_bytes, rep.buffer_peak_requests)
            for rep in cluster.replicas
            if rep.role == "decode"
        },
        host_buffer_bytes=spec.host_buffer_bytes if spec.disaggregated else 0,
        num_back_pressured=cluster.num_back_pressured,
    )


def _merged_steps(results: Sequence[ReplayResult]) -> dict[str, np.ndarray]:
    """Every replica's steps by start time (stable), with a ``replica`` column."""
    lengths = [len(rr.steps["time_s"]) for rr in results]
    replica = np.repeat(np.arange(len(results), dtype=np.int64), lengths)
    merged = {c: np.concatenate([rr.steps[c] for rr in results]) for c in results[0].steps}
    order = np.argsort(merged["time_s"], kind="stable")
    out = {c: v[order] for c, v in merged.items()}
    out["replica"] = replica[order]
    return out


def request_columns(result: ClusterResult, rows: Sequence[Request]) -> dict[str, Any]:
    """Per-request cluster columns for ``rows`` (requests.csv): ``replica`` (that produced
    the last token; empty when never placed); disaggregated also ``prefill_replica``,
    ``prefill_ttft_s`` (arrival to the prefill replica's token), ``kv_transfer_bytes``,
    ``transfer_queue_s`` (waiting for the link) and ``transfer_s`` (KV ready on the prefill
    replica to landed on the decode one, the wait included)."""
    import pandas as pd

    def ints(values) -> Any:
        return pd.array(values, dtype="Int64")

    cols = {"replica": ints([result.replica_of.get(r) for r in rows])}
    if "prefill" in result.roles:
        prefill = []
        for r in rows:
            first = result.first_token.get(r)
            prefill.append(first[0] if first is not None else result.replica_of.get(r))
        nan = (math.nan, math.nan, math.nan, None)
        tr = [result.transfers.get(r, nan) for r in rows]
        cols["prefill_replica"] = ints(prefill)
        cols["prefill_ttft_s"] = np.array(
            [result.prefill_token_s(r) - r.arrival_s for r in rows], dtype=np.float64
        )
        cols["kv_transfer_bytes"] = ints([t[3] for t in tr])
        cols["transfer_queue_s"] = np.array([t[1] - t[0] for t in tr], dtype=np.float64)
        cols["transfer_s"] = np.array([t[2] - t[0] for t in tr], dtype=np.float64)
    return cols
