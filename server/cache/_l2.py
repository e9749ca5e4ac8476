"""The L2 tier's store, as the sidecar sees it: a small interface a shared
store implements (server/cache/_l2_redis.py: Redis Cluster), and the one encoding
of an item in it.

An item is one record under its store key: a manifest (the serialised
`UpdateEntry` a client would send for it: spec, chunk count, metadata) and
its chunk frames, exactly as they travel over gRPC (each at most
MAX_CHUNK_BYTES of payload). A record is written all at once or not at all,
so a reader sees a whole item or none, and a store's eviction takes it whole.
What is read back is checked as an upload is: the store is shared, so its
bytes are input like any client's. The manifest is in the wire's format, so
the edge (server/_records.py) writes and parses it (`Manifests`); its frames
are checked here, by the one check of every item's frames (_entries.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from mmcache._errors import MMCacheError

from ._entries import EntryHeader, check_frames, upload_entry
from ._region import region_frames
from ._store import StoredItem

__all__ = [
    "DEFAULT_PREFIX",
    "L2Backend",
    "L2Error",
    "L2Record",
    "Manifests",
    "Poll",
    "Sighting",
    "Want",
    "item_of_record",
    "record_of_item",
]


# Of every key a sidecar writes: fleets sharing one cluster each take their own.
DEFAULT_PREFIX = "mmcache:"


class L2Error(MMCacheError):
    """The L2 store failed or did not answer in time: the caller goes on without it."""

    code = "UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class L2Record:
    manifest: bytes
    chunks: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return len(self.manifest) + sum(len(c) for c in self.chunks)


class Sighting(enum.IntEnum):
    FIRST = 0  # this node claims the cold item: its frontend processes it
    MINE = 1  # this node claimed it earlier in the window
    OTHERS = 2  # another node claimed it: it is being processed there


class Want(enum.IntEnum):
    ASKED = 0  # the holder will write it
    OWNER_GONE = 1  # the holder is not alive: nobody will write it


class Poll(enum.IntEnum):
    GONE = 0  # neither the item nor a claim: nobody will write it
    CLAIMED = 1  # a node is processing it (or holds it and may write it)
    HELD = 2  # the item is in L2


class L2Backend(Protocol):
    """A shared store of item records. Every method raises L2Error (and only
    that) when the store fails; none waits longer than the backend's timeout."""

    @property
    def where(self) -> str:
        """The store, for logs (no credentials)."""
        ...

    @property
    def up(self) -> bool:
        """Connected, and every part of the store answers (`mmcache_l2_up`)."""
        ...

    @property
    def nodes_down(self) -> int:
        """Parts of the store (Redis masters) skipped until they answer again."""
        ...

    async def watch(self) -> None:
        """Connect now, at start, then watch the store until `close` (it
        returns only then: the tier runs it as a task); a failure is logged at
        ERROR with its reason (and tried again later), never raised."""
        ...

    async def read(self, key: str) -> L2Record | None:
        """The whole record under `key`, or None."""
        ...

    async def holds(self, key: str) -> bool:
        """Whether a whole record is under `key` (without reading it)."""
        ...

    async def write(self, key: str, record: L2Record, ttl_s: float) -> None:
        """Store `record` under `key`, replacing any, all or nothing (`ttl_s` 0: no TTL)."""
        ...

    async def sight(self, key: str, window_s: float, node: str) -> tuple[Sighting, str]:
        """`node` asks for `key`, which neither tier holds. The first to ask
        claims it (FIRST) for `window_s` (its processing); a later ask by the
        claimer is MINE; one by any other node is OTHERS (and counts as wanting
        it). With the claimer."""
        ...

    async def hold(self, key: str, node: str, hold_s: float) -> tuple[Sighting, int]:
        """`node` stored `key` in its cache: its claim (made now, FIRST, if
        none) lasts `hold_s`, so a node asking later knows whom to ask; OTHERS
        when another node claims it. With how many other nodes asked."""
        ...

    async def want(self, owner: str, key: str) -> Want:
        """Ask the node `owner`, which claims `key`, to write it (its want list)."""
        ...

    async def take_over(self, key: str, dead: str, node: str, window_s: float) -> bool:
        """The claim of `dead` (not alive) on `key` passes to `node`, for `window_s`."""
        ...

    async def beat(self, node: str, alive_s: float, most: int) -> list[str]:
        """`node` is alive for `alive_s`; takes (at most `most`) keys others want of it."""
        ...

    async def leave(self, node: str) -> None:
        """`node` stops: its claims pass to the next node that asks."""
        ...

    async def unclaim(self, key: str, node: str) -> None:
        """End `node`'s claim on `key` (it no longer holds the item): the next
        node to ask claims it, and nodes waiting for it stop waiting."""
        ...

    async def poll(self, key: str) -> Poll:
        """Whether the item is in L2 now (HELD), still claimed (CLAIMED), or neither."""
        ...

    async def close(self) -> None: ...


class Manifests(Protocol):
    """An item's manifest in its L2 record, in the wire's format (server/_records.py)."""

    def encode(self, item: StoredItem, chunks: int) -> bytes:
        """The manifest of `item`, whose payload is in `chunks` chunk frames."""
        ...

    def decode(self, key: str, manifest: bytes) -> EntryHeader:
        """The entry a manifest describes, its spec checked as an upload's is;
        InvalidArgumentError says what is wrong with one no sidecar wrote."""
        ...


def record_of_item(item: StoredItem, manifests: Manifests) -> L2Record:
    """The record of a held item (copied out of the region when resident there)."""
    frames = item.frames
    if item.resident is not None:
        frames = tuple(region_frames(item.resident.payload()))
    return L2Record(manifests.encode(item, len(frames)), frames)


def item_of_record(key: str, record: L2Record, manifests: Manifests) -> StoredItem:
    """The item a record holds, checked as an upload is (InvalidArgumentError)."""
    entry = manifests.decode(key, record.manifest)
    check_frames(record.chunks, entry)
    item = upload_entry(entry, record.chunks).item
    assert item is not None  # an entry with a spec, not withheld
    return item
