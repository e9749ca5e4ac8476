"""GetAndUpdate's messages on the server: the header, the chunk frames, the reply.

The header comes from the call's metadata or its first frame; `parse_header`
turns each of its entries into one frozen `EntryHeader`, checked before any
byte is read, its spec kept as the bytes it came in (the data plane never
reads protobuf); `read_chunks` reads one entry's frames, checked as
server/cache/_entries.py checks every item's frames; `build_reply` writes the
answer. No other module reads or writes these wire messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mmcache._errors import InvalidArgumentError
from mmcache._frames import (
    HEADER_TAG,
    MAX_CHUNK_BYTES,
    UPDATE_HEADER_KEY,
    header_frame_body,
)
from mmcache._spec import MAX_METADATA_BYTES, check_count, check_name, item_size
from mmcache.v1 import cache_pb2 as pb

from ._namespaces import Namespace
from .cache import (
    BatchResult,
    Deadline,
    EntryHeader,
    Lease,
    ShmRef,
    Slot,
    check_received,
    chunk_length,
)

__all__ = [
    "Batch",
    "TruncatedUploadError",
    "build_reply",
    "check_no_surplus",
    "check_posted",
    "chunks_declared",
    "entry_header",
    "frames_of",
    "grace_for_cancel",
    "header_metadata",
    "parse_header",
    "read_chunks",
    "read_request",
    "request_of_frame",
    "slot_message",
    "slot_sizes",
    "times_of",
]

Context = grpc.aio.ServicerContext[Any, Any]

_LEASE_MODES = frozenset(int(mode) for mode in Lease)

# How long a stream that ended mid-upload is given to show its client's cancel.
TRUNCATION_GRACE_S = 0.5


class TruncatedUploadError(InvalidArgumentError):
    """The stream ended before the chunks its header declared: a client's bug,
    or (more often) a client that cancelled, seen before grpc reports it."""


@dataclass(frozen=True)
class Batch:
    """One GetAndUpdate batch as the servicer handles it: its namespace, its
    header parsed, and the frames its data comes in."""

    namespace: Namespace
    request: pb.UpdateRequest
    entries: list[EntryHeader]
    frames: AsyncIterator[bytes]
    in_metadata: bool  # its header came in the call's metadata, not as a frame
    last: bool  # no frame may follow it (a call; a session's batch has more after it)


async def read_request(
    context: Context, frames: AsyncIterator[bytes]
) -> tuple[pb.UpdateRequest, bool]:
    """The call's UpdateRequest, and whether it came as metadata (else as the first frame)."""
    value = header_metadata(context)
    if value is not None:
        try:
            return pb.UpdateRequest.FromString(value), True
        except DecodeError as exc:
            raise InvalidArgumentError(
                f"the {UPDATE_HEADER_KEY} metadata is not a serialised UpdateRequest: {exc}"
            ) from None
    what = f"the first GetAndUpdate frame (the call has no {UPDATE_HEADER_KEY} metadata)"
    frame = await anext(frames, None)
    if frame is None:
        raise InvalidArgumentError(f"GetAndUpdate got no header: {what} is missing")
    return request_of_frame(frame, what), False


def header_metadata(context: Context) -> bytes | None:
    """The call's header metadata, if it has one."""
    for key, value in context.invocation_metadata() or ():
        if key == UPDATE_HEADER_KEY and isinstance(value, bytes):  # "-bin" values are bytes
            return value
    return None


def request_of_frame(frame: bytes, what: str) -> pb.UpdateRequest:
    """The UpdateRequest of a header frame; `what` names the frame in errors."""
    try:
        return pb.UpdateRequest.FromString(header_frame_body(frame, what))
    except DecodeError as exc:
        raise InvalidArgumentError(f"the header does not parse: {exc}") from None


