"""The P1 item cache: a byte-bounded LRU of validated items, with leases (no gRPC here).

Items are kept as the chunk frames they arrived in, so a Fetch sends the very
same `bytes` objects back: no copy on the way in or out; or in an extent
placement gave them (_extent.py), where co-located clients read them. Every
change to the key set is published on the change stream (_changes.py), and a
leased item is pinned: it counts in the capacity and is never evicted until
its lease ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from mmcache._errors import CacheMissError
from mmcache._lru import BatchEntry, ByteLRU, Outcome

from ._changes import ItemChange, ItemChanges
from ._extent import Extent, extent_frames
from ._leases import LeaseBook
from ._types import Change, FeedState, Lease

__all__ = ["BatchResult", "ItemStore", "StoredItem", "UploadEntry"]

# Evicted hashes named in one reply; the feed names every one.
MAX_REPLY_EVICTIONS = 4096
# Metadata put in one reply, so that it fits one 8 MiB message.
MAX_REPLY_METADATA_BYTES = 6 << 20

_HELD = (Outcome.HIT, Outcome.STORED, Outcome.REPLACED)


@dataclass(frozen=True, slots=True)
class StoredItem:
    spec: bytes  # the serialised mmcache.v1.ItemSpec, checked when it arrived
    frames: tuple[bytes, ...]  # empty when resident
    payload: int  # tensor bytes carried by the frames
    size: int  # bytes charged to the LRU: the spec's size plus the metadata's
    metadata: bytes = b""
    # Where the payload lies instead of `frames` (placement's: the region).
    resident: Extent | None = None
    modality: str = ""  # its spec's own (the first field's): a label for its lookups


@dataclass(frozen=True, slots=True)
class UploadEntry:
    """One validated entry of a GetAndUpdate.

    Exactly one of: `item` (data to store), `withheld` (data the client kept
    home because it is larger than the whole cache), or neither (hash only).
    """

    mm_hash: str
    item: StoredItem | None = None
    withheld: bool = False
    want_metadata: bool = False


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one get_and_update batch did."""

    outcomes: list[Outcome]
    sizes: list[int]  # charged bytes of each entry held afterwards, else 0
    evicted: list[str]  # hashes evicted to make room (at most MAX_REPLY_EVICTIONS)
    evicted_truncated: bool
    metadata: list[bytes] | None  # per entry when any asked for it
    metadata_truncated: bool = False  # some blobs left out (MAX_REPLY_METADATA_BYTES)


