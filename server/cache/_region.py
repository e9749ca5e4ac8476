"""The shared-memory region: where co-located clients' bytes cross without gRPC.

The server owns one file in a shared-memory directory (`/dev/shm`, a
Kubernetes `emptyDir` of `medium: Memory`, a Compose tmpfs), created 0600 (or
0660 with a group the deployment names) and mapped by the server and by
every client that can open it. Its layout is mmcache._shm_layout's. A client
that can read the header's token proves it maps the very same file (not
another host's, not a stale one) by sending it with its calls; anything else
uses gRPC.

The region holds three kinds of extent, from one allocator:

- items resident in it: an item whose bytes live here and not in the heap
  (charged once, in the store's capacity). The index lets a co-located
  client find and copy it with no call at all. An upload through shared
  memory becomes resident where the client wrote it; an item uploaded over
  gRPC moves here the first time a co-located client reads it (ReadShm). A
  resident extent is freed when its item is gone from the store and no
  in-flight read holds it (`Resident` is that reference);
- write slots: a client asks for them (ShmAllocate), writes payloads, and
  names them in GetAndUpdate, under a lease that expires;
- transient extents: a copy of an item that stays in the heap, made for one
  ReadShm when the region has no room for it to move in, and freed when its
  reader's hold ends. Residents and write slots may be asked to leave room
  free for them (`allocate`'s `keep_free`: the read reserve, whose rule is
  _placement.py's, as is which residents a read may take the place of).

An extent's generation word is zeroed when it is freed, before its memory
can be used again: a reader checks the word before and after copying, and
discards a copy the word changed under. A view (client.view) instead takes
a hold, which keeps the extent from being freed until the client gives it
back or the hold expires. Handles from a client are checked here: the lease
must be live, of the right kind, and its range inside the region.

A co-located client may also lease a resident item with no call, by writing
the generation it found into its report ring (server/cache/_report_rings.py). An
extent whose item leaves the store is therefore unindexed and its word
zeroed first, then the rings' unread records are looked at (`keep_leased`):
one that names its generation keeps the extent, indexed again, under a hold
that the client's release (`end_orphan`) or the lease's end gives back.

Transport-free; one event loop uses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import itertools
import logging
import mmap
import os
import secrets
import stat
import time
from bisect import insort
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mmcache._errors import InvalidArgumentError
from mmcache._frames import chunk_payload_offset
from mmcache._lockfiles import unlocked
from mmcache._rings import fence, reset_ring
from mmcache._shm_layout import (
    ADVICE_AT,
    BEAT_AT,
    BUCKET,
    EXTENT_HEAD,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PAGE,
    WORD,
    bucket_at,
    data_start,
    extent_span,
    fingerprint,
    index_buckets,
    payload_at,
    probes,
)
from mmcache._wake import wake_path

__all__ = [
    "ITEM",
    "READ",
    "RING",
    "WRITE",
    "Region",
    "Resident",
    "Slot",
    "copy_payload",
    "open_region",
]

_LOGGER = logging.getLogger(__name__)

_PREFIX = "mmcache-"
_SUFFIX = ".shm"

WRITE = "write"
ITEM = "item"
READ = "read"  # a transient extent: one read's copy of an item in the heap
RING = "ring"  # a client's report ring (mmcache._rings), until the server retires it


@dataclass(slots=True)
class Slot:
    """An extent of the region: [offset, offset + length) holds the payload."""

    lease: int  # its generation word
    kind: str  # WRITE, ITEM or READ
    start: int  # where its head begins
    span: int  # bytes taken, head, trailer and padding included
    length: int  # payload bytes
    expires: float
    key: str = ""  # an item's store key, once resident
    since: float = 0.0  # when it came in, or was last read through ReadShm

    @property
    def offset(self) -> int:
        return payload_at(self.start)


class Resident:
    """The reference that keeps a resident item's extent: the store's item holds
    one, as does a read in flight; the extent is freed when the last goes. A
    transient extent has one too, held only by its reader's hold."""

    __slots__ = ("_region", "slot")

    def __init__(self, region: Region, slot: Slot) -> None:
        self._region = region
        self.slot = slot

    def payload(self) -> memoryview:
        return self._region.payload(self.slot)

    def __del__(self) -> None:
        self._region.drop(self.slot)


