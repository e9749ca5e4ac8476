"""`ItemCache`: the server's items, wherever they live (heap, region, L2), for
the calls that use them. An upload is `prepare`d (everything that waits:
claims of its region slots, other calls' uploads of its hashes, the L2
tier's reads, the bytes in flight), its data read by the caller, then
committed (no await: what the reply says is what the cache holds)."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mmcache._errors import CacheMissError
from mmcache._lru import Outcome
from mmcache._spec import check_count
from mmcache.metrics import CacheMetrics

from ._changes import ItemChanges
from ._colocated import CoLocatedReports
from ._deadline import Deadline
from ._entries import EntryHeader
from ._extent import Extent, extent_frames, frame_count
from ._inflight import InflightBudget
from ._pending import PendingUploads
from ._placement import Placement
from ._region import Region, Slot
from ._report_rings import ReportRings
from ._reuse import SmallReuse
from ._store import BatchResult, ItemStore, StoredItem, UploadEntry
from ._types import FeedState, Lease, Report, Scope

if TYPE_CHECKING:  # they import the facade's modules
    from ._open import Lifecycle
    from ._tier import L2Tier

__all__ = [
    "CacheParts",
    "CacheStats",
    "ItemCache",
    "PreparedUpdate",
    "RegionInfo",
    "ShmRead",
    "Tier",
    "parts_of",
]


class Tier(enum.Enum):
    """Where an item is held (Locate)."""

    NONE = 0
    L1 = 1
    L2 = 2


@dataclass(frozen=True)
class RegionInfo:
    """The shared-memory region, as Info announces it to co-located clients."""

    path: str
    size: int
    id: bytes


@dataclass(frozen=True)
class Limits:
    """The cache's bounds, which every upload's reply repeats (no stats built)."""

    capacity: int
    max_items: int
    lease_s: float


@dataclass(frozen=True)
class CacheStats:
    """The cache's state, as Info and /metrics report it."""

    capacity: int
    used: int
    items: int
    max_items: int
    lease_s: float
    leases: int
    leased_bytes: int
    inflight_bytes: int
    queries: int
    hits: int
    shared_tier: bool
    l2_up: bool
    shm: RegionInfo | None  # the shared-memory region, when it has one
    shm_leased_bytes: int = 0  # write slots
    shm_resident_bytes: int = 0
    shm_transient_bytes: int = 0
    shm_reserve_bytes: int = 0  # the read reserve (_placement.py)


@dataclass(eq=False)
class CacheParts:
    """What `open_cache` builds (_open.py). Calls use ItemCache's operations;
    tests and probes that must look inside get these with `parts_of`."""

    store: ItemStore
    inflight: InflightBudget
    metrics: CacheMetrics
    placement: Placement
    tier: L2Tier | None
    changes: ItemChanges
    reports: CoLocatedReports
    reuse: SmallReuse  # of small items: whether sharing them pays (_reuse.py)

    @property
    def region(self) -> Region | None:
        return self.placement.region

    @property
    def rings(self) -> ReportRings | None:
        return self.reports.rings


@dataclass(frozen=True)
class ShmRead:
    """An item a read finds in the region: its extent, and the hold that keeps
    it (0: none asked)."""

    item: StoredItem
    slot: Slot
    hold: int