def check_posted(header: bytes) -> pb.UpdateRequest:
    """The UpdateRequest of an upload posted in a report ring, checked for what
    only a call could answer: every entry's payload in a write slot, nothing
    leased, no spares, no claims (nobody reads a reply)."""
    try:
        request = pb.UpdateRequest.FromString(header)
    except DecodeError as exc:
        raise InvalidArgumentError(f"a posted upload's header does not parse: {exc}") from None
    if (
        request.lease != pb.LEASE_NONE
        or request.claim_ms
        or request.shm_spare_lengths
        or request.batch_id
    ):
        raise InvalidArgumentError(
            "a posted upload leases, claims, asks for spares or names a batch_id, which "
            "only a call answers: post it with lease LEASE_NONE and none of them, or send "
            "it by call"
        )
    if not request.entries:
        raise InvalidArgumentError("a posted upload has no entries: post uploads only")
    for index, entry in enumerate(request.entries):
        if not (entry.HasField("item") and entry.HasField("shm")):
            raise InvalidArgumentError(
                f"entry {index} ({entry.mm_hash!r}) of a posted upload has no item in a "
                "write slot: a posted upload's payloads are all in the region (a hash "
                "alone asks a question only a reply answers); send others by call"
            )
    return request


def chunks_declared(frame: bytes) -> int:
    """The chunk frames a header frame says follow it; 0 if it does not parse."""
    try:
        request = request_of_frame(frame, "a header")
    except InvalidArgumentError:
        return 0
    return sum(entry.num_chunks for entry in request.entries)


def parse_header(
    request: pb.UpdateRequest, key_of: Callable[[str], str] = str
) -> list[EntryHeader]:
    """Check the touches and every entry; raises InvalidArgumentError naming the fault.

    `key_of` gives the store's key of a hash (its namespace's).
    """
    check_count("touches", len(request.touches))
    check_count("entries", len(request.entries))
    if request.lease not in _LEASE_MODES:
        raise InvalidArgumentError(
            f"lease mode {request.lease} is not one this server knows: give LEASE_NONE, "
            "LEASE_HELD or LEASE_HITS"
        )
    for h in request.touches:
        check_name("touched mm_hash", h)
    return [entry_header(i, entry, key_of) for i, entry in enumerate(request.entries)]


def entry_header(index: int, entry: pb.UpdateEntry, key_of: Callable[[str], str]) -> EntryHeader:
    """Entry `index` of a header, checked (an upload's, or an L2 record's manifest)."""
    check_name(f"mm_hash of entry {index}", entry.mm_hash)
    check_name(f"modality of entry {index}", entry.modality, allow_empty=True)
    where = f"entry {index} ({entry.mm_hash!r})"
    if not entry.HasField("item"):
        if entry.withheld or entry.num_chunks or entry.resend or entry.metadata:
            raise InvalidArgumentError(
                f"{where} has no item spec, so withheld, num_chunks, resend and metadata "
                "must be unset"
            )
        return EntryHeader(
            index=index,
            mm_hash=entry.mm_hash,
            key=key_of(entry.mm_hash),
            modality=entry.modality,
            spec=None,
            chunks=None,
            payload=0,
            charged=0,
            withheld=False,
            resend=False,
            metadata=b"",
            want_metadata=entry.want_metadata,
        )
    if len(entry.metadata) > MAX_METADATA_BYTES:
        raise InvalidArgumentError(
            f"{where} carries {len(entry.metadata)} bytes of metadata; the limit is "
            f"{MAX_METADATA_BYTES} ({MAX_METADATA_BYTES // 1024} KiB): store less per item"
        )
    try:
        size = item_size(entry.item)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None
    return EntryHeader(
        index=index,
        mm_hash=entry.mm_hash,
        key=key_of(entry.mm_hash),
        modality=entry.modality,
        spec=entry.item.SerializeToString(),
        chunks=_chunks_of(entry, size.payload, where),
        payload=size.payload,
        charged=size.charged + len(entry.metadata),
        withheld=entry.withheld,
        resend=entry.resend,
        metadata=entry.metadata,
        want_metadata=entry.want_metadata,
        shm=_shm_ref(entry.shm) if entry.HasField("shm") else None,
        item_modality=entry.item.fields[0].modality if entry.item.fields else "",
    )


def _shm_ref(slot: pb.ShmSlot) -> ShmRef:
    return ShmRef(slot.offset, slot.length, slot.lease)


