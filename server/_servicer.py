"""The gRPC face of the item cache (`mmcache.v1.MMCache`): each handler parses
its request, calls the `ItemCache` (server/cache/), and replies.

GetAndUpdate, GetAndUpdateOne and Fetch move tensor bytes, so their messages
are raw `bytes`: protobuf parses only the header (an upload's comes in the
call's metadata when small, else as its first frame), and chunk frames are
checked by hand and kept as they came (mmcache._frames, server._upload).
GetAndUpdateOne is GetAndUpdate with its one frame (or none) as a unary
request. An upload a co-located client posts in its report ring with no call
is applied as a GetAndUpdate with no frames, in a task of its own, with no
reply (`posted`). Subscribe streams the feed's messages, serialised once by
the feed for every subscriber. The other methods are ordinary protobuf.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mmcache import __version__
from mmcache._errors import CacheMissError, InvalidArgumentError, MMCacheError
from mmcache._frames import MAX_CHUNK_BYTES, header_frame
from mmcache.v1 import cache_pb2 as pb

from ._auth import Metadata
from ._namespaces import Namespace, Namespaces
from ._replays import Replays, batch_key
from ._reports import report_of
from ._session_calls import SessionCalls
from ._status import guard, protobuf_method, write
from ._upload import (
    Batch,
    Context,
    TruncatedUploadError,
    build_reply,
    check_no_surplus,
    check_posted,
    frames_of,
    grace_for_cancel,
    parse_header,
    read_chunks,
    read_request,
    slot_message,
    slot_sizes,
    times_of,
)
from .cache import (
    BatchResult,
    Deadline,
    ItemCache,
    Lease,
    PreparedUpdate,
    Scope,
    StoredItem,
    Tier,
    upload_entry,
)

__all__ = ["SERVICE_NAME", "CacheServicer"]

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MMCache"].full_name
SESSION_METHOD = f"/{SERVICE_NAME}/UpdateSession"  # its metrics count batches

_TIERS = {Tier.NONE: pb.TIER_NONE, Tier.L1: pb.TIER_L1, Tier.L2: pb.TIER_L2}

# A posted upload's whole bound (no call's deadline ends it): its payloads are
# in the region already, so only room for them (the in-flight budget) is waited for.
POSTED_TIMEOUT_S = 5.0
# Posted uploads applied at once; past that a record's upload is refused (its
# client shares a little less), so a flood of records cannot pile up tasks.
MAX_POSTED = 256


class CacheServicer:
    """Handlers of `mmcache.v1.MMCache`: each parses its request, calls the
    `ItemCache`, and replies."""

    def __init__(
        self,
        cache: ItemCache,
        namespaces: Namespaces,
        instance_id: str,
        sessions: SessionCalls,
        may_upload: Callable[[Metadata], bool] = lambda metadata: True,
    ) -> None:
        self._cache = cache
        self._namespaces = namespaces
        self._instance_id = instance_id
        self._sessions = sessions
        self._may_upload = may_upload  # a call's token may call GetAndUpdate
        self._replays = Replays()
        self._posted: set[asyncio.Task[None]] = set()
        self._closed = False
        cache.take_posted_uploads(self.posted)

    def _namespace(self, context: Context) -> Namespace:
        return self._namespaces.of_call(context.invocation_metadata())

    def handler(self) -> grpc.GenericRpcHandler:
        g = guard(self._instance_id)

        def unary(method: Any, request_type: Any) -> grpc.RpcMethodHandler[Any, Any]:
            return protobuf_method(method, request_type, self._instance_id)

        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Info": unary(self.info, pb.InfoRequest),
            # Raw bytes in and out: see the module docstring.
            "GetAndUpdate": grpc.stream_unary_rpc_method_handler(g(self.get_and_update)),
            "GetAndUpdateOne": grpc.unary_unary_rpc_method_handler(g(self.get_and_update_one)),
            "UpdateSession": grpc.stream_stream_rpc_method_handler(g(self.update_session)),
            "Fetch": grpc.unary_stream_rpc_method_handler(g(self.fetch)),
            "Touch": unary(self.touch, pb.TouchRequest),
            "Clear": unary(self.clear, pb.ClearRequest),
            "Release": unary(self.release, pb.ReleaseRequest),
            "ShmAllocate": unary(self.shm_allocate, pb.ShmAllocateRequest),
            "OpenReportRing": unary(self.open_report_ring, pb.OpenReportRingRequest),
            "ReadShm": unary(self.read_shm, pb.FetchRequest),
            "Locate": unary(self.locate, pb.LocateRequest),
            # The feed serialises each message once for every subscriber.
            "Subscribe": grpc.unary_stream_rpc_method_handler(g(self.subscribe)),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    async def info(self, request: pb.InfoRequest, context: Context) -> pb.InfoReply:
        self._namespace(context)  # a bad or one-too-many namespace fails at connect
        stats = self._cache.stats()
        reply = pb.InfoReply(
            instance_id=self._instance_id,
            capacity_bytes=stats.capacity,
            version=__version__,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            items=stats.items,
            used_bytes=stats.used,
            max_items=stats.max_items,
            shared_tier=stats.shared_tier,
            leases=stats.leases,
            queries=stats.queries,
            hits=stats.hits,
            namespaces=len(self._namespaces),
            l2_up=stats.l2_up,
        )
        region = stats.shm
        if region is not None:
            reply.shm.CopyFrom(
                pb.ShmRegion(
                    path=region.path,
                    size_bytes=region.size,
                    region_id=region.id,
                    posted_uploads=True,  # `posted` applies ring uploads; clients post only if set
                )
            )
        return reply

    async def shm_allocate(
        self, request: pb.ShmAllocateRequest, context: Context
    ) -> pb.ShmAllocateReply:
        sizes = slot_sizes("ShmAllocate", request.lengths, request.trailers)
        slots = self._cache.allocate(request.shm_token, sizes)
        reply = pb.ShmAllocateReply(instance_id=self._instance_id)
        reply.slots.extend(slot_message(s) for s in slots)
        return reply

    async def open_report_ring(
        self, request: pb.OpenReportRingRequest, context: Context
    ) -> pb.ShmAllocateReply:
        # Its ring carries uploads only where its token could call GetAndUpdate.
        uploads = self._may_upload(context.invocation_metadata())
        ring = self._cache.open_ring(request.shm_token, self._namespace(context), uploads=uploads)
        reply = pb.ShmAllocateReply(instance_id=self._instance_id)
        reply.slots.extend([] if ring is None else [slot_message(ring)])
        return reply

    async def touch(self, request: pb.TouchRequest, context: Context) -> pb.TouchReply:
        keys = self._namespace(context).checked_keys(request.mm_hashes)
        return pb.TouchReply(instance_id=self._instance_id, touched=self._cache.touch(keys))

    async def clear(self, request: pb.ClearRequest, context: Context) -> pb.ClearReply:
        namespace = self._namespace(context)
        removed, kept = self._cache.clear(self._namespaces.owned_by(namespace))
        _LOGGER.info(
            "namespace %r cleared: %d items removed, %d leased items kept",
            namespace.name,
            removed,
            kept,
        )
        seq = self._namespaces.seq_of(namespace)
        return pb.ClearReply(
            instance_id=self._instance_id, removed=removed, kept_leased=kept, seq=seq
        )

    async def release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseReply:
        namespace = self._namespace(context)
        keys = namespace.checked_keys(request.mm_hashes)
        released = self._cache.release(namespace, keys, report_of(request))
        return pb.ReleaseReply(instance_id=self._instance_id, released=released)

    async def locate(self, request: pb.LocateRequest, context: Context) -> pb.LocateReply:
        keys = self._namespace(context).checked_keys(request.mm_hashes)
        deadline = Deadline.within(context.time_remaining())
        found = await self._cache.locate(keys, request.check_l2, deadline)
        return pb.LocateReply(
            instance_id=self._instance_id,
            tiers=[_TIERS[tier] for tier, _ in found],
            sizes=[size for _, size in found],
        )

    async def subscribe(self, request_bytes: bytes, context: Context) -> None:
        try:
            request = pb.SubscribeRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgumentError(f"SubscribeRequest does not parse: {exc}") from None
        feed = self._namespace(context).feed
        subscriber = feed.subscribe(request.gap_ms / 1000)
        try:
            async for message in subscriber.messages():
                await write(context, message)
        finally:
            feed.unsubscribe(subscriber)

    async def get_and_update(self, frames: AsyncIterator[bytes], context: Context) -> bytes:
        namespace = self._namespace(context)
        request, in_metadata = await read_request(context, frames)
        return await self._update(context, namespace, request, frames, in_metadata)

    def posted(self, scope: Scope, header: bytes) -> None:
        """An upload a co-located client posted in its report ring (read by a
        drain, on the event loop): applied in a task of its own, as its
        GetAndUpdate would be, with no frames and no reply."""
        assert isinstance(scope, Namespace)  # the ring's, opened by open_report_ring
        if self._closed or len(self._posted) >= MAX_POSTED:
            self._cache.metrics.posted_uploads.labels("refused").inc()
            raise InvalidArgumentError(
                "the server is stopping"
                if self._closed
                else f"{MAX_POSTED} posted uploads are being applied already"
            )
        task = asyncio.get_running_loop().create_task(self._apply_posted(scope, header))
        self._posted.add(task)  # kept until done: the loop holds tasks weakly
        task.add_done_callback(self._posted.discard)

    async def _apply_posted(self, namespace: Namespace, header: bytes) -> None:
        result = "refused"
        try:
            request = check_posted(header)
            async with asyncio.timeout(POSTED_TIMEOUT_S):
                await self._update(None, namespace, request, frames_of(b""), False)
            result = "applied"
        except MMCacheError as exc:  # its client's mistake, or a slot that expired
            _LOGGER.warning("an upload posted in a report ring was refused: %s", exc)
        except TimeoutError:
            _LOGGER.warning(
                "an upload posted in a report ring was refused: no room for it within %.0f s",
                POSTED_TIMEOUT_S,
            )
        except Exception:  # never "task exception was never retrieved"
            _LOGGER.exception("an upload posted in a report ring failed")
        finally:
            self._cache.metrics.posted_uploads.labels(result).inc()

    async def aclose(self) -> None:
        """Posted uploads still being applied end now, and none start (the
        server is stopping: its cache closes next)."""
        self._closed = True
        tasks = list(self._posted)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def get_and_update_one(self, frame: bytes, context: Context) -> bytes:
        return await self.get_and_update(frames_of(frame), context)

    async def update_session(self, frames: AsyncIterator[bytes], context: Context) -> None:
        """GetAndUpdate, batch after batch, over one stream (server._session_calls)."""
        await self._sessions.serve(frames, context, self._namespace, self._update)

    async def _update(
        self,
        context: Context | None,
        namespace: Namespace,
        request: pb.UpdateRequest,
        frames: AsyncIterator[bytes],
        in_metadata: bool,
        *,
        last: bool = True,
    ) -> bytes:
        """Apply one batch, once (server._replays); its serialised reply. `last`:
        no frame may follow it. `context`: None for an upload posted with no
        call, which gets no reply (b"")."""
        entries = parse_header(request, namespace.key)
        batch = Batch(namespace, request, entries, frames, in_metadata, last)
        key = batch_key(namespace.name, request.batch_id)
        apply = partial(self._apply, context, batch)
        return await (apply() if key is None else self._replays.once(key, apply, call=last))

    async def _apply(self, context: Context | None, batch: Batch) -> bytes:
        """Receive and store one batch, and build its reply with no await after
        the store changed (server._replays relies on it)."""
        request = batch.request
        spare_sizes = slot_sizes(
            "the upload's spares", request.shm_spare_lengths, request.shm_spare_trailers
        )
        remaining = POSTED_TIMEOUT_S if context is None else context.time_remaining()
        deadline, said_wait = times_of(request, remaining)
        try:
            async with self._cache.prepare(
                request.shm_token, batch.entries, deadline, said_wait, request.claim_ms / 1000
            ) as ready:
                result = await self._receive(batch, ready)
        except TruncatedUploadError:
            if context is not None:
                await grace_for_cancel(context)
            raise
        if context is None:  # posted: no one to reply to (and no batch_id to replay)
            return b""
        return self._reply(batch, result, spare_sizes)

    def _reply(
        self, batch: Batch, result: BatchResult, spare_sizes: list[tuple[int, int]]
    ) -> bytes:
        namespace, request = batch.namespace, batch.request
        # Only the caller's own evictions: another namespace's hashes are not its business.
        result = replace(result, evicted=namespace.hashes(result.evicted))
        seq = self._namespaces.seq_of(namespace)
        # After `seq`: what the spares push out of the cache comes by the feed.
        keys = [e.key for e in batch.entries]
        spares = self._cache.spares(request.shm_token, spare_sizes, keys)
        leased = request.lease != pb.LEASE_NONE  # checked by parse_header
        limits = self._cache.limits()  # on every upload: not the whole stats
        lease_ms = int(limits.lease_s * 1000) if leased else 0
        spare_slots = [slot_message(s) for s in spares]
        return build_reply(
            self._instance_id, limits.capacity, limits.max_items, seq, lease_ms, result, spare_slots
        )

    async def _receive(self, batch: Batch, prepared: PreparedUpdate) -> BatchResult:
        """Read the batch's data (from the call, or its region slots), check it
        all, and commit it."""
        # Made only now: an iterator never started (a call refused on its
        # header) would warn when collected. grpc hands back the same one.
        stream = aiter(batch.frames)
        uploads = []
        for e in batch.entries:
            if e.chunks is None:
                uploads.append(upload_entry(e, ()))
            elif prepared.in_region(e):
                uploads.append(upload_entry(e, *prepared.from_region(e)))
            else:
                uploads.append(upload_entry(e, await read_chunks(stream, e)))
        if batch.last:
            await check_no_surplus(stream, batch.in_metadata)
        touches = batch.namespace.keys(batch.request.touches)
        return prepared.commit(uploads, touches, Lease(batch.request.lease))

    async def fetch(self, request_bytes: bytes, context: Context) -> None:
        try:
            request = pb.FetchRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgumentError(f"FetchRequest does not parse: {exc}") from None
        namespace = self._namespace(context)
        keys = namespace.checked_keys(request.mm_hashes)
        items = await self._read(namespace, keys, context)
        header = pb.FetchHeader(instance_id=self._instance_id)
        for mm_hash, item in zip(request.mm_hashes, items, strict=True):
            chunks = self._cache.chunk_count(item)
            header.items.add(mm_hash=mm_hash, num_chunks=chunks).item.MergeFromString(item.spec)
        await write(context, header_frame(header.SerializeToString()))
        for item in items:
            for frame in self._cache.frames_of(item):
                await write(context, frame)
            self._cache.sent(item)
        if request.release:  # read to the end: the leases' promise is kept
            self._cache.release_leases(keys)

    async def read_shm(self, request: pb.FetchRequest, context: Context) -> pb.FetchHeader:
        namespace = self._namespace(context)
        keys = namespace.checked_keys(request.mm_hashes)
        deadline = Deadline.within(context.time_remaining())
        try:
            reads = await self._cache.read_shm(
                request.shm_token, keys, request.shm_done, request.shm_hold, deadline
            )
        except CacheMissError as exc:
            raise CacheMissError(namespace.hashes(exc.missing_hashes)) from None
        header = pb.FetchHeader(instance_id=self._instance_id)
        if reads is None:
            return header  # no room: the client calls Fetch
        for mm_hash, read in zip(request.mm_hashes, reads, strict=True):
            where = slot_message(read.slot)
            where.hold = read.hold
            header.items.add(mm_hash=mm_hash, shm=where).item.MergeFromString(read.item.spec)
        if request.release:  # the reply says where every item is: the leases' promise is kept
            self._cache.release_leases(keys)
        return header

    async def _read(
        self, namespace: Namespace, keys: list[str], context: Context
    ) -> list[StoredItem]:
        """The items under `keys`; CacheMissError names the missing as the caller did."""
        try:
            return await self._cache.read(keys, Deadline.within(context.time_remaining()))
        except CacheMissError as exc:
            raise CacheMissError(namespace.hashes(exc.missing_hashes)) from None