class PreparedUpdate:
    """An upload past its waits: its claimed region slots and what came from L2."""

    def __init__(
        self,
        cache: ItemCache,
        parts: CacheParts,
        entries: Sequence[EntryHeader],
        claimed: dict[int, Slot],
        pulled: list[tuple[str, StoredItem]],
        payload: int,
    ) -> None:
        self._cache = cache
        self._parts = parts
        self._entries = entries
        self._claimed = claimed
        self._pulled = pulled
        self._payload = payload

    def in_region(self, entry: EntryHeader) -> bool:
        """Whether the entry's data is in a region slot the upload claimed."""
        return entry.index in self._claimed

    def from_region(self, entry: EntryHeader) -> tuple[tuple[bytes, ...], Extent | None]:
        """The entry's data in its claimed slot (Placement.from_region)."""
        return self._parts.placement.from_region(self._claimed.pop(entry.index), entry)

    def commit(
        self,
        uploads: Sequence[UploadEntry],
        touches: Sequence[str],
        lease: Lease,
    ) -> BatchResult:
        """Store the batch (no await: what came from L2 is in L1 when answered,
        and its room is made without evicting what this batch names); count
        its lookups; the evictions of both."""
        cache, store, entries = self._cache, self._parts.store, self._entries
        cache.metrics.received_bytes.inc(self._payload)
        batch = [e.key for e in entries]
        adopted = store.adopt(self._pulled, keep=batch) if self._pulled else []
        result = store.update(touches, uploads, lease=lease)
        cache.write_behind(entries, result.outcomes)
        if adopted:
            result = replace(result, evicted=adopted + result.evicted)
        blobs = result.metadata or [b""] * len(entries)
        reuse = self._parts.reuse
        answered = zip(entries, result.outcomes, blobs, result.sizes, strict=True)
        for entry, outcome, blob, size in answered:
            if outcome == Outcome.STORED:
                reuse.stored(size)
            elif outcome in (Outcome.HIT, Outcome.REPLACED):  # asked for again
                reuse.hit(size)
            # A hit whose caller asked for its metadata and got none (stored
            # without, or left out of a full reply) is one it cannot use: it
            # processes the item, and counts a miss (as vLLM does).
            unusable = entry.want_metadata and outcome == Outcome.HIT and not blob
            counted = Outcome.MISSING if unusable else outcome
            cache.count(entry.modality or cache.modality_of(entry.key), counted, entry.resend)
        return result


