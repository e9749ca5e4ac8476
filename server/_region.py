"""The shared-memory region: where co-located clients' bytes cross without gRPC.

The server owns one file in a shared-memory directory (`/dev/shm`, a
Kubernetes `emptyDir` of `medium: Memory`, a Compose tmpfs), created 0600 (or
0660 with a group the deployment names) and mapped by the server and by
every client that can open it. The file starts with a header: a magic, the
region's id (announced by Info) and a secret token. A client that can read
the token proves it maps the very same file (not another host's, not a stale
one) by sending it with its calls; anything else uses gRPC.

The region is a transfer window, not a second copy of the cache: items
live in the store (charged once, in the capacity), and a slot of the region
holds an item's bytes only while one transfer needs them, under a lease:

- a read: ReadShm copies an item's payload into a slot, the client copies
  it out into tensors it owns and gives the lease back (with its next read,
  or the lease expires);
- a write: the client asks for slots (ShmAllocate), writes payloads, and
  names the slots in GetAndUpdate, which copies them into the store and
  frees them.

Every slot starts with a 64-byte header whose first word is its lease (a
random 63-bit number, unguessable): written when the slot is handed out, and
zeroed when it is freed, before the memory can be handed out again. A reader
checks the word before and after copying: if it changed, the slot was freed
(its lease expired) and maybe reused meanwhile, and the copy is discarded.
Handles from a client are checked here: the lease must be live, of the
right kind, and its range inside the region.

Transport-free; one event loop uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import mmap
import os
import secrets
import struct
import time
from bisect import insort
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from mmcache._errors import InvalidArgumentError
from mmcache._frames import MAX_CHUNK_BYTES, chunk_payload_offset, chunk_prefix

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "READ",
    "SLOT_HEADER_BYTES",
    "WRITE",
    "Region",
    "Slot",
    "copy_payload",
    "open_region",
    "region_frames",
]

_LOGGER = logging.getLogger(__name__)

MAGIC = b"MMCSHM01"
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 64  # the lease word, then padding: payloads start cache-aligned
_ALIGN = 4096  # slots start on pages: memcpy runs at full speed, and no false sharing
# Header layout: magic, region id (16 bytes), token (32 bytes), size.
_HEADER = struct.Struct("<8s16s32sQ")
_WORD = struct.Struct("<Q")
_PREFIX = "mmcache-"
_SUFFIX = ".shm"

READ = "read"
WRITE = "write"


@dataclass(slots=True)
class Slot:
    """A leased piece of the region: [offset, offset + length) holds the payload."""

    lease: int
    kind: str  # READ or WRITE
    start: int  # where its header begins
    span: int  # bytes taken, header and padding included
    length: int  # payload bytes
    expires: float

    @property
    def offset(self) -> int:
        return self.start + SLOT_HEADER_BYTES


class Region:
    """A mapped region file, its free extents and its leased slots."""

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
        self._fd = fd  # held open: its lock tells other servers this file is alive
        self._map = mmap.mmap(fd, size)
        self.view = memoryview(self._map)
        _HEADER.pack_into(self._map, 0, MAGIC, self.id, self.token, size)
        self._lease_s = lease_s
        self._clock = clock
        # Free extents (start, length), by start; neighbours merge on free.
        self._free: list[tuple[int, int]] = [(HEADER_BYTES, size - HEADER_BYTES)]
        self._slots: dict[int, Slot] = {}
        # Expired write slots, kept out of use a while longer: their writer may
        # be stalled mid-copy, and must not write into another's slot.
        self._quarantine: list[tuple[float, Slot]] = []
        self.leased_bytes = 0
        self.expired = 0  # slots freed by expiry: clients that never said "done"

    @property
    def slots(self) -> int:
        return len(self._slots)

    def allocate(self, length: int, kind: str) -> Slot | None:
        """A slot for `length` payload bytes, or None when the region has no room."""
        span = -(-(SLOT_HEADER_BYTES + length) // _ALIGN) * _ALIGN
        index = next((i for i, (_, free) in enumerate(self._free) if free >= span), None)
        if index is None:
            return None
        start, free = self._free[index]
        if free == span:
            del self._free[index]
        else:
            self._free[index] = (start + span, free - span)
        lease = secrets.randbits(63) | 1
        while lease in self._slots:
            lease = secrets.randbits(63) | 1
        slot = Slot(lease, kind, start, span, length, self._clock() + self._lease_s)
        _WORD.pack_into(self._map, start, lease)
        self._slots[lease] = slot
        self.leased_bytes += span
        return slot

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
        slot.expires = float("inf")
        return slot

    def release(self, lease: int, kind: str) -> bool:
        """Free the slot of `lease` if it is a live one of `kind` (a client's "done")."""
        slot = self._slots.get(lease)
        return slot is not None and slot.kind == kind and self.free(lease)

    def matches(self, token: bytes) -> bool:
        """Whether a client's token is this region's (compared in constant time)."""
        return bool(token) and secrets.compare_digest(token, self.token)

    def payload(self, slot: Slot) -> memoryview:
        return self.view[slot.offset : slot.offset + slot.length]

    def free(self, lease: int) -> bool:
        """Give a slot back; False when the lease is not live (already freed, expired)."""
        slot = self._slots.pop(lease, None)
        if slot is None:
            return False
        _WORD.pack_into(self._map, slot.start, 0)  # readers of the old lease see it gone
        self._reuse(slot)
        return True

    def expire(self) -> int:
        """Free the slots past their lease (a client that died or stalled); how many.

        A write slot's memory waits one more lease before it is used again.
        """
        now = self._clock()
        late = [slot for slot in self._slots.values() if slot.expires <= now]
        for slot in late:
            del self._slots[slot.lease]
            _WORD.pack_into(self._map, slot.start, 0)
            if slot.kind == WRITE:
                self._quarantine.append((now + self._lease_s, slot))
            else:
                self._reuse(slot)
        while self._quarantine and self._quarantine[0][0] <= now:
            self._reuse(self._quarantine.pop(0)[1])
        self.expired += len(late)
        return len(late)

    def _reuse(self, slot: Slot) -> None:
        self.leased_bytes -= slot.span
        insort(self._free, (slot.start, slot.span))
        self._merge_around(slot.start)

    def close(self) -> None:
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
    """Copy the payloads of an item's chunk frames, in order, into a slot."""
    pos = 0
    for frame in frames:
        start = chunk_payload_offset(frame)
        end = pos + len(frame) - start
        into[pos:end] = memoryview(frame)[start:]
        pos = end


def region_frames(payload: memoryview) -> tuple[bytes, ...]:
    """A slot's payload as the chunk frames the store keeps (one copy)."""
    return tuple(
        b"".join(
            (
                chunk_prefix(min(MAX_CHUNK_BYTES, len(payload) - at)),
                payload[at : at + MAX_CHUNK_BYTES],
            )
        )
        for at in range(0, len(payload), MAX_CHUNK_BYTES)
    )


def _stale(directory: str) -> Iterator[str]:
    """Region files whose server is gone (nobody holds their lock)."""
    for path in glob.glob(os.path.join(directory, f"{_PREFIX}*{_SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live server's
        finally:
            os.close(fd)
        yield path


def open_region(directory: str, size: int, *, lease_s: float, group: int | None = None) -> Region:
    """Create this server's region in `directory`; OSError when it cannot.

    Files left by servers that died are removed first (a crash leaves its
    region behind; a live server holds a lock on its own).
    """
    if size <= HEADER_BYTES + _ALIGN:
        raise OSError(f"a shared-memory region of {size} bytes holds nothing")
    for path in _stale(directory):
        with contextlib.suppress(OSError):
            os.unlink(path)
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
