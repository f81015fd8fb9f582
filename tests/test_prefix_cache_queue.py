"""The prefix cache's key maps (runs of blocks a head) and eviction queue (segments, one per
release, with their keys), against the code they replaced (``ReferenceQueue``: one key int
per block and one dict entry per key, one OrderedDict entry per queued block, each block's
key in its own list; that code, verbatim).

Hand-computed scenarios for the segment paths (a hit not at a segment's start, an eviction
across several segments, swap out and in through the cache), then random operation scripts
driven through both managers with every observable compared after each step.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from collections.abc import Collection
from itertools import compress, islice, repeat
from operator import is_, is_not, not_, sub

import pytest

from sched_lab.core.kv import (
    _LOOKUP_CHUNK,
    ROOT_KEY,
    BlockManager,
    PrefixCachingBlockManager,
    blocks_for,
    extra_keys,
)
from sched_lab.core.request import EMPTY, Request, RequestStatus


class ReferenceQueue(BlockManager):
    """The prefix cache before its key map went by runs of blocks: one key int per block
    in ``block_hashes`` and one dict entry per key; the eviction queue as one OrderedDict
    entry per block (before the segments), each block's key in a list (before keys were
    known from tables and segments)."""

    enable_prefix_caching = True

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._ref = [0] * self.num_gpu_blocks
        self._block_of: dict[int, int] = {}
        self._holes: set[str] = set()
        self.num_evicted_blocks = 0
        self._queue: OrderedDict[int, None] = OrderedDict()
        self._keys: list[int | None] = [None] * self.num_gpu_blocks

    @property
    def num_cached_blocks(self) -> int:  # type: ignore[override]
        return len(self._block_of)

    def can_allocate(self, num_blocks: int, use_watermark: bool = True) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_gpu_blocks - num_blocks >= reserve

    def block_hashes(self, r: Request, num_blocks: int) -> list[int]:
        """``r.block_hashes`` (mutated), extended to up to ``num_blocks`` keys where the
        content is known. ValueError if ``r.hash_block_size`` is not a multiple of the
        block size."""
        hs, bs = r.block_hashes, self.block_size
        if len(hs) >= num_blocks:
            return hs
        if hs is EMPTY:
            hs = r.block_hashes = []
        parent = hs[-1] if hs else ROOT_KEY
        first, rest = extra_keys(r)
        if r.hash_ids is not None:
            per, rem = divmod(r.hash_block_size, bs)
            if per < 1 or rem:
                raise ValueError(
                    f"request {r.request_id}: hash_block_size {r.hash_block_size} is not a "
                    f"multiple of the KV block size {bs} (prefix caching)"
                )
            ids = r.hash_ids
            covered = (  # tokens the ids describe (class docstring)
                len(ids) * r.hash_block_size
                if len(ids) > -(-r.prompt_len // r.hash_block_size)
                else r.prompt_len
            )
            cap = min(covered, len(ids) * r.hash_block_size) // bs  # hs is cut short only here
            start = len(hs)  # a multiple of per below cap: whole hash blocks at a time
            if start >= cap:
                return hs
            parent = hs[start - per] if start else ROOT_KEY  # H_{h-1} = its first key
            for h in range(start // per, min(-(-num_blocks // per), -(-cap // per))):
                parent = hash((parent, ids[h], rest if h else first))
                hs.extend(range(parent, parent + min(per, cap - h * per)))
        elif r.prompt_token_ids is not None:
            known = len(r.prompt_token_ids) + len(r.output_token_ids)
            end = min(num_blocks, known // bs)
            if end > len(hs):
                tokens = r.prompt_token_ids
                if end * bs > len(tokens):
                    tokens = tokens + r.output_token_ids
                for j in range(len(hs), end):
                    key = tuple(tokens[j * bs : (j + 1) * bs])
                    parent = hash((parent, key, rest if j else first))
                    hs.append(parent)
        return hs

    def lookup(self, r: Request) -> list[int]:
        """GPU blocks of the longest cached prefix of a waiting ``r``, at most
        ``(r.num_tokens - 1) // block_size``. Mutates only ``r.block_hashes``."""
        limit = (r.num_tokens - 1) // self.block_size
        hs = self.block_hashes(r, limit)
        get, out = self._block_of.get, []
        for lo in range(0, min(limit, len(hs)), _LOOKUP_CHUNK):  # C-speed gets, chunk by chunk
            got = list(map(get, hs[lo : min(lo + _LOOKUP_CHUNK, limit)]))
            if None in got:
                return out + got[: got.index(None)]
            out += got
        return out

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached free (referencing them lowers the free count)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def num_freed_by(
        self, blocks: list[int], released: Counter[int], keep: Collection[int] = ()
    ) -> int:
        # A block another request still holds stays used; one that reaches ref count 0
        # becomes cached free (evictable by allocate) or free, either way counted as free.
        ref, n = self._ref, 0
        for b in blocks:
            released[b] += 1
            if released[b] == ref[b] and b not in keep:
                n += 1
        return n

    # ----------------------------------------------------------------------- mutations

    def allocate(self, request: Request, num_blocks: int) -> None:
        """Append ``num_blocks`` GPU blocks: free ones first, then evicted cached ones."""
        if num_blocks > self.num_free_gpu_blocks:
            raise RuntimeError(
                f"request {request.request_id}: {num_blocks} blocks asked, "
                f"{self.num_free_gpu_blocks} free"
            )
        blocks = self._take(num_blocks)
        if request.block_table is EMPTY:
            request.block_table = blocks
        else:
            request.block_table.extend(blocks)

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (GPU ones after :meth:`register`)."""
        if request.status is RequestStatus.SWAPPED:
            self._free_cpu.put(request.block_table)
        else:
            self.register(request)
            self._release_table(request)
        request.block_table = EMPTY
        request.num_registered_blocks = 0
        if request.num_output_tokens >= request.output_len:  # finished: keys not needed
            request.block_hashes = EMPTY

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Copy every block to CPU, drop the GPU references; returns (gpu_block, cpu_block)
        copies in table order."""
        self.register(request)
        table = request.block_table
        cpu = self._free_cpu.take(len(table))
        self._release_table(request)
        request.block_table = cpu
        request.num_registered_blocks = 0
        return list(zip(table, cpu))

    def blocks_to_swap_in(self, request: Request) -> int:
        """Free GPU blocks :meth:`swap_in` takes: copies plus re-referenced cached free ones."""
        found = [b for b in self._swap_in_hits(request) if b >= 0]
        return len(request.block_table) - len(found) + self.num_evictable(found)

    def _swap_in_hits(self, r: Request) -> list[int]:
        """Per block of a swapped ``r``: the GPU block holding its key, or -1 (copy it)."""
        n = min(r.num_computed_tokens // self.block_size, len(r.block_table))
        hs = self.block_hashes(r, n)
        block_of = self._block_of
        hits = [block_of.get(h, -1) for h in hs[: min(n, len(hs))]]
        return hits + [-1] * (len(r.block_table) - len(hits))

    def free_tail(self, request: Request, num_blocks: int) -> None:
        if num_blocks <= 0 or request.status is RequestStatus.SWAPPED:
            super().free_tail(request, num_blocks)
            return
        table, n = request.block_table, len(request.block_table)
        start = n - num_blocks
        keys = self._offered_keys(request)[start:]  # normally none: drafts are never offered
        self._release(table[start:], keys, len(keys), request.request_id in self._holes)
        if keys:  # offered blocks leave: any later block at their indices is a hole
            self._holes.add(request.request_id)
        del table[start:]

    def _offered_keys(self, r: Request) -> list[int | None]:
        """The key of each offered block of a held ``r`` (``block_table[:num_registered_blocks]``),
        None for a hole: a block is keyed iff the key map gives it for its key."""
        hs, table, get = r.block_hashes, r.block_table, self._block_of.get
        keys = hs[: r.num_registered_blocks]
        if r.request_id not in self._holes:
            return keys
        return [h if get(h) == b else None for h, b in zip(keys, table)]

    def _release_table(self, r: Request) -> None:
        """:meth:`_release` of every GPU block of ``r``, their keys known from its table."""
        if r.request_id in self._holes:
            keys = self._offered_keys(r)
            self._release(r.block_table, keys, len(keys), holes=True)
            self._holes.discard(r.request_id)
        else:
            self._release(r.block_table, r.block_hashes, r.num_registered_blocks)

    @property
    def _key_of(self) -> list[int | None]:
        return self._keys

    def register(self, r: Request) -> None:
        n = min(r.num_computed_tokens // self.block_size, len(r.block_table))
        start = r.num_registered_blocks
        if n <= start:
            return
        hs = self.block_hashes(r, n)
        end = min(n, len(hs))
        if end > start:
            block_of = self._block_of
            keys, blocks = hs[start:end], r.block_table[start:end]
            if not block_of.keys().isdisjoint(keys):  # some key held already: not taken
                new = [(h, b) for h, b in zip(keys, blocks) if h not in block_of]
                keys, blocks = [h for h, _ in new], [b for _, b in new]
            block_of.update(zip(keys, blocks))
            deque(map(self._keys.__setitem__, blocks, keys), 0)
            r.num_registered_blocks = end

    @property
    def num_free_gpu_blocks(self) -> int:
        return self._free_gpu.num_free + len(self._queue)

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self._free_gpu.num_free - len(self._queue)

    @property
    def num_cached_free_gpu_blocks(self) -> int:
        return len(self._queue)

    @property
    def _evictable(self) -> list[int]:
        return list(self._queue)

    def allocate_cached(self, r: Request, hits: list[int], num_new_blocks: int) -> None:
        ref, evictable = self._ref, self._queue
        for b in hits:
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1
        r.block_table = list(hits)
        r.num_registered_blocks = len(hits)
        self.allocate(r, num_new_blocks)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        hits = self._swap_in_hits(request)
        ref, evictable = self._ref, self._queue
        for b in hits:
            if b >= 0:
                if ref[b] == 0:
                    del evictable[b]
                ref[b] += 1
        cpu = request.block_table
        new = iter(self._take(sum(1 for b in hits if b < 0)))
        gpu = [b if b >= 0 else next(new) for b in hits]
        mapping = [(c, g) for c, g, b in zip(cpu, gpu, hits) if b < 0]
        self._free_cpu.put(cpu)
        request.block_table = gpu
        request.num_registered_blocks = 0
        self.register(request)
        return mapping

    def _take(self, n: int) -> list[int]:
        pool, evictable = self._free_gpu, self._queue
        if n > pool.num_free + len(evictable):
            raise RuntimeError(
                f"prefix cache: {n} blocks asked, {pool.num_free + len(evictable)} free"
            )
        k = min(n, pool.num_free)
        out = pool.take(k) if k else []
        if n > k:
            victims = list(islice(evictable, n - k))
            deque(map(evictable.__delitem__, victims), 0)
            key_of = self._key_of
            deque(map(self._block_of.__delitem__, map(key_of.__getitem__, victims)), 0)
            deque(map(key_of.__setitem__, victims, repeat(None)), 0)
            out += victims
            self.num_evicted_blocks += n - k
        deque(map(self._ref.__setitem__, out, repeat(1)), 0)
        return out

    def _release(self, blocks: list[int], *_unused) -> None:  # keys: its own list
        ref, key_of = self._ref, self._key_of
        tail_first = blocks[::-1]
        counts = list(map(sub, map(ref.__getitem__, tail_first), repeat(1)))
        deque(map(ref.__setitem__, tail_first, counts), 0)
        zero = list(compress(tail_first, map(not_, counts))) if any(counts) else tail_first
        keys = list(map(key_of.__getitem__, zero))
        if None not in keys:
            self._queue.update(zip(zero, repeat(None)))
            return
        self._queue.update(zip(compress(zero, map(is_not, keys, repeat(None))), repeat(None)))
        zero.reverse()
        keys.reverse()
        self._free_gpu.put(list(compress(zero, map(is_, keys, repeat(None)))))

    def check_integrity(self, requests: list[Request]) -> None:
        pass  # the segments' checks do not apply; the scripts compare it with the new one


# --------------------------------------------------------------------------- by hand
def _cached(bm, rid, ids, computed=None, extra=0, bs=4):
    """A request with one hash id per block of 4, admitted with its lookup hits and
    ``extra`` more blocks than its prompt needs, its first ``computed`` tokens registered."""
    r = Request(rid, 0.0, len(ids) * bs, 4, hash_ids=ids, hash_block_size=bs)
    hits = bm.lookup(r)
    bm.allocate_cached(r, hits, blocks_for(r.prompt_len, bs) - len(hits) + extra)
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.prompt_len if computed is None else computed
    bm.register(r)
    return r


def _both(fn):
    got = []
    for cls in (PrefixCachingBlockManager, ReferenceQueue):
        got.append(fn(cls))
    assert got[0] == got[1]
    return got[0]


def test_a_hit_inside_a_segment_and_a_hit_chain_across_two():
    # 12 blocks of 4. a: ids [1,2,3] -> [0,1,2]; b: ids [1,2,9,8] hits 0, 1, new [3,4].
    # a then b freed: a's segment is its block 2 alone (0, 1 still held by b), b's is
    # [0,1,3,4]: queue [2, 4, 3, 1, 0]. d: ids [1,2,3,7] hits 0, 1 (the start of b's
    # segment) and 2 (a's whole segment), takes 1 new block (5, never used): queue [4, 3].
    # Then block 3 alone (not at its segment's start) leaves: queue [4].
    def run(cls):
        bm = cls(12, 0, 4, 0.0)
        a = _cached(bm, "a", [1, 2, 3])
        b = _cached(bm, "b", [1, 2, 9, 8])
        assert (a.block_table, b.block_table) == ([0, 1, 2], [0, 1, 3, 4])
        bm.free(a)
        bm.free(b)
        q1 = bm._evictable
        d = _cached(bm, "d", [1, 2, 3, 7])
        q2 = bm._evictable
        # A hit that is not at a segment's start: block 3 (b's id 9) alone, by hand.
        bm.allocate_cached(Request("x", 0.0, 4, 1), [3], 0)
        q3 = bm._evictable
        return q1, d.block_table, q2, q3, bm.num_evicted_blocks

    q1, table, q2, q3, evicted = _both(run)
    assert q1 == [2, 4, 3, 1, 0]
    assert table == [0, 1, 2, 5] and q2 == [4, 3]
    assert q3 == [4] and evicted == 0


def test_a_hit_in_the_middle_of_a_segment_splits_nothing_else():
    # 8 blocks of 4; a: ids [1..5] -> [0..4], freed: queue [4, 3, 2, 1, 0] (one segment).
    # Taking block 2 alone (by hand) leaves [4, 3, 1, 0]; then 3 evictions take 4, 3, 1
    # (the 3 unused blocks 5..7 first).
    def run(cls):
        bm = cls(8, 0, 4, 0.0)
        a = _cached(bm, "a", [1, 2, 3, 4, 5])
        bm.free(a)
        bm.allocate_cached(Request("x", 0.0, 4, 1), [2], 0)
        q = bm._evictable
        taken = bm._take(6)
        return (
            q,
            taken,
            bm._evictable,
            bm.num_evicted_blocks,
            bm.lookup(Request("y", 0.0, 12, 1, hash_ids=[1, 2, 3], hash_block_size=4)),
        )

    q, taken, left, evicted, hits = _both(run)
    assert q == [4, 3, 1, 0]
    assert taken == [5, 6, 7, 4, 3, 1] and left == [0] and evicted == 3
    assert hits == [0]  # block 1 (id 2) was evicted: the chain stops there


def test_eviction_across_several_segments_oldest_first_tail_first():
    # 9 blocks of 4: a [0,1], b [2,3,4], c [5,6] freed in that order: queue
    # [1, 0, 4, 3, 2, 6, 5] (segments a, b, c), 2 blocks (7, 8) never used.
    # Taking 6 takes 7, 8, then a's whole segment (1, 0) and b's end (4, 3); 2 more take
    # b's last block 2 and c's block 6, then 1 more: the last one, c's block 5.
    def run(cls):
        bm = cls(9, 0, 4, 0.0)
        rs = [_cached(bm, n, ids) for n, ids in (("a", [1, 2]), ("b", [3, 4, 5]), ("c", [6, 7]))]
        for r in rs:
            bm.free(r)
        q = bm._evictable
        first = bm._take(6)
        mid = bm._evictable
        second = bm._take(2)
        left = bm._evictable
        last = bm._take(1)  # one block: the queue's last, its segment gone with it
        if cls is PrefixCachingBlockManager:
            assert not bm._segs and not bm._seg_at
        return q, first, mid, second, left, last, bm._evictable, bm.num_evicted_blocks

    assert _both(run) == (
        [1, 0, 4, 3, 2, 6, 5],
        [7, 8, 1, 0, 4, 3],
        [2, 6, 5],
        [2, 6],
        [5],
        [5],
        [],
        7,
    )


def test_swap_out_and_in_through_the_cache():
    # 8 GPU blocks of 4, 8 CPU. a: ids [1,2,3] plus 1 block -> [0,1,2,3], 3 keyed. Swapped
    # out (CPU 0..3): its keyed blocks queue [2, 1, 0], block 3 (unkeyed) goes to the pool.
    # b takes 6: block 3, the never used 4..7, then the LRU head, a's block 2 (evicted).
    # b's last 2 blocks (7, 2) are freed as a draft tail (pool, LIFO: 7 first). Swap in:
    # blocks 0, 1 still hold a's keys (re-referenced, queue empty); CPU 2, 3 are copied
    # into 7, 2.
    def run(cls):
        bm = cls(8, 8, 4, 0.0)
        a = _cached(bm, "a", [1, 2, 3], extra=1)
        out = bm.swap_out(a)
        a.status = RequestStatus.SWAPPED
        q1 = bm._evictable
        b = Request("b", 0.0, 24, 1)
        bm.allocate_cached(b, [], 6)
        q2, tb = bm._evictable, list(b.block_table)
        need = bm.blocks_to_swap_in(a)
        bm.free_tail(b, 2)
        inn = bm.swap_in(a)
        a.status = RequestStatus.RUNNING
        bm.check_integrity([a, b])
        return out, q1, q2, tb, need, inn, a.block_table, bm._evictable, bm.num_evicted_blocks

    out, q1, q2, tb, need, inn, table, q3, evicted = _both(run)
    assert out == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert q1 == [2, 1, 0] and tb == [3, 4, 5, 6, 7, 2] and q2 == [1, 0]
    assert need == 4  # 2 copies + 2 cached free re-referenced
    assert inn == [(2, 7), (3, 2)] and table == [0, 1, 7, 2]
    assert q3 == [] and evicted == 1


def _run_request(bm, rid, ids, blocks_per_id=2, bs=4):
    """A request with ``blocks_per_id`` blocks of 4 a hash id, admitted with its lookup hits,
    its whole prompt computed and registered."""
    hbs = blocks_per_id * bs
    r = Request(rid, 0.0, len(ids) * hbs, 4, hash_ids=ids, hash_block_size=hbs)
    hits = bm.lookup(r)
    bm.allocate_cached(r, hits, blocks_for(r.prompt_len, bs) - len(hits))
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.prompt_len
    bm.register(r)
    return r


def test_runs_of_blocks_keyed_evicted_and_hit():
    # 6 blocks of 4, 2 blocks a hash id. a: ids [1, 2, 3] -> blocks 0..5, heads H1, H2, H3
    # (H2 chains H1), keys (H, 0) and (H, 1): 3 slot lists of 2. Freed: one segment, its runs
    # [H1 0..1, H2 0..1, H3 0..1]. x taking 3 evicts 5, 4, 3 (tail first): H3's list goes, H2
    # keeps offset 0. A request with ids [1, 2, 3] then hits 0, 1, 2 (3 cached free blocks).
    bm = PrefixCachingBlockManager(6, 0, 4, 0.0)
    a = _run_request(bm, "a", [1, 2, 3])
    h1 = hash((0, 1, ()))
    h2 = hash((h1, 2, ()))
    h3 = hash((h2, 3, ()))
    assert a.block_table == [0, 1, 2, 3, 4, 5] and a.block_hashes == [h1, h2, h3]
    assert bm._slots == {h1: [0, 1], h2: [2, 3], h3: [4, 5]} and bm.num_cached_blocks == 6
    assert bm._key_of == [h1, h1 + 1, h2, h2 + 1, h3, h3 + 1]
    bm.free(a)
    assert list(bm._segs.values()) == [
        ([0, 1, 2, 3, 4, 5], [[h1, 0, 2], [h2, 0, 2], [h3, 0, 2]], True)
    ]
    x = Request("x", 0.0, 12, 1)
    bm.allocate(x, 3)
    assert x.block_table == [5, 4, 3] and bm.num_evicted_blocks == 3
    assert bm._slots == {h1: [0, 1], h2: [2, -1]} and bm.num_cached_blocks == 3
    assert list(bm._segs.values()) == [([0, 1, 2], [[h1, 0, 2], [h2, 0, 1]], True)]
    b = Request("b", 0.0, 25, 1, hash_ids=[1, 2, 3, 4], hash_block_size=8)
    hits = bm.lookup(b)
    assert hits == [0, 1, 2] and bm.num_evictable(hits) == 3
    bm.allocate_cached(b, hits, 0)
    assert not bm._segs and bm.num_cached_free_gpu_blocks == 0 and bm._ref[:3] == [1, 1, 1]
    b.status = x.status = RequestStatus.RUNNING
    bm.check_integrity([b, x])


def test_a_run_whose_keys_are_held_leaves_a_hole_and_frees_to_the_pool():
    # 8 blocks of 4, 2 a hash id. a and b, both ids [1, 2], admitted before either is
    # computed (no hits): a keys blocks 0..3; b's 4..7 find their keys held (a hole each),
    # stay unkeyed and go to the pool when b is freed. A hit on b's table from a's keys is
    # then a's blocks.
    def run(cls):
        bm = cls(8, 0, 4, 0.0)
        ra, rb = (Request(n, 0.0, 16, 4, hash_ids=[1, 2], hash_block_size=8) for n in "ab")
        for r in (ra, rb):
            assert bm.lookup(r) == []
            bm.allocate_cached(r, [], 4)
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = 16
        bm.register(ra)
        bm.register(rb)
        key_of = list(bm._key_of)
        bm.free(rb)
        pool, queue = list(bm._free_gpu.freed), bm._evictable
        c = Request("c", 0.0, 17, 1, hash_ids=[1, 2, 3], hash_block_size=8)
        return key_of, pool, queue, bm.lookup(c), bm.num_cached_blocks

    key_of, pool, queue, hits, cached = _both(run)
    h1 = hash((0, 1, ()))
    h2 = hash((h1, 2, ()))
    assert key_of == [h1, h1 + 1, h2, h2 + 1, None, None, None, None]
    assert pool == [7, 6, 5, 4] and queue == [] and hits == [0, 1, 2, 3] and cached == 4


# --------------------------------------------------------------------------- scripts
def _state(bm, reqs):
    return (
        bm.num_free_gpu_blocks,
        bm.num_used_gpu_blocks,
        bm.num_cached_free_gpu_blocks,
        bm.num_cached_blocks,
        bm.num_evicted_blocks,
        bm.num_free_cpu_blocks,
        bm._evictable,
        list(bm._ref),
        list(bm._key_of),
        dict(bm._block_of),
        list(bm._free_gpu.freed),
        bm._free_gpu.next_unused,
        [(r.status, list(r.block_table), r.num_registered_blocks) for r in reqs],
    )


def run_script(seed: int, steps: int = 120) -> None:
    """Random admissions (after lookup), growth, registration, frees, draft tails, swaps
    out and in, on both managers; every observable compared after each step."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    per = rng.choice([1, 2, 4])  # 1: keys in the flat map, else in runs
    gpu, cpu = rng.randint(4, 40), rng.randint(0, 30)
    bms = [PrefixCachingBlockManager(gpu, cpu, bs, 0.0), ReferenceQueue(gpu, cpu, bs, 0.0)]
    pairs: list[tuple[Request, Request]] = []
    prefixes = [[]]
    for step in range(steps):
        waiting = [p for p in pairs if p[0].status is RequestStatus.WAITING]
        running = [p for p in pairs if p[0].status is RequestStatus.RUNNING]
        swapped = [p for p in pairs if p[0].status is RequestStatus.SWAPPED]
        op = rng.random()
        if op < 0.2 or not pairs:
            base = rng.choice(prefixes)
            ids = base + [rng.randint(0, 3) for _ in range(rng.randint(0, 4))]
            ids = ids or [rng.randint(0, 3)]
            if rng.random() < 0.3:
                prefixes.append(ids)
            prompt = max(1, len(ids) * per * bs - rng.randint(0, per * bs))
            out = rng.randint(1, 4 * bs)
            rid = f"r{step}"
            pairs.append(
                tuple(
                    Request(rid, 0.0, prompt, out, None, list(ids), hash_block_size=per * bs)
                    for _ in bms
                )
            )
        elif op < 0.45 and waiting:
            pair = rng.choice(waiting)
            hits = [bm.lookup(r) for bm, r in zip(bms, pair)]
            assert hits[0] == hits[1]
            need = max(0, blocks_for(pair[0].num_tokens + 1, bs) - len(hits[0]))
            need += rng.randint(0, 2)
            fits = [bm.can_allocate(need + bm.num_evictable(h), False) for bm, h in zip(bms, hits)]
            assert fits[0] == fits[1]
            if fits[0]:
                computed = rng.randint(len(hits[0]) * bs, pair[0].num_tokens)
                for bm, r, h in zip(bms, pair, hits):
                    bm.allocate_cached(r, h, need)
                    r.status = RequestStatus.RUNNING
                    r.num_computed_tokens = computed
                    bm.register(r)
        elif op < 0.6 and running:
            pair = rng.choice(running)
            r0 = pair[0]
            grow = rng.randint(0, min(3, r0.output_len - r0.num_output_tokens))
            more = max(0, blocks_for(r0.num_tokens + grow + 1, bs) - len(r0.block_table))
            if bms[0].can_allocate(more, False):
                for bm, r in zip(bms, pair):
                    r.num_output_tokens += grow
                    r.num_computed_tokens = r.num_tokens
                    bm.allocate(r, more)
                    bm.register(r)
        elif op < 0.7 and running:
            pair = rng.choice(running)
            k = rng.randint(1, 2)
            if bms[0].can_allocate(k, False):
                for bm, r in zip(bms, pair):
                    bm.allocate(r, k)
                    bm.free_tail(r, k)
        elif op < 0.82 and running:
            pair = rng.choice(running)
            finish = rng.random() < 0.5
            for bm, r in zip(bms, pair):
                if finish:
                    r.num_output_tokens = r.output_len
                bm.free(r)
                r.status = RequestStatus.FINISHED if finish else RequestStatus.WAITING
                r.num_computed_tokens = 0
        elif op < 0.9 and running:
            pair = rng.choice(running)
            if bms[0].can_swap_out(pair[0]):
                maps = [bm.swap_out(r) for bm, r in zip(bms, pair)]
                assert maps[0] == maps[1]
                for r in pair:
                    r.status = RequestStatus.SWAPPED
        elif op < 0.94 and per == 1 and bms[0].num_cached_free_gpu_blocks:
            # Cached free blocks in any order, held as a request's table (hits that are no
            # lookup's chain: the queue's general path); its keys made its own (one key a
            # block: the flat map's only).
            queue = bms[0]._evictable
            pins = rng.sample(queue, rng.randint(1, min(4, len(queue))))
            rid = f"p{step}"
            pair = tuple(Request(rid, 0.0, len(pins) * bs, 1) for _ in bms)
            for bm, r in zip(bms, pair):
                r.block_hashes = [bm._key_of[b] for b in pins]
                bm.allocate_cached(r, pins, 0)
                r.status = RequestStatus.RUNNING
            pairs.append(pair)
        elif swapped:
            pair = rng.choice(swapped)
            if rng.random() < 0.2:  # aborted while swapped
                for bm, r in zip(bms, pair):
                    bm.free(r)
                    r.status = RequestStatus.ABORTED
            else:
                need = [bm.blocks_to_swap_in(r) for bm, r in zip(bms, pair)]
                assert need[0] == need[1]
                if bms[0].can_allocate(need[0], False):
                    maps = [bm.swap_in(r) for bm, r in zip(bms, pair)]
                    assert maps[0] == maps[1]
                    for r in pair:
                        r.status = RequestStatus.RUNNING
        held = [p[0] for p in pairs if p[0].block_table is not EMPTY]
        bms[0].check_integrity(held)
        s0 = _state(bms[0], [p[0] for p in pairs])
        s1 = _state(bms[1], [p[1] for p in pairs])
        assert s0 == s1, f"seed {seed}, step {step}"


@pytest.mark.parametrize("seed", range(40))
def test_random_scripts_match_the_reference_queue(seed):
    run_script(seed)
