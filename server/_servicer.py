"""The gRPC face of the item cache (`mmcache.v1.MMCache`).

GetAndUpdate, GetAndUpdateOne and Fetch move tensor bytes, so their messages
are handled as raw `bytes`: protobuf parses only the header (an upload's
comes in the call's metadata when small, else as its first frame), and chunk
frames are checked by hand and kept as they came (see mmcache._frames).
GetAndUpdateOne is GetAndUpdate with its one frame (or none) as a unary
request, and runs the same code. Subscribe streams the feed's messages,
serialised once by the feed for every subscriber. The other methods are
ordinary protobuf.

GetAndUpdate's messages are read and written by `_upload`; uploads of one
hash from two calls at once meet in `_pending` (a call that already sends
data when another upload of the hash is in flight is stored over it,
REPLACED: both succeed, the item is stored once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mmcache._errors import CacheMissError, InvalidArgumentError
from mmcache._frames import MAX_CHUNK_BYTES, header_frame
from mmcache._lru import Outcome
from mmcache._spec import check_count, check_name
from mmcache.metrics import CacheMetrics
from mmcache.v1 import cache_pb2 as pb

from ._inflight import InflightBudget
from ._namespaces import Namespace, Namespaces
from ._pending import PendingUploads
from ._region import (
    ITEM,
    WRITE,
    Region,
    Resident,
    Slot,
    copy_payload,
    frame_count,
    region_frames,
)
from ._status import guard, protobuf_method, write
from ._store import BatchResult, ItemStore, StoredItem
from ._upload import (
    EntryHeader,
    TruncatedUploadError,
    build_reply,
    check_no_surplus,
    data_hashes,
    frames_of,
    parse_header,
    read_chunks,
    read_request,
    upload_entry,
)

__all__ = ["SERVICE_NAME", "UPLOAD_WAIT_S", "CacheServicer"]

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MMCache"].full_name

# How long a hash-only entry waits for another call's upload of the same hash:
# enough for items up to tens of MiB on loopback; a longer upload, or a
# stalled one, costs the waiter a re-send, never a hang.
UPLOAD_WAIT_S = 0.5
TRUNCATION_GRACE_S = 0.05

Context = grpc.aio.ServicerContext[Any, Any]


class CacheServicer:
    """Handlers of `mmcache.v1.MMCache` over an `ItemStore`."""

    def __init__(
        self,
        store: ItemStore,
        inflight: InflightBudget,
        metrics: CacheMetrics,
        namespaces: Namespaces,
        instance_id: str,
        version: str,
        region: Callable[[], Region | None] = lambda: None,
    ) -> None:
        self._store = store
        self._inflight = inflight
        self._metrics = metrics
        self._namespaces = namespaces
        self._instance_id = instance_id
        self._version = version
        self._pending = PendingUploads(namespaces.emit)
        self._region = region

    @property
    def pending(self) -> list[str]:
        """Store keys being uploaded now."""
        return self._pending.hashes()

    def _namespace(self, context: Context) -> Namespace:
        return self._namespaces.of_call(context.invocation_metadata())

    def _keys(self, namespace: Namespace, mm_hashes: Sequence[str]) -> list[str]:
        """The store keys of a request's hashes, each checked."""
        check_count("mm_hashes", len(mm_hashes))
        for h in mm_hashes:
            check_name("mm_hash", h)
        return namespace.keys(mm_hashes)

    def handler(self) -> grpc.GenericRpcHandler:
        g = guard(self._instance_id)
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Info": protobuf_method(self.info, pb.InfoRequest, self._instance_id),
            # Raw bytes in and out: see the module docstring.
            "GetAndUpdate": grpc.stream_unary_rpc_method_handler(g(self.get_and_update)),
            "GetAndUpdateOne": grpc.unary_unary_rpc_method_handler(g(self.get_and_update_one)),
            "Fetch": grpc.unary_stream_rpc_method_handler(g(self.fetch)),
            "Touch": protobuf_method(self.touch, pb.TouchRequest, self._instance_id),
            "Clear": protobuf_method(self.clear, pb.ClearRequest, self._instance_id),
            "Release": protobuf_method(self.release, pb.ReleaseRequest, self._instance_id),
            "ShmAllocate": protobuf_method(
                self.shm_allocate, pb.ShmAllocateRequest, self._instance_id
            ),
            "ReadShm": protobuf_method(self.read_shm, pb.FetchRequest, self._instance_id),
            # The feed serialises each message once for every subscriber.
            "Subscribe": grpc.unary_stream_rpc_method_handler(g(self.subscribe)),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    async def info(self, request: pb.InfoRequest, context: Context) -> pb.InfoReply:
        self._namespace(context)  # a bad or one-too-many namespace fails at connect
        reply = pb.InfoReply(
            instance_id=self._instance_id,
            capacity_bytes=self._store.capacity,
            version=self._version,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            items=len(self._store),
            used_bytes=self._store.used,
            max_items=self._store.max_items,
        )
        region = self._region()
        if region is not None:
            reply.shm.CopyFrom(
                pb.ShmRegion(path=region.path, size_bytes=region.size, region_id=region.id)
            )
        return reply

    async def shm_allocate(
        self, request: pb.ShmAllocateRequest, context: Context
    ) -> pb.ShmAllocateReply:
        region = self._region_of(request.shm_token)
        check_count("lengths", len(request.lengths))
        trailers = list(request.trailers) or [0] * len(request.lengths)
        if len(trailers) != len(request.lengths):
            raise InvalidArgumentError(
                f"ShmAllocate names {len(request.lengths)} lengths but {len(trailers)} "
                "trailers: give one per length, or none"
            )
        reply = pb.ShmAllocateReply(instance_id=self._instance_id)
        region.expire()
        slots: list[Slot] = []
        # What the store takes in if all are uploaded: past its capacity, it evicts.
        incoming = sum(request.lengths)
        for length, trailer in zip(request.lengths, trailers, strict=True):
            slot = self._allocate(region, length, WRITE, trailer, incoming)
            if slot is None:  # no room for all: none, and the client uses gRPC
                for given in slots:
                    region.free(given.lease)
                return reply
            slots.append(slot)
        reply.slots.extend(
            pb.ShmSlot(offset=s.offset, length=s.length, lease=s.lease) for s in slots
        )
        return reply

    def _allocate(
        self,
        region: Region,
        length: int,
        kind: str,
        trailer: int,
        incoming: int = 0,
        keep: Sequence[str] = (),
    ) -> Slot | None:
        """An extent of the region, made room for by taking the items that came
        into it longest ago out of it (but none of `keep`); None when even that
        fails."""
        if not region.fits(length, trailer):
            return None
        slot = region.allocate(length, kind, trailer)
        if slot is None:
            for _ in self._store.leave_region(region.resident_keys(keep), incoming):
                slot = region.allocate(length, kind, trailer)
                if slot is not None:
                    break
        return slot

    def _region_of(self, token: bytes) -> Region:
        region = self._region()
        if region is None or not region.matches(token):
            raise InvalidArgumentError(
                "the shared-memory token is not this server's region's (a restarted server, "
                "or another host's): map the region Info announces, or send over gRPC"
            )
        return region

    async def touch(self, request: pb.TouchRequest, context: Context) -> pb.TouchReply:
        keys = self._keys(self._namespace(context), request.mm_hashes)
        return pb.TouchReply(instance_id=self._instance_id, touched=self._store.touch(keys))

    async def clear(self, request: pb.ClearRequest, context: Context) -> pb.ClearReply:
        namespace = self._namespace(context)
        removed, kept = self._store.clear(self._namespaces.owned_by(namespace))
        _LOGGER.info(
            "namespace %r cleared: %d items removed, %d leased items kept",
            namespace.name,
            removed,
            kept,
        )
        return pb.ClearReply(
            instance_id=self._instance_id,
            removed=removed,
            kept_leased=kept,
            seq=self._namespaces.seq_of(namespace),
        )

    async def release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseReply:
        keys = self._keys(self._namespace(context), request.mm_hashes)
        check_count("shm_done", len(request.shm_done))
        region = self._region()
        # Only a client that maps the region reports; one of a region gone is
        # too late, but its leases are still given back.
        if region is not None and region.matches(request.shm_token):
            for hold in request.shm_done:
                region.release(hold)
            self._metrics.shm_bytes.labels("read").inc(request.shm_read_bytes)
            self._metrics.sent_bytes.inc(request.shm_read_bytes)  # as if Fetch had sent them
        return pb.ReleaseReply(instance_id=self._instance_id, released=self._store.release(keys))

    async def subscribe(self, request_bytes: bytes, context: Context) -> None:
        try:
            pb.SubscribeRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgumentError(f"SubscribeRequest does not parse: {exc}") from None
        feed = self._namespace(context).feed
        subscriber = feed.subscribe()
        try:
            async for message in subscriber.messages():
                await write(context, message)
        finally:
            feed.unsubscribe(subscriber)

    async def get_and_update(self, frames: AsyncIterator[bytes], context: Context) -> bytes:
        namespace = self._namespace(context)
        request, in_metadata = await read_request(context, frames)
        entries = parse_header(request, namespace.key)
        # Slots named are checked, and kept from expiry, before anything waits.
        claimed = self._claim(request.shm_token, entries)
        try:
            result = await self._receive(
                context, namespace, request, entries, frames, in_metadata, claimed
            )
        finally:
            self._unclaim(claimed)  # those a failed call never read
        for entry, outcome in zip(entries, result.outcomes, strict=True):
            self._count(entry.modality or self._modality_of(entry.key), outcome, entry.resend)
        leased = request.lease != pb.LEASE_NONE
        # Only the caller's own evictions: another namespace's hashes are not its business.
        result = replace(result, evicted=namespace.hashes(result.evicted))
        return build_reply(
            self._instance_id,
            self._store.capacity,
            self._store.max_items,
            self._namespaces.seq_of(namespace),
            int(self._store.lease_s * 1000) if leased else 0,
            result,
        )

    async def _receive(
        self,
        context: Context,
        namespace: Namespace,
        request: pb.UpdateRequest,
        entries: list[EntryHeader],
        frames: AsyncIterator[bytes],
        in_metadata: bool,
        claimed: dict[int, Slot],
    ) -> BatchResult:
        """Wait for other calls' uploads of the hashes sent alone, read this call's
        data, and apply the batch once every byte has arrived and been checked."""
        # Past the wait the entry is simply MISSING and its sender re-sends it:
        # a stalled upload elsewhere never holds this call up for long.
        remaining = context.time_remaining()
        wait_s = UPLOAD_WAIT_S if remaining is None else min(UPLOAD_WAIT_S, remaining - 0.05)
        waited = await self._pending.wait(
            [e.key for e in entries if e.spec is None], max(0.0, wait_s)
        )
        if waited:
            self._metrics.upload_waits.inc(waited)
        payload = sum(e.payload for e in entries if e.chunks is not None)
        marked = self._pending.mark(data_hashes(entries))
        # Made only now: an iterator never started (a call refused on its
        # header) would warn when collected. grpc hands back the same one.
        stream = aiter(frames)
        try:
            # Nothing is stored until every byte has arrived and been checked,
            # so a cancelled or malformed upload leaves the cache as it was.
            async with self._inflight.reserve(payload):
                uploads = []
                for e in entries:
                    resident = None
                    if e.chunks is None:
                        data: tuple[bytes, ...] = ()
                    elif e.index in claimed:
                        data, resident = self._from_region(claimed[e.index], e)
                    else:
                        data = await read_chunks(stream, e)
                    uploads.append(upload_entry(e, data, resident))
                await check_no_surplus(stream, in_metadata)
                self._metrics.received_bytes.inc(payload)
                touches = namespace.keys(request.touches)
                return self._store.update(touches, uploads, lease=request.lease)
        except TruncatedUploadError:
            # A client's cancel can end its stream here before grpc marks the
            # call cancelled: give it a moment to, so a cancel is counted as
            # one, and only a stream its client really closed early is refused.
            await asyncio.sleep(TRUNCATION_GRACE_S)
            raise
        finally:
            self._pending.settle(marked)

    def _claim(self, token: bytes, entries: Sequence[EntryHeader]) -> dict[int, Slot]:
        """The write slots this upload names, checked now and kept from expiry
        until the call ends (`_from_region` reads them), by entry index."""
        named = [e for e in entries if e.shm is not None]
        if not named:
            return {}
        region = self._region_of(token)
        claimed: dict[int, Slot] = {}
        for entry in named:
            assert entry.shm is not None
            try:
                claimed[entry.index] = region.claim(
                    entry.shm.lease, entry.shm.offset, entry.shm.length
                )
            except InvalidArgumentError as exc:
                self._unclaim(claimed)
                raise InvalidArgumentError(f"{entry.where}: {exc}") from None
        return claimed

    def _unclaim(self, claimed: dict[int, Slot]) -> None:
        region = self._region()
        if region is not None:
            for slot in claimed.values():
                region.free(slot.lease)

    def _from_region(
        self, slot: Slot, entry: EntryHeader
    ) -> tuple[tuple[bytes, ...], Resident | None]:
        """An uploaded payload in its claimed slot: resident there from now on (no
        copy), or, when the slot has no room for its key and spec, copied out as
        chunk frames and the slot freed."""
        region = self._region()
        assert region is not None and entry.spec is not None
        self._metrics.shm_bytes.labels("write").inc(slot.length)
        resident = region.settle(slot, entry.key, entry.spec.SerializeToString())
        if resident is not None:
            return (), resident
        try:
            return tuple(region_frames(region.payload(slot))), None
        finally:
            region.free(slot.lease)

    async def get_and_update_one(self, frame: bytes, context: Context) -> bytes:
        return await self.get_and_update(frames_of(frame), context)

    async def fetch(self, request_bytes: bytes, context: Context) -> None:
        try:
            request = pb.FetchRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgumentError(f"FetchRequest does not parse: {exc}") from None
        keys, items = self._fetched(request, context)
        header = pb.FetchHeader(instance_id=self._instance_id)
        for mm_hash, item in zip(request.mm_hashes, items, strict=True):
            chunks = len(item.frames) if item.resident is None else frame_count(item.payload)
            header.items.add(mm_hash=mm_hash, item=item.spec, num_chunks=chunks)
        await write(context, header_frame(header.SerializeToString()))
        # The frames are the very objects that arrived, or made from the region
        # one at a time: held references keep either alive if the items are
        # evicted meanwhile.
        for item in items:
            resident = item.resident
            for frame in item.frames if resident is None else region_frames(resident.payload()):
                await write(context, frame)
            self._metrics.sent_bytes.inc(item.payload)
        if request.release:  # read to the end: the leases' promise is kept
            self._store.release(keys)

    async def read_shm(self, request: pb.FetchRequest, context: Context) -> pb.FetchHeader:
        region = self._region_of(request.shm_token)
        keys, items = self._fetched(request, context)
        header = pb.FetchHeader(instance_id=self._instance_id)
        residents = self._residents(region, keys, items)
        if residents is None:
            return header  # no room: the client calls Fetch
        for mm_hash, item, resident in zip(request.mm_hashes, items, residents, strict=True):
            slot = resident.slot
            where = pb.ShmSlot(offset=slot.offset, length=slot.length, lease=slot.lease)
            if request.shm_hold:
                where.hold = region.hold(resident)
            header.items.add(mm_hash=mm_hash, item=item.spec, shm=where)
            self._metrics.sent_bytes.inc(item.payload)
        self._metrics.shm_bytes.labels("read").inc(sum(item.payload for item in items))
        if request.release:  # the reply says where every item is: the leases' promise is kept
            self._store.release(keys)
        return header

    def _fetched(
        self, request: pb.FetchRequest, context: Context
    ) -> tuple[list[str], list[StoredItem]]:
        """The store keys of a read's hashes and their items; CacheMissError names
        the missing ones as the caller did."""
        namespace = self._namespace(context)
        keys = self._keys(namespace, request.mm_hashes)
        try:
            return keys, self._store.fetch(keys)
        except CacheMissError as exc:
            raise CacheMissError(namespace.hashes(exc.missing_hashes)) from None

    def _residents(
        self, region: Region, keys: Sequence[str], items: Sequence[StoredItem]
    ) -> list[Resident] | None:
        """The items' extents in the region, moving there those that are not yet
        (their frames then dropped); None when the region has no room for all."""
        residents: list[Resident] = []
        for key, item in zip(keys, items, strict=True):
            if item.resident is not None:
                region.read(item.resident)
                residents.append(item.resident)
                continue
            spec = item.spec.SerializeToString()
            trailer = len(key.encode()) + len(spec)
            slot = self._allocate(region, item.payload, ITEM, trailer, keep=keys)
            if slot is None:
                return None
            copy_payload(item.frames, region.payload(slot))
            resident = region.settle(slot, key, spec)
            assert resident is not None  # allocated with room for its trailer
            self._store.make_resident(key, item, resident)
            residents.append(resident)
        return residents

    def _modality_of(self, key: str) -> str:
        """A held item's own modality: the label of a hash sent without one."""
        item = self._store.peek(key)
        return item.spec.fields[0].modality if item is not None and item.spec.fields else ""

    def _count(self, modality: str, outcome: Outcome, resend: bool) -> None:
        if resend:
            self._metrics.resends.labels(modality or "unknown").inc()
        else:
            self._metrics.queried(modality, hit=outcome in (Outcome.HIT, Outcome.REPLACED))
        if outcome == Outcome.UNCACHED:
            self._metrics.uncached.labels(modality or "unknown").inc()
