"""The gRPC face of the item cache (`mmcache.v1.MMCache`).

GetAndUpdate, GetAndUpdateOne and Fetch move tensor bytes, so their messages
are handled as raw `bytes`: protobuf parses only the header (an upload's
comes in the call's metadata when small, else as its first frame), and chunk
frames are checked by hand and kept as they came (see mmcache._frames).
GetAndUpdateOne is GetAndUpdate with its one frame (or none) as a unary
request, and runs the same code. Subscribe streams the feed's messages,
serialised once by the feed for every subscriber. The other methods are
ordinary protobuf.

Uploads of one hash from two calls at once: the first call's header marks
the hash pending (and the feed says so); a call that names a pending hash
without data waits for that upload to end, then finds it held. A client
whose mirror saw the pending mark sends the hash alone, so the bytes travel
once. A second call that already sends data is stored over the first
(REPLACED): both succeed, the item is stored once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mmcache._errors import InvalidArgumentError
from mmcache._frames import (
    HEADER_TAG,
    MAX_CHUNK_BYTES,
    UPDATE_HEADER_KEY,
    chunk_payload_offset,
    header_frame,
    header_frame_body,
)
from mmcache._lru import Outcome
from mmcache._spec import MAX_METADATA_BYTES, check_name, item_size
from mmcache.metrics import CacheMetrics
from mmcache.v1 import cache_pb2 as pb

from ._feed import Feed
from ._inflight import InflightBudget
from ._status import guard
from ._store import BatchResult, ItemStore, StoredItem, UploadEntry

__all__ = ["SERVICE_NAME", "CacheServicer"]

_LOGGER = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MMCache"].full_name

Context = grpc.aio.ServicerContext[Any, Any]


class CacheServicer:
    """Handlers of `mmcache.v1.MMCache` over an `ItemStore`."""

    def __init__(
        self,
        store: ItemStore,
        inflight: InflightBudget,
        metrics: CacheMetrics,
        feed: Feed,
        instance_id: str,
        version: str,
    ) -> None:
        self._store = store
        self._inflight = inflight
        self._metrics = metrics
        self._feed = feed
        self._instance_id = instance_id
        self._version = version
        # Hashes whose upload has begun and not ended, with what ends it.
        self._pending: dict[str, asyncio.Future[None]] = {}

    @property
    def pending(self) -> list[str]:
        """Hashes being uploaded now."""
        return list(self._pending)

    def handler(self) -> grpc.GenericRpcHandler:
        g = guard(self._instance_id)
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Info": grpc.unary_unary_rpc_method_handler(
                g(self.info),
                request_deserializer=pb.InfoRequest.FromString,
                response_serializer=pb.InfoReply.SerializeToString,
            ),
            # Raw bytes in and out: see the module docstring.
            "GetAndUpdate": grpc.stream_unary_rpc_method_handler(g(self.get_and_update)),
            "GetAndUpdateOne": grpc.unary_unary_rpc_method_handler(g(self.get_and_update_one)),
            "Fetch": grpc.unary_stream_rpc_method_handler(g(self.fetch)),
            "Touch": grpc.unary_unary_rpc_method_handler(
                g(self.touch),
                request_deserializer=pb.TouchRequest.FromString,
                response_serializer=pb.TouchReply.SerializeToString,
            ),
            "Clear": grpc.unary_unary_rpc_method_handler(
                g(self.clear),
                request_deserializer=pb.ClearRequest.FromString,
                response_serializer=pb.ClearReply.SerializeToString,
            ),
            "Release": grpc.unary_unary_rpc_method_handler(
                g(self.release),
                request_deserializer=pb.ReleaseRequest.FromString,
                response_serializer=pb.ReleaseReply.SerializeToString,
            ),
            # The feed serialises each message once for every subscriber.
            "Subscribe": grpc.unary_stream_rpc_method_handler(g(self.subscribe)),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    async def info(self, request: pb.InfoRequest, context: Context) -> pb.InfoReply:
        return pb.InfoReply(
            instance_id=self._instance_id,
            capacity_bytes=self._store.capacity,
            version=self._version,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            items=len(self._store),
            used_bytes=self._store.used,
            max_items=self._store.max_items,
        )

    async def touch(self, request: pb.TouchRequest, context: Context) -> pb.TouchReply:
        for h in request.mm_hashes:
            check_name("mm_hash", h)
        return pb.TouchReply(
            instance_id=self._instance_id, touched=self._store.touch(request.mm_hashes)
        )

    async def clear(self, request: pb.ClearRequest, context: Context) -> pb.ClearReply:
        removed, kept = self._store.clear()
        _LOGGER.info("cache cleared: %d items removed, %d leased items kept", removed, kept)
        return pb.ClearReply(instance_id=self._instance_id, removed=removed, kept_leased=kept)

    async def release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseReply:
        for h in request.mm_hashes:
            check_name("mm_hash", h)
        return pb.ReleaseReply(
            instance_id=self._instance_id, released=self._store.release(request.mm_hashes)
        )

    async def subscribe(self, request_bytes: bytes, context: Context) -> None:
        try:
            pb.SubscribeRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgumentError(f"SubscribeRequest does not parse: {exc}") from None
        subscriber = self._feed.subscribe()
        try:
            async for message in subscriber.messages():
                await context.write(message)
        finally:
            self._feed.unsubscribe(subscriber)

    async def get_and_update(self, frames: AsyncIterator[bytes], context: Context) -> bytes:
        request = _metadata_header(context)
        in_metadata = request is not None
        if request is None:
            request = _parse_header(await anext(frames, None))
        plan = [_plan_entry(i, entry) for i, entry in enumerate(request.entries)]
        for h in request.touches:
            check_name("touched mm_hash", h)
        await self._await_uploads(
            [e.mm_hash for e, p in zip(request.entries, plan, strict=True) if not p.spec_present],
            context,
        )
        # Registered only after waiting: a call never waits while it holds a
        # mark another call may be waiting for, so no two calls wait on each other.
        mine = self._mark_pending(
            [e.mm_hash for e, p in zip(request.entries, plan, strict=True) if p.chunks is not None]
        )
        try:
            result = await self._receive_and_apply(request, plan, frames, in_metadata)
        finally:
            self._settle(mine)
        reply = pb.UpdateReply(
            instance_id=self._instance_id,
            capacity_bytes=self._store.capacity,
            max_items=self._store.max_items,
            outcomes=[o.value for o in result.outcomes],  # type: ignore[misc]
            sizes=result.sizes,
            seq=self._feed.seq,
            evicted=result.evicted,
            evicted_truncated=result.evicted_truncated,
            metadata=result.metadata or (),
            lease_ms=int(self._store.lease_s * 1000) if request.lease != pb.LEASE_NONE else 0,
        )
        for entry, outcome in zip(request.entries, result.outcomes, strict=True):
            self._count(entry, outcome)
        return reply.SerializeToString()

    async def _receive_and_apply(
        self,
        request: pb.UpdateRequest,
        plan: list[_EntryPlan],
        frames: AsyncIterator[bytes],
        in_metadata: bool,
    ) -> BatchResult:
        payload = sum(p.payload for p in plan if p.chunks is not None)
        # Made only now: an iterator never started (a call refused on its
        # header) would warn when collected. grpc hands back the same one.
        stream = aiter(frames)
        # Nothing is stored until every byte has arrived and been checked, so
        # a cancelled or malformed upload leaves the cache as it was.
        async with self._inflight.reserve(payload):
            for i, p in enumerate(plan):
                if p.chunks is not None:
                    p.frames = await _read_chunks(stream, i, request.entries[i], p)
            surplus = await anext(stream, None)
            if surplus is not None:
                raise InvalidArgumentError(_surplus_message(surplus, in_metadata))
            self._metrics.received_bytes.inc(payload)
            entries = [p.to_upload_entry(request.entries[i]) for i, p in enumerate(plan)]
            return self._store.update(request.touches, entries, lease=request.lease)

    async def _await_uploads(self, mm_hashes: Sequence[str], context: Context) -> None:
        """Wait, within the call's deadline, for other calls' uploads of these hashes."""
        waits = {self._pending[h] for h in mm_hashes if h in self._pending}
        if not waits:
            return
        self._metrics.upload_waits.inc(len(waits))
        remaining = context.time_remaining()
        # Leave the call time to answer; past that the entry is simply MISSING.
        timeout = None if remaining is None else max(0.0, remaining - 0.05)
        await asyncio.wait(waits, timeout=timeout)

    def _mark_pending(self, mm_hashes: Sequence[str]) -> list[str]:
        mine: list[str] = []
        loop = asyncio.get_running_loop()
        for h in mm_hashes:
            if h not in self._pending:
                self._pending[h] = loop.create_future()
                self._feed.emit(pb.CHANGE_PENDING, h)
                mine.append(h)
        return mine

    def _settle(self, mine: Sequence[str]) -> None:
        for h in mine:
            self._pending.pop(h).set_result(None)
            self._feed.emit(pb.CHANGE_SETTLED, h)

    async def get_and_update_one(self, frame: bytes, context: Context) -> bytes:
        return await self.get_and_update(_frames_of(frame), context)

    async def fetch(self, request_bytes: bytes, context: Context) -> None:
        try:
            request = pb.FetchRequest.FromString(request_bytes)
        except DecodeError as exc:
            raise InvalidArgumentError(f"FetchRequest does not parse: {exc}") from None
        for h in request.mm_hashes:
            check_name("mm_hash", h)
        items = self._store.fetch(request.mm_hashes)
        header = pb.FetchHeader(instance_id=self._instance_id)
        for mm_hash, item in zip(request.mm_hashes, items, strict=True):
            header.items.add(mm_hash=mm_hash, item=item.spec, num_chunks=len(item.frames))
        await context.write(header_frame(header.SerializeToString()))
        # The frames are the very objects that arrived: held references keep
        # them alive even if the items are evicted meanwhile.
        for item in items:
            for frame in item.frames:
                await context.write(frame)
            self._metrics.sent_bytes.inc(item.payload)
        if request.release:  # read to the end: the leases' promise is kept
            self._store.release(request.mm_hashes)

    def _count(self, entry: pb.UpdateEntry, outcome: Outcome) -> None:
        if entry.resend:
            self._metrics.resends.labels(entry.modality or "unknown").inc()
        else:
            self._metrics.queried(entry.modality, hit=outcome in (Outcome.HIT, Outcome.REPLACED))
        if outcome == Outcome.UNCACHED:
            self._metrics.uncached.labels(entry.modality or "unknown").inc()


class _EntryPlan:
    """What the header says one entry brings, checked before any byte is read."""

    __slots__ = ("charged", "chunks", "frames", "payload", "spec_present", "withheld")

    # charged: the item's size plus its metadata's, what the LRU charges

    def __init__(self, entry: pb.UpdateEntry, index: int) -> None:
        self.spec_present = entry.HasField("item")
        self.withheld = entry.withheld
        self.payload = 0
        self.charged = 0
        self.chunks: int | None = None  # chunk frames to read; None: no data follows
        self.frames: tuple[bytes, ...] = ()
        where = f"entry {index} ({entry.mm_hash!r})"
        if not self.spec_present:
            if entry.withheld or entry.num_chunks or entry.resend or entry.metadata:
                raise InvalidArgumentError(
                    f"{where} has no item spec, so withheld, num_chunks, resend and metadata "
                    "must be unset"
                )
            return
        if len(entry.metadata) > MAX_METADATA_BYTES:
            raise InvalidArgumentError(
                f"{where} carries {len(entry.metadata)} bytes of metadata; the limit is "
                f"{MAX_METADATA_BYTES} ({MAX_METADATA_BYTES // 1024} KiB): store less per item"
            )
        try:
            size = item_size(entry.item)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
        self.payload, self.charged = size.payload, size.charged + len(entry.metadata)
        if entry.withheld:
            if entry.num_chunks:
                raise InvalidArgumentError(f"{where} is withheld but declares chunks")
            return
        least = -(-size.payload // MAX_CHUNK_BYTES)
        if not least <= entry.num_chunks <= size.payload:
            raise InvalidArgumentError(
                f"{where}: {size.payload} payload bytes cannot travel in {entry.num_chunks} "
                f"chunks of 1 to {MAX_CHUNK_BYTES} bytes (need {least} to {size.payload})"
            )
        self.chunks = entry.num_chunks

    def to_upload_entry(self, entry: pb.UpdateEntry) -> UploadEntry:
        if not self.spec_present:
            return UploadEntry(entry.mm_hash, want_metadata=entry.want_metadata)
        if self.withheld:
            return UploadEntry(entry.mm_hash, withheld=True)
        item = StoredItem(entry.item, self.frames, self.payload, self.charged, entry.metadata)
        return UploadEntry(entry.mm_hash, item)


def _plan_entry(index: int, entry: pb.UpdateEntry) -> _EntryPlan:
    check_name(f"mm_hash of entry {index}", entry.mm_hash)
    check_name(f"modality of entry {index}", entry.modality, allow_empty=True)
    return _EntryPlan(entry, index)


async def _frames_of(request: bytes) -> AsyncIterator[bytes]:
    """A GetAndUpdateOne request as the frames of a GetAndUpdate: it or none."""
    if request:  # a frame is never empty: it holds at least a tag and a length
        yield request


def _metadata_header(context: Context) -> pb.UpdateRequest | None:
    """The request the call's metadata carries, if it carries one."""
    for key, value in context.invocation_metadata() or ():
        if key == UPDATE_HEADER_KEY and isinstance(value, bytes):  # "-bin" values are bytes
            try:
                return pb.UpdateRequest.FromString(value)
            except DecodeError as exc:
                raise InvalidArgumentError(
                    f"the {UPDATE_HEADER_KEY} metadata is not a serialised UpdateRequest: {exc}"
                ) from None
    return None


