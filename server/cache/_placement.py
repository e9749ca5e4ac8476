"""Where an item's bytes live: the heap (the chunk frames it came in) or the
co-located clients' shared-memory region, and what a write or a read is
given room by. The region itself only allocates and indexes (_region.py);
the rules are here, apart from the calls that use them."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmcache._errors import InvalidArgumentError
from mmcache._shm_layout import PAGE, extent_span
from mmcache.metrics import CacheMetrics

from ._extent import payload_frames
from ._region import (
    ITEM,
    READ,
    WRITE,
    Region,
    Resident,
    Slot,
    copy_payload,
)
from ._store import ItemStore, StoredItem

if TYPE_CHECKING:  # _entries imports the store, as this does
    from ._entries import EntryHeader

__all__ = ["RESERVE_S", "TENURE_S", "Placement", "ReadRoom"]

# How long a resident is safe from items read again (`read_again`): reads
# change the region's content at most at that pace (a copy out, one in), so
# a hot set larger than the region does not churn it.
TENURE_S = 10.0
MAX_REREADS = 1 << 16  # transient reads remembered (their keys, their times)
# How long the read reserve keeps room for an item of a size no read has
# needed since: one large item read once does not hold half the region for good.
RESERVE_S = 300.0


@dataclass(frozen=True)
class RegionState:
    """The region as Info and /metrics report it."""

    path: str
    size: int
    id: bytes
    leased_bytes: int
    resident_bytes: int
    transient_bytes: int


class ReadRoom:
    """What reads of items in the heap need of one region: the reserve that
    residents and write slots leave free for their transient copies (the
    largest such copy in the last `reserve_s`, at most half the region), so
    that reads of a hot set larger than the region do not push residents out;
    and which items come back within the tenure (only those take the place of
    residents in for longer than that). Reads with no call are not seen: a
    resident's time counts from when it came in, or was last read by ReadShm.
    On the region's clock."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.reserve_s = RESERVE_S
        self.tenure_s = TENURE_S
        # (when, span), spans falling: the window's max first.
        self._needs: deque[tuple[float, int]] = deque()
        # Items read from transient extents: store key -> when, oldest first.
        self._rereads: OrderedDict[str, float] = OrderedDict()

    @property
    def reserve(self) -> int:
        """The bytes residents and write slots leave free for reads' copies.
        A pure read: /metrics calls it from its own thread (list() copies the
        deque in one step), and only the loop's `need_read` drops old needs."""
        cutoff = self.region.clock() - self.reserve_s
        return next((span for when, span in list(self._needs) if when >= cutoff), 0)

    def need_read(self, length: int) -> None:
        """A read needs a transient extent of `length` payload bytes: keep that much
        free for the next `reserve_s`, but never more than half the region."""
        span = min(extent_span(length), self.region.room // 2 // PAGE * PAGE)
        cutoff = self.region.clock() - self.reserve_s
        while self._needs and self._needs[0][0] < cutoff:
            self._needs.popleft()
        while self._needs and self._needs[-1][1] <= span:
            self._needs.pop()  # smaller and older: never the window's max again
        self._needs.append((self.region.clock(), span))

    def read_again(self, key: str) -> bool:
        """Note a read of the item under `key` from a transient extent; whether
        it had one within the tenure before."""
        now = self.region.clock()
        last = self._rereads.pop(key, None)
        self._rereads[key] = now
        while len(self._rereads) > MAX_REREADS or next(iter(self._rereads.values())) < (
            now - self.tenure_s
        ):
            self._rereads.popitem(last=False)
        return last is not None and last >= now - self.tenure_s

    def aged(self) -> float:
        """Residents in since before this time are past their tenure."""
        return self.region.clock() - self.tenure_s


class Placement:
    """Room in the region for uploads and reads, made by moving residents out
    to the heap (their order in the LRU kept); none of it waits. The only
    part that knows the region: the store holds its extents as `Extent`s."""

    def __init__(self, store: ItemStore, metrics: CacheMetrics) -> None:
        self._store = store
        self._metrics = metrics
        self.region: Region | None = None  # while the cache runs with one (_open.py)
        self._room: ReadRoom | None = None

    def room(self, region: Region) -> ReadRoom:
        """The read reserve and re-reads of `region` (new with each region)."""
        if self._room is None or self._room.region is not region:
            self._room = ReadRoom(region)
        return self._room

    @property
    def reserve(self) -> int:
        """The region's read reserve now (0 without a region, or before its
        first read). Makes nothing: /metrics reads it from its own thread."""
        room, region = self._room, self.region
        if room is None or region is None or room.region is not region:
            return 0
        return room.reserve

    def region_state(self) -> RegionState | None:
        """The region as Info and /metrics report it (None: gRPC only)."""
        region = self.region
        if region is None:
            return None
        return RegionState(
            region.path,
            region.size,
            region.id,
            region.leased_bytes,
            region.resident_bytes,
            region.transient_bytes,
        )

    def region_of(self, token: bytes) -> Region:
        """The region a client's token names; InvalidArgumentError (with the fix) if none."""
        region = self.region
        if region is None or not region.matches(token):
            raise InvalidArgumentError(
                "the shared-memory token is not this server's region's (a restarted server, "
                "or another host's): map the region Info announces, or send over gRPC"
            )
        return region

    # -- uploads --

    def write_slots(
        self, region: Region, sizes: Sequence[tuple[int, int]], keep: Sequence[str] = ()
    ) -> list[Slot]:
        """Write slots of these (payload, trailer) sizes: all, or none when the
        region has no room for all (the client then uploads over gRPC); room is
        made without taking out the items under `keep`."""
        region.expire()
        slots: list[Slot] = []
        # What the store takes in if all are uploaded: past its capacity, it evicts.
        incoming = sum(length for length, _ in sizes)
        for length, trailer in sizes:
            slot = self._allocate(region, length, WRITE, trailer, incoming, keep)
            if slot is None:
                for given in slots:
                    region.free(given.lease)
                return []
            slots.append(slot)
        return slots

    def allocate(self, token: bytes, sizes: Sequence[tuple[int, int]]) -> list[Slot]:
        """Write slots for the client of `token`'s uploads: all, or none."""
        return self.write_slots(self.region_of(token), sizes)

    def spares(
        self, token: bytes, sizes: Sequence[tuple[int, int]], batch: Sequence[str]
    ) -> list[Slot]:
        """The spare write slots an upload asked for with its reply; none when
        its token is not the region's (asking never fails an upload). Their
        room never takes out the batch's own items: what the reply answers
        held stays readable (in a full cache, taking one out evicts it)."""
        region = self.region
        if not sizes or region is None or not region.matches(token):
            return []
        return self.write_slots(region, sizes, batch)

    def claim(self, token: bytes, entries: Sequence[EntryHeader]) -> dict[int, Slot]:
        """The write slots an upload names, checked now and kept from expiry
        until `unclaim` (`from_region` reads them), by entry index."""
        named = [e for e in entries if e.shm is not None]
        if not named:
            return {}
        region = self.region_of(token)
        claimed: dict[int, Slot] = {}
        for entry in named:
            assert entry.shm is not None
            try:
                claimed[entry.index] = region.claim(
                    entry.shm.lease, entry.shm.offset, entry.shm.length
                )
            except InvalidArgumentError as exc:
                self.unclaim(claimed)
                raise InvalidArgumentError(f"{entry.where}: {exc}") from None
        return claimed

    def unclaim(self, claimed: dict[int, Slot]) -> None:
        """Free what a call claimed and never made resident (a failed call's)."""
        region = self.region
        if region is not None:
            for slot in claimed.values():
                region.free(slot.lease)

    def from_region(
        self, slot: Slot, entry: EntryHeader
    ) -> tuple[tuple[bytes, ...], Resident | None]:
        """An uploaded payload in its claimed slot: resident there from now on (no
        copy), or, when the slot has no room for its key and spec, copied out as
        chunk frames and the slot freed."""
        region = self.region
        assert region is not None and entry.spec is not None
        self._metrics.shm_bytes.labels("write").inc(slot.length)
        resident = region.settle(slot, entry.key, entry.spec, entry.metadata)
        if resident is not None:
            return (), resident
        try:
            return tuple(payload_frames(region.payload(slot))), None
        finally:
            region.free(slot.lease)

    # -- reads --

    def release(self, token: bytes, holds: Sequence[int]) -> None:
        """The holds a client of `token` is done with."""
        region = self.region_of(token)
        for held in holds:
            region.release(held)

    def read_in(
        self, token: bytes, keys: Sequence[str], items: Sequence[StoredItem], hold: bool
    ) -> list[tuple[Slot, int]] | None:
        """Each item's extent in the region of `token` (`residents`) and its
        hold (0 without `hold`); None when the region has no room for all."""
        region = self.region_of(token)
        residents = self.residents(region, keys, items, hold)
        if residents is None:
            return None
        return [(r.slot, region.hold(r) if hold else 0) for r in residents]

    def residents(
        self, region: Region, keys: Sequence[str], items: Sequence[StoredItem], hold: bool
    ) -> list[Resident] | None:
        """The items' extents in the region (those in the heap copied there:
        `_extent_for`); None when it has no room for all."""
        residents: list[Resident] = []
        for key, item in zip(keys, items, strict=True):
            if item.resident is not None:
                # Placement made every extent the store holds: the region's.
                assert isinstance(item.resident, Resident)
                region.read(item.resident)
                residents.append(item.resident)
                continue
            trailer = len(key.encode()) + len(item.spec) + len(item.metadata)
            slot = self._extent_for(region, key, item.payload, trailer, keys, hold)
            if slot is None:
                return None
            copy_payload(item.frames, region.payload(slot))
            if slot.kind == READ:
                self._metrics.shm_copies.labels("transient").inc()
                residents.append(Resident(region, slot))  # freed when its hold ends
                continue
            self._metrics.shm_copies.labels("in").inc()
            resident = region.settle(slot, key, item.spec, item.metadata)
            assert resident is not None  # allocated with room for its trailer
            self._store.make_resident(key, item, resident)
            residents.append(resident)
        return residents

    def _extent_for(
        self,
        region: Region,
        key: str,
        payload: int,
        trailer: int,
        keys: Sequence[str],
        hold: bool,
    ) -> Slot | None:
        """Where a read copies an item in the heap: an extent it moves into
        (ITEM; its frames then dropped), or a transient one (READ), the item
        staying in the heap; None when the region has no room.

        It moves in where there is room beside the reserve. Where there is
        not, a read that holds its extents (`hold`) gets a transient copy: a
        hot set larger than the region costs a copy per read, not a resident
        pushed out to the heap (a copy) and the item moved in (another) on
        every read. An item read again within the region's tenure takes the
        place of residents in for longer (a hot set that moved on), and where
        even the reserve is taken (other reads in flight) residents are moved
        out for the copy. Without `hold` (a client that never says done) the
        item moves in, as room is made."""
        if not hold:
            return self._allocate(region, payload, ITEM, trailer, keep=keys)
        room = self.room(region)
        room.need_read(payload)
        slot = region.allocate(payload, ITEM, trailer, room.reserve)
        if slot is None and room.read_again(key):
            slot = self._allocate(region, payload, ITEM, trailer, keep=keys, aged=True)
        if slot is None:
            slot = self._allocate(region, payload, READ, 0, keep=keys)
        return slot

    def _allocate(
        self,
        region: Region,
        length: int,
        kind: str,
        trailer: int,
        incoming: int = 0,
        keep: Sequence[str] = (),
        *,
        aged: bool = False,
    ) -> Slot | None:
        """An extent of the region, made room for by taking the items that came
        into it longest ago out of it (but none of `keep`; `aged`: only those
        in for longer than its tenure); None when even that fails."""
        if not region.fits(length, trailer):
            return None
        room = self.room(region)
        # Only a transient extent (READ) may take the read reserve.
        keep_free = 0 if kind == READ else room.reserve
        slot = region.allocate(length, kind, trailer, keep_free)
        if slot is None:
            since = room.aged() if aged else None
            residents = region.resident_keys(keep, since_before=since)
            for moved in self._store.leave_extents(residents, incoming):
                if moved:
                    self._metrics.shm_copies.labels("out").inc()
                slot = region.allocate(length, kind, trailer, keep_free)
                if slot is not None:
                    break
        return slot