class Region:
    """A mapped region file, its free extents, its leased slots and resident items."""

    def __init__(
        self,
        path: str,
        fd: int,
        size: int,
        *,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.size = size
        self.id = secrets.token_bytes(16)
        self.token = secrets.token_bytes(32)
        self._buckets = index_buckets(size)
        if data_start(self._buckets) + 2 * PAGE > size:
            raise OSError(f"a shared-memory region of {size} bytes holds nothing")
        self._fd = fd  # held open: its lock tells other servers this file is alive
        self._map = mmap.mmap(fd, size)
        self.view = memoryview(self._map)
        HEADER.pack_into(
            self._map, 0, MAGIC, self.id, self.token, size, HEADER_BYTES, self._buckets
        )
        self._closed = False
        self.beat()  # alive from the first look (Info announces it next)
        self._lease_s = lease_s
        self.clock = clock
        self._data = data_start(self._buckets)
        # Free extents (start, length), by start; neighbours merge on free.
        self._free: list[tuple[int, int]] = [(self._data, size - self._data)]
        # Every extent, by its generation; resident items in the order they
        # came in (or were last read through ReadShm): the first to leave.
        self._slots: dict[int, Slot] = {}
        self._writes: dict[int, Slot] = {}  # the write slots among them
        # Expired write slots, kept out of use a while longer: their writer may
        # be stalled mid-copy, and must not write into another's slot.
        self._quarantine: list[tuple[float, Slot]] = []
        # The index, as this side knows it: the generation in each bucket.
        self._bucket_gen = [0] * self._buckets
        self._indexed: dict[int, int] = {}  # generation -> bucket
        # Views' holds: hold id -> (the resident it keeps, when the hold ends).
        self._holds: dict[int, tuple[Resident, float]] = {}
        self.leased_bytes = 0  # write slots
        self.resident_bytes = 0  # resident items' extents
        self.transient_bytes = 0  # transient extents
        self.expired = 0  # slots and holds ended by expiry: clients that never said "done"
        # Whether an unread report-ring record leases the extent of this
        # generation (and item key) with no call: then it is kept (`drop`).
        self.keep_leased: Callable[[int, str], bool] | None = None
        # Extents kept so, by store key: the holds that keep them, oldest first.
        self._orphans: dict[str, list[int]] = {}

    @property
    def slots(self) -> int:
        """Write slots and holds outstanding: what clients have yet to give back."""
        return len(self._writes) + len(self._holds)

    def allocate(self, length: int, kind: str, trailer: int = 0, keep_free: int = 0) -> Slot | None:
        """An extent for `length` payload bytes and `trailer` bytes after them, or
        None when the region has no room; one that leaves an extent of
        `keep_free` bytes free, unless the region could never hold both."""
        span = extent_span(length, trailer)
        keep = keep_free if span + keep_free <= self.room else 0
        index = self._first_fit(span, keep)
        if index is None:
            return None
        start, free = self._free[index]
        if free == span:
            del self._free[index]
        else:
            self._free[index] = (start + span, free - span)
        slot = Slot(self._new_lease(), kind, start, span, length, self.clock() + self._lease_s)
        WORD.pack_into(self._map, start, slot.lease)
        self._slots[slot.lease] = slot
        if kind == WRITE:
            self._writes[slot.lease] = slot
        self._count(slot, 1)
        return slot

    def _first_fit(self, span: int, keep: int) -> int | None:
        """The first free extent that holds `span` bytes and leaves one of `keep`
        bytes free (in itself or elsewhere)."""
        largest = second = 0  # the two largest free extents' sizes
        for _, free in self._free:
            largest, second = (free, largest) if free > largest else (largest, max(second, free))
        for index, (_, free) in enumerate(self._free):
            if free < span:
                continue
            elsewhere = second if free == largest else largest
            if max(free - span, elsewhere) >= keep:
                return index
        return None

    def fits(self, length: int, trailer: int = 0) -> bool:
        """Whether an extent of that size could ever be had (the region is large enough)."""
        return extent_span(length, trailer) <= self.room

    @property
    def room(self) -> int:
        """The bytes extents can have: the region less its header and index."""
        return self.size - self._data

    def _new_lease(self) -> int:
        lease = secrets.randbits(63) | 1
        while lease in self._slots or lease in self._holds:
            lease = secrets.randbits(63) | 1
        return lease

    def _count(self, slot: Slot, sign: int) -> None:
        if slot.kind == ITEM:
            self.resident_bytes += sign * slot.span
        elif slot.kind == READ:
            self.transient_bytes += sign * slot.span
        else:
            self.leased_bytes += sign * slot.span

    def get(self, lease: int, kind: str, offset: int, length: int) -> Slot:
        """The live slot a client's handle names; InvalidArgumentError for a handle
        that is not one (a lease not live, or not of `kind`; another range)."""
        slot = self._slots.get(lease)
        if slot is None or slot.kind != kind:
            raise InvalidArgumentError(
                f"shared-memory lease {lease} is no live {kind} slot of this server (expired "
                "or never given): send the data over gRPC"
            )
        if (offset, length) != (slot.offset, slot.length):
            raise InvalidArgumentError(
                f"shared-memory slot {lease} is {slot.length} bytes at {slot.offset}, not "
                f"{length} at {offset}"
            )
        return slot

    def claim(self, lease: int, offset: int, length: int) -> Slot:
        """A write slot an upload names, kept from expiry until the upload frees it."""
        slot = self.get(lease, WRITE, offset, length)
        if slot.expires == float("inf"):
            raise InvalidArgumentError(
                f"shared-memory slot {lease} is named twice: one slot holds one payload"
            )
        slot.expires = float("inf")
        return slot

    def settle(self, slot: Slot, key: str, spec: bytes, metadata: bytes = b"") -> Resident | None:
        """Make a claimed write slot, or a fresh ITEM extent whose payload is
        written, the resident extent of the item under `key` (its spec
        serialised, and its metadata where there is room for it): indexed,
        with a generation no client has seen. None when the slot has no room
        for the key and spec after its payload."""
        key_bytes = key.encode()
        end = slot.offset + slot.length
        room = slot.start + slot.span - end - len(key_bytes) - len(spec)
        if room < 0:
            return None
        if len(metadata) > room:
            metadata = b""  # clients ask for it by call (a lookup's reply)
        trailer = b"".join((key_bytes, spec, metadata))
        self._map[end : end + len(trailer)] = trailer
        self._count(slot, -1)
        del self._slots[slot.lease]
        self._writes.pop(slot.lease, None)
        slot.kind, slot.lease, slot.expires, slot.key = ITEM, self._new_lease(), float("inf"), key
        slot.since = self.clock()
        self._slots[slot.lease] = slot
        self._count(slot, 1)
        # The generation last: a reader that sees it sees the rest written.
        EXTENT_HEAD.pack_into(
            self._map, slot.start, 0, slot.length, len(key_bytes), len(spec), len(metadata)
        )
        WORD.pack_into(self._map, slot.start, slot.lease)
        self._index(fingerprint(key), slot)
        return Resident(self, slot)

    def read(self, resident: Resident) -> None:
        """A resident item read through ReadShm: last to leave now, and indexed
        again if its buckets were taken meanwhile."""
        slot = resident.slot
        if self._slots.get(slot.lease) is slot:
            self._slots[slot.lease] = self._slots.pop(slot.lease)
            slot.since = self.clock()
        if slot.lease not in self._indexed:
            self._index(fingerprint(slot.key), slot)

    def resident_keys(
        self, keep: Collection[str] = (), *, since_before: float | None = None
    ) -> list[str]:
        """The store keys of the items resident here, first to leave first, but
        none of `keep`; `since_before`: only those in since before that time
        (the clock's)."""
        residents: Iterable[Slot] = (s for s in self._slots.values() if s.kind == ITEM)
        if since_before is not None:
            cutoff = since_before
            residents = itertools.takewhile(lambda s: s.since <= cutoff, residents)
        return [s.key for s in residents if s.key not in keep]

    def _index(self, fp: int, slot: Slot) -> None:
        for bucket in probes(fp, self._buckets):
            gen = self._bucket_gen[bucket]
            at = bucket_at(bucket)
            if gen == 0 or BUCKET.unpack_from(self._map, at)[0] == fp:
                if gen:
                    self._indexed.pop(gen, None)
                self._bucket_gen[bucket] = slot.lease
                self._indexed[slot.lease] = bucket
                BUCKET.pack_into(self._map, at, fp, slot.start, slot.lease, 0)
                return
        # All its buckets taken: the item is read through ReadShm, which says where.

    def _unindex(self, lease: int) -> None:
        bucket = self._indexed.pop(lease, None)
        if bucket is not None and self._bucket_gen[bucket] == lease:
            self._bucket_gen[bucket] = 0
            BUCKET.pack_into(self._map, bucket_at(bucket), 0, 0, 0, 0)

    def hold(self, resident: Resident) -> int:
        """Keep a resident item's (or a transient) extent until `release` or the
        lease ends; the hold's id."""
        hold = self._new_lease()
        self._holds[hold] = (resident, self.clock() + self._lease_s)
        return hold

    def release(self, lease: int) -> bool:
        """A client's "done": end a view's hold, or free a write slot it will not
        use (not one an upload has claimed); False when neither is live."""
        if self._holds.pop(lease, None) is not None:
            return True
        slot = self._writes.get(lease)
        return slot is not None and slot.expires != float("inf") and self.free(lease)

    def beat(self) -> None:
        """Tell co-located clients this server serves now: the time, on the
        host's monotonic clock (mmcache._shm_layout.BEAT_AT; not `clock`,
        which tests may replace, as clients read the real one)."""
        if not self._closed:
            WORD.pack_into(self._map, BEAT_AT, time.monotonic_ns())

    def advise(self, flags: int) -> None:
        """The server's advice to co-located clients (mmcache._shm_layout.ADVICE_AT)."""
        if not self._closed:
            WORD.pack_into(self._map, ADVICE_AT, flags)

    def matches(self, token: bytes) -> bool:
        """Whether a client's token is this region's (compared in constant time)."""
        return bool(token) and secrets.compare_digest(token, self.token)

    def payload(self, slot: Slot) -> memoryview:
        return self.view[slot.offset : slot.offset + slot.length]

    def free(self, lease: int) -> bool:
        """Give a write slot back; False when the lease is not live (already freed, expired)."""
        slot = self._writes.get(lease)
        if slot is None:
            return False
        self._free_slot(slot)
        return True

    def drop(self, slot: Slot) -> None:
        """Free a resident item's or a transient extent (its last reference went),
        unless a client leased the item with no call in a record not read yet:
        it then stays, indexed, under a hold (an orphan: the store has it no more)."""
        if self._closed or self._slots.get(slot.lease) is not slot:
            return
        self._unindex(slot.lease)
        WORD.pack_into(self._map, slot.start, 0)  # a client's check after its lease fails now
        if slot.kind == ITEM and self.keep_leased is not None:
            fence()  # the word's zero before the rings are read: see mmcache._rings.fence
            if self._kept(slot):
                WORD.pack_into(self._map, slot.start, slot.lease)
                self._index(fingerprint(slot.key), slot)
                self._orphans.setdefault(slot.key, []).append(self.hold(Resident(self, slot)))
                return
        self._free_slot(slot)

    def _kept(self, slot: Slot) -> bool:
        assert self.keep_leased is not None
        try:
            return self.keep_leased(slot.lease, slot.key)
        except Exception:  # called from a finaliser: an error would leak the extent
            _LOGGER.exception("could not look for leases of a freed extent; freeing it")
            return False

    @property
    def orphans(self) -> int:
        """Extents kept for leases taken with no call after their item left the store."""
        return sum(len(holds) for holds in self._orphans.values())

    def end_orphan(self, key: str) -> bool:
        """A lease of `key` given back that the store did not hold: end the oldest
        hold of an extent kept for it; False when there is none."""
        holds = self._orphans.get(key)
        while holds:
            if self._holds.pop(holds.pop(0), None) is not None:
                if not holds:
                    del self._orphans[key]
                return True
        self._orphans.pop(key, None)
        return False

    def _free_slot(self, slot: Slot) -> None:
        del self._slots[slot.lease]
        self._writes.pop(slot.lease, None)
        WORD.pack_into(self._map, slot.start, 0)  # readers of the old generation see it gone
        self._reuse(slot)

    def open_ring(self, length: int) -> Slot | None:
        """A report ring of `length` bytes, emptied, or None when there is no room."""
        slot = self.allocate(length, RING)
        if slot is not None:
            slot.expires = float("inf")  # until retired
            reset_ring(self.payload(slot))
        return slot

    def retire(self, slot: Slot) -> None:
        """End a report ring. Its memory waits a lease before it is used again,
        as an expired write slot's does: its client may be writing a record it
        found the ring live for."""
        if self._slots.pop(slot.lease, None) is slot:
            WORD.pack_into(self._map, slot.start, 0)
            self._quarantine.append((self.clock() + self._lease_s, slot))

    def expire(self) -> int:
        """End the write slots and holds past their lease (a client that died or
        stalled); how many. A write slot's memory waits one more lease before
        it is used again."""
        now = self.clock()
        late = [s for s in self._writes.values() if s.expires <= now]
        for slot in late:
            del self._slots[slot.lease]
            del self._writes[slot.lease]
            WORD.pack_into(self._map, slot.start, 0)
            self._quarantine.append((now + self._lease_s, slot))
        holds = [hold for hold, (_, ends) in self._holds.items() if ends <= now]
        for hold in holds:
            del self._holds[hold]
        if holds and self._orphans:
            for key in list(self._orphans):
                kept = [hold for hold in self._orphans[key] if hold in self._holds]
                if kept:
                    self._orphans[key] = kept
                else:
                    del self._orphans[key]
        while self._quarantine and self._quarantine[0][0] <= now:
            self._reuse(self._quarantine.pop(0)[1])
        self.expired += len(late) + len(holds)
        return len(late) + len(holds)

    def _reuse(self, slot: Slot) -> None:
        self._count(slot, -1)
        insort(self._free, (slot.start, slot.span))
        self._merge_around(slot.start)

    def close(self) -> None:
        self._closed = True
        self._holds.clear()
        self._orphans.clear()
        # Mappings outlive the file: a client still reading sees the region closed.
        with contextlib.suppress(ValueError):
            self._map[: len(MAGIC)] = bytes(len(MAGIC))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        # A handler cut short may still hold a view: then the collector unmaps.
        with contextlib.suppress(BufferError):
            self.view.release()
            self._map.close()

    def _merge_around(self, start: int) -> None:
        free = self._free
        index = next(i for i, (s, _) in enumerate(free) if s == start)
        if index + 1 < len(free) and free[index][0] + free[index][1] == free[index + 1][0]:
            free[index] = (free[index][0], free[index][1] + free[index + 1][1])
            del free[index + 1]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == free[index][0]:
            free[index - 1] = (free[index - 1][0], free[index - 1][1] + free[index][1])
            del free[index]


def copy_payload(frames: Sequence[bytes], into: memoryview) -> None:
    """Copy the payloads of an item's chunk frames, in order, into a slot.

    A large item is copied by two threads (ctypes' memmove lets go of the
    GIL): one core's memcpy is well below what memory moves, and a reader of
    the region waits for this copy (docs/shm.md, re-reads)."""
    pieces: list[tuple[int, bytes, int, int]] = []  # (to, frame, from, length)
    pos = 0
    for frame in frames:
        start = chunk_payload_offset(frame)
        pieces.append((pos, frame, start, len(frame) - start))
        pos += len(frame) - start
    if pos < _PARALLEL_COPY_BYTES or into.readonly or not all(type(f) is bytes for f in frames):
        for to, frame, start, length in pieces:
            into[to : to + length] = memoryview(frame)[start:]
        return
    target = ctypes.c_char.from_buffer(into)  # the slot's address (an export, dropped below)
    base = ctypes.addressof(target)
    half = len(pieces) // 2

    def copy(part: list[tuple[int, bytes, int, int]]) -> None:
        for to, frame, start, length in part:
            source = ctypes.cast(ctypes.c_char_p(frame), ctypes.c_void_p).value
            assert source is not None
            ctypes.memmove(base + to, source + start, length)

    other = _copier().submit(copy, pieces[half:])
    try:
        copy(pieces[:half])
    finally:
        other.result()
        del target


_PARALLEL_COPY_BYTES = 8 << 20  # below this, a second thread costs more than it saves
_copy_pool: ThreadPoolExecutor | None = None


def _copier() -> ThreadPoolExecutor:
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(1, thread_name_prefix="mmcache-copy")
    return _copy_pool


def _stale(directory: str) -> Iterator[str]:
    """Region files whose server is gone (nobody holds their lock)."""
    return unlocked(glob.glob(os.path.join(directory, f"{_PREFIX}*{_SUFFIX}")))


def _bury(path: str) -> None:
    """Remove a dead server's region, its magic blanked first: clients that
    still map it (the file outlives no mapping) see it closed at once, as a
    server that stopped cleanly leaves it, before its heartbeat is stale."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: alive after all
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_size >= HEADER_BYTES:
            os.pwrite(fd, bytes(len(MAGIC)), 0)
        os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(wake_path(path))  # its wake pipe (mmcache._wake)
    finally:
        os.close(fd)


def open_region(directory: str, size: int, *, lease_s: float, group: int | None = None) -> Region:
    """Create this server's region in `directory`; OSError when it cannot.

    Files left by servers that died are removed first (a crash leaves its
    region behind; a live server holds a lock on its own).
    """
    for path in _stale(directory):
        with contextlib.suppress(OSError):
            _bury(path)
            _LOGGER.info("removed %s, the region of a server that is gone", path)
    name = f"{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(directory, f"{_PREFIX}{name}{_SUFFIX}")
    # Made under a name the stale scan does not match, and renamed once locked:
    # a neighbour starting meanwhile never takes it for a dead server's.
    making = os.path.join(directory, f".{_PREFIX}{name}.new")
    mode = 0o600 if group is None else 0o660
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if group is not None:
            os.fchown(fd, -1, group)
        os.fchmod(fd, mode)  # whatever the umask took away
        try:
            # Reserved now, not page by page: a tmpfs smaller than the region
            # (Docker's /dev/shm is 64 MiB) would kill the writer with SIGBUS.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            free = os.fstatvfs(fd)
            raise OSError(
                f"cannot reserve {size >> 20} MiB there ({exc.strerror}; "
                f"{free.f_bavail * free.f_frsize >> 20} MiB free): give --shm-mb less, or "
                "mount a larger tmpfs"
            ) from None
        region = Region(path, fd, size, lease_s=lease_s)
        os.rename(making, path)
        return region
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(making)
        raise
