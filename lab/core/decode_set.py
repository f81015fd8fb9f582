"""The decode batch in closed form: O(1) per tick plus O(changes), not O(batch).

A member that joined at tick ``t0`` with ``n0`` output tokens has ``n0 + (tick - t0)`` now.
It needs a block when its token count L has L % block_size == 0, so members are bucketed by
``(L - tick) % block_size``; finishes come from a heap keyed by the finishing tick. A
member's state is written back to its ``Request`` only when it leaves the set.
"""

from __future__ import annotations

import heapq

from sched_lab.core.request import EMPTY, Request


def num_tokens_at(request: Request, tick: int) -> int:
    """Prompt + output tokens at decode tick ``tick`` of a decode-set member that joined at
    ``request.join_tick`` with ``request.join_num_output`` output tokens."""
    return request.prompt_len + request.join_num_output + tick - request.join_tick


class DecodeSet:
    """Running requests whose prompt is fully computed.

    Invariant: a member holding L tokens has KV for L - 1 of them (the latest sampled
    token is fed by the next tick) and holds ceil(L / block_size) blocks.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tick = 0  # decode ticks so far
        self._members: dict[Request, None] = {}  # insertion-ordered set
        self._buckets: list[dict[Request, None]] = [{} for _ in range(block_size)]
        self._finish_heap: list[tuple[int, int, Request]] = []
        self._offset_sum = 0  # sum over members of (num_tokens at join - join tick)
        self._seq = 0  # tie-breaker for the heap, keeps finishing order deterministic

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        return request in self._members

    def requests(self) -> list[Request]:
        """Members in the order they joined."""
        return list(self._members)

    def num_tokens(self, request: Request) -> int:
        """Prompt + output tokens of a member now (the latest sampled token included)."""
        return num_tokens_at(request, self.tick)

    @property
    def context_tokens(self) -> int:
        """Sum of ``num_tokens`` over members: the KV positions one decode tick reads."""
        return self._offset_sum + len(self._members) * self.tick

    def needing_block(self) -> dict[Request, None]:
        """Members that need one more block for the next tick (do not mutate)."""
        return self._buckets[-self.tick % self.block_size]

    def needing_blocks(self) -> list[dict[Request, None]]:
        """:meth:`needing_block` for each of the next ``block_size`` ticks (do not mutate):
        while no member leaves or joins, tick ``j`` from now needs ``[j % block_size]``."""
        b, i = self._buckets, -self.tick % self.block_size
        return b[i::-1] + b[:i:-1]

    def add(self, request: Request) -> None:
        """Add a request that has just sampled a token (or was swapped back in)."""
        r = request
        num_tokens = r.prompt_len + r.num_output_tokens
        r.join_tick, r.join_num_output = self.tick, r.num_output_tokens
        self._members[r] = None
        self._buckets[(num_tokens - self.tick) % self.block_size][r] = None
        self._offset_sum += num_tokens - self.tick
        if r.num_output_tokens >= r.output_len:
            return  # done already (async: it joins for its wasted slot only)
        # The tick whose step samples the last output token.
        last_tick = self.tick + r.output_len - r.num_output_tokens - 1
        heapq.heappush(self._finish_heap, (last_tick, self._seq, r))
        self._seq += 1

    def remove(self, request: Request, end_tick: int | None = None) -> None:
        """Remove a member, writing its state back as of tick ``end_tick`` (default now; for
        a member kept by ``advance(keep_done=True)``, the tick after its last token)."""
        r = request
        del self._members[r]
        key = self.num_tokens(r) - self.tick  # constant while a member
        del self._buckets[key % self.block_size][r]
        self._offset_sum -= key
        end = self.tick if end_tick is None else end_tick
        num_tokens = num_tokens_at(r, end)
        if end > r.join_tick:
            if r.decode_segments is EMPTY:
                r.decode_segments = [(r.join_tick, end)]
            else:
                r.decode_segments.append((r.join_tick, end))
        r.num_output_tokens = num_tokens - r.prompt_len
        r.num_computed_tokens = num_tokens - 1
        r.join_tick = -1  # marks heap entries of this membership as stale

    def ticks_before_finish(self) -> int | None:
        """Ticks from now in which no member samples its last token: that many
        ``advance()`` calls return nothing (None: no member will finish). Drops stale heap
        entries on top (``advance`` would skip them)."""
        heap = self._finish_heap
        while heap:
            last_tick, _, r = heap[0]
            if (
                r in self._members
                and r.join_tick + r.output_len - r.join_num_output - 1 == last_tick
            ):
                return last_tick - self.tick
            heapq.heappop(heap)
        return None

    def skip(self, num_ticks: int) -> None:
        """``num_ticks`` ticks at once, none finishing a member (at most
        :meth:`ticks_before_finish`; the caller checks)."""
        self.tick += num_ticks

    def advance(self, keep_done: bool = False) -> list[Request]:
        """One tick: every member gains a token. Returns those that sampled their last one,
        removed unless ``keep_done`` (async)."""
        self.tick += 1
        done = []
        heap = self._finish_heap
        while heap and heap[0][0] < self.tick:
            last_tick, _, r = heapq.heappop(heap)
            if (
                r in self._members
                and r.join_tick + r.output_len - r.join_num_output - 1 == last_tick
                and not (keep_done and r in done)  # a stale entry of an earlier membership
            ):
                if not keep_done:
                    self.remove(r)
                done.append(r)
        return done