def _surplus_message(frame: bytes, header_in_metadata: bool) -> str:
    if header_in_metadata and frame[:1] == bytes((HEADER_TAG,)):
        return (
            f"a header frame arrived, but the header came as {UPDATE_HEADER_KEY} metadata: "
            "send one or the other"
        )
    return "more chunk frames arrived than the header's num_chunks declare"


def _parse_header(frame: bytes | None) -> pb.UpdateRequest:
    """The request in the first frame (when the metadata carried none)."""
    what = f"the first GetAndUpdate frame (the call has no {UPDATE_HEADER_KEY} metadata)"
    if frame is None:
        raise InvalidArgumentError(f"GetAndUpdate got no header: {what} is missing")
    body = header_frame_body(frame, what)
    try:
        return pb.UpdateRequest.FromString(body)
    except DecodeError as exc:
        raise InvalidArgumentError(f"the header does not parse: {exc}") from None


async def _read_chunks(
    stream: AsyncIterator[bytes], index: int, entry: pb.UpdateEntry, plan: _EntryPlan
) -> tuple[bytes, ...]:
    assert plan.chunks is not None
    frames: list[bytes] = []
    received = 0
    for n in range(plan.chunks):
        frame = await anext(stream, None)
        if frame is None:
            raise InvalidArgumentError(
                f"the upload ended after {n} of the {plan.chunks} chunks of entry {index} "
                f"({entry.mm_hash!r})"
            )
        length = len(frame) - chunk_payload_offset(frame)
        if not 0 < length <= MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"chunk {n} of entry {index} carries {length} bytes; chunks carry 1 to "
                f"{MAX_CHUNK_BYTES}"
            )
        received += length
        frames.append(frame)
    if received != plan.payload:
        raise InvalidArgumentError(
            f"entry {index} ({entry.mm_hash!r}) declares {plan.payload} payload bytes "
            f"(from its dtypes and shapes) but its {plan.chunks} chunks carry {received}"
        )
    return tuple(frames)
