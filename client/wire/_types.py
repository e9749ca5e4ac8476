"""The client's values of what travels: what the wire layer gives the rest of
the client and takes from it, in place of the generated messages."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from mmcache._lru import Outcome

from ._spec import Spec

__all__ = [
    "Allocated",
    "Change",
    "Cleared",
    "FeedChanges",
    "FeedMessage",
    "FeedSnapshot",
    "Fetched",
    "FetchedItem",
    "Lease",
    "Located",
    "RegionInfo",
    "Reply",
    "Report",
    "ServerInfo",
    "Slot",
    "Tier",
    "UpdateEntry",
]

# What a call leases: True (every item held or stored), "hits" (only those
# returned as None, which the engine must read), or False.
Lease = bool | Literal["hits"]

# Where a hash is: "l1" (held by the sidecar asked), "l2" (only in the fleet's
# L2 tier), None (neither).
Tier = Literal["l1", "l2"] | None


@dataclass(frozen=True, slots=True)
class Slot:
    """An extent of the server's shared-memory region, under a lease."""

    offset: int
    length: int  # payload bytes
    lease: int
    hold: int = 0  # a ReadShm's hold on it (0: none), said done once read


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """The shared-memory region a server announces: its file, and the id its
    header carries (another server's file, or a stale one, has another)."""

    path: str
    size_bytes: int
    region_id: bytes = b""
    posted_uploads: bool = False  # the server applies uploads posted in report rings


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """Info's answer: who the server is and how it is doing."""

    instance_id: str
    capacity_bytes: int
    max_items: int
    version: str = ""
    max_chunk_bytes: int = 0
    items: int = 0
    used_bytes: int = 0
    region: RegionInfo | None = None
    shared_tier: bool = False
    leases: int = 0
    queries: int = 0
    hits: int = 0
    namespaces: int = 0
    l2_up: bool = False


@dataclass(frozen=True, slots=True)
class Cleared:
    instance_id: str
    seq: int  # the feed's number once the removals were made
    removed: int
    kept_leased: int


@dataclass(frozen=True, slots=True)
class Located:
    instance_id: str
    tiers: list[Tier]  # one per hash, in order
    sizes: list[int]  # bytes charged for each item held here (0 elsewhere)


@dataclass(frozen=True, slots=True)
class Allocated:
    """ShmAllocate's (or OpenReportRing's) answer: the slots, all asked or none."""

    instance_id: str
    slots: list[Slot]


@dataclass(slots=True)
class Report:
    """A Release: leases given back, and what a co-located client tells its
    server (holds done, bytes read, leases taken with no call, queries, CPU)."""

    mm_hashes: list[str] = field(default_factory=list)
    shm_token: bytes = b""
    shm_read_bytes: int = 0
    shm_done: list[int] = field(default_factory=list)
    misses: Counter[str] = field(default_factory=Counter)
    shm_leases: list[tuple[str, int]] = field(default_factory=list)  # (hash, generation)
    hits: Counter[str] = field(default_factory=Counter)
    client_cpu_ns: int = 0
    upload: bytes = b""  # a ring's record only: a serialised UpdateRequest, posted with no call


@dataclass(frozen=True, slots=True)
class FetchedItem:
    mm_hash: str
    spec: Spec
    num_chunks: int
    slot: Slot | None  # in ReadShm replies: where its payload lies in the region


@dataclass(frozen=True, slots=True)
class Fetched:
    """A Fetch's (or ReadShm's) header: which items follow, and how."""

    instance_id: str
    items: list[FetchedItem]


@dataclass(frozen=True, slots=True)
class UpdateEntry:
    """One entry of a GetAndUpdate as it travels."""

    mm_hash: str
    modality: str
    spec: Spec | None = None  # None: the hash alone
    withheld: bool = False  # larger than the whole cache: its spec only
    metadata: bytes = b""
    want_metadata: bool = False
    resend: bool = False
    slot: Slot | None = None  # its payload already in this region slot
    num_chunks: int = 0  # else the chunk frames that follow


@dataclass(frozen=True, slots=True)
class Reply:
    """What the server did with a batch, true as of `seq`."""

    instance_id: str
    capacity: int
    max_items: int
    seq: int
    outcomes: list[Outcome]
    sizes: list[int]
    evicted: list[str]
    metadata: list[bytes] | None  # per entry, when any entry asked
    spares: list[Slot]  # write slots asked for with the batch (all or none)


class Change(enum.IntEnum):
    """A feed change's kind (the wire's ChangeKind numbers)."""

    STORED = 1  # held from now on, with this size (new or replaced)
    REMOVED = 2  # no longer held
    PENDING = 3  # an upload of this hash has begun
    SETTLED = 4  # that upload has ended


@dataclass(frozen=True, slots=True)
class FeedChanges:
    kinds: list[int]  # Change values (others are skipped)
    mm_hashes: list[str]
    sizes: list[int]


@dataclass(frozen=True, slots=True)
class FeedSnapshot:
    mm_hashes: list[str]  # least recently used first
    sizes: list[int]
    pending: list[str]
    last: bool
    capacity_bytes: int
    max_items: int


@dataclass(frozen=True, slots=True)
class FeedMessage:
    """One message of the feed: changes, a snapshot's part, or (neither) the
    head after a snapshot."""

    instance_id: str
    seq: int
    changes: FeedChanges | None = None
    snapshot: FeedSnapshot | None = None
