"""The client's end of the shared-memory fast path (server/_region.py).

When Info announces a region, the client maps its file and checks the
header: the magic, and the id Info gave (a file of the same name on another
host, or a stale one, has another). The header's token then goes with the
client's ReadShm and ShmAllocate calls: the server answers with slots of the
region instead of chunk frames. Whatever goes wrong (no such file, no
permission, another host's file, a restarted server) leaves the client on
gRPC, silently and correctly.

A read checks the slot's lease word before and after copying: a slot freed
meanwhile (its lease expired under a stalled reader) fails the read, and the
caller fetches again over gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import struct

from mmcache.v1 import cache_pb2 as pb

from ._codec import EncodedItem, ItemDecoder, copy_payload

__all__ = ["ClientRegion", "attach"]

_LOGGER = logging.getLogger(__name__)

MAGIC = b"MMCSHM01"
_HEADER = struct.Struct("<8s16s32sQ")  # magic, region id, token, size (server/_region.py)
_WORD = struct.Struct("<Q")
SLOT_HEADER_BYTES = 64
MIN_REGION_BYTES = 8192  # a header page and one slot page


class ClientRegion:
    """A mapped region of one server instance."""

    def __init__(self, instance_id: str, buffer: mmap.mmap, token: bytes) -> None:
        self.instance_id = instance_id
        self.token = token
        self._map = buffer
        self._view = memoryview(buffer)

    def _payload(self, slot: pb.ShmSlot) -> memoryview:
        if slot.offset < SLOT_HEADER_BYTES or slot.offset + slot.length > len(self._view):
            raise ValueError(f"slot {slot.lease} lies outside the region")
        return self._view[slot.offset : slot.offset + slot.length]

    def view(self, slot: pb.ShmSlot) -> memoryview:
        """The slot's payload in place (no copy), while its lease is live."""
        payload = self._payload(slot)
        if not self._live(slot):
            raise ValueError(f"slot {slot.lease} is no longer leased")
        return payload

    def live(self, slot: pb.ShmSlot) -> bool:
        return self._live(slot)

    def _live(self, slot: pb.ShmSlot) -> bool:
        word: int = _WORD.unpack_from(self._map, slot.offset - SLOT_HEADER_BYTES)[0]
        return word == slot.lease

    def read(self, slot: pb.ShmSlot, decoder: ItemDecoder) -> bool:
        """Copy a read slot into the decoder; False if the slot was freed under the copy."""
        payload = self._payload(slot)
        if not self._live(slot):
            return False
        decoder.feed_payload(payload)
        return self._live(slot)

    def write(self, slot: pb.ShmSlot, encoded: EncodedItem) -> None:
        """Copy an item's payload into a write slot; ValueError for a slot that does
        not fit it or is no longer its lease's (the caller sends over gRPC)."""
        if slot.length != encoded.size.payload:
            raise ValueError(f"slot {slot.lease} holds {slot.length} bytes, not the payload's")
        payload = self._payload(slot)
        if not self._live(slot):  # expired while this client stalled: not ours to write
            raise ValueError(f"slot {slot.lease} is no longer leased")
        copy_payload(encoded, payload)

    def close(self) -> None:
        # Tensors viewing it (client.view) keep the mapping; the collector unmaps.
        with contextlib.suppress(BufferError):
            self._view.release()
            self._map.close()


def attach(instance_id: str, announced: pb.ShmRegion) -> ClientRegion | None:
    """Map the region Info announced, or None (the reason logged) to stay on gRPC."""
    try:
        return _attach(instance_id, announced)
    except (OSError, ValueError, struct.error) as exc:
        _LOGGER.debug("shared memory off: %s: %s", announced.path, exc)
        return None


def _attach(instance_id: str, announced: pb.ShmRegion) -> ClientRegion:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    fd = os.open(announced.path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < MIN_REGION_BYTES:
            raise ValueError("no region file")
        if info.st_size != announced.size_bytes:
            raise ValueError("not the size the server announced")
        buffer = mmap.mmap(fd, info.st_size)
    finally:
        os.close(fd)
    magic, region_id, token, _ = _HEADER.unpack_from(buffer, 0)
    if magic != MAGIC or region_id != announced.region_id:
        buffer.close()
        raise ValueError("another server's region (another host's, or a stale one)")
    _LOGGER.debug("shared memory on: %s", announced.path)
    return ClientRegion(instance_id, buffer, token)
