"""The client's end of the shared-memory fast path (server/cache/_region.py).

When Info announces a region, the client maps its file and checks the
header: the magic, and the id Info gave (a file of the same name on another
host, or a stale one, has another). The header's token then goes with the
client's ReadShm, ShmAllocate and Release calls. Whatever goes wrong (no
such file, no permission, another host's file, a restarted server) leaves
the client on gRPC, silently and correctly.

An item resident in the region is read with no call at all: the index
(mmcache._shm_layout) says where its extent is, and the extent holds its key
and spec. Every read checks the extent's generation word before and after
copying: an extent freed meanwhile (the item evicted, its memory maybe
reused) fails the read, and the caller reads again through a call.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import stat
import struct
import threading
import time
from typing import NamedTuple

from mmcache._items import Item
from mmcache._rings import write_record
from mmcache._shm_layout import (
    ADVICE_AT,
    ADVICE_SMALL_PAUSED,
    BEAT_AT,
    BUCKET,
    EXTENT_HEAD,
    HEAD_BYTES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PAGE,
    WORD,
    beat_fresh,
    bucket_at,
    data_start,
    fingerprint,
    index_buckets,
    payload_at,
    probes,
)
from mmcache._wake import Poker

from .._codec import EncodedItem, ItemDecoder, copy_payload
from .._pool import BufferPool
from ..wire import RegionInfo, Slot
from ._plans import decode_from_region

__all__ = ["ClientRegion", "ClientRing", "Extent", "attach"]

_LOGGER = logging.getLogger(__name__)


class Extent(NamedTuple):
    """A resident item's extent, as the index and its head say."""

    start: int
    generation: int
    length: int  # payload bytes
    spec: bytes
    metadata: bytes  # empty: none stored, or no room for it


class ClientRegion:
    """A mapped region of one server instance."""

    def __init__(
        self,
        instance_id: str,
        buffer: mmap.mmap,
        token: bytes,
        buckets: int,
        poker: Poker | None = None,  # its wake pipe; None: the server reads on a timer
    ) -> None:
        self.instance_id = instance_id
        self.token = token
        self._map = buffer
        self._view = memoryview(buffer)
        self._buckets = buckets
        self._data = data_start(buckets)  # the index is at HEADER_BYTES (checked at open)
        self._first_payload = payload_at(self._data)
        self._poker = poker
        self._closed = False

    def _payload(self, slot: Slot) -> memoryview:
        if slot.offset < self._first_payload or slot.offset + slot.length > len(self._view):
            raise ValueError(f"slot {slot.lease} lies outside the region")
        return self._view[slot.offset : slot.offset + slot.length]

    def view(self, slot: Slot) -> memoryview:
        """The slot's payload in place (no copy), while it is live."""
        payload = self._payload(slot)
        if not self.live(slot):
            raise ValueError(f"slot {slot.lease} is no longer live")
        return payload

    def live(self, slot: Slot) -> bool:
        return self.still(slot.offset - HEAD_BYTES, slot.lease)

    def open(self) -> bool:
        """Whether the server still serves the region (it blanks the magic when it
        stops), and this client has not dropped it."""
        return not self._closed and self._map[: len(MAGIC)] == MAGIC

    def serving(self) -> bool:
        """`open`, and the server's last heartbeat less than STALE_S old now: a
        server killed never blanks the magic, and its beat's time only ages
        (mmcache._shm_layout.BEAT_AT), however long this client looked away.
        Checked before any work with no call, which would never hear that the
        server is gone."""
        return self.open() and beat_fresh(self._word(BEAT_AT), time.monotonic_ns())

    def small_paused(self) -> bool:
        """Whether the server advises sharing small items only in the sample
        (mmcache._shm_layout.ADVICE_AT): they were seldom asked for again."""
        return self.open() and bool(self._word(ADVICE_AT) & ADVICE_SMALL_PAUSED)

    def _word(self, start: int) -> int:
        word: int = WORD.unpack_from(self._map, start)[0]
        return word

    def read(self, slot: Slot, decoder: ItemDecoder) -> bool:
        """Copy an extent's payload into the decoder; False if it was freed under the copy."""
        payload = self._payload(slot)
        if not self.live(slot):
            return False
        decoder.feed_payload(payload)
        return self.live(slot)

    def read_resident(self, key: str, pool: BufferPool | None) -> tuple[Item, int] | None:
        """The item under store key `key` and its payload bytes, copied straight
        from its extent with no call; None when it is not resident (or not
        indexed), or was freed under the copy."""
        found = self._find(key)
        if found is None:
            return None
        offset = payload_at(found.start)
        got = decode_from_region(found.spec, self._view[offset : offset + found.length], pool)
        if got is None or self._word(found.start) != found.generation:
            return None
        return got

    def locate(self, key: str) -> Extent | None:
        """The extent of the resident item under store key `key`, or None;
        `still` tells later whether it is live yet."""
        return self._find(key)

    def still(self, start: int, generation: int) -> bool:
        """Whether the extent at `start` is live under `generation` yet."""
        return self._word(start) == generation

    def _find(self, key: str) -> Extent | None:
        """The extent the index names for `key`, checked: a bucket caught half
        written, or naming a freed extent, matches nothing."""
        fp = fingerprint(key)
        wanted = key.encode()
        size = len(self._map)
        for bucket in probes(fp, self._buckets):
            at = bucket_at(bucket)
            bucket_fp, start, generation, _ = BUCKET.unpack_from(self._map, at)
            if bucket_fp != fp or not generation:
                continue
            payload = payload_at(start)
            if start < self._data or start % PAGE or payload > size:
                continue
            word, length, key_len, spec_len, meta_len = EXTENT_HEAD.unpack_from(self._map, start)
            end = payload + length
            if word != generation or end + key_len + spec_len + meta_len > size:
                continue
            if key_len != len(wanted) or self._map[end : end + key_len] != wanted:
                continue
            end += key_len
            spec = self._map[end : end + spec_len]
            metadata = self._map[end + spec_len : end + spec_len + meta_len]
            if self._word(start) == generation:  # read whole while live
                return Extent(start, generation, length, spec, metadata)
        return None

    def ring(self, slot: Slot) -> ClientRing:
        """The report ring the server gave this client (OpenReportRing)."""
        self._payload(slot)  # within the region, or ValueError
        return ClientRing(self, slot)

    def write(self, slot: Slot, encoded: EncodedItem) -> None:
        """Copy an item's payload into a write slot; ValueError for a slot that does
        not fit it or is no longer its lease's (the caller sends over gRPC)."""
        if slot.length != encoded.size.payload:
            raise ValueError(f"slot {slot.lease} holds {slot.length} bytes, not the payload's")
        payload = self._payload(slot)
        if not self.live(slot):  # expired while this client stalled: not ours to write
            raise ValueError(f"slot {slot.lease} is no longer leased")
        copy_payload(encoded, payload)

    def poke(self, lease: int) -> None:
        """Wake the server to read the ring of `lease` (mmcache._wake)."""
        if self._poker is not None and not self._closed:
            self._poker.poke(lease)

    def close(self) -> None:
        self._closed = True  # not used again, even while views keep it mapped
        if self._poker is not None:
            self._poker.close()
        # Tensors viewing it (client.view) keep the mapping; the collector unmaps.
        with contextlib.suppress(BufferError):
            self._view.release()
            self._map.close()


