"""The data plane's own types: what the servicer turns the wire into.

The package never reads a protobuf message. Enums keep the wire's numbers
(mmcache.v1's ChangeKind and LeaseMode), so converting is `Enum(number)` one
way and `int(value)` the other (tests/test_item_cache.py checks they agree);
an item's spec is kept as the bytes it arrived in, checked at the edge
(server/_upload.py) and opaque here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Change", "FeedState", "Lease", "Report", "Scope", "ShmRef"]


class Change(enum.IntEnum):
    """A change to the key set, for the feed and the item events."""

    STORED = 1  # held from now on, with this size (new or replaced)
    REMOVED = 2  # no longer held (evicted, dropped, cleared)
    PENDING = 3  # an upload of this hash has begun
    SETTLED = 4  # that upload has ended (STORED precedes it on success)


class Lease(enum.IntEnum):
    """What a batch leases: nothing, every held entry, or its hits only."""

    NONE = 0
    HELD = 1  # HIT, STORED and REPLACED entries (the engine reads every item)
    HITS = 2  # HIT entries only (data that was sent travels inline)


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A region slot an upload names for its payload (ShmAllocate gave it)."""

    offset: int
    length: int
    lease: int


@dataclass(frozen=True, slots=True)
class Report:
    """A Release call, or a co-located client's record in its report ring:
    leases ended, holds done, lookups the client answered itself."""

    mm_hashes: Sequence[str] = ()  # one lease of each ends
    shm_token: bytes = b""  # the region the client maps (b"": none)
    shm_read_bytes: int = 0  # payload bytes it read with no call
    shm_done: Sequence[int] = ()  # holds it is done with
    misses: Mapping[str, int] = field(default_factory=dict)  # by modality
    hits: Mapping[str, int] = field(default_factory=dict)  # by modality
    shm_leases: Sequence[tuple[str, int]] = ()  # (mm_hash, extent generation)
    client_cpu_ns: int = 0
    upload: bytes = b""  # a ring's record only: an upload posted with no call (wire format)


class Scope(Protocol):
    """A tenant's view of the store's keys (server/_namespaces.py's Namespace)."""

    def checked_keys(self, mm_hashes: Sequence[str]) -> list[str]:
        """The store keys of `mm_hashes`, each checked (InvalidArgumentError)."""
        ...


@dataclass(frozen=True, slots=True)
class FeedState:
    """The store's key set at one moment: what a feed snapshot sends."""

    mm_hashes: list[str]
    sizes: list[int]
    pending: list[str]
    capacity: int
    max_items: int
