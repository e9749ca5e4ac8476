"""A byte-bounded LRU, and the batch rule that both sides of mmcache apply.

The server's item store and the client's key-only mirror are the same class
with different values (the item's bytes on the server, nothing on the
client), so for a single client the two make the same decision for every
item by construction: a mirror that agrees with the server is not a second
implementation kept in step by hand.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["BatchEntry", "ByteLRU", "Outcome"]

V = TypeVar("V")


class Outcome(enum.IntEnum):
    """What happened to one entry of a batch. Values match `mmcache.v1.Outcome`."""

    HIT = 1  # hash only, and the cache held it
    MISSING = 2  # hash only, and the cache did not hold it
    STORED = 3  # data sent and stored; the hash was not held before
    REPLACED = 4  # data sent and stored over an entry under the same hash (counted a miss)
    UNCACHED = 5  # data sent but not storable: larger than the room beside the batch


@dataclass(frozen=True, slots=True)
class BatchEntry(Generic[V]):
    """One item of a batch: its key, and its size and value when data is sent."""

    key: str
    size: int | None = None  # None: hash only
    value: V | None = None


class ByteLRU(Generic[V]):
    """Least-recently-used map bounded by the sum of its entries' sizes.

    Every operation is O(1) (eviction O(1) per entry evicted); the order
    lives in an `OrderedDict`, whose move-to-end and pop-first are O(1).
    `max_items`, when set, bounds the number of entries as well: sizes count
    only an item's data, so without it many tiny items could hold far more
    memory in bookkeeping than the capacity says.

    A pinned entry (`pin`) is held apart from the eviction order until
    `unpin`: it counts in both bounds but is never evicted, so eviction never
    scans past it. The server pins leased items; the mirror never pins.
    """

    __slots__ = (
        "_capacity",
        "_data",
        "_max_items",
        "_on_evict",
        "_pinned",
        "_pinned_bytes",
        "_used",
    )

    def __init__(
        self,
        capacity: int,
        on_evict: Callable[[str, V, int], None] | None = None,
        *,
        max_items: int | None = None,
    ) -> None:
        _check_bounds(capacity, max_items)
        self._capacity = capacity
        self._max_items = max_items
        self._used = 0
        self._data: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._pinned: dict[str, tuple[V, int]] = {}
        self._pinned_bytes = 0
        self._on_evict = on_evict

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_items(self) -> int | None:
        """The most entries held at once (None: bounded by bytes alone)."""
        return self._max_items

    @property
    def used(self) -> int:
        """Sum of the sizes of the entries held."""
        return self._used

    @property
    def pinned_bytes(self) -> int:
        """Sum of the sizes of the pinned entries."""
        return self._pinned_bytes

    @property
    def pinned_count(self) -> int:
        return len(self._pinned)

    def __len__(self) -> int:
        return len(self._data) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._data or key in self._pinned

    def keys(self) -> Iterator[str]:
        """Keys from least to most recently used (pinned ones last)."""
        yield from self._data
        yield from self._pinned

    def items(self) -> Iterator[tuple[str, V, int]]:
        """(key, value, size), in the order of `keys`."""
        for key, (value, size) in self._data.items():
            yield key, value, size
        for key, (value, size) in self._pinned.items():
            yield key, value, size

    def sizes(self) -> tuple[list[str], list[int]]:
        """Every key and its size, in the order of `keys` (C-speed loops: a
        million entries in tens of milliseconds)."""
        keys = [*self._data, *self._pinned]
        sizes = [entry[1] for entry in self._data.values()]
        sizes += [entry[1] for entry in self._pinned.values()]
        return keys, sizes

    def _get(self, key: str) -> tuple[V, int] | None:
        entry = self._data.get(key)
        return self._pinned.get(key) if entry is None else entry

    def peek(self, key: str) -> V | None:
        """The value under `key`, without changing the eviction order."""
        entry = self._get(key)
        return None if entry is None else entry[0]

    def size_of(self, key: str) -> int | None:
        entry = self._get(key)
        return None if entry is None else entry[1]

    def touch(self, key: str) -> bool:
        """Mark `key` most recently used. A missing key is left missing."""
        if key in self._data:
            self._data.move_to_end(key)
            return True
        return key in self._pinned

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def pin(self, key: str) -> bool:
        """Keep `key` from eviction until `unpin`; False when it is not held."""
        entry = self._data.pop(key, None)
        if entry is not None:
            self._pinned[key] = entry
            self._pinned_bytes += entry[1]
            return True
        return key in self._pinned

    def unpin(self, key: str) -> None:
        """Return a pinned entry to the eviction order, as the most recently used."""
        entry = self._pinned.pop(key, None)
        if entry is not None:
            self._pinned_bytes -= entry[1]
            self._data[key] = entry

    def pop(self, key: str) -> V | None:
        """Remove `key` (not counted as an eviction) and return its value."""
        entry = self._data.pop(key, None)
        if entry is None:
            entry = self._pinned.pop(key, None)
            if entry is None:
                return None
            self._pinned_bytes -= entry[1]
        self._used -= entry[1]
        return entry[0]

    def replace_value(self, key: str, value: V) -> bool:
        """Put `value` in place of the held entry's, its size and place kept."""
        for table in (self._data, self._pinned):
            entry = table.get(key)
            if entry is not None:
                table[key] = (value, entry[1])
                return True
        return False

    def evict(self, key: str) -> bool:
        """Evict one unpinned entry now, as if room were needed (`on_evict` hears of it)."""
        entry = self._data.pop(key, None)
        if entry is None:
            return False
        self._used -= entry[1]
        if self._on_evict is not None:
            self._on_evict(key, *entry)
        return True

    def clear(self, *, keep_pinned: bool = False) -> list[str]:
        """Remove every entry (every unpinned one with `keep_pinned`); the keys removed."""
        removed = list(self._data)
        self._data.clear()
        if not keep_pinned:
            removed.extend(self._pinned)
            self._pinned.clear()
            self._pinned_bytes = 0
        self._used = self._pinned_bytes
        return removed

    def resize(self, capacity: int, max_items: int | None = None) -> None:
        """Change the bounds, evicting the oldest entries that no longer fit."""
        _check_bounds(capacity, max_items)
        self._capacity = capacity
        self._max_items = max_items
        self._evict_until(0, 0)

    def put(self, key: str, value: V, size: int) -> Outcome:
        """Store `value` under `key` (replacing any entry), evicting as needed.

        The batch rule for a batch of one entry, without the batch's
        bookkeeping (the mirror calls this for every fact it learns).
        """
        pinned = self._pinned.get(key)
        held = self._data.get(key) if pinned is None else pinned
        old_size = 0 if held is None else held[1]
        # What must stay: every pinned entry, less the one being replaced.
        others = len(self._pinned) - (pinned is not None)
        full = self._max_items is not None and others >= self._max_items
        if full or size > self._capacity - (self._pinned_bytes - (pinned is not None) * old_size):
            self._refuse(key, held)
            return Outcome.UNCACHED
        return self._store(key, value, size, held)

    def apply_batch(
        self, entries: Sequence[BatchEntry[V]], *, replace_present: bool
    ) -> list[Outcome]:
        """Apply one `get_and_update` batch and say what happened to each entry.

        Every key of the batch is touched first, then the entries run in
        order. An entry with data is stored; if its key is held, the server
        replaces it (`replace_present=True`: sent data wins; REPLACED, a
        miss in the counts: its caller processed the item) while the mirror
        calls it a hit (it would not have sent the data). An insert
        evicts only entries the batch does not refer to: an item that would
        need more room than that (bytes, or an entry slot under `max_items`)
        is UNCACHED, and an entry it was meant to replace is dropped rather
        than left serving old data, unless that entry is pinned (promised to
        a reader): a pinned entry leaves only by `unpin`, `pop` or `clear`.
        """
        data = self._data
        batch_keys = {e.key for e in entries}
        for key in batch_keys:
            if key in data:
                data.move_to_end(key)
        # The batch's own entries now sit at the most-recent end, so eviction
        # from the other end reaches every other entry before any of them.
        # What must stay: the batch's held entries and every pinned one.
        held_keys = [k for k in batch_keys if k in data]
        pinned = sum(data[k][1] for k in held_keys) + self._pinned_bytes
        pinned_items = len(held_keys) + len(self._pinned)
        limit = self._max_items
        outcomes: list[Outcome] = []
        for entry in entries:
            key = entry.key
            held = self._get(key)
            if entry.size is None or (held is not None and not replace_present):
                if held is None:
                    outcomes.append(Outcome.MISSING)
                else:
                    self.touch(key)
                    outcomes.append(Outcome.HIT)
                continue
            old_size = 0 if held is None else held[1]
            others = pinned_items - (held is not None)  # entries that must stay
            full = limit is not None and others >= limit
            if full or entry.size > self._capacity - (pinned - old_size):
                if self._refuse(key, held):
                    pinned -= old_size
                    pinned_items -= 1
                outcomes.append(Outcome.UNCACHED)
                continue
            outcomes.append(self._store(key, entry.value, entry.size, held))  # type: ignore[arg-type]
            pinned += entry.size - old_size
            pinned_items = others + 1
        return outcomes

    def _refuse(self, key: str, held: tuple[V, int] | None) -> bool:
        """New data for `key` cannot be stored: the old entry goes rather than
        serve stale data, unless it is pinned (promised to a reader). Whether
        it went."""
        if held is None or key in self._pinned:
            return False
        self.pop(key)
        return True

    def _store(self, key: str, value: V, size: int, held: tuple[V, int] | None) -> Outcome:
        """Store one entry that fits, evicting unpinned entries as needed."""
        was_pinned = key in self._pinned
        if held is not None:
            self.pop(key)
        self._evict_until(size, 1)
        self._data[key] = (value, size)
        self._used += size
        if was_pinned:  # sent data replaces a leased entry, which stays leased
            self.pin(key)
        return Outcome.STORED if held is None else Outcome.REPLACED

    def _evict_until(self, incoming: int, new_items: int) -> None:
        data = self._data
        limit = self._max_items
        while data and (
            self._used + incoming > self._capacity
            or (limit is not None and len(self) + new_items > limit)
        ):
            key, (value, size) = data.popitem(last=False)
            self._used -= size
            if self._on_evict is not None:
                self._on_evict(key, value, size)


def _check_bounds(capacity: int, max_items: int | None) -> None:
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if max_items is not None and max_items < 1:
        raise ValueError(f"max_items must be >= 1 (or None: no bound), got {max_items}")
