"""A GetAndUpdate batch on the client: its header and frames, its reply checked.

The client decides what each entry carries (`Entry`); this module turns that
into the entries as they travel (the wire layer writes the header) and the
items' chunk frames, and checks the server's `Reply` against the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from mmcache._errors import InvalidArgumentError
from mmcache._frames import MAX_MESSAGE_BYTES
from mmcache._spec import check_count

from ._codec import EncodedItem, iter_chunk_frames, num_chunks
from .wire import Lease, Reply, Slot, UpdateEntry, update_header

__all__ = ["Batch", "Entry", "Lease", "Reply", "build_batch", "check_lease", "read_reply"]

# A header must fit one message, with room for the frame's own prefix.
MAX_HEADER_BYTES = MAX_MESSAGE_BYTES - 1024


def check_lease(lease: Lease) -> Lease:
    if lease is True or lease is False or lease == "hits":
        return lease
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


def build_batch(
    entries: Sequence[Entry],
    touches: Sequence[str],
    *,
    lease: Lease,
    chunk_bytes: int,
    shm: tuple[bytes, Mapping[int, Slot]] = (b"", {}),
    spares: Sequence[tuple[int, int]] = (),
    wait_ms: int = 0,
    claim_ms: int = 0,
) -> Batch:
    """The header and the items whose chunk frames follow it.

    `shm`: the region's token, and the slots (by entry index) already
    holding entries' payloads: those entries name their slot instead.
    `spares`: the (payload, trailer) sizes of write slots to ask for with
    the reply, for the next uploads. `wait_ms`: how long hash-only entries
    may wait for an upload of theirs in flight elsewhere (0: the server's);
    `claim_ms`: how long those still missing are claimed for this caller (0: not).
    """
    check_count("entries", len(entries))
    token, slots = shm
    sending: list[EncodedItem] = []
    wire: list[UpdateEntry] = []
    for index, entry in enumerate(entries):
        data, slot, chunks = entry.data, None, 0
        if data is not None and not entry.withheld:
            slot = slots.get(index)
            if slot is None:
                chunks = num_chunks(data, chunk_bytes)
                sending.append(data)
        wire.append(
            UpdateEntry(
                entry.mm_hash,
                entry.modality,
                None if data is None else data.spec,
                entry.withheld,
                entry.metadata,
                entry.want_metadata,
                entry.resend,
                slot,
                chunks,
            )
        )
    header = update_header(
        wire,
        touches,
        lease=lease,
        shm_token=token,
        spares=spares,
        wait_ms=wait_ms,
        claim_ms=claim_ms,
    )
    if len(header) > MAX_HEADER_BYTES:
        raise InvalidArgumentError(
            f"this batch's header is {len(header)} bytes (its specs and metadata); one call's "
            f"header must fit {MAX_HEADER_BYTES}: send fewer items per call"
        )
    return Batch(header, tuple(sending), chunk_bytes)


def read_reply(reply: Reply, entries: int) -> Reply:
    """The reply to a batch of `entries` entries, checked for shape."""
    if len(reply.outcomes) != entries or len(reply.sizes) != entries:
        raise InvalidArgumentError(
            f"the server answered {len(reply.outcomes)} outcomes for {entries} entries"
        )
    if reply.metadata is not None and len(reply.metadata) != entries:
        raise InvalidArgumentError("the server's reply carries metadata for other entries")
    return reply
