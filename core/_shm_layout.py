"""The layout of a shared-memory region file: what the server writes and its
co-located clients read (server/cache/_region.py, client/colocated/_shm.py).

    [header page][index: BUCKETS x 32 bytes, page-rounded][extents ...]

The header holds the magic, the region's id (Info announces it), a token
that proves a client maps this very file, the size and where the index is.

Every extent (a write slot, or an item resident in the region) starts on a
page with a 64-byte head whose first word is its generation: a random
63-bit number, written when the extent is handed out and zeroed when it is
freed, before its memory can be used again. Its payload follows the head. An
item's extent also holds, after the payload, the item's store key, its
serialised spec and its metadata (none, where the extent has no room for
it), so a reader needs nothing but the region to rebuild it and use it.

The index maps a store key's fingerprint to the extent of its resident item:
a bucket is (fingerprint, extent start, generation, 0), and a key lives in
one of PROBES buckets from `fingerprint % buckets`. Only the server writes
it, without locks: a reader that catches a bucket half written reads a
generation that is not the extent's, or a key that is not its own, and
treats it as a miss.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

__all__ = [
    "ADVICE_AT",
    "ADVICE_SMALL_PAUSED",
    "BEAT_AT",
    "BEAT_S",
    "BUCKET",
    "EXTENT_HEAD",
    "HEADER",
    "HEADER_BYTES",
    "HEAD_BYTES",
    "MAGIC",
    "PAGE",
    "PROBES",
    "SAMPLE_ONE_IN",
    "SHM_MIN_BYTES",
    "STALE_S",
    "WORD",
    "beat_fresh",
    "bucket_at",
    "data_start",
    "extent_span",
    "fingerprint",
    "index_buckets",
    "payload_at",
    "probes",
    "sampled",
]

MAGIC = b"MMCSHM04"  # 04: the heartbeat word is a time, not a count
PAGE = 4096
HEADER_BYTES = PAGE
# magic, region id (16 bytes), token (32 bytes), size, index offset, buckets
HEADER = struct.Struct("<8s16s32sQQQ")
# In the header page, past HEADER: the time (CLOCK_MONOTONIC, in ns: one
# clock for every process of a host) of the server's last heartbeat, written
# every BEAT_S while it serves. A client that finds it older than STALE_S
# takes its server for gone (killed: it never blanked the magic; stopped) and
# neither leases nor reads there with no call. A time, not a count: a count
# that stopped looks like one that moved to a client that looked away.
BEAT_AT = 128
BEAT_S = 0.2
STALE_S = 2.0
# Past the beat: the server's advice to its co-located clients, bit flags
# written with each beat (0, what an older server leaves, advises nothing).
# ADVICE_SMALL_PAUSED: the small items stored lately were seldom asked for
# again (server/cache/_reuse.py); a client shares a small image then only if
# it is `sampled`, so the server keeps measuring.
# Items under SHM_MIN_BYTES are small: uploaded through the region only when
# a client asks (the plugin's small images), and judged by the server's reuse.
SHM_MIN_BYTES = 1 << 20
ADVICE_AT = 136
ADVICE_SMALL_PAUSED = 1
SAMPLE_ONE_IN = 8
_STALE_NS = int(STALE_S * 1e9)
BUCKET = struct.Struct("<QQQQ")  # fingerprint, extent start, generation, spare
# An extent's head: generation, payload bytes, key, spec and metadata bytes;
# then padding, so payloads start cache-aligned.
EXTENT_HEAD = struct.Struct("<QQIII")
HEAD_BYTES = 64
WORD = struct.Struct("<Q")
PROBES = 8
# One bucket per 32 KiB of region, twice over (items resident in the region
# are mostly 1 MiB and up): a 256 MiB region has a 256 KiB index.
_BYTES_PER_BUCKET = 16 << 10


def beat_fresh(beat_ns: int, now_ns: int) -> bool:
    """Whether a heartbeat written at `beat_ns` is recent at `now_ns` (both
    time.monotonic_ns()). A beat ahead of the reader's clock by STALE_S or
    more (a process in another time namespace) is not trusted either: such a
    client stays on gRPC."""
    return -_STALE_NS < now_ns - beat_ns < _STALE_NS


def sampled(key: str) -> bool:
    """Whether a key is in the one-in-SAMPLE_ONE_IN sample, the same in every
    process (a key's fingerprint, not Python's per-process hash; its high
    bits, as the index places keys by the low ones)."""
    return (fingerprint(key) >> 32) % SAMPLE_ONE_IN == 0


def index_buckets(size: int) -> int:
    """How many index buckets a region of `size` bytes has: a power of two."""
    wanted = max(64, size // _BYTES_PER_BUCKET)
    return 1 << (wanted - 1).bit_length()


def data_start(buckets: int) -> int:
    """Where extents begin: after the header and an index of `buckets`, on a page."""
    return HEADER_BYTES + -(-buckets * BUCKET.size // PAGE) * PAGE


def bucket_at(bucket: int) -> int:
    """Where index bucket number `bucket` lies."""
    return HEADER_BYTES + bucket * BUCKET.size


def probes(fp: int, buckets: int) -> Iterator[int]:
    """The buckets a key of fingerprint `fp` may sit in, in the order both
    sides try them (`buckets`: a power of two)."""
    mask = buckets - 1
    return ((fp + probe) & mask for probe in range(PROBES))


def payload_at(start: int) -> int:
    """Where the payload of the extent at `start` begins: after its head."""
    return start + HEAD_BYTES


def extent_span(length: int, trailer: int = 0) -> int:
    """The bytes an extent of `length` payload bytes and `trailer` takes: whole pages."""
    return -(-(HEAD_BYTES + length + trailer) // PAGE) * PAGE


def fingerprint(key: str) -> int:
    """A store key's 64-bit fingerprint (never 0: an empty bucket's)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1
