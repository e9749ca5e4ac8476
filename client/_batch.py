"""GetAndUpdate's messages on the client: a batch's header and frames, its reply.

The client decides what each entry carries (`Entry`); this module alone
turns that into the wire's `UpdateRequest` and chunk frames, and the
server's `UpdateReply` back into a checked `Reply`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from mmcache._errors import InvalidArgumentError
from mmcache._frames import MAX_MESSAGE_BYTES
from mmcache._lru import Outcome
from mmcache._spec import check_count
from mmcache.v1 import cache_pb2 as pb

from ._codec import EncodedItem, iter_chunk_frames, num_chunks

__all__ = ["Batch", "Entry", "Lease", "Reply", "build_batch", "lease_mode", "read_reply"]

# A header must fit one message, with room for the frame's own prefix.
MAX_HEADER_BYTES = MAX_MESSAGE_BYTES - 1024

# What a call leases: True (every item held or stored), "hits" (only those
# returned as None, which the engine must read), or False.
Lease = bool | Literal["hits"]


def lease_mode(lease: Lease) -> pb.LeaseMode.ValueType:
    if lease == "hits":
        return pb.LEASE_HITS
    if lease is True:
        return pb.LEASE_HELD
    if lease is False:
        return pb.LEASE_NONE
    raise InvalidArgumentError(f"lease must be True, False or 'hits', got {lease!r}")


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry as it will travel."""

    mm_hash: str
    modality: str  # the metrics label
    data: EncodedItem | None = None  # None: the hash alone
    withheld: bool = False  # data larger than the whole cache: its spec only
    metadata: bytes = b""
    want_metadata: bool = False
    resend: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    header: bytes  # a serialised UpdateRequest
    sending: tuple[EncodedItem, ...]  # whose chunk frames follow, in order
    chunk_bytes: int

    def frames(self) -> Iterator[bytes]:
        for encoded in self.sending:
            yield from iter_chunk_frames(encoded, self.chunk_bytes)


@dataclass(frozen=True, slots=True)
class Reply:
    """What the server did with a batch, true as of `seq`."""

    instance_id: str
    capacity: int
    max_items: int
    seq: int
    outcomes: list[Outcome]
    sizes: list[int]
    evicted: list[str]
    metadata: list[bytes] | None  # per entry, when any entry asked
    spares: list[pb.ShmSlot]  # write slots asked for with the batch (all or none)


def build_batch(
    entries: Sequence[Entry],
    touches: Sequence[str],
    *,
    lease: pb.LeaseMode.ValueType,
    chunk_bytes: int,
    shm: tuple[bytes, Mapping[int, pb.ShmSlot]] = (b"", {}),
    spares: Sequence[tuple[int, int]] = (),
    wait_ms: int = 0,
) -> Batch:
    """The header and the items whose chunk frames follow it.

    `shm`: the region's token, and the slots (by entry index) already
    holding entries' payloads: those entries name their slot instead.
    `spares`: the (payload, trailer) sizes of write slots to ask for with
    the reply, for the next uploads. `wait_ms`: how long hash-only entries
    may wait for an upload of theirs in flight elsewhere (0: the server's).
    """
    check_count("entries", len(entries))
    token, slots = shm
    request = pb.UpdateRequest(
        touches=touches,
        lease=lease,
        shm_token=token if slots or spares else b"",
        shm_spare_lengths=[length for length, _ in spares],
        shm_spare_trailers=[trailer for _, trailer in spares],
        wait_ms=wait_ms,
    )
    sending: list[EncodedItem] = []
    for index, entry in enumerate(entries):
        wire = request.entries.add(
            mm_hash=entry.mm_hash,
            modality=entry.modality,
            resend=entry.resend,
            want_metadata=entry.want_metadata,
        )
        if entry.data is None:
            continue
        wire.item.CopyFrom(entry.data.spec)
        if entry.withheld:
            wire.withheld = True
            continue
        wire.metadata = entry.metadata
        slot = slots.get(index)
        if slot is not None:
            wire.shm.CopyFrom(slot)
            continue
        wire.num_chunks = num_chunks(entry.data, chunk_bytes)
        sending.append(entry.data)
    header = request.SerializeToString()
    if len(header) > MAX_HEADER_BYTES:
        raise InvalidArgumentError(
            f"this batch's header is {len(header)} bytes (its specs and metadata); one call's "
            f"header must fit {MAX_HEADER_BYTES}: send fewer items per call"
        )
    return Batch(header, tuple(sending), chunk_bytes)


def read_reply(reply: pb.UpdateReply, entries: int) -> Reply:
    """The reply to a batch of `entries` entries, checked for shape."""
    if len(reply.outcomes) != entries or len(reply.sizes) != entries:
        raise InvalidArgumentError(
            f"the server answered {len(reply.outcomes)} outcomes for {entries} entries"
        )
    metadata = list(reply.metadata) if reply.metadata else None
    if metadata is not None and len(metadata) != entries:
        raise InvalidArgumentError("the server's reply carries metadata for other entries")
    return Reply(
        instance_id=reply.instance_id,
        capacity=reply.capacity_bytes,
        max_items=reply.max_items,
        seq=reply.seq,
        outcomes=[Outcome(o) for o in reply.outcomes],
        sizes=list(reply.sizes),
        evicted=list(reply.evicted),
        metadata=metadata,
        spares=list(reply.shm_spares),
    )
