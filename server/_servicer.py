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

from mmcache._errors import AbortedError, CacheMissError, InvalidArgumentError, MMCacheError
from mmcache._frames import MAX_CHUNK_BYTES, UPDATE_HEADER_KEY, header_frame
from mmcache._lru import Outcome
from mmcache._spec import check_count, check_counts, check_name
from mmcache.metrics import CacheMetrics, RequestMetrics
from mmcache.v1 import cache_pb2 as pb

from ._auth import Metadata
from ._namespaces import Namespace, Namespaces
from ._replays import Replays, batch_key
from ._sessions import Sessions, skip_batch
from ._status import failure_code, guard, protobuf_method, write
from ._upload import (
    EntryHeader,
    TruncatedUploadError,
    build_reply,
    check_no_surplus,
    chunks_declared,
    data_hashes,
    frames_of,
    header_metadata,
    parse_header,
    read_chunks,
    read_request,
    request_of_frame,
    slot_message,
    slot_sizes,
    upload_entry,
)
from .cache._inflight import InflightBudget
from .cache._pending import PendingUploads
from .cache._region import (
    ITEM,
    READ,
    WRITE,
    Region,
    Resident,
    Slot,
    copy_payload,
    frame_count,
    region_frames,
)
from .cache._report_rings import ReportRings
from .cache._store import BatchResult, ItemStore, StoredItem
from .cache._tier import L2Tier

__all__ = ["SERVICE_NAME", "UPLOAD_WAIT_S", "CacheServicer"]

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MMCache"].full_name
SESSION_METHOD = f"/{SERVICE_NAME}/UpdateSession"  # its metrics count batches

