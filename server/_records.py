"""An item's manifest in its L2 record: the `UpdateEntry` a client would send
for it (spec, chunk count, metadata), serialised. The L2 tier (server/cache)
never reads protobuf; it is given `WIRE_MANIFESTS`.

The record's key names the item; a store key may hold the namespace's NUL,
which no mm_hash may, so the manifest names it by a placeholder.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from mmcache._errors import InvalidArgumentError
from mmcache.v1 import cache_pb2 as pb

from ._upload import entry_header
from .cache._entries import EntryHeader
from .cache._l2 import Manifests
from .cache._store import StoredItem

__all__ = ["WIRE_MANIFESTS", "WireManifests"]

_NAMED_BY_KEY = "l2"


class WireManifests:
    """Manifests as the sidecars of every release since the L2 tier write them."""

    def encode(self, item: StoredItem, chunks: int) -> bytes:
        entry = pb.UpdateEntry(mm_hash=_NAMED_BY_KEY, num_chunks=chunks, metadata=item.metadata)
        entry.item.MergeFromString(item.spec)
        return entry.SerializeToString()

    def decode(self, key: str, manifest: bytes) -> EntryHeader:
        try:
            entry = pb.UpdateEntry.FromString(manifest)
        except DecodeError as exc:
            raise InvalidArgumentError(
                f"the L2 manifest of {key!r} does not parse: {exc}"
            ) from None
        if (
            entry.mm_hash != _NAMED_BY_KEY
            or not entry.HasField("item")
            or entry.withheld
            or entry.HasField("shm")
        ):
            raise InvalidArgumentError(f"the L2 record under {key!r} is not an item record")
        return entry_header(0, entry, str)


WIRE_MANIFESTS: Manifests = WireManifests()
