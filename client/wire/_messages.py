"""The MMCache service's messages to and from the client's values (`_types`):
the one place where the client writes or reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from mmcache._errors import InvalidArgumentError
from mmcache._lru import Outcome
from mmcache.v1 import cache_pb2 as pb

from ._spec import Spec
from ._types import (
    Allocated,
    Cleared,
    FeedChanges,
    FeedMessage,
    FeedSnapshot,
    Fetched,
    FetchedItem,
    Lease,
    Located,
    RegionInfo,
    Reply,
    Report,
    ServerInfo,
    Slot,
    Tier,
    UpdateEntry,
)

__all__ = [
    "allocated_of",
    "cleared_of",
    "feed_message_of",
    "fetch_request",
    "info_of",
    "located_of",
    "parse_fetched",
    "reply_of",
    "report_bytes",
    "report_message",
    "update_header",
]

_TIERS: dict[int, Tier] = {pb.TIER_L1: "l1", pb.TIER_L2: "l2"}


def lease_mode(lease: Lease) -> pb.LeaseMode.ValueType:
    if lease == "hits":
        return pb.LEASE_HITS
    if lease is True:
        return pb.LEASE_HELD
    if lease is False:
        return pb.LEASE_NONE
    raise InvalidArgumentError(f"lease must be True, False or 'hits', got {lease!r}")


def _slot(slot: pb.ShmSlot) -> Slot:
    return Slot(slot.offset, slot.length, slot.lease, slot.hold)


def _slot_message(slot: Slot) -> pb.ShmSlot:
    return pb.ShmSlot(offset=slot.offset, length=slot.length, lease=slot.lease, hold=slot.hold)


# ServerInfo's fields and Report's (but one each) are the messages' own, by name.
_INFO = tuple(f.name for f in dataclasses.fields(ServerInfo) if f.name != "region")
_REPORT = tuple(f.name for f in dataclasses.fields(Report) if f.name != "shm_leases")


def info_of(reply: pb.InfoReply) -> ServerInfo:
    shm = reply.shm
    region = (
        RegionInfo(shm.path, shm.size_bytes, shm.region_id, shm.posted_uploads)
        if reply.HasField("shm")
        else None
    )
    return ServerInfo(**{name: getattr(reply, name) for name in _INFO}, region=region)


def cleared_of(reply: pb.ClearReply) -> Cleared:
    return Cleared(reply.instance_id, reply.seq, reply.removed, reply.kept_leased)


def located_of(reply: pb.LocateReply) -> Located:
    return Located(reply.instance_id, [_TIERS.get(t) for t in reply.tiers], list(reply.sizes))


def allocated_of(reply: pb.ShmAllocateReply) -> Allocated:
    return Allocated(reply.instance_id, [_slot(s) for s in reply.slots])


def fetch_request(
    mm_hashes: Sequence[str],
    release: bool,
    *,
    shm_token: bytes = b"",
    shm_hold: bool = False,
    shm_done: Sequence[int] = (),
) -> pb.FetchRequest:
    """A Fetch, or (with the region's token) a ReadShm, its extents held or not."""
    return pb.FetchRequest(
        mm_hashes=mm_hashes,
        release=release,
        shm_token=shm_token,
        shm_hold=shm_hold,
        shm_done=shm_done,
    )


def parse_fetched(raw: bytes) -> Fetched:
    """A serialised FetchHeader (a Fetch's first frame, a ReadShm's reply)."""
    try:
        header = pb.FetchHeader.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(f"the Fetch reply's header does not parse: {exc}") from None
    return Fetched(
        header.instance_id,
        [
            FetchedItem(
                item.mm_hash,
                Spec(item.item),
                item.num_chunks,
                _slot(item.shm) if item.HasField("shm") else None,
            )
            for item in header.items
        ],
    )


def report_message(report: Report) -> pb.ReleaseRequest:
    # Only the fields it sets: a ring's reports say one or two things each,
    # and every field passed costs protobuf the same, empty or not.
    fields = {name: value for name in _REPORT if (value := getattr(report, name))}
    if report.shm_leases:
        fields["shm_leases"] = [pb.ShmLease(mm_hash=h, generation=g) for h, g in report.shm_leases]
    return pb.ReleaseRequest(**fields)


def report_bytes(report: Report) -> bytes:
    """A report as a ring's record holds it (empty when it says nothing)."""
    return report_message(report).SerializeToString()


def update_header(
    entries: Sequence[UpdateEntry],
    touches: Sequence[str],
    *,
    lease: Lease,
    shm_token: bytes = b"",
    spares: Sequence[tuple[int, int]] = (),
    wait_ms: int = 0,
    claim_ms: int = 0,
) -> bytes:
    """A serialised UpdateRequest: a GetAndUpdate's header.

    `shm_token` goes when an entry names a slot or `spares` asks for write
    slots ((payload, trailer) sizes) with the reply."""
    named = any(entry.slot is not None for entry in entries)
    request = pb.UpdateRequest(
        touches=touches,
        lease=lease_mode(lease),
        shm_token=shm_token if named or spares else b"",
        shm_spare_lengths=[length for length, _ in spares],
        shm_spare_trailers=[trailer for _, trailer in spares],
        wait_ms=wait_ms,
        claim_ms=claim_ms,
    )
    for entry in entries:
        wire = request.entries.add(
            mm_hash=entry.mm_hash,
            modality=entry.modality,
            resend=entry.resend,
            want_metadata=entry.want_metadata,
        )
        if entry.spec is None:
            continue
        wire.item.CopyFrom(entry.spec.message)
        if entry.withheld:
            wire.withheld = True
            continue
        wire.metadata = entry.metadata
        if entry.slot is not None:
            wire.shm.CopyFrom(_slot_message(entry.slot))
            continue
        wire.num_chunks = entry.num_chunks
    return request.SerializeToString()


def reply_of(reply: pb.UpdateReply) -> Reply:
    return Reply(
        instance_id=reply.instance_id,
        capacity=reply.capacity_bytes,
        max_items=reply.max_items,
        seq=reply.seq,
        outcomes=[Outcome(o) for o in reply.outcomes],
        sizes=list(reply.sizes),
        evicted=list(reply.evicted),
        metadata=list(reply.metadata) if reply.metadata else None,
        spares=[_slot(s) for s in reply.shm_spares],
    )


def feed_message_of(message: pb.FeedMessage) -> FeedMessage:
    body = message.WhichOneof("body")
    if body == "changes":
        changes = message.changes
        return FeedMessage(
            message.instance_id,
            message.seq,
            changes=FeedChanges(list(changes.kinds), list(changes.mm_hashes), list(changes.sizes)),
        )
    if body == "snapshot":
        part = message.snapshot
        return FeedMessage(
            message.instance_id,
            message.seq,
            snapshot=FeedSnapshot(
                list(part.mm_hashes),
                list(part.sizes),
                list(part.pending),
                part.last,
                part.capacity_bytes,
                part.max_items,
            ),
        )
    return FeedMessage(message.instance_id, message.seq)
