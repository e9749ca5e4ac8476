"""The P0 mirror: the server's keys and sizes, never tensor data.

The mirror follows the server rather than predicting it: once other clients,
leases and concurrent calls share one cache, the server's order of events is
the only truth. It learns from three sources, in any order:

- the replies of this client's own calls (each entry's outcome, the hashes
  the batch evicted), true as of the reply's sequence number;
- the server's feed, when subscribed: a snapshot, then every change in order;
- a Fetch that finds hashes missing.

Every fact carries the server's sequence number, and the mirror keeps, per
key, the number of the newest fact it applied (and, while calls are in
flight, of recent removals), so an older fact arriving late never undoes a
newer one. For a single client without leases the replies alone keep it
identical to the server, key for key and in LRU order; with the feed it
holds what the whole fleet stored.

Without the feed it also bounds itself by the server's capacity and item
bound (the same `ByteLRU` rule as the server), so it cannot grow past what
the server could hold; with the feed the server's own evictions arrive
instead, and the mirror never evicts on its own guess.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from mmcache._lru import ByteLRU, Outcome
from mmcache._spec import MAX_HASHES_PER_CALL

from .wire import Change, FeedChanges

__all__ = ["Mirror"]

_HELD = (Outcome.HIT, Outcome.STORED, Outcome.REPLACED)


class Mirror:
    def __init__(self, instance_id: str = "", capacity: int = 0, max_items: int = 0) -> None:
        self.instance_id = instance_id
        self._capacity = capacity
        self._max_items = max_items
        # key -> the sequence number of the newest fact applied for it.
        self._lru: ByteLRU[int] = ByteLRU(capacity, max_items=max_items or None)
        self._gone: dict[str, int] = {}  # recent removals, while calls are in flight
        # Calls in flight: token -> the newest number known when each began
        # (its reply's number can be no lower).
        self._calls: dict[int, int] = {}
        self._next_call = 0
        self._seen = 0  # the newest sequence number of any fact applied
        # Uploads in flight on the server (feed), with the number of their mark:
        # any newer fact about the key ends the mark, so a mark the feed has
        # not yet settled never outlives what a reply already told.
        self._pending: dict[str, int] = {}
        self._touched: list[str] = []
        self.following = False  # the feed is live: the server's evictions arrive
        # A subscription is under way and its snapshot (which may be older
        # than what replies told) is yet to come: keep every removal till then.
        self.syncing = False
        self.feed_seq = 0  # the number of the last feed change applied

    @property
    def capacity(self) -> int:
        """The server's capacity (0: caching disabled)."""
        return self._capacity

    @property
    def max_items(self) -> int:
        return self._max_items

    @property
    def used(self) -> int:
        return self._lru.used

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._lru

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._lru.keys())

    def size_of(self, mm_hash: str) -> int | None:
        return self._lru.size_of(mm_hash)

    def is_pending(self, mm_hash: str) -> bool:
        return mm_hash in self._pending

    # -- this client's calls -------------------------------------------------

    def touch(self, mm_hash: str) -> None:
        """Touch locally now; the server gets the touch with the next batch."""
        if self._lru.touch(mm_hash):
            self._touched.append(mm_hash)
            if len(self._touched) > 2 * MAX_HASHES_PER_CALL:
                self._touched = self.take_touches()

    def take_touches(self) -> list[str]:
        """The touches since the last batch; past a call's worth, each once and the
        most recent only (touches only order the LRU, so the oldest may go)."""
        touched, self._touched = self._touched, []
        if len(touched) <= MAX_HASHES_PER_CALL:
            return touched
        latest = list(dict.fromkeys(reversed(touched)))[:MAX_HASHES_PER_CALL]
        return latest[::-1]

    def plan(
        self, hashes: Sequence[str], has_data: Sequence[bool], *, processed: bool = False
    ) -> list[bool]:
        """Which entries of a batch should carry their data.

        An entry goes as its hash alone when it repeats an earlier entry of
        the batch, and (unless `processed`: the caller shares data it
        processed, which counts as a miss however the server answers) when
        the mirror holds it or another client's upload of it is in flight
        (the server waits for that upload, so the bytes travel once). Pure:
        the reply, not the guess, changes the mirror.
        """
        seen: set[str] = set()
        send: list[bool] = []
        for mm_hash, data in zip(hashes, has_data, strict=True):
            known = not processed and (mm_hash in self._lru or mm_hash in self._pending)
            held = mm_hash in seen or known
            send.append(data and not held)
            seen.add(mm_hash)
        return send

    def call_started(self) -> int:
        """Note a call in flight; pass the token to `call_ended`."""
        self._next_call += 1
        self._calls[self._next_call] = self._seen
        return self._next_call

    def call_ended(self, token: int) -> None:
        self._calls.pop(token, None)
        if not self._gone or self.syncing:
            return
        # A removal need be remembered only while an older fact can still
        # arrive: from a reply of a call begun before it, or from the feed.
        floor = min(self._calls.values(), default=self._seen + 1)
        if self.following:
            floor = min(floor, self.feed_seq + 1)
        if not self._calls or len(self._gone) > 1024:
            self._forget_removals_below(floor)

    def apply_reply(
        self,
        instance_id: str,
        capacity: int,
        max_items: int,
        seq: int,
        hashes: Sequence[str],
        outcomes: Sequence[Outcome],
        sizes: Sequence[int],
        evicted: Iterable[str] = (),
    ) -> None:
        """What one of this client's batches did on the server, true at `seq`."""
        if instance_id != self.instance_id:
            self._reset(instance_id)
        self._set_bounds(capacity, max_items)
        self._seen = max(self._seen, seq)
        for mm_hash in evicted:
            self._absent(mm_hash, seq)
        for mm_hash, outcome, size in zip(hashes, outcomes, sizes, strict=True):
            if outcome in _HELD:
                self._present(mm_hash, size, seq)
            else:
                self._absent(mm_hash, seq)

    def forget(self, mm_hashes: Iterable[str]) -> None:
        """Hashes the server turned out not to hold (a Fetch's miss)."""
        for mm_hash in mm_hashes:
            self._lru.pop(mm_hash)

    def clear(self, instance_id: str) -> None:
        """The server was cleared and the feed did not tell: forget everything."""
        following = self.following and instance_id == self.instance_id
        self._lru.clear()
        self._gone.clear()
        self._pending.clear()
        self._touched.clear()
        if not following:
            self._reset(instance_id)

    # -- the feed ------------------------------------------------------------

    def apply_snapshot(
        self,
        instance_id: str,
        seq: int,
        hashes: Sequence[str],
        sizes: Sequence[int],
        pending: Iterable[str],
        capacity: int,
        max_items: int,
    ) -> None:
        """The server's whole key set at `seq`: the mirror becomes it (plus newer facts)."""
        if instance_id != self.instance_id:
            self._reset(instance_id)
        old = self._lru
        self._lru = ByteLRU(sys.maxsize)
        for mm_hash, size in zip(hashes, sizes, strict=True):
            if self._gone.get(mm_hash, -1) <= seq:
                self._lru.put(mm_hash, seq, size)
        for mm_hash, fact_seq, size in old.items():
            if fact_seq > seq:  # learnt from a reply ahead of the snapshot
                self._lru.put(mm_hash, fact_seq, size)
        self._pending = {h: seq for h in pending}
        self._capacity, self._max_items = capacity, max_items
        self.syncing = False
        self.feed_seq = seq
        self._seen = max(self._seen, seq)
        self.following = True

    def apply_changes(self, instance_id: str, last_seq: int, changes: FeedChanges) -> bool:
        """Changes last_seq-n+1 .. last_seq, in order. False on a gap (resubscribe)."""
        if instance_id != self.instance_id or not self.following:
            return False
        first = last_seq - len(changes.kinds) + 1
        if first > self.feed_seq + 1:
            return False
        for offset, (kind, mm_hash, size) in enumerate(
            zip(changes.kinds, changes.mm_hashes, changes.sizes, strict=True)
        ):
            seq = first + offset
            if seq <= self.feed_seq:
                continue  # already in the snapshot
            if kind == Change.STORED:
                self._present(mm_hash, size, seq)
            elif kind == Change.REMOVED:
                self._absent(mm_hash, seq)
            elif kind == Change.PENDING:
                if max(self._lru.peek(mm_hash) or -1, self._gone.get(mm_hash, -1)) < seq:
                    self._pending[mm_hash] = seq
            elif kind == Change.SETTLED:
                self._pending.pop(mm_hash, None)
        self.feed_seq = max(self.feed_seq, last_seq)
        self._seen = max(self._seen, last_seq)
        if self._gone and not self._calls and not self.syncing:
            # No reply in flight: only removals ahead of the feed still matter.
            self._forget_removals_below(self.feed_seq + 1)
        return True

    def feed_lost(self) -> None:
        """The feed went quiet: bound the mirror by the server's limits again."""
        self.following = False
        self.syncing = False
        self._pending.clear()
        self._lru.resize(self._capacity, self._max_items or None)

    # -- internals -----------------------------------------------------------

    def _reset(self, instance_id: str) -> None:
        # A new server process (a restart): it holds nothing this mirror knew.
        self.instance_id = instance_id
        self._lru = ByteLRU(self._capacity, max_items=self._max_items or None)
        self._gone.clear()
        self._pending.clear()
        self._touched.clear()
        self.following = False
        self.syncing = False
        self.feed_seq = 0
        self._seen = 0

    def _set_bounds(self, capacity: int, max_items: int) -> None:
        if (capacity, max_items) == (self._capacity, self._max_items):
            return
        self._capacity, self._max_items = capacity, max_items
        if not self.following:
            self._lru.resize(capacity, max_items or None)

    def _forget_removals_below(self, floor: int) -> None:
        self._gone = {k: s for k, s in self._gone.items() if s >= floor}

    def _end_pending(self, mm_hash: str, seq: int) -> None:
        if self._pending.get(mm_hash, seq) < seq:
            del self._pending[mm_hash]

    def _present(self, mm_hash: str, size: int, seq: int) -> None:
        self._end_pending(mm_hash, seq)
        known = self._lru.peek(mm_hash)
        if (known is not None and known > seq) or self._gone.get(mm_hash, -1) > seq:
            return  # a newer fact is known
        self._gone.pop(mm_hash, None)
        self._lru.put(mm_hash, seq, size)  # its fact's number, its size, and recency

    def _absent(self, mm_hash: str, seq: int) -> None:
        self._end_pending(mm_hash, seq)
        known = self._lru.peek(mm_hash)
        if known is not None and known > seq:
            return
        self._lru.pop(mm_hash)
        if self._calls or self.following or self.syncing:
            self._gone[mm_hash] = max(seq, self._gone.get(mm_hash, -1))