def _chunks_of(entry: pb.UpdateEntry, payload: int, where: str) -> int | None:
    """The chunk frames that follow an entry with a spec (0: its payload is in a
    region slot; None: withheld, none follow), checked against its payload."""
    if entry.withheld:
        if entry.num_chunks or entry.HasField("shm"):
            raise InvalidArgumentError(f"{where} is withheld but declares chunks or a slot")
        return None
    if entry.HasField("shm"):
        if entry.num_chunks or entry.shm.length != payload:
            raise InvalidArgumentError(
                f"{where} names a shared-memory slot of {entry.shm.length} bytes for "
                f"{payload} payload bytes, with {entry.num_chunks} chunks (must be 0)"
            )
        return 0
    least = -(-payload // MAX_CHUNK_BYTES)
    if not least <= entry.num_chunks <= payload:
        raise InvalidArgumentError(
            f"{where}: {payload} payload bytes cannot travel in {entry.num_chunks} "
            f"chunks of 1 to {MAX_CHUNK_BYTES} bytes (need {least} to {payload})"
        )
    return entry.num_chunks


async def read_chunks(stream: AsyncIterator[bytes], entry: EntryHeader) -> tuple[bytes, ...]:
    """The chunk frames of one entry, each checked, their bytes totalled."""
    assert entry.chunks is not None
    frames: list[bytes] = []
    received = 0
    for n in range(entry.chunks):
        frame = await anext(stream, None)
        if frame is None:
            raise TruncatedUploadError(
                f"the upload ended after {n} of the {entry.chunks} chunks of {entry.where}"
            )
        received += chunk_length(frame, n, entry)
        frames.append(frame)
    check_received(received, entry)
    return tuple(frames)


async def check_no_surplus(stream: AsyncIterator[bytes], header_in_metadata: bool) -> None:
    """Fail when frames follow the last declared chunk."""
    frame = await anext(stream, None)
    if frame is None:
        return
    if header_in_metadata and frame[:1] == bytes((HEADER_TAG,)):
        raise InvalidArgumentError(
            f"a header frame arrived, but the header came as {UPDATE_HEADER_KEY} metadata: "
            "send one or the other"
        )
    raise InvalidArgumentError("more chunk frames arrived than the header's num_chunks declare")


def build_reply(
    instance_id: str,
    capacity: int,
    max_items: int,
    seq: int,
    lease_ms: int,
    result: BatchResult,
    spares: Sequence[pb.ShmSlot] = (),
) -> bytes:
    return pb.UpdateReply(
        instance_id=instance_id,
        capacity_bytes=capacity,
        max_items=max_items,
        outcomes=[o.value for o in result.outcomes],  # type: ignore[misc]
        sizes=result.sizes,
        seq=seq,
        evicted=result.evicted,
        evicted_truncated=result.evicted_truncated,
        metadata=result.metadata or (),
        metadata_truncated=result.metadata_truncated,
        lease_ms=lease_ms,
        shm_spares=spares,
    ).SerializeToString()


def slot_sizes(what: str, lengths: Sequence[int], trailers: Sequence[int]) -> list[tuple[int, int]]:
    """The (payload, trailer) sizes of the write slots a request asks for,
    checked: one trailer per length, or none (no room after the payloads)."""
    check_count(f"{what} lengths", len(lengths))
    if trailers and len(trailers) != len(lengths):
        raise InvalidArgumentError(
            f"{what} name {len(lengths)} lengths but {len(trailers)} trailers: give one "
            "per length, or none"
        )
    return list(zip(lengths, trailers or [0] * len(lengths), strict=True))


def slot_message(slot: Slot) -> pb.ShmSlot:
    return pb.ShmSlot(offset=slot.offset, length=slot.length, lease=slot.lease)


async def frames_of(request: bytes) -> AsyncIterator[bytes]:
    """A GetAndUpdateOne request as the frames of a GetAndUpdate: it or none."""
    if request:  # a frame is never empty: it holds at least a tag and a length
        yield request


def times_of(request: pb.UpdateRequest, remaining_s: float | None) -> tuple[Deadline, float | None]:
    """A batch's deadline (a session's batch says its time; a call's deadline
    does), and the client's own bound on its waits (its processing time: past
    it, it processes)."""
    said = request.timeout_ms / 1000 if request.timeout_ms else None
    said_wait = request.wait_ms / 1000 if request.wait_ms else None
    return Deadline.within(remaining_s, said), said_wait


async def grace_for_cancel(context: Context) -> None:
    """A client's cancel can end its stream mid-upload before grpc marks the
    call cancelled: give it a moment to, so a cancel is counted as one, and
    only a stream its client really closed early is refused. (grpc's context
    has nothing to await for a cancel: it is polled.)"""
    loop = asyncio.get_running_loop()
    grace_ends = loop.time() + TRUNCATION_GRACE_S
    while not context.cancelled() and loop.time() < grace_ends:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
