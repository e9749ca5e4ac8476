"""An item's manifest in its L2 record: an `L2Manifest`, which names the key
the record was written under and the digest of its frames, around the
`UpdateEntry` a client would send for the item (spec, chunk count, metadata),
serialised. The L2 tier (server/cache) never reads protobuf; it is given
`WIRE_MANIFESTS`.

A store key may hold the namespace's NUL, which no mm_hash may, so the entry
names the item by a placeholder; the manifest's `key` is the store key itself.
A record of a release before 0.2 (a bare UpdateEntry) parses as a manifest
whose key is "l2" (or not at all): a miss, written over once the item is stored.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from mmcache._errors import InvalidArgumentError
from mmcache.v1 import cache_pb2 as pb

from ._upload import entry_header
from .cache import BadRecord, Manifest, Manifests, StoredItem

__all__ = ["WIRE_MANIFESTS", "WireManifests"]

_NAMED_BY_KEY = "l2"


class WireManifests:
    """Manifests as the sidecars of release 0.2 on write them."""

    def encode(self, key: str, item: StoredItem, chunks: int, digest: bytes) -> bytes:
        entry = pb.UpdateEntry(mm_hash=_NAMED_BY_KEY, num_chunks=chunks, metadata=item.metadata)
        entry.item.MergeFromString(item.spec)
        return pb.L2Manifest(key=key, digest=digest, entry=entry).SerializeToString()

    def decode(self, key: str, manifest: bytes) -> Manifest:
        try:
            parsed = pb.L2Manifest.FromString(manifest)
        except DecodeError as exc:
            raise BadRecord(
                "format", f"the L2 manifest read for {key!r} does not parse: {exc}"
            ) from None
        if parsed.key != key:  # before anything else: the record of another item
            raise BadRecord("key", f"the L2 record read for {key!r} was written for {parsed.key!r}")
        entry = parsed.entry
        if (
            entry.mm_hash != _NAMED_BY_KEY
            or not entry.HasField("item")
            or entry.withheld
            or entry.HasField("shm")
        ):
            raise BadRecord("format", f"the L2 record for {key!r} is not an item record")
        try:
            header = entry_header(0, entry, str)
        except InvalidArgumentError as exc:
            raise BadRecord("format", f"the L2 record for {key!r}: {exc}") from None
        return Manifest(parsed.digest, header)


WIRE_MANIFESTS: Manifests = WireManifests()