class ClientRing:
    """This client's report ring in the region (mmcache._rings): its reports
    go there instead of in a Release call, while the server keeps it."""

    def __init__(self, region: ClientRegion, slot: Slot) -> None:
        self.region = region
        self.slot = slot
        self._lock = threading.Lock()  # one writer at a time: the loop, or a caller's thread

    def live(self) -> bool:
        """Whether the server still keeps the ring (it retires an idle or broken
        one), and the client its region."""
        return self.region.open() and self.region.live(self.slot)

    def write(self, report: bytes) -> bool:
        """Append a serialised ReleaseRequest; False when the ring is full, or
        retired (the caller sends a Release instead)."""
        try:
            if not self.region.open():  # dropped by the client: never written again
                return False
            ring = self.region.view(self.slot)
        except ValueError:  # retired
            return False
        with self._lock:
            return write_record(ring, report)

    def poke(self) -> None:
        """Wake the server to read this ring now (after a record it must not wait for)."""
        self.region.poke(self.slot.lease)


def attach(instance_id: str, announced: RegionInfo) -> ClientRegion | None:
    """Map the region Info announced, or None (the reason logged) to stay on gRPC."""
    try:
        return _attach(instance_id, announced)
    except (OSError, ValueError, struct.error) as exc:
        _LOGGER.debug("shared memory off: %s: %s", announced.path, exc)
        return None


def _attach(instance_id: str, announced: RegionInfo) -> ClientRegion:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    fd = os.open(announced.path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < HEADER_BYTES + 2 * PAGE:
            raise ValueError("no region file")
        if info.st_size != announced.size_bytes:
            raise ValueError("not the size the server announced")
        buffer = mmap.mmap(fd, info.st_size)
    finally:
        os.close(fd)
    magic, region_id, token, size, index, buckets = HEADER.unpack_from(buffer, 0)
    if magic != MAGIC or region_id != announced.region_id:
        buffer.close()
        raise ValueError("another server's region (another host's, or a stale one)")
    if size != info.st_size or index != HEADER_BYTES or buckets != index_buckets(size):
        buffer.close()
        raise ValueError("a region laid out otherwise (another version's)")
    _LOGGER.debug("shared memory on: %s", announced.path)
    _populate(buffer)
    return ClientRegion(instance_id, buffer, token, buckets, Poker.open(announced.path))


# madvise(2): fault every page of a mapping in, writable (Linux 5.14 and up).
_MADV_POPULATE_WRITE = 23


def _populate(buffer: mmap.mmap) -> None:
    """Map every page of the region into this process now, in a thread of its own.

    The first touch of each page of a mapping costs a fault: an upload of
    6.44 MB into pages this process never touched took 2.4 ms of CPU here,
    0.8 ms once they were mapped (and a read pays the same). Done once, in
    the background, at about 0.3 ms per MiB; the pages are the region's own
    (shared: counted in this process's RSS as shared memory, not allocated
    again). Where the kernel has no MADV_POPULATE_WRITE, pages map as they
    are first touched, as before.
    """

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            anchor = ctypes.c_char.from_buffer(buffer)
        except (OSError, TypeError, ValueError, BufferError):
            return
        try:  # a foreign call: the GIL is released meanwhile
            libc.madvise(
                ctypes.c_void_p(ctypes.addressof(anchor)),
                ctypes.c_size_t(len(buffer)),
                ctypes.c_int(_MADV_POPULATE_WRITE),
            )
        finally:
            del anchor  # the region may be closed from now on

    threading.Thread(target=run, name="mmcache-populate", daemon=True).start()
