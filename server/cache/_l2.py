"""The L2 tier's store, as the sidecar sees it: a small interface a shared
store implements (server/cache/_l2_redis.py: Redis Cluster), and the one encoding
of an item in it.

An item is one record under its store key: a manifest (the serialised
`UpdateEntry` a client would send for it: spec, chunk count, metadata) and
its chunk frames, exactly as they travel over gRPC (each at most
MAX_CHUNK_BYTES of payload). A record is written all at once or not at all,
so a reader sees a whole item or none, and a store's eviction takes it whole.
What is read back is checked as an upload is: the store is shared, so its
bytes are input like any client's. And it must be the item asked for: the
manifest names the key it was written under and a digest of its frames
(XXH3-128), so a record read under another key (a reply that reached the
wrong read, a bug, another fleet's writer) or with other bytes is a miss,
never another item served. The manifest is in the wire's format, so the edge
(server/_records.py) writes and parses it (`Manifests`); its frames are
checked here, by the one check of every item's frames (_entries.py).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import xxhash

from mmcache._errors import InvalidArgumentError, MMCacheError

from ._entries import EntryHeader, check_frames, upload_entry
from ._extent import extent_frames
from ._store import StoredItem

__all__ = [
    "DEFAULT_PREFIX",
    "BadRecord",
    "L2Backend",
    "L2Error",
    "L2Record",
    "Manifest",
    "Manifests",
    "Poll",
    "Sighting",
    "Want",
    "item_of_record",
    "payload_digest",
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


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a record's manifest says, once it names the key asked for: the
    digest of its frames, and the entry (spec, chunk count, metadata)."""

    digest: bytes
    entry: EntryHeader


BadReason = Literal["format", "key", "digest"]


class BadRecord(InvalidArgumentError):
    """A record that is not the item asked for, whole: `reason` is `format` (it
    does not parse, or its frames do not fit its spec), `key` (written under
    another key, or by a release before 0.2) or `digest` (other bytes)."""

    def __init__(self, reason: BadReason, message: str) -> None:
        super().__init__(message)
        self.reason: BadReason = reason


class Manifests(Protocol):
    """An item's manifest in its L2 record, in the wire's format (server/_records.py)."""

    def encode(self, key: str, item: StoredItem, chunks: int, digest: bytes) -> bytes:
        """The manifest of `item`, stored under `key`, whose payload is in
        `chunks` chunk frames of digest `digest`."""
        ...

    def decode(self, key: str, manifest: bytes) -> Manifest:
        """What a manifest read for `key` says, its spec checked as an upload's
        is: BadRecord("key") when it was written under another key (checked
        first), BadRecord("format") when no sidecar could have written it."""
        ...


def payload_digest(frames: Iterable[bytes | memoryview]) -> bytes:
    """XXH3-128 of the frames in order: 0.1 ms for 6.4 MB (60 GB/s), a few
    percent of an L2 hit; hashlib's fastest would cost more than the hit."""
    digest = xxhash.xxh3_128()
    for frame in frames:
        digest.update(frame)
    return digest.digest()


def record_of_item(key: str, item: StoredItem, manifests: Manifests) -> L2Record:
    """The record of a held item (copied out of its extent when it has one)."""
    frames = item.frames
    if item.resident is not None:
        frames = tuple(extent_frames(item.resident))
    manifest = manifests.encode(key, item, len(frames), payload_digest(frames))
    return L2Record(manifest, frames)


def item_of_record(key: str, record: L2Record, manifests: Manifests) -> StoredItem:
    """The item a record holds, if it is the item under `key`, whole and
    unchanged, and checked as an upload is; else BadRecord."""
    manifest = manifests.decode(key, record.manifest)
    if payload_digest(record.chunks) != manifest.digest:
        raise BadRecord("digest", f"the L2 record of {key!r} does not match its digest")
    try:
        check_frames(record.chunks, manifest.entry)
    except InvalidArgumentError as exc:
        raise BadRecord("format", str(exc)) from None
    item = upload_entry(manifest.entry, record.chunks).item
    assert item is not None  # an entry with a spec, not withheld
    return item