class ItemCache:
    """The store (L1: heap and region), the L2 tier, the uploads in flight and
    the co-located clients' reports, behind the operations of the calls;
    made by `open_cache` (_open.py), run by `async with`.

        async with cache.prepare(token, entries, deadline, said_wait) as prepared:
            uploads = [...]  # each entry's data, read from the call
            result = prepared.commit(uploads, touches, lease)
    """

    def __init__(self, parts: CacheParts, lifecycle: Lifecycle) -> None:
        self._parts = parts
        self._store = parts.store
        self._placement = parts.placement
        self._l2 = parts.tier
        self._lifecycle = lifecycle
        self._pending = PendingUploads(parts.changes, parts.metrics.claim_expiries.inc)
        self._reports = parts.reports
        self.metrics = parts.metrics
        self.changes = parts.changes  # what it holds, as it changes: subscribe to it

    async def __aenter__(self) -> ItemCache:
        """Run it: its region opened, the L2 tier and the timers started."""
        await self._lifecycle.start(self.beat)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._lifecycle.stop()

    # -- state --

    @property
    def pending(self) -> list[str]:
        """Store keys being uploaded now."""
        return self._pending.hashes()

    def __contains__(self, key: object) -> bool:
        """Whether L1 holds an item under the store key."""
        return key in self._store

    def feed_state(self) -> FeedState:
        """The key set now, and the uploads in flight: what a feed snapshot sends."""
        return self._store.state(self.pending)

    def limits(self) -> Limits:
        store = self._store
        return Limits(store.capacity, store.max_items, store.lease_s)

    def stats(self, *, drain: bool = True) -> CacheStats:
        """Its state now; `drain`: with what the report rings hold counted first."""
        if drain:
            self.drain_reports()
        store, shm, l2 = self._store, self._placement.region_state(), self._l2
        return CacheStats(
            capacity=store.capacity,
            used=store.used,
            items=len(store),
            max_items=store.max_items,
            lease_s=store.lease_s,
            leases=store.leases,
            leased_bytes=store.leased_bytes,
            inflight_bytes=self._parts.inflight.used,
            queries=self.metrics.total_queries,
            hits=self.metrics.total_hits,
            shared_tier=l2 is not None,
            l2_up=l2 is not None and bool(l2.backend.up),
            shm=None if shm is None else RegionInfo(shm.path, shm.size, shm.id),
            shm_leased_bytes=0 if shm is None else shm.leased_bytes,
            shm_resident_bytes=0 if shm is None else shm.resident_bytes,
            shm_transient_bytes=0 if shm is None else shm.transient_bytes,
            shm_reserve_bytes=self._placement.reserve,
        )

    # -- uploads --

    @contextlib.asynccontextmanager
    async def prepare(
        self,
        token: bytes,
        entries: Sequence[EntryHeader],
        deadline: Deadline,
        said_wait_s: float | None,
        claim_s: float = 0.0,
    ) -> AsyncIterator[PreparedUpdate]:
        """Everything an upload waits for, in order: its region slots checked
        and claimed (before anything waits, so none expires), other calls'
        uploads (and claims) of the hashes it sends alone, its own hashes
        marked pending, the L2 tier's reads of those it sends alone, the
        claims it asks for (`claim_s`: on those still missing, _pending.py),
        room for its bytes in flight. What it yields commits; leaving undoes
        what was not."""
        self.drain_reports()  # leases given back before anything is evicted
        claimed = self._placement.claim(token, entries)
        try:
            alone = [e.key for e in entries if e.spec is None]
            waited = await self._pending.wait(
                alone, deadline.upload_wait(said_wait_s), deadline.upload_wait(None)
            )
            if waited:
                self.metrics.upload_waits.inc(waited)
            marked = self._pending.mark([e.key for e in entries if e.chunks is not None])
            try:
                pulled = await self.read_through(alone, deadline, wait_s=said_wait_s)
                if claim_s > 0:
                    self._claim(alone, pulled, claim_s)
                # Nothing is stored until every byte has arrived and been checked,
                # so a cancelled or malformed upload leaves the cache as it was.
                payload = sum(e.payload for e in entries if e.chunks is not None)
                async with self._parts.inflight.reserve(payload):
                    yield PreparedUpdate(self, self._parts, entries, claimed, pulled, payload)
            finally:
                self._pending.settle(marked)
        finally:
            self._placement.unclaim(claimed)  # those a failed call never read

    def _claim(
        self, alone: Sequence[str], pulled: Sequence[tuple[str, StoredItem]], seconds: float
    ) -> None:
        read = {key for key, _ in pulled}
        missing = [k for k in dict.fromkeys(alone) if k not in self._store and k not in read]
        claimed = self._pending.claim(missing, seconds)
        if claimed:
            self.metrics.claims.inc(claimed)

    def spares(
        self, token: bytes, sizes: Sequence[tuple[int, int]], batch: Sequence[str]
    ) -> list[Slot]:
        return self._placement.spares(token, sizes, batch)

    def allocate(self, token: bytes, sizes: Sequence[tuple[int, int]]) -> list[Slot]:
        """Write slots for a co-located client's uploads: all, or none."""
        self._placement.region_of(token)  # a token not the region's: refused before any work
        self.drain_reports()
        return self._placement.allocate(token, sizes)

    # -- reads --

    async def read(self, keys: Sequence[str], deadline: Deadline) -> list[StoredItem]:
        """The items under `keys`, read through to the L2 tier for those L1
        lacks; CacheMissError names the store keys still missing."""
        try:
            return self._store.fetch(keys)
        except CacheMissError as exc:
            missing = exc.missing_hashes
        pulled = await self.read_through(missing, deadline, flight=False)
        self._store.adopt(pulled, keep=keys)
        return self._store.fetch(keys)

    def frames_of(self, item: StoredItem) -> Iterable[bytes]:
        """An item's chunk frames: the very objects that arrived, or made from
        its extent one at a time (a held reference keeps either alive if the
        item is evicted meanwhile)."""
        resident = item.resident
        return item.frames if resident is None else extent_frames(resident)

    def chunk_count(self, item: StoredItem) -> int:
        """How many frames `frames_of` gives."""
        return len(item.frames) if item.resident is None else frame_count(item.payload)

    def sent(self, item: StoredItem) -> None:
        self.metrics.sent_bytes.inc(item.payload)

    async def read_shm(
        self,
        token: bytes,
        keys: Sequence[str],
        done: Sequence[int],
        hold: bool,
        deadline: Deadline,
    ) -> list[ShmRead] | None:
        """A co-located read: the items' extents (those in the heap copied in),
        held while `hold`; None when the region has no room for all (the client
        then calls Fetch). `done`: the client's earlier reads' holds, released
        first, so that their transient extents are free for this one."""
        self._placement.region_of(token)  # a token not the region's: refused before any work
        check_count("shm_done", len(done))
        self.drain_reports()
        self._placement.release(token, done)
        items = await self.read(keys, deadline)
        extents = self._placement.read_in(token, keys, items, hold)
        if extents is None:
            return None
        reads = [
            ShmRead(item, slot, held) for item, (slot, held) in zip(items, extents, strict=True)
        ]
        payload = sum(item.payload for item in items)
        self.metrics.sent_bytes.inc(payload)
        self.metrics.shm_bytes.labels("read").inc(payload)
        return reads

    def release_leases(self, keys: Iterable[str]) -> int:
        return self._store.release(keys)

    async def locate(
        self, keys: Sequence[str], check_l2: bool, deadline: Deadline
    ) -> list[tuple[Tier, int]]:
        """Where each item is held, and its size in L1 (0 elsewhere)."""
        sizes = [self._store.size_of(key) for key in keys]
        tiers = [Tier.L1 if key in self._store else Tier.NONE for key in keys]
        if check_l2 and self._l2 is not None:
            absent = [i for i, tier in enumerate(tiers) if tier == Tier.NONE]
            found = await self._l2.holds([keys[i] for i in absent], deadline.budget())
            for i, held in zip(absent, found, strict=True):
                if held:
                    tiers[i] = Tier.L2
        return list(zip(tiers, sizes, strict=True))

    def touch(self, keys: Iterable[str]) -> int:
        return self._store.touch(keys)

    def clear(self, owned: Callable[[str], bool] | None) -> tuple[int, int]:
        return self._store.clear(owned)

    # -- the L2 tier --

    async def read_through(
        self,
        keys: Sequence[str],
        deadline: Deadline,
        *,
        flight: bool = True,
        wait_s: float | None = None,
    ) -> list[tuple[str, StoredItem]]:
        """Items L1 lacks under `keys`, read from the L2 tier within the call's
        time (_tier.py; `flight`: the caller processes what is missing)."""
        if self._l2 is None or not keys:
            return []
        absent = [key for key in dict.fromkeys(keys) if key not in self._store]
        if not absent:
            return []
        return await self._l2.pull(absent, deadline.budget(), flight=flight, wait_s=wait_s)

    def write_behind(self, entries: Sequence[EntryHeader], outcomes: Sequence[Outcome]) -> None:
        """Tell the L2 tier what a batch stored and found: its admission's sightings."""
        if self._l2 is None:
            return
        for entry, outcome in zip(entries, outcomes, strict=True):
            if outcome == Outcome.HIT:
                self._l2.hit(entry.key)
            elif outcome in (Outcome.STORED, Outcome.REPLACED):
                self._l2.stored(entry.key, replaced=outcome == Outcome.REPLACED)
            elif entry.spec is not None:  # data it could not keep: UNCACHED, withheld
                self._l2.not_stored(entry.key)

    # -- lookups' counts --

    def modality_of(self, key: str) -> str:
        """A held item's own modality: the label of a hash sent without one."""
        item = self._store.peek(key)
        return "" if item is None else item.modality

    def count(self, modality: str, outcome: Outcome, resend: bool) -> None:
        """One entry's query. A hit is a hash sent alone and held: data sent
        (STORED, REPLACED) was processed by its caller, a miss as vLLM counts
        it, whatever another client uploaded meanwhile."""
        if resend:
            self.metrics.resends.labels(modality or "unknown").inc()
        else:
            self.metrics.queried(modality, hit=outcome == Outcome.HIT)
        if outcome == Outcome.UNCACHED:
            self.metrics.uncached.labels(modality or "unknown").inc()

    # -- co-located clients' reports --

    def release(self, namespace: Scope, keys: list[str], report: Report) -> int:
        """A Release call: the leases it ended."""
        self.drain_reports()  # what came before this call, first
        return self._reports.release(namespace, keys, report)

    def take_posted_uploads(self, posted: Callable[[Scope, bytes], None]) -> None:
        """`posted` takes the uploads co-located clients post in their report
        rings (a namespace, a serialised UpdateRequest), as they are read."""
        self._reports.posted = posted

    def open_ring(self, token: bytes, namespace: Scope, *, uploads: bool = False) -> Slot | None:
        """A report ring for a co-located client; None when there is no room.
        `uploads`: the client may post uploads in it (docs/shm.md)."""
        return self._reports.open_ring(token, namespace, uploads=uploads)

    def drain_reports(self) -> int:
        """Apply what co-located clients wrote in their report rings; how many
        reports. The region's heartbeat too: a server that serves a call is alive."""
        return self._reports.drain()

    def beat(self) -> None:
        """The region's heartbeat, and its rings read (the cache's timer, every BEAT_S)."""
        self.drain_reports()


def parts_of(cache: ItemCache) -> CacheParts:
    """The parts inside `cache`, for tests and probes that must look; the
    calls use its operations."""
    return cache._parts