class ItemStore:
    """The cache of items under `mm_hash`, bounded by `capacity` bytes and `max_items` items."""

    def __init__(
        self,
        capacity: int,
        *,
        max_items: int,
        lease_s: float,
        changes: ItemChanges | None = None,
        on_evict: Callable[[int], None] | None = None,
        on_expire: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lru: ByteLRU[StoredItem] = ByteLRU(capacity, self._evicted_one, max_items=max_items)
        self._leases = LeaseBook(lease_s, self._lru.pin, self._lru.unpin)
        self.changes = ItemChanges() if changes is None else changes
        self._on_evict = on_evict
        self._on_expire = on_expire
        self._clock = clock

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

    @property
    def lease_s(self) -> float:
        return self._leases.lease_s

    @property
    def leases(self) -> int:
        """Lease grants outstanding."""
        return len(self._leases)

    @property
    def leased_items(self) -> int:
        return self._lru.pinned_count

    @property
    def leased_bytes(self) -> int:
        return self._lru.pinned_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._lru

    def keys(self) -> list[str]:
        return list(self._lru.keys())

    def peek(self, mm_hash: str) -> StoredItem | None:
        return self._lru.peek(mm_hash)

    def size_of(self, mm_hash: str) -> int:
        """The bytes charged for the item under `mm_hash`; 0 when none is held."""
        return self._lru.size_of(mm_hash) or 0

    def update(
        self,
        touches: Iterable[str],
        entries: Sequence[UploadEntry],
        *,
        lease: Lease = Lease.NONE,
    ) -> BatchResult:
        """Apply a client's pending touches, then one get_and_update batch."""
        self.expire()
        for key in touches:
            self._lru.touch(key)
        # Withheld data could never be stored: UNCACHED, and any older entry
        # under the hash is dropped rather than left serving old data, unless
        # it is leased (promised to a reader; the hash names the same content).
        for entry in entries:
            if entry.withheld and not self._lru.is_pinned(entry.mm_hash):
                self._drop(entry.mm_hash)
        rest = [self._keep_metadata(e) for e in entries if not e.withheld]
        held_before = {e.mm_hash for e in rest if e.item is not None and e.mm_hash in self._lru}
        evicted = _Evictions()
        with self.changes.listening(evicted.heard):
            applied = iter(
                self._lru.apply_batch(
                    [
                        BatchEntry(e.mm_hash)
                        if e.item is None
                        else BatchEntry(e.mm_hash, e.item.size, e.item)
                        for e in rest
                    ],
                    replace_present=True,
                )
            )
        outcomes = [Outcome.UNCACHED if e.withheld else next(applied) for e in entries]
        for entry, outcome in zip(entries, outcomes, strict=True):
            if outcome in (Outcome.STORED, Outcome.REPLACED):
                self._change(Change.STORED, entry.mm_hash, self._lru.size_of(entry.mm_hash))
            elif (
                outcome == Outcome.UNCACHED
                and entry.mm_hash in held_before
                and entry.mm_hash not in self._lru
            ):
                self._leases.forget(entry.mm_hash)
                self._change(Change.REMOVED, entry.mm_hash)
        sizes = [
            (self._lru.size_of(e.mm_hash) or 0) if o in _HELD else 0
            for e, o in zip(entries, outcomes, strict=True)
        ]
        if lease != Lease.NONE:
            leased = _HELD if lease == Lease.HELD else (Outcome.HIT,)
            self._leases.grant(
                (e.mm_hash for e, o in zip(entries, outcomes, strict=True) if o in leased),
                self._clock(),
            )
        metadata, cut = self._reply_metadata(entries, outcomes)
        return BatchResult(outcomes, sizes, evicted.keys, evicted.truncated, metadata, cut)

    def _reply_metadata(
        self, entries: Sequence[UploadEntry], outcomes: Sequence[Outcome]
    ) -> tuple[list[bytes] | None, bool]:
        """The metadata of the hits whose callers asked for it, in a reply of at
        most MAX_REPLY_METADATA_BYTES (past it, the rest go without: True)."""
        if not any(e.want_metadata for e in entries):
            return None, False
        metadata: list[bytes] = []
        budget = MAX_REPLY_METADATA_BYTES
        for e, o in zip(entries, outcomes, strict=True):
            blob = self._metadata_of(e.mm_hash) if e.want_metadata and o == Outcome.HIT else b""
            if len(blob) > budget:
                blob, budget = b"", -1  # the rest of the reply goes without
            budget -= len(blob)
            metadata.append(blob)
        return metadata, budget < 0

    def adopt(
        self, items: Iterable[tuple[str, StoredItem]], *, keep: Iterable[str] = ()
    ) -> list[str]:
        """Store items read from the L2 tier under keys still absent, as an
        upload would (the feed hears of them), making room without evicting
        the held items under `keep` (the rest of the caller's batch: they are
        touched, as that batch will); the keys their room evicted."""
        absent = [UploadEntry(key, item) for key, item in items if key not in self._lru]
        if not absent:
            return []
        kept = [UploadEntry(key) for key in dict.fromkeys(keep) if key in self._lru]
        return self.update((), [*kept, *absent]).evicted

    def fetch(self, mm_hashes: Sequence[str]) -> list[StoredItem]:
        """The items under `mm_hashes`, in order, without touching the order.

        Raises CacheMissError naming every hash that is not held.
        """
        self.expire()
        items = [self._lru.peek(h) for h in mm_hashes]
        missing = [h for h, item in zip(mm_hashes, items, strict=True) if item is None]
        if missing:
            raise CacheMissError(missing)
        return items  # type: ignore[return-value]

    def make_resident(self, key: str, item: StoredItem, resident: Extent) -> None:
        """The held `item` under `key` keeps its bytes in the region from now on
        (its frames dropped: charged once), its place in the order kept."""
        if self._lru.peek(key) is item:
            self._lru.replace_value(key, replace(item, frames=(), resident=resident))

    def leave_extents(self, keys: Iterable[str], incoming: int) -> Iterator[bool]:
        """Take the items under `keys` (in extents, first to leave first) out
        of them, one a step: the caller stops once placement has the room
        it needs. While the store has room for the `incoming` bytes, an
        item moves back to the heap (still cached, leased, in its place in the
        order: the step yields True, a copy); once it is full, and must evict
        to take them anyway, the item is evicted (unless leased; False).
        Extents are freed once no read holds them."""
        for key in keys:
            item = self._lru.peek(key)
            if item is None or item.resident is None:
                continue
            moved = self.used + incoming <= self.capacity or self._lru.is_pinned(key)
            if moved:
                frames = tuple(extent_frames(item.resident))
                self._lru.replace_value(key, replace(item, frames=frames, resident=None))
            else:
                self._lru.evict(key)
            del item  # the last reference to the extent, unless a read holds it
            yield moved

    def lease(self, mm_hashes: Sequence[str]) -> int:
        """Touch and lease the held ones of `mm_hashes`, as a lookup's hits are
        (a co-located client's leases taken with no call); how many were held."""
        self.expire()
        held = [h for h in mm_hashes if self._lru.touch(h)]
        self._leases.grant(held, self._clock())
        return len(held)

    def is_leased(self, mm_hash: str) -> bool:
        return mm_hash in self._leases

    def release(self, mm_hashes: Iterable[str]) -> int:
        """Give back one lease of each hash; how many were leased."""
        return self._leases.release(mm_hashes)

    def expire(self) -> int:
        """End the leases past their time; how many ended."""
        expired = self._leases.expire(self._clock())
        if expired and self._on_expire is not None:
            self._on_expire(expired)
        return expired

    def touch(self, mm_hashes: Iterable[str]) -> int:
        """Mark hashes recently used; missing ones are ignored. Returns how many were held."""
        return sum(self._lru.touch(h) for h in mm_hashes)

    def clear(self, owned: Callable[[str], bool] | None = None) -> tuple[int, int]:
        """Remove every item (every `owned` one) that no lease holds:
        (removed, kept because leased)."""
        if owned is None:
            removed = self._lru.clear(keep_pinned=True)
            kept = self._lru.pinned_count
        else:
            removed, kept = [], 0
            for key in [k for k in self._lru.keys() if owned(k)]:  # noqa: SIM118
                if self._lru.is_pinned(key):
                    kept += 1
                else:
                    self._lru.pop(key)
                    removed.append(key)
        for key in removed:
            self._change(Change.REMOVED, key)
        return len(removed), kept

    def state(self, pending: Iterable[str] = ()) -> FeedState:
        """The key set now, least recently used first: what a feed snapshot sends."""
        hashes, sizes = self._lru.sizes()
        return FeedState(hashes, sizes, list(pending), self.capacity, self.max_items)

    def _keep_metadata(self, entry: UploadEntry) -> UploadEntry:
        """Data sent again without metadata keeps the metadata stored with it."""
        item = entry.item
        if item is None or item.metadata:
            return entry
        held = self._lru.peek(entry.mm_hash)
        if held is None or not held.metadata:
            return entry
        kept = replace(item, metadata=held.metadata, size=item.size + len(held.metadata))
        return replace(entry, item=kept)

    def _metadata_of(self, mm_hash: str) -> bytes:
        item = self._lru.peek(mm_hash)
        return b"" if item is None else item.metadata

    def _drop(self, mm_hash: str) -> None:
        if self._lru.pop(mm_hash) is not None:
            self._leases.forget(mm_hash)
            self._change(Change.REMOVED, mm_hash)

    def _evicted_one(self, key: str, value: StoredItem, size: int) -> None:
        if self._on_evict is not None:
            self._on_evict(size)
        self.changes.publish(ItemChange(Change.REMOVED, key, evicted=True))

    def _change(self, kind: Change, mm_hash: str, size: int | None = 0) -> None:
        self.changes.publish(ItemChange(kind, mm_hash, size or 0))


class _Evictions:
    """The evictions one batch made, as its reply names them (the first
    MAX_REPLY_EVICTIONS; the feed names every one)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.truncated = False

    def heard(self, change: ItemChange) -> None:
        if not change.evicted:
            return
        if len(self.keys) < MAX_REPLY_EVICTIONS:
            self.keys.append(change.key)
        else:
            self.truncated = True
