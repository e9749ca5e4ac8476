"""An item's payload held outside the heap: the seam between the store and
where placement puts bytes (today the shared-memory region, _region.py).

The store, an upload's entry and the L2 codec only read an extent's payload
as chunk frames; which medium holds it, and the rules of its room, are
placement's alone (_placement.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from mmcache._frames import MAX_CHUNK_BYTES, chunk_prefix

__all__ = ["Extent", "extent_frames", "frame_count", "payload_frames"]


class Extent(Protocol):
    """Where a held item's payload lies; the item holds it as long as it is held."""

    def payload(self) -> memoryview: ...


def payload_frames(payload: memoryview) -> Iterator[bytes]:
    """A payload as chunk frames (each one copy), made one at a time."""
    for at in range(0, len(payload), MAX_CHUNK_BYTES):
        piece = payload[at : at + MAX_CHUNK_BYTES]
        yield b"".join((chunk_prefix(len(piece)), piece))


def extent_frames(extent: Extent) -> Iterator[bytes]:
    """An extent's payload as chunk frames (`payload_frames`)."""
    return payload_frames(extent.payload())


def frame_count(payload: int) -> int:
    """How many chunk frames `payload_frames` makes of `payload` bytes."""
    return -(-payload // MAX_CHUNK_BYTES)
