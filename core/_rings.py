"""Report rings: a co-located client's reports reach its server through the
shared-memory region instead of a call (client/colocated/_reports.py writes,
server/cache/_report_rings.py reads).

A ring is an extent of the region that one client writes and its server
reads, laid out as:

    [head u64][tail u64][spare, to 64 bytes][records ...]

`head` counts the bytes the client has written and `tail` those the server
has read: both only grow, and each side writes only its own. A record is a
16-byte header (payload bytes u32, crc32 u32 of its position and payload,
its position u64) and the payload (a serialised ReleaseRequest), padded to 8
bytes; an empty one says the client is done with the ring. A record never
wraps: where one would, the writer marks the rest of the lap skipped. The
reader takes a record only at its position and whole (the crc): one not yet
visible (written out of order) or left from an earlier lap reads as not
there yet.
"""

from __future__ import annotations

import struct
import threading
import zlib

__all__ = [
    "RECORD",
    "RING_BYTES",
    "RING_HEAD_BYTES",
    "RingCorrupt",
    "commit_tail",
    "fence",
    "read_records",
    "reset_ring",
    "ring_head",
    "write_record",
]

RING_BYTES = 64 << 10  # a ring's payload: some hundreds of reports
RING_HEAD_BYTES = 64
_WORD = struct.Struct("<Q")
_TAIL_AT = 8
RECORD = struct.Struct("<IIQ")  # payload bytes, crc32, position
_SKIP = 0xFFFFFFFF


class RingCorrupt(Exception):
    """A ring whose words or records no writer of this module could have made."""


def _padded(n: int) -> int:
    return (n + 7) & ~7


def _crc(position: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_WORD.pack(position)))


def ring_head(ring: memoryview) -> int:
    """The bytes its writer has written so far (the reader's tail equals it
    when nothing is new)."""
    head: int = _WORD.unpack_from(ring, 0)[0]
    return head


def reset_ring(ring: memoryview) -> None:
    """A fresh ring: no records, nothing left of the memory's last use."""
    ring[:] = bytes(len(ring))


def write_record(ring: memoryview, payload: bytes) -> bool:
    """Append one record; False when the ring lacks room for it (the server
    has not read that far yet) or could never hold it."""
    capacity = len(ring) - RING_HEAD_BYTES
    need = _padded(RECORD.size + len(payload))
    head = ring_head(ring)
    tail = _WORD.unpack_from(ring, _TAIL_AT)[0]
    at = head % capacity
    skip = capacity - at if capacity - at < need else 0
    if need > capacity or head + skip + need - tail > capacity:
        return False
    if skip >= RECORD.size:
        RECORD.pack_into(ring, RING_HEAD_BYTES + at, _SKIP, 0, head)
    head += skip
    start = RING_HEAD_BYTES + head % capacity
    ring[start + RECORD.size : start + RECORD.size + len(payload)] = payload
    RECORD.pack_into(ring, start, len(payload), _crc(head, payload), head)
    _WORD.pack_into(ring, 0, head + need)  # last: the record is whole before it counts
    return True


def read_records(ring: memoryview, tail: int, *, commit: bool = True) -> tuple[list[bytes], int]:
    """The whole records from `tail` (the reader's own count, never the ring's
    word, which its writer could change) and the tail after them, which is
    also written back for the writer (`commit`; without, the records are
    only looked at, and read again next time). RingCorrupt for a ring no
    writer of this module made."""
    capacity = len(ring) - RING_HEAD_BYTES
    head = ring_head(ring)
    if head < tail or head - tail > capacity or head % 8:
        raise RingCorrupt(f"head {head} is not within a ring's length of tail {tail}")
    payloads: list[bytes] = []
    while tail < head:
        at = tail % capacity
        if capacity - at < RECORD.size:  # too little left in the lap for a header
            tail += capacity - at
            continue
        start = RING_HEAD_BYTES + at
        length, crc, position = RECORD.unpack_from(ring, start)
        if position != tail:
            break  # not visible yet
        if length == _SKIP:
            tail += capacity - at
            continue
        if RECORD.size + length > capacity - at:
            raise RingCorrupt(f"a record of {length} bytes at {position} overruns the lap")
        payload = bytes(ring[start + RECORD.size : start + RECORD.size + length])
        if _crc(position, payload) != crc:
            break  # not whole yet
        payloads.append(payload)
        tail += _padded(RECORD.size + length)
    if commit:
        commit_tail(ring, tail)
    return payloads, tail


def commit_tail(ring: memoryview, tail: int) -> None:
    """Tell the writer the records before `tail` are read: their room is its again."""
    _WORD.pack_into(ring, _TAIL_AT, tail)


_FENCE = threading.Lock()


def fence() -> None:
    """Order this thread's writes to shared memory before its reads after it.

    A leases record and the index it is checked against are a Dekker pair:
    the client writes its record then reads the extent's word; the server
    zeroes the word then reads the rings. Each side's read must not pass its
    write. A lock's acquire is an atomic read-modify-write (lock cmpxchg on
    x86-64), which orders every access before it against every one after;
    Python has no barrier of its own.
    """
    with _FENCE:
        pass