# How long a hash-only entry waits for another call's upload of the same hash:
# enough for items up to tens of MiB on loopback; a longer upload, or a
# stalled one, costs the waiter a re-send, never a hang.
UPLOAD_WAIT_S = 0.5
# How long a stream that ended mid-upload is given to show its client's cancel.
TRUNCATION_GRACE_S = 0.5
# What a call keeps of its time, past waits for uploads and the L2 tier's
# reads, to answer.
ANSWER_MARGIN_S = 0.05

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
        *,
        sessions: Sessions,
        batch_metrics: RequestMetrics,
        authorize: Callable[[Metadata], MMCacheError | None] = lambda _: None,
        l2: L2Tier | None = None,
    ) -> None:
        self._authorize = authorize
        self._l2 = l2
        self._store = store
        self._sessions = sessions
        self._batch_metrics = batch_metrics
        self._inflight = inflight
        self._metrics = metrics
        self._namespaces = namespaces
        self._instance_id = instance_id
        self._version = version
        self._pending = PendingUploads(namespaces.emit)
        self._replays = Replays()
        self._region = region
        self._rings: ReportRings | None = None

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
            "UpdateSession": grpc.stream_stream_rpc_method_handler(g(self.update_session)),
            "Fetch": grpc.unary_stream_rpc_method_handler(g(self.fetch)),
            "Touch": protobuf_method(self.touch, pb.TouchRequest, self._instance_id),
            "Clear": protobuf_method(self.clear, pb.ClearRequest, self._instance_id),
            "Release": protobuf_method(self.release, pb.ReleaseRequest, self._instance_id),
            "ShmAllocate": protobuf_method(
                self.shm_allocate, pb.ShmAllocateRequest, self._instance_id
            ),
            "OpenReportRing": protobuf_method(
                self.open_report_ring, pb.OpenReportRingRequest, self._instance_id
            ),
            "ReadShm": protobuf_method(self.read_shm, pb.FetchRequest, self._instance_id),
            "Locate": protobuf_method(self.locate, pb.LocateRequest, self._instance_id),
            # The feed serialises each message once for every subscriber.
            "Subscribe": grpc.unary_stream_rpc_method_handler(g(self.subscribe)),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    async def info(self, request: pb.InfoRequest, context: Context) -> pb.InfoReply:
        self._namespace(context)  # a bad or one-too-many namespace fails at connect
        self.drain_reports()  # its counts include what the rings hold
        reply = pb.InfoReply(
            instance_id=self._instance_id,
            capacity_bytes=self._store.capacity,
            version=self._version,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            items=len(self._store),
            used_bytes=self._store.used,
            max_items=self._store.max_items,
            shared_tier=self._l2 is not None,
            leases=self._store.leases,
            queries=self._metrics.total_queries,
            hits=self._metrics.total_hits,
            namespaces=len(self._namespaces),
            l2_up=self._l2 is not None and bool(self._l2.backend.up),
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
        self.drain_reports()
        reply = pb.ShmAllocateReply(instance_id=self._instance_id)
        sizes = slot_sizes("ShmAllocate", request.lengths, request.trailers)
        reply.slots.extend(slot_message(s) for s in self._write_slots(region, sizes))
        return reply

    async def open_report_ring(
        self, request: pb.OpenReportRingRequest, context: Context
    ) -> pb.ShmAllocateReply:
        region = self._region_of(request.shm_token)
        ring = self._rings_of(region).open(self._namespace(context))
        reply = pb.ShmAllocateReply(instance_id=self._instance_id)
        reply.slots.extend([] if ring is None else [slot_message(ring)])
        return reply

    def _write_slots(
        self, region: Region, sizes: Sequence[tuple[int, int]], keep: Sequence[str] = ()
    ) -> list[Slot]:
        """Write slots of these (payload, trailer) sizes: all, or none when the
        region has no room for all (the client then uploads over gRPC); room is
        made without taking out the items under `keep`."""
        region.expire()
        slots: list[Slot] = []
        # What the store takes in if all are uploaded: past its capacity, it evicts.
        incoming = sum(length for length, _ in sizes)
        for length, trailer in sizes:
            slot = self._allocate(region, length, WRITE, trailer, incoming, keep)
            if slot is None:
                for given in slots:
                    region.free(given.lease)
                return []
            slots.append(slot)
        return slots

    def _spares(
        self, token: bytes, sizes: Sequence[tuple[int, int]], batch: Sequence[str]
    ) -> list[Slot]:
        """The spare write slots an upload asked for with its reply; none when
        its token is not the region's (asking never fails an upload). Their
        room never takes out the batch's own items: what the reply answers
        held stays readable (in a full cache, taking one out evicts it)."""
        region = self._region()
        if not sizes or region is None or not region.matches(token):
            return []
        return self._write_slots(region, sizes, batch)

    def _allocate(
        self,
        region: Region,
        length: int,
        kind: str,
        trailer: int,
        incoming: int = 0,
        keep: Sequence[str] = (),
        *,
        aged: bool = False,
    ) -> Slot | None:
        """An extent of the region, made room for by taking the items that came
        into it longest ago out of it (but none of `keep`; `aged`: only those
        in for longer than its tenure); None when even that fails."""
        if not region.fits(length, trailer):
            return None
        slot = region.allocate(length, kind, trailer)
        if slot is None:
            residents = region.resident_keys(keep, aged=aged)
            for moved in self._store.leave_region(residents, incoming):
                if moved:
                    self._metrics.shm_copies.labels("out").inc()
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
        namespace = self._namespace(context)
        self.drain_reports()  # what came before this call, first
        region = self._region()
        # Only a client that maps the region reports; one of a region gone is
        # too late, but its leases are still given back.
        mapped = region is not None and region.matches(request.shm_token)
        released = self._report(namespace, request, region if mapped else None)
        return pb.ReleaseReply(instance_id=self._instance_id, released=released)

    def _report(
        self, namespace: Namespace, request: pb.ReleaseRequest, region: Region | None
    ) -> int:
        """Apply a Release, or a report ring's record; the leases it ended.
        `region`: the client maps it (its holds and its bytes read count)."""
        keys = self._keys(namespace, request.mm_hashes)
        check_count("shm_done", len(request.shm_done))
        check_count("shm_leases", len(request.shm_leases))
        check_counts("misses", request.misses)
        check_counts("hits", request.hits)
        # Queries a client answered itself count as lookups would.
        for modality, count in request.misses.items():
            self._metrics.queried(modality, hit=False, count=count)
        for modality, count in request.hits.items():
            self._metrics.queried(modality, hit=True, count=count)
        if region is None:
            return self._store.release(keys)
        for hold in request.shm_done:
            region.release(hold)
        self._metrics.shm_bytes.labels("read").inc(request.shm_read_bytes)
        self._metrics.sent_bytes.inc(request.shm_read_bytes)  # as if Fetch had sent them
        self._metrics.shm_client_cpu.inc(request.client_cpu_ns / 1e9)
        if request.shm_leases:  # taken with no call: as a lookup's hits are
            leased = [lease.mm_hash for lease in request.shm_leases]
            self._store.lease(self._keys(namespace, leased))
        if region.orphans:  # a lease of an extent kept after its item left
            orphaned = [key for key in keys if not self._store.is_leased(key)]
            for key in orphaned:
                region.end_orphan(key)
        return self._store.release(keys)

    def _rings_of(self, region: Region) -> ReportRings:
        if self._rings is None or self._rings.region is not region:

            def apply(namespace: Namespace, report: pb.ReleaseRequest) -> None:
                self._report(namespace, report, region)

            rings = self._rings = ReportRings(region, apply)

            def keep_leased(generation: int, key: str) -> bool:
                # An item still in the store (moved to the heap) is leased there.
                return key not in self._store and rings.leased(generation)

            region.keep_leased = keep_leased
        return self._rings

    def drain_reports(self) -> int:
        """Apply what co-located clients wrote in their report rings; how many reports."""
        region = self._region()
        return 0 if region is None or self._rings is None else self._rings_of(region).drain()

    def beat(self) -> None:
        """The region's heartbeat, and its rings read (the server's timer, every BEAT_S)."""
        region = self._region()
        if region is not None:
            region.beat()
        self.drain_reports()

    async def locate(self, request: pb.LocateRequest, context: Context) -> pb.LocateReply:
        keys = self._keys(self._namespace(context), request.mm_hashes)
        sizes = [self._store.size_of(key) for key in keys]
        tiers = [pb.TIER_L1 if key in self._store else pb.TIER_NONE for key in keys]
        if request.check_l2 and self._l2 is not None:
            absent = [i for i, tier in enumerate(tiers) if tier == pb.TIER_NONE]
            remaining = context.time_remaining()
            budget = None if remaining is None else remaining - ANSWER_MARGIN_S
            found = await self._l2.holds([keys[i] for i in absent], budget)
            for i, held in zip(absent, found, strict=True):
                if held:
                    tiers[i] = pb.TIER_L2
        return pb.LocateReply(instance_id=self._instance_id, tiers=tiers, sizes=sizes)

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
        return await self._update(context, namespace, request, frames, in_metadata)

    async def update_session(self, frames: AsyncIterator[bytes], context: Context) -> None:
        """GetAndUpdate, batch after batch, over one stream (server._sessions)."""
        self._namespace(context)  # refused at open, not at its first batch
        if header_metadata(context) is not None:
            raise InvalidArgumentError(
                f"an UpdateSession carries each batch's header as the batch's first frame, "
                f"not as {UPDATE_HEADER_KEY} metadata"
            )
        with self._sessions.admitted():
            await self._serve_session(frames, context)

    async def _serve_session(self, frames: AsyncIterator[bytes], context: Context) -> None:
        # Headers at once: the client waits for them before its first batch.
        await context.send_initial_metadata(())
        stream = aiter(frames)
        async for first in self._sessions.headers(stream):
            t0 = self._batch_metrics.start()
            code = grpc.StatusCode.UNKNOWN
            try:
                namespace = await self._admit_batch(context, stream, first)
                request = request_of_frame(first, "the first frame of a session's batch")
                reply = await self._update(context, namespace, request, stream, False, last=False)
                await write(context, reply)
                code = grpc.StatusCode.OK
            except BaseException as exc:
                code = failure_code(context, exc)
                raise
            finally:
                self._batch_metrics.end(t0, code)

    async def _admit_batch(
        self, context: Context, stream: AsyncIterator[bytes], first: bytes
    ) -> Namespace:
        """The namespace of a session's next batch (`first`: its header). Its
        token may have been revoked since the last batch, and a namespace
        forgotten since (no items, no subscribers) comes back only within
        --max-namespaces; a batch refused is read to its end first, so that
        its client reads the refusal (server._sessions)."""
        try:
            refusal = self._authorize(context.invocation_metadata())
            if refusal is not None:
                raise refusal
            return self._namespace(context)
        except MMCacheError:
            await skip_batch(stream, chunks_declared(first))
            raise

    async def _update(
        self,
        context: Context,
        namespace: Namespace,
        request: pb.UpdateRequest,
        frames: AsyncIterator[bytes],
        in_metadata: bool,
        *,
        last: bool = True,
    ) -> bytes:
        """Apply one batch; its serialised reply. `last`: no frame may follow it."""
        self.drain_reports()  # leases given back before anything is evicted
        entries = parse_header(request, namespace.key)
        spare_sizes = slot_sizes(
            "the upload's spares", request.shm_spare_lengths, request.shm_spare_trailers
        )
        key = batch_key(namespace.name, request.batch_id)
        if key is None:
            return await self._apply(
                context, namespace, request, entries, spare_sizes, frames, in_metadata, last
            )
        if last:  # a call: perhaps a batch its session lost the reply of
            earlier = await self._replays.earlier(key)
            if earlier is not None:
                return earlier
        self._replays.start(key)
        reply = None
        try:
            reply = await self._apply(
                context, namespace, request, entries, spare_sizes, frames, in_metadata, last
            )
            return reply
        except asyncio.CancelledError:
            if not self._replays.superseded():
                raise
            raise AbortedError(
                "a copy of this batch (same batch_id) came as a call and took over: its "
                "reply answers the batch; this stream ends here"
            ) from None
        finally:
            self._replays.end(key, reply)

    async def _apply(
        self,
        context: Context,
        namespace: Namespace,
        request: pb.UpdateRequest,
        entries: list[EntryHeader],
        spare_sizes: list[tuple[int, int]],
        frames: AsyncIterator[bytes],
        in_metadata: bool,
        last: bool,
    ) -> bytes:
        """Receive and store one batch, and build its reply with no await after
        the store changed (server._replays relies on it)."""
        # Slots named are checked, and kept from expiry, before anything waits.
        claimed = self._claim(request.shm_token, entries)
        try:
            result = await self._receive(
                context, namespace, request, entries, frames, in_metadata, claimed, last
            )
        finally:
            self._unclaim(claimed)  # those a failed call never read
        blobs = result.metadata or [b""] * len(entries)
        for entry, outcome, blob in zip(entries, result.outcomes, blobs, strict=True):
            # A hit whose caller asked for its metadata and got none (stored
            # without, or left out of a full reply) is one it cannot use: it
            # processes the item, and counts a miss (as vLLM does).
            unusable = entry.want_metadata and outcome == Outcome.HIT and not blob
            counted = Outcome.MISSING if unusable else outcome
            self._count(entry.modality or self._modality_of(entry.key), counted, entry.resend)
        leased = request.lease != pb.LEASE_NONE
        # Only the caller's own evictions: another namespace's hashes are not its business.
        result = replace(result, evicted=namespace.hashes(result.evicted))
        seq = self._namespaces.seq_of(namespace)
        # After `seq`: what the spares push out of the cache comes by the feed.
        spares = self._spares(request.shm_token, spare_sizes, [e.key for e in entries])
        return build_reply(
            self._instance_id,
            self._store.capacity,
            self._store.max_items,
            seq,
            int(self._store.lease_s * 1000) if leased else 0,
            result,
            [slot_message(s) for s in spares],
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
        last: bool,
    ) -> BatchResult:
        """Wait for other calls' uploads of the hashes sent alone, read this call's
        data, and apply the batch once every byte has arrived and been checked."""
        # Past the wait the entry is simply MISSING and its sender re-sends it:
        # a stalled upload elsewhere never holds this call up for long.
        remaining = context.time_remaining()
        if request.timeout_ms:  # a session's batch says its time (a call's deadline does)
            said = request.timeout_ms / 1000
            remaining = said if remaining is None else min(remaining, said)
        loop = asyncio.get_running_loop()
        deadline = None if remaining is None else loop.time() + remaining
        # The client's own bound (its processing time): past it, it processes.
        said_wait = request.wait_ms / 1000 if request.wait_ms else None
        wait_s = UPLOAD_WAIT_S if said_wait is None else min(UPLOAD_WAIT_S, said_wait)
        if remaining is not None:
            wait_s = min(wait_s, remaining - ANSWER_MARGIN_S)
        alone = [e.key for e in entries if e.spec is None]
        waited = await self._pending.wait(alone, max(0.0, wait_s))
        if waited:
            self._metrics.upload_waits.inc(waited)
        payload = sum(e.payload for e in entries if e.chunks is not None)
        marked = self._pending.mark(data_hashes(entries))
        try:
            left = None if deadline is None else deadline - loop.time()
            pulled = await self._read_through(alone, left, wait_s=said_wait)
            # Made only now: an iterator never started (a call refused on its
            # header) would warn when collected. grpc hands back the same one.
            stream = aiter(frames)
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
                if last:
                    await check_no_surplus(stream, in_metadata)
                self._metrics.received_bytes.inc(payload)
                touches = namespace.keys(request.touches)
                # No await from here on: what came from L2 is in L1 when answered,
                # and its room is made without evicting what this batch names.
                batch = [e.key for e in entries]
                adopted = self._store.adopt(pulled, keep=batch) if pulled else []
                result = self._store.update(touches, uploads, lease=request.lease)
                self._write_behind(entries, result.outcomes)
                return replace(result, evicted=adopted + result.evicted) if adopted else result
        except TruncatedUploadError:
            # A client's cancel can end its stream here before grpc marks the
            # call cancelled: give it a moment to, so a cancel is counted as
            # one, and only a stream its client really closed early is refused.
            # (grpc's context has nothing to await for a cancel: it is polled.)
            grace_ends = loop.time() + TRUNCATION_GRACE_S
            while not context.cancelled() and loop.time() < grace_ends:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            raise
        finally:
            self._pending.settle(marked)

    async def _read_through(
        self,
        keys: Sequence[str],
        remaining: float | None,
        *,
        flight: bool = True,
        wait_s: float | None = None,
    ) -> list[tuple[str, StoredItem]]:
        """Items L1 lacks under `keys`, read from the L2 tier within the call's
        time (server._tier; `flight`: the caller processes what is missing)."""
        if self._l2 is None or not keys:
            return []
        absent = [key for key in dict.fromkeys(keys) if key not in self._store]
        budget = None if remaining is None else remaining - ANSWER_MARGIN_S
        return await self._l2.pull(absent, budget, flight=flight, wait_s=wait_s) if absent else []

    def _write_behind(self, entries: Sequence[EntryHeader], outcomes: Sequence[Outcome]) -> None:
        """Tell the L2 tier what this batch stored and found: its admission's sightings."""
        if self._l2 is None:
            return
        for entry, outcome in zip(entries, outcomes, strict=True):
            if outcome == Outcome.HIT:
                self._l2.hit(entry.key)
            elif outcome in (Outcome.STORED, Outcome.REPLACED):
                self._l2.stored(entry.key, replaced=outcome == Outcome.REPLACED)
            elif entry.spec is not None:  # data it could not keep: UNCACHED, withheld
                self._l2.not_stored(entry.key)

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
        resident = region.settle(slot, entry.key, entry.spec.SerializeToString(), entry.metadata)
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
        keys, items = await self._fetched(request, context)
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
        check_count("shm_done", len(request.shm_done))
        self.drain_reports()
        # The client's earlier reads first: their transient extents are free for this one.
        for hold in request.shm_done:
            region.release(hold)
        keys, items = await self._fetched(request, context)
        header = pb.FetchHeader(instance_id=self._instance_id)
        residents = self._residents(region, keys, items, request.shm_hold)
        if residents is None:
            return header  # no room: the client calls Fetch
        for mm_hash, item, resident in zip(request.mm_hashes, items, residents, strict=True):
            where = slot_message(resident.slot)
            if request.shm_hold:
                where.hold = region.hold(resident)
            header.items.add(mm_hash=mm_hash, item=item.spec, shm=where)
            self._metrics.sent_bytes.inc(item.payload)
        self._metrics.shm_bytes.labels("read").inc(sum(item.payload for item in items))
        if request.release:  # the reply says where every item is: the leases' promise is kept
            self._store.release(keys)
        return header

    async def _fetched(
        self, request: pb.FetchRequest, context: Context
    ) -> tuple[list[str], list[StoredItem]]:
        """The store keys of a read's hashes and their items, read through to the
        L2 tier for those L1 lacks; CacheMissError names the missing ones as the
        caller did."""
        namespace = self._namespace(context)
        keys = self._keys(namespace, request.mm_hashes)
        try:
            return keys, self._store.fetch(keys)
        except CacheMissError as exc:
            missing = exc.missing_hashes
        pulled = await self._read_through(missing, context.time_remaining(), flight=False)
        try:
            self._store.adopt(pulled, keep=keys)
            return keys, self._store.fetch(keys)
        except CacheMissError as exc:
            raise CacheMissError(namespace.hashes(exc.missing_hashes)) from None

    def _residents(
        self, region: Region, keys: Sequence[str], items: Sequence[StoredItem], hold: bool
    ) -> list[Resident] | None:
        """The items' extents in the region (those in the heap copied there:
        `_extent_for`); None when it has no room for all."""
        residents: list[Resident] = []
        for key, item in zip(keys, items, strict=True):
            if item.resident is not None:
                region.read(item.resident)
                residents.append(item.resident)
                continue
            spec = item.spec.SerializeToString()
            trailer = len(key.encode()) + len(spec) + len(item.metadata)
            slot = self._extent_for(region, key, item.payload, trailer, keys, hold)
            if slot is None:
                return None
            copy_payload(item.frames, region.payload(slot))
            if slot.kind == READ:
                self._metrics.shm_copies.labels("transient").inc()
                residents.append(Resident(region, slot))  # freed when its hold ends
                continue
            self._metrics.shm_copies.labels("in").inc()
            resident = region.settle(slot, key, spec, item.metadata)
            assert resident is not None  # allocated with room for its trailer
            self._store.make_resident(key, item, resident)
            residents.append(resident)
        return residents

    def _extent_for(
        self,
        region: Region,
        key: str,
        payload: int,
        trailer: int,
        keys: Sequence[str],
        hold: bool,
    ) -> Slot | None:
        """Where a read copies an item in the heap: an extent it moves into
        (ITEM; its frames then dropped), or a transient one (READ), the item
        staying in the heap; None when the region has no room.

        It moves in where there is room beside the reserve. Where there is
        not, a read that holds its extents (`hold`) gets a transient copy: a
        hot set larger than the region costs a copy per read, not a resident
        pushed out to the heap (a copy) and the item moved in (another) on
        every read. An item read again within the region's tenure takes the
        place of residents in for longer (a hot set that moved on), and where
        even the reserve is taken (other reads in flight) residents are moved
        out for the copy. Without `hold` (a client that never says done) the
        item moves in, as room is made."""
        if not hold:
            return self._allocate(region, payload, ITEM, trailer, keep=keys)
        region.need_read(payload)
        slot = region.allocate(payload, ITEM, trailer)
        if slot is None and region.read_again(key):
            slot = self._allocate(region, payload, ITEM, trailer, keep=keys, aged=True)
        if slot is None:
            slot = self._allocate(region, payload, READ, 0, keep=keys)
        return slot

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
