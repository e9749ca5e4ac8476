"""The P1 item cache: a byte-bounded LRU of validated items (no gRPC here).

Items are kept as the chunk frames they arrived in, so a Fetch sends the very
same `bytes` objects back: no copy on the way in or out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mmcache._errors import CacheMissError
from mmcache._lru import BatchEntry, ByteLRU, Outcome
from mmcache.v1 import cache_pb2 as pb

__all__ = ["ItemStore", "StoredItem", "UpdateItem"]


@dataclass(frozen=True, slots=True)
class StoredItem:
    spec: pb.ItemSpec
    frames: tuple[bytes, ...]
    payload: int  # tensor bytes carried by the frames
    size: int  # bytes charged to the LRU


@dataclass(frozen=True, slots=True)
class UpdateItem:
    """One validated entry of a GetAndUpdate: hash only when `item` is None."""

    mm_hash: str
    item: StoredItem | None = None
    withheld_size: int | None = None  # data withheld by the client: larger than the cache


class ItemStore:
    """The cache of items under `mm_hash`, bounded by `capacity` bytes and `max_items` items."""

    def __init__(
        self,
        capacity: int,
        on_evict: Callable[[int], None] | None = None,
        *,
        max_items: int,
    ) -> None:
        evict_hook = None if on_evict is None else (lambda _k, _v, size: on_evict(size))
        self._lru: ByteLRU[StoredItem] = ByteLRU(capacity, evict_hook, max_items=max_items)

    @property
    def capacity(self) -> int:
        return self._lru.capacity

    @property
    def max_items(self) -> int:
        """The item bound, as the wire says it (0: none)."""
        return self._lru.max_items or 0

    @property
    def used(self) -> int:
        return self._lru.used

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._lru

    def update(self, touches: Iterable[str], entries: Sequence[UpdateItem]) -> list[Outcome]:
        """Apply a client's pending touches, then one get_and_update batch."""
        for key in touches:
            self._lru.touch(key)
        batch: list[BatchEntry[StoredItem]] = []
        for entry in entries:
            if entry.item is not None:
                batch.append(BatchEntry(entry.mm_hash, entry.item.size, entry.item))
            elif entry.withheld_size is not None:
                # Sized beyond the whole cache by the client: the batch rule
                # answers UNCACHED (and drops any stale entry) without data.
                batch.append(BatchEntry(entry.mm_hash, max(entry.withheld_size, self.capacity + 1)))
            else:
                batch.append(BatchEntry(entry.mm_hash))
        return self._lru.apply_batch(batch, replace_present=True)

    def size_of(self, mm_hash: str) -> int:
        return self._lru.size_of(mm_hash) or 0

    def fetch(self, mm_hashes: Sequence[str]) -> list[StoredItem]:
        """The items under `mm_hashes`, in order, without touching the order.

        Raises CacheMissError naming every hash that is not held.
        """
        items = [self._lru.peek(h) for h in mm_hashes]
        missing = [h for h, item in zip(mm_hashes, items, strict=True) if item is None]
        if missing:
            raise CacheMissError(missing)
        return items  # type: ignore[return-value]

    def touch(self, mm_hashes: Iterable[str]) -> int:
        """Mark hashes recently used; missing ones are ignored. Returns how many were held."""
        return sum(self._lru.touch(h) for h in mm_hashes)

    def clear(self) -> int:
        return self._lru.clear()
