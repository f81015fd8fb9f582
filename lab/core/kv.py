"""Paged KV cache bookkeeping: GPU and CPU block pools and per-request block tables.

Counts blocks, never tokens (those are the scheduler's). A request's ``block_table`` holds GPU
ids while it runs, CPU ids while it is swapped. Freed blocks are reused LIFO (as vLLM's
free-block queue, for locality); never-used ones follow in id order.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Collection
from itertools import compress, count, repeat
from operator import and_, delitem, eq, gt, itemgetter, ne, not_, setitem, sub

from sched_lab.core.request import EMPTY, Request, RequestStatus


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def contiguous_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in a sorted list: (first id, start index, stop index). The
    engine copies each run of swap-space ids as one host <-> device transfer."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((ids[start], start, i))
            start = i
    return runs


def num_swap_runs(swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
    """Host <-> device transfers the engine makes for a step's swap maps: the runs of
    consecutive CPU ids in ``swap_out`` [(gpu, cpu), ...] plus those in ``swap_in``
    [(cpu, gpu), ...] (each CPU id once per map)."""
    return len(contiguous_runs(sorted(c for _, c in swap_out))) + len(
        contiguous_runs(sorted(c for c, _ in swap_in))
    )


class BlockPool:
    """Free ids of ``[0, size)``: freed blocks (LIFO), then ``next_unused`` onwards."""

    __slots__ = ("size", "freed", "next_unused", "num_free")

    def __init__(self, size: int) -> None:
        self.size = size
        self.freed: list[int] = []
        self.next_unused = 0
        self.num_free = size  # len(freed) + size - next_unused, kept as a plain attribute

    def __len__(self) -> int:
        return self.num_free

    def take(self, n: int) -> list[int]:
        """``n`` free ids, the most recently freed first (the caller checks ``num_free``)."""
        freed = self.freed
        self.num_free -= n
        if n == 1 and freed:  # the common case: one block for a decode
            return [freed.pop()]
        k = min(n, len(freed))
        out = freed[: -k - 1 : -1] if k else []
        if k:
            del freed[-k:]
        if n > k:
            start = self.next_unused
            out.extend(range(start, start + n - k))
            self.next_unused = start + n - k
        return out

    def put(self, blocks: list[int]) -> None:
        """Free ``blocks``; the first of them is taken first again."""
        self.freed.extend(reversed(blocks))
        self.num_free += len(blocks)

    def free_ids(self) -> list[int]:
        """Every free id (for integrity checks; O(pool size))."""
        return self.freed + list(range(self.next_unused, self.size))


class BlockManager:
    """GPU and CPU (swap) block pools; every block has one owner (no prefix cache).

    Args:
        num_gpu_blocks: GPU blocks (>= 1); num_cpu_blocks: swap blocks (>= 0).
        block_size: tokens per block (>= 1).
        watermark: fraction of GPU blocks kept free at admission (vLLM V0's default 0.01).
    """

    #: True in :class:`PrefixCachingBlockManager`: the scheduler then looks cached prefixes up.
    enable_prefix_caching = False
    #: GPU blocks evicted from the prefix cache so far (always 0 here).
    num_evicted_blocks = 0
    #: GPU blocks that hold a key now (always 0 here).
    num_cached_blocks = 0

    def __init__(
        self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, watermark: float = 0.01
    ) -> None:
        if num_gpu_blocks < 1 or num_cpu_blocks < 0 or block_size < 1:
            raise ValueError("need num_gpu_blocks >= 1, num_cpu_blocks >= 0, block_size >= 1")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = math.floor(watermark * num_gpu_blocks)
        # Block 0 is handed out first (readable block tables in tests).
        self._free_gpu = BlockPool(num_gpu_blocks)
        self._free_cpu = BlockPool(num_cpu_blocks)

    # ----------------------------------------------------------------------- queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self._free_gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._free_cpu.num_free

    @property
    def num_unkeyed_free_gpu_blocks(self) -> int:
        """Free GPU blocks that allocation takes before it evicts a cached one (all of them
        without prefix caching)."""
        return self._free_gpu.num_free

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self._free_gpu.num_free

    @property
    def num_used_cpu_blocks(self) -> int:
        return self.num_cpu_blocks - self._free_cpu.num_free

    def can_allocate(self, num_blocks: int, use_watermark: bool = True) -> bool:
        """True if ``num_blocks`` GPU blocks can be handed out (keeping the watermark free)."""
        reserve = self.watermark_blocks if use_watermark else 0
        return self._free_gpu.num_free - num_blocks >= reserve

    def num_freed_by(
        self, blocks: list[int], released: Counter[int], keep: Collection[int] = ()
    ) -> int:
        """GPU blocks that releasing ``blocks`` would free, after the releases already
        counted in ``released`` (mutated: ``blocks`` are added). Here every one; with prefix
        caching only those whose reference count drops to 0, not counting ``keep`` (cached
        blocks the caller will reference again)."""
        return len(blocks)

    # ----------------------------------------------------------------------- mutations
    def allocate(self, request: Request, num_blocks: int) -> None:
        """Append ``num_blocks`` GPU blocks to ``request.block_table``; RuntimeError if short."""
        if num_blocks > self._free_gpu.num_free:
            raise RuntimeError(
                f"request {request.request_id}: {num_blocks} blocks asked, "
                f"{self._free_gpu.num_free} free"
            )
        blocks = self._free_gpu.take(num_blocks)
        if request.block_table is EMPTY:
            request.block_table = blocks
        else:
            request.block_table.extend(blocks)

    def free_tail(self, request: Request, num_blocks: int) -> None:
        """Release the last ``num_blocks`` blocks of ``request`` (rejected drafts' slots, never
        keyed); CPU ones if swapped."""
        if num_blocks > 0:
            table = request.block_table
            swapped = request.status is RequestStatus.SWAPPED  # async: rejected after swap out
            (self._free_cpu if swapped else self._free_gpu).put(table[-num_blocks:])
            del table[-num_blocks:]

    def free(self, request: Request) -> None:
        """Return all blocks of ``request`` to the pool it is in (GPU, or CPU if swapped)."""
        pool = self._free_cpu if request.status is RequestStatus.SWAPPED else self._free_gpu
        pool.put(request.block_table)
        request.block_table = EMPTY

    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_table) <= self._free_cpu.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the blocks to CPU; returns (gpu_block, cpu_block) copies in table order. The
        caller sets the status to SWAPPED."""
        cpu = self._free_cpu.take(len(request.block_table))
        mapping = list(zip(request.block_table, cpu))
        self._free_gpu.put(request.block_table)
        request.block_table = cpu
        return mapping

    def blocks_to_swap_in(self, request: Request) -> int:
        """Free GPU blocks that :meth:`swap_in` of a swapped ``request`` takes."""
        return len(request.block_table)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks back to the GPU; returns (cpu_block, gpu_block) pairs."""
        gpu = self._free_gpu.take(len(request.block_table))
        mapping = list(zip(request.block_table, gpu))
        self._free_cpu.put(request.block_table)
        request.block_table = gpu
        return mapping

    # ----------------------------------------------------------------------- invariants
    def check_integrity(self, requests: list[Request]) -> None:
        """Assert one owner per block and used + free = total per pool, given every request
        that may hold blocks (AssertionError names the broken invariant)."""
        owners: dict[tuple[str, int], str] = {}
        for pool, free in (("gpu", self._free_gpu), ("cpu", self._free_cpu)):
            for b in free.free_ids():
                key = (pool, b)
                assert key not in owners, f"{pool} block {b} is free twice"
                owners[key] = "free"
        for r in requests:
            pool = "cpu" if r.status is RequestStatus.SWAPPED else "gpu"
            for b in r.block_table:
                key = (pool, b)
                assert key not in owners, (
                    f"{pool} block {b} of request {r.request_id} is also {owners[key]}"
                )
                owners[key] = r.request_id
        for pool, total in (("gpu", self.num_gpu_blocks), ("cpu", self.num_cpu_blocks)):
            n = sum(1 for p, _ in owners if p == pool)
            assert n == total, f"{pool}: used + free = {n}, total = {total}"
            bad = [b for p, b in owners if p == pool and not 0 <= b < total]
            assert not bad, f"{pool}: block ids out of range: {bad[:5]}"


#: Parent key of a request's first block.
ROOT_KEY = 0
_LOOKUP_CHUNK = 32  # blocks looked up per C-level map() call


def _gather(seq: list, idx: list[int]) -> tuple | list:
    """``seq[i]`` for each ``i`` of ``idx``, in order, in C (itemgetter: a tuple)."""
    return itemgetter(*idx)(seq) if len(idx) > 1 else [seq[i] for i in idx]


def make_block_manager(
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    block_size: int,
    watermark: float = 0.01,
    enable_prefix_caching: bool = False,
) -> BlockManager:
    """A :class:`PrefixCachingBlockManager` if ``enable_prefix_caching``, else a
    :class:`BlockManager`."""
    cls = PrefixCachingBlockManager if enable_prefix_caching else BlockManager
    return cls(num_gpu_blocks, num_cpu_blocks, block_size, watermark)


def extra_keys(r: Request) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The extra keys of ``r``'s first block and of every later one: the adapter name in
    both, the cache salt in the first only (vLLM's order: LoRA, then salt)."""
    rest = (r.lora_name,) if r.lora_name else ()
    return (rest + (r.cache_salt,) if r.cache_salt else rest), rest


def has_prefix_identity(r: Request) -> bool:
    """True if ``r`` has hash ids or prompt token ids (content the prefix cache can key)."""
    return r.hash_ids is not None or r.prompt_token_ids is not None


class PrefixCachingBlockManager(BlockManager):
    """Block pools plus an automatic prefix cache (vLLM V1's design: hashed full blocks,
    reference counts, an LRU queue of cached free blocks).

    Keys (full blocks only) chain their parent's, from ``ROOT_KEY``; 64-bit hashes as vLLM's
    builtin-hash option. With ``hash_ids``: hash block h has the head
    ``H_h = hash((H_{h-1}, hash_ids[h], extra_h))`` and its block at offset i the key
    ``(H_h, i)`` (``H_h + i`` where shown as one int: ``_key_of``); ``hash_block_size`` must
    be a multiple of ``block_size``. The ids describe the prompt only when there are
    ceil(prompt_len / hash_block_size) of them (Mooncake), else every token they span.
    Else with ``prompt_token_ids``: one head a block, ``hash((parent, block's tokens,
    extra_j))`` over prompt + output, the key ``(head, 0)``. Else no key.
    ``Request.block_hashes`` keeps a request's heads. ``extra`` (vLLM's extra keys,
    :func:`extra_keys`): ``Request.lora_name`` in every block's, ``Request.cache_salt`` in
    the first one's only (the chain carries it on); ``()`` when a request has neither, so
    different adapters or salts never share a block.

    The key map works per run of blocks where a hash block spans several (``_slots``: head ->
    the block at each offset, one list slice a run), per key where it spans one (``_flat``:
    head -> block, token ids and ``hash_block_size == block_size``). Requests whose hash
    blocks span several KV blocks share blocks only with requests whose do too.

    GPU block states: used (ref >= 1), cached free (ref 0, keyed, in the LRU eviction queue),
    free (ref 0, unkeyed); used + cached free + free = total, and ``num_free_gpu_blocks``
    counts the last two. Allocation takes free blocks, then evicts the queue's head
    (``num_evicted_blocks``); a request releases its blocks tail first. A block's key is
    known from where it sits, not stored per block: a held block at index j of a table has
    the request's key j if ``j < num_registered_blocks`` (each of them unless the request
    has a hole: a block left unkeyed because another block held its key), a queued one the
    key its segment gives it.

    ``register`` keys prompt blocks once computed, and generated blocks whose content is
    known on finish, preemption or abort; a key another block holds is not taken again.
    ``lookup`` hits at most ``(num_tokens - 1) // block_size`` blocks, so a step computes at
    least one token (vLLM V1). Swap out copies every block, shared ones too; swap in
    re-references blocks whose key is still cached and copies the rest.
    """

    enable_prefix_caching = True

    def __init__(
        self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, watermark: float = 0.01
    ) -> None:
        super().__init__(num_gpu_blocks, num_cpu_blocks, block_size, watermark)
        self._ref = [0] * num_gpu_blocks  # GPU block -> requests holding it
        self._flat: dict[int, int] = {}  # head -> GPU block (one block a head)
        self._slots: dict[int, list[int]] = {}  # head -> GPU block at each offset, or -1
        self._num_slotted = 0  # blocks keyed in _slots
        # Ids of requests with a hole: offered blocks (block_table[:num_registered_blocks])
        # that are not all keyed. Rare: a key computed twice at once, or a draft tail freed.
        self._holes: set[str] = set()
        # The eviction queue (cached free blocks, LRU first) as segments, one per release
        # that queued blocks, oldest first: (blocks, keys, slotted), blocks in table order, so
        # the queue reads each one from its end: released tail first, evicted from the end of
        # the oldest one. keys: the blocks' heads in _flat, or if slotted their runs in
        # _slots ([head, lo, hi]: offsets lo..hi-1, in table order). Hits, normally a table
        # prefix, leave from a segment's start.
        self._segs: OrderedDict[int, tuple[list[int], list, bool]] = OrderedDict()
        self._seg_at: dict[int, int] = {}  # first block of a segment -> segment id
        self._next_seg = 0
        self._num_queued = 0  # blocks in the queue
        self.num_evicted_blocks = 0

    # ----------------------------------------------------------------------- queries
    @property
    def num_free_gpu_blocks(self) -> int:
        return self._free_gpu.num_free + self._num_queued

    @property
    def num_used_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - self._free_gpu.num_free - self._num_queued

    @property
    def num_cached_free_gpu_blocks(self) -> int:
        """Keyed blocks that no request holds (the eviction queue)."""
        return self._num_queued

    @property
    def _evictable(self) -> list[int]:
        """The eviction queue, LRU first (a new list; for tests and integrity checks)."""
        return [b for blocks, _, _ in self._segs.values() for b in reversed(blocks)]

    @property
    def _block_of(self) -> dict[int, int]:
        """Key (as one int) -> GPU block (a new dict, from the key maps; for tests and checks)."""
        out = dict(self._flat)
        for h, s in self._slots.items():
            out.update((h + i, b) for i, b in enumerate(s) if b >= 0)
        return out

    @property
    def _key_of(self) -> list[int | None]:
        """GPU block -> its key (as one int) or None (a new list; for tests and checks)."""
        key_of: list[int | None] = [None] * self.num_gpu_blocks
        for h, b in self._block_of.items():
            key_of[b] = h
        return key_of

    @property
    def num_cached_blocks(self) -> int:  # type: ignore[override]
        """GPU blocks holding a key (used or cached free)."""
        return len(self._flat) + self._num_slotted

    def can_allocate(self, num_blocks: int, use_watermark: bool = True) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_gpu_blocks - num_blocks >= reserve

    def _per(self, r: Request) -> int:
        """KV blocks per head of ``r`` (1: its keys are in ``_flat``, else in ``_slots``)."""
        return r.hash_block_size // self.block_size if r.hash_ids is not None else 1

    def _hash_id_cap(self, r: Request) -> int:
        """Blocks that ``r``'s hash ids give keys: those of the tokens they describe."""
        ids, hbs = r.hash_ids, r.hash_block_size
        covered = len(ids) * hbs if len(ids) > -(-r.prompt_len // hbs) else r.prompt_len
        return min(covered, len(ids) * hbs) // self.block_size

    def block_hashes(self, r: Request, num_blocks: int) -> int:
        """Extends ``r.block_hashes`` (mutated) to the heads of up to ``num_blocks`` blocks
        where the content is known; returns how many blocks they key (may pass
        ``num_blocks``). ValueError if ``r.hash_block_size`` is not a multiple of the block
        size."""
        hs, bs = r.block_hashes, self.block_size
        if r.hash_ids is not None:
            per, rem = divmod(r.hash_block_size, bs)
            if per < 1 or rem:
                if num_blocks <= 0:  # nothing asked: no heads, no error
                    return 0
                raise ValueError(
                    f"request {r.request_id}: hash_block_size {r.hash_block_size} is not a "
                    f"multiple of the KV block size {bs} (prefix caching)"
                )
            cap, ids = self._hash_id_cap(r), r.hash_ids
            want = min(-(-num_blocks // per), -(-cap // per))
            if want > len(hs):
                if hs is EMPTY:
                    hs = r.block_hashes = []
                parent = hs[-1] if hs else ROOT_KEY
                first, rest = extra_keys(r)
                for h in range(len(hs), want):
                    parent = hash((parent, ids[h], rest if h else first))
                    hs.append(parent)
            return min(len(hs) * per, cap)
        if r.prompt_token_ids is not None and num_blocks > len(hs):
            known = len(r.prompt_token_ids) + len(r.output_token_ids)
            end = min(num_blocks, known // bs)
            if end > len(hs):
                if hs is EMPTY:
                    hs = r.block_hashes = []
                parent = hs[-1] if hs else ROOT_KEY
                first, rest = extra_keys(r)
                tokens = r.prompt_token_ids
                if end * bs > len(tokens):
                    tokens = tokens + r.output_token_ids
                for j in range(len(hs), end):
                    key = tuple(tokens[j * bs : (j + 1) * bs])
                    parent = hash((parent, key, rest if j else first))
                    hs.append(parent)
        return len(hs)

    def _num_keys(self, r: Request) -> int:
        """Blocks that ``r.block_hashes`` keys now."""
        per = self._per(r)
        if per == 1:
            return len(r.block_hashes)
        return min(len(r.block_hashes) * per, self._hash_id_cap(r))

    def _held_by(self, r: Request, start: int, end: int) -> list[int]:
        """For keys ``start..end-1`` of ``r`` (known), the GPU block holding each, or -1."""
        hs, per = r.block_hashes, self._per(r)
        if per == 1:
            return list(map(self._flat.get, hs[start:end], repeat(-1)))
        out: list[int] = []
        if end <= start:
            return out
        slots = self._slots
        for h in range(start // per, -(-end // per)):
            base = h * per
            lo, hi = max(start, base) - base, min(end, base + per) - base
            got = slots.get(hs[h], EMPTY)[lo:hi]
            out += got
            if len(got) < hi - lo:
                out += [-1] * (hi - lo - len(got))
        return out

    def lookup(self, r: Request) -> list[int]:
        """GPU blocks of the longest cached prefix of a waiting ``r``, at most
        ``(r.num_tokens - 1) // block_size``. Mutates only ``r.block_hashes``."""
        limit = (r.num_tokens - 1) // self.block_size
        n = min(limit, self.block_hashes(r, limit))
        hs, per, out = r.block_hashes, self._per(r), []
        if per == 1:
            get = self._flat.get
            for lo in range(0, n, _LOOKUP_CHUNK):  # C-speed gets, chunk by chunk
                got = list(map(get, hs[lo : min(lo + _LOOKUP_CHUNK, n)]))
                if None in got:
                    return out + got[: got.index(None)]
                out += got
            return out
        get = self._slots.get
        for h in range(-(-n // per)):  # one run of blocks a head
            k = min(per, n - h * per)
            got = get(hs[h], EMPTY)[:k]
            if -1 in got:
                return out + got[: got.index(-1)]
            out += got
            if len(got) < k:
                return out
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
    def allocate_cached(self, r: Request, hits: list[int], num_new_blocks: int) -> None:
        """Give a waiting ``r`` the cached ``hits`` (from :meth:`lookup`) plus
        ``num_new_blocks`` new ones; the caller checked
        ``can_allocate(num_new_blocks + num_evictable(hits))``."""
        ref, queued = self._ref, []
        for b in hits:
            if ref[b] == 0:
                queued.append(b)
            ref[b] += 1
        if queued:
            self._unqueue(queued)
        self._holes.discard(r.request_id)
        r.block_table = list(hits)
        r.num_registered_blocks = len(hits)
        self.allocate(r, num_new_blocks)

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

    def register(self, r: Request) -> None:
        """Key ``r``'s full computed blocks not offered yet. Mutates the key maps and
        ``r.num_registered_blocks``."""
        n = min(r.num_computed_tokens // self.block_size, len(r.block_table))
        start = r.num_registered_blocks
        if n <= start:
            return
        end = min(n, self.block_hashes(r, n))
        if end <= start:
            return
        hs, table, per = r.block_hashes, r.block_table, self._per(r)
        if per == 1:
            flat, size = self._flat, len(self._flat)
            keys, blocks = hs[start:end], table[start:end]
            if not flat.keys().isdisjoint(keys):  # some key held already: not taken
                new = [(h, b) for h, b in zip(keys, blocks) if h not in flat]
                keys, blocks = [h for h, _ in new], [b for _, b in new]
            flat.update(zip(keys, blocks))
            hole = len(flat) - size < end - start
        else:
            slots, hole, num = self._slots, False, self._num_slotted
            for h in range(start // per, -(-end // per)):  # one slice a head
                base = h * per
                lo, hi = max(start, base) - base, min(end, base + per) - base
                s = slots.get(hs[h])
                if s is None:
                    if lo == 0 and hi == per:  # a new head, keyed whole: one slice
                        slots[hs[h]] = table[base : base + per]
                        num += per
                        continue
                    s = slots[hs[h]] = [-1] * per
                elif len(s) < hi:
                    s += [-1] * (hi - len(s))
                if s[lo:hi].count(-1) == hi - lo:
                    s[lo:hi] = table[base + lo : base + hi]
                    num += hi - lo
                else:  # some key held already: not taken
                    hole = True
                    for i in range(lo, hi):
                        if s[i] < 0:
                            s[i] = table[base + i]
                            num += 1
            self._num_slotted = num
        if hole:  # a block left unkeyed
            self._holes.add(r.request_id)
        r.num_registered_blocks = end

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (GPU ones after :meth:`register`)."""
        if request.status is RequestStatus.SWAPPED:
            self._free_cpu.put(request.block_table)
        else:
            self.register(request)
            self._release(request, 0)
            self._holes.discard(request.request_id)
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
        self._release(request, 0)
        self._holes.discard(request.request_id)
        request.block_table = cpu
        request.num_registered_blocks = 0
        return list(zip(table, cpu))

    def blocks_to_swap_in(self, request: Request) -> int:
        """Free GPU blocks :meth:`swap_in` takes: copies plus re-referenced cached free ones."""
        found = [b for b in self._swap_in_hits(request) if b >= 0]
        return len(request.block_table) - len(found) + self.num_evictable(found)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (cpu_block, gpu_block) copies of the blocks
        not cached on the GPU."""
        hits = self._swap_in_hits(request)
        ref, queued = self._ref, []
        for b in hits:
            if b >= 0:
                if ref[b] == 0:
                    queued.append(b)
                ref[b] += 1
        if queued:
            self._unqueue(queued)
        cpu = request.block_table
        new = iter(self._take(sum(1 for b in hits if b < 0)))
        gpu = [b if b >= 0 else next(new) for b in hits]
        mapping = [(c, g) for c, g, b in zip(cpu, gpu, hits) if b < 0]
        self._free_cpu.put(cpu)
        request.block_table = gpu
        request.num_registered_blocks = 0
        self.register(request)
        return mapping

    def free_tail(self, request: Request, num_blocks: int) -> None:
        if num_blocks <= 0 or request.status is RequestStatus.SWAPPED:
            super().free_tail(request, num_blocks)
            return
        table = request.block_table
        start = len(table) - num_blocks
        self._release(request, start)  # its offered blocks: normally none (drafts never are)
        if request.num_registered_blocks > start:  # those leave: later blocks there are holes
            self._holes.add(request.request_id)
        del table[start:]

    # ----------------------------------------------------------------------- internals
    def _swap_in_hits(self, r: Request) -> list[int]:
        """Per block of a swapped ``r``: the GPU block holding its key, or -1 (copy it)."""
        n = min(r.num_computed_tokens // self.block_size, len(r.block_table))
        hits = self._held_by(r, 0, min(n, self.block_hashes(r, n)))
        return hits + [-1] * (len(r.block_table) - len(hits))

    def _take(self, n: int) -> list[int]:
        """``n`` blocks at ref count 1: free ones, then evicted LRU cached ones. RuntimeError
        (nothing taken) if fewer are free; callers check first."""
        pool = self._free_gpu
        if n > pool.num_free + self._num_queued:
            raise RuntimeError(
                f"prefix cache: {n} blocks asked, {pool.num_free + self._num_queued} free"
            )
        k = min(n, pool.num_free)
        out = pool.take(k) if k else []
        if n == 1:  # a decode's block, free or the queue's head: no maps for one
            if not k:
                sid = next(iter(self._segs))
                blocks, keys, slotted = self._segs[sid]
                b = blocks.pop()
                if not blocks:
                    del self._segs[sid], self._seg_at[b]
                if slotted:
                    self._unkey_tail(keys, 1)
                else:
                    del self._flat[keys.pop()]
                out.append(b)
                self._num_queued -= 1
                self.num_evicted_blocks += 1
            self._ref[out[0]] = 1
            return out
        if n > k:
            need = n - k
            segs, victims, gone = self._segs, [], []  # gone: the flat victims' heads
            while need:  # the queue's head: the end of the oldest segment
                sid = next(iter(segs))
                blocks, keys, slotted = segs[sid]
                m = min(need, len(blocks))
                if slotted:
                    self._unkey_tail(keys, m)
                else:
                    gone += keys[-m:]
                    del keys[-m:]
                victims += blocks[: -m - 1 : -1]  # the last m, tail first
                del blocks[-m:]  # O(m): the start stays
                if not blocks:
                    del segs[sid], self._seg_at[victims[-1]]
                need -= m
            if gone:
                deque(map(delitem, repeat(self._flat), gone), 0)
            out += victims
            self._num_queued -= n - k
            self.num_evicted_blocks += n - k
        deque(map(setitem, repeat(self._ref), out, repeat(1)), 0)  # ref[b] = 1 for each, in C
        return out

    def _unkey_tail(self, runs: list[list[int]], m: int) -> None:
        """Remove the keys of the last ``m`` blocks of a slotted segment (``runs``, cut
        short) from ``_slots``."""
        slots = self._slots
        self._num_slotted -= m
        while m:
            run = runs[-1]
            head, lo, hi = run
            s = slots[head]
            if hi - lo > m:  # the run's start stays keyed: so does its head
                s[hi - m : hi] = [-1] * m
                run[2] = hi - m
                return
            m -= hi - lo
            runs.pop()
            if hi - lo == len(s):  # the run keyed the whole head
                del slots[head]
            else:
                s[lo:hi] = [-1] * (hi - lo)
                if s.count(-1) == len(s):
                    del slots[head]

    def _unqueue(self, blocks: list[int]) -> None:
        """Take ``blocks`` (cached free, distinct) out of the eviction queue. A run of them
        that starts a segment (a hit chain is a table prefix) goes in one slice; any other
        block is searched for segment by segment."""
        segs, seg_at = self._segs, self._seg_at
        i, n = 0, len(blocks)
        self._num_queued -= n
        while i < n:
            b = blocks[i]
            sid = seg_at.get(b)
            if sid is not None:
                (seg, keys, slotted), pos = segs[sid], 0
            else:  # not at a segment's start: search
                sid = next((k for k, v in segs.items() if b in v[0]), None)
                if sid is None:
                    raise KeyError(f"gpu block {b} is not in the eviction queue")
                seg, keys, slotted = segs[sid]
                pos = seg.index(b)
            run = blocks[i : i + len(seg) - pos]
            m = next(compress(count(), map(ne, seg[pos : pos + len(run)], run)), len(run))
            del seg[pos : pos + m]
            if slotted:
                keys[:] = _cut_runs(keys, pos, m)
            else:
                del keys[pos : pos + m]
            i += m
            if pos == 0:
                del seg_at[b]
                if seg:
                    seg_at[seg[0]] = sid
            if not seg:
                del segs[sid]

    def _release(self, r: Request, start: int) -> None:
        """Drop one reference to each of ``r.block_table[start:]``, tail first: keyed blocks
        reaching ref count 0 join the eviction queue (one new segment), unkeyed ones the
        pool. Blocks at indices below ``num_registered_blocks`` are keyed (all of them unless
        ``r`` has a hole); the rest are not."""
        table = r.block_table
        blocks = table[start:] if start else table
        ref = self._ref
        refs = _gather(ref, blocks)
        n = len(refs)
        nk = max(0, min(r.num_registered_blocks - start, n))
        m = n - refs.count(1)  # blocks held by others too, mostly a shared prefix
        if m and refs[m:].count(1) != n - m:
            m = n  # not a prefix: every block counted one by one
        # blocks[m:] all at ref count 1 (the common case): they reach 0, in one pass
        deque(map(setitem, repeat(ref), blocks[m:] if m else blocks, repeat(0)), 0)
        if m:
            counts = list(map(sub, refs[:m], repeat(1)))
            deque(map(setitem, repeat(ref), blocks, counts), 0)
        holes = r.request_id in self._holes
        if m < n and not holes:  # blocks[m:] reach 0, the first m stay held: slices
            queued, unkeyed = blocks[m:nk], blocks[max(m, nk) :]
            at: list[int] | range = range(start + m, start + nk)  # their keys' indices
        else:
            zero = [True] * n if not m else list(map(not_, counts)) + [True] * (n - m)
            keyed = [True] * nk + [False] * (n - nk)
            if holes:  # keyed iff the key map gives the block for its key
                keyed[:nk] = map(eq, self._held_by(r, start, start + nk), blocks)
            idx = list(compress(range(n), map(and_, zero, keyed)))
            queued = [blocks[k] for k in idx]
            at = [start + k for k in idx]
            unkeyed = list(compress(blocks, map(gt, zero, keyed)))  # reach 0, unkeyed
        if unkeyed:
            self._free_gpu.put(unkeyed)
        if queued:  # a new segment, at the queue's tail
            hs, per = r.block_hashes, self._per(r)
            if per == 1:
                keys = hs[at.start : at.stop] if type(at) is range else [hs[j] for j in at]
            else:
                keys = _runs_of(hs, per, at)
            sid = self._next_seg
            self._next_seg = sid + 1
            self._segs[sid] = (queued, keys, per > 1)
            self._seg_at[queued[0]] = sid
            self._num_queued += len(queued)

    # ----------------------------------------------------------------------- invariants
    def check_integrity(self, requests: list[Request]) -> None:
        """Assert ref counts, eviction queue and key maps (GPU), one owner per CPU block, and
        used + cached free + free = total, given every request that may hold blocks."""
        held: Counter[int] = Counter()
        block_of = self._block_of
        key_of = self._key_of
        assert len(block_of) == self.num_cached_blocks, "a key map's count is off"
        assert len(set(block_of.values())) == len(block_of), "a block holds 2 keys"
        assert all(s.count(-1) < len(s) for s in self._slots.values()), "an empty slot list kept"
        cpu_owner: dict[int, str] = {b: "free" for b in self._free_cpu.free_ids()}
        assert len(cpu_owner) == self._free_cpu.num_free, "cpu: a block is free twice"
        for r in requests:
            if r.status is RequestStatus.SWAPPED:
                for b in r.block_table:
                    assert b not in cpu_owner, (
                        f"cpu block {b} of {r.request_id}: also {cpu_owner[b]}"
                    )
                    cpu_owner[b] = r.request_id
                continue
            assert len(set(r.block_table)) == len(r.block_table), f"{r.request_id}: block twice"
            held.update(r.block_table)
            offered, holes = r.num_registered_blocks, r.request_id in self._holes
            keys = _key_ints(r.block_hashes, self._per(r), self._num_keys(r))
            for j, b in enumerate(r.block_table):
                if key_of[b] is not None:
                    assert j < len(keys) and keys[j] == key_of[b], (
                        f"gpu block {b} (index {j} of {r.request_id}) holds another key"
                    )
                if j >= offered or not holes:  # keyed iff offered
                    assert (key_of[b] is not None) == (j < offered), (
                        f"gpu block {b} (index {j} of {r.request_id}): keyed iff offered"
                    )
        assert len(cpu_owner) == self.num_cpu_blocks, (
            f"cpu: used + free = {len(cpu_owner)}, total = {self.num_cpu_blocks}"
        )
        assert all(0 <= b < self.num_cpu_blocks for b in cpu_owner), "cpu: ids out of range"
        n = self.num_gpu_blocks
        assert all(0 <= b < n for b in held), "gpu: held block ids out of range"
        bad = [b for b in range(n) if self._ref[b] != held.get(b, 0)]
        assert not bad, f"gpu blocks {bad[:5]}: ref count != requests holding them"
        free = self._free_gpu.free_ids()
        assert len(set(free)) == len(free) == self._free_gpu.num_free, "gpu: pool broken"
        assert not [b for b in free if self._ref[b] or key_of[b] is not None], (
            "gpu: pool block used"
        )
        queue = self._evictable
        assert len(set(queue)) == len(queue) == self._num_queued, "gpu: eviction queue broken"
        for b in queue:
            assert self._ref[b] == 0 and key_of[b] is not None, f"gpu block {b}: queued, not free"
        for blocks, keys, slotted in self._segs.values():
            assert blocks, "gpu: an empty segment is queued"
            if slotted:
                assert all(lo < hi for _, lo, hi in keys), "gpu: an empty run is kept"
                keys = [h + i for h, lo, hi in keys for i in range(lo, hi)]
            assert keys == [key_of[b] for b in blocks], "gpu: a segment's keys are not its blocks'"
        assert self._seg_at == {seg[0]: sid for sid, (seg, _, _) in self._segs.items()}, (
            "gpu: segment starts broken"
        )
        used = sum(1 for b in range(n) if self._ref[b])
        assert used + len(queue) + len(free) == n, (
            f"gpu: used {used} + cached free {len(queue)} + free {len(free)} != {n}"
        )


def _runs_of(heads: list[int], per: int, at: list[int] | range) -> list[list[int]]:
    """The runs ``[head, lo, hi]`` (offsets lo..hi-1 of one head) of the keys at indices
    ``at`` (ascending) of a request with ``per`` blocks a head, in order."""
    if type(at) is range:  # consecutive: one run a head, whole ones between the ends
        a, b = at.start, at.stop
        h0, h1 = a // per, (b - 1) // per
        if h0 == h1:
            return [[heads[h0], a - h0 * per, b - h0 * per]]
        whole = [[h, 0, per] for h in heads[h0 + 1 : h1]]
        return [[heads[h0], a - h0 * per, per], *whole, [heads[h1], 0, b - h1 * per]]
    runs: list[list[int]] = []
    last = -1
    for j in at:
        h, i = divmod(j, per)
        if h == last and runs[-1][2] == i:
            runs[-1][2] = i + 1
        else:
            runs.append([heads[h], i, i + 1])
            last = h
    return runs


def _cut_runs(runs: list[list[int]], pos: int, m: int) -> list[list[int]]:
    """``runs`` without the keys of the segment's blocks ``pos..pos+m-1``."""
    out, at, stop = [], 0, pos + m
    for head, lo, hi in runs:
        a, b = at, at + hi - lo  # the run keys the segment's blocks a..b-1
        at = b
        if b <= pos or a >= stop:
            out.append([head, lo, hi])
            continue
        if a < pos:
            out.append([head, lo, lo + pos - a])
        if b > stop:
            out.append([head, hi - (b - stop), hi])
    return out


def _key_ints(heads: list[int], per: int, num_keys: int) -> list[int]:
    """A request's keys as one int each (``head + offset``), the first ``num_keys``."""
    if per == 1:
        return list(heads[:num_keys])
    return [heads[j // per] + j % per for j in range(num_keys)]
