"""One entry of an upload batch, and the one check of an item's frames.

The edge (server/_upload.py) parses a header into `EntryHeader`s, checking
each spec and sizing it (mmcache._spec); what arrives after (an upload's
chunk frames, or an L2 record's) is checked here against that size, one way
for both, and joined with the header into what the store applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmcache._errors import InvalidArgumentError
from mmcache._frames import MAX_CHUNK_BYTES, chunk_payload_offset

from ._extent import Extent
from ._store import StoredItem, UploadEntry
from ._types import ShmRef

__all__ = ["EntryHeader", "check_frames", "check_received", "chunk_length", "upload_entry"]


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """One entry as its header describes it, checked."""

    index: int
    mm_hash: str  # as the caller named it
    key: str  # the store's key: the hash in the caller's namespace
    modality: str  # the metrics label
    spec: bytes | None  # the serialised ItemSpec, checked; None: the hash alone
    chunks: int | None  # chunk frames that follow for it; None: no data follows
    payload: int  # tensor bytes those frames carry
    charged: int  # what the LRU charges: the spec's size plus the metadata's
    withheld: bool  # data larger than the whole cache, kept home by the client
    resend: bool
    metadata: bytes
    want_metadata: bool
    shm: ShmRef | None = None  # the payload is in this shared-memory slot (chunks: 0)
    item_modality: str = ""  # the spec's own (its first field's)

    @property
    def where(self) -> str:
        return f"entry {self.index} ({self.mm_hash!r})"


def check_frames(frames: Sequence[bytes], entry: EntryHeader) -> None:
    """Check chunk frames that came all at once (an L2 record's) as an
    upload's are checked one by one (`chunk_length`, then `check_received`)."""
    if len(frames) != entry.chunks:
        raise InvalidArgumentError(
            f"{entry.where} declares {entry.chunks} chunks but {len(frames)} came"
        )
    check_received(sum(chunk_length(f, n, entry) for n, f in enumerate(frames)), entry)


def chunk_length(frame: bytes, n: int, entry: EntryHeader) -> int:
    """The payload bytes chunk frame `n` of `entry` carries, checked."""
    length = len(frame) - chunk_payload_offset(frame)
    if not 0 < length <= MAX_CHUNK_BYTES:
        raise InvalidArgumentError(
            f"chunk {n} of entry {entry.index} carries {length} bytes; chunks carry 1 to "
            f"{MAX_CHUNK_BYTES}"
        )
    return length


def check_received(received: int, entry: EntryHeader) -> None:
    """All of an entry's chunks carry exactly the payload its spec sizes."""
    if received != entry.payload:
        raise InvalidArgumentError(
            f"{entry.where} declares {entry.payload} payload bytes (from its dtypes and "
            f"shapes) but its {entry.chunks} chunks carry {received}"
        )


def upload_entry(
    entry: EntryHeader, frames: tuple[bytes, ...], resident: Extent | None = None
) -> UploadEntry:
    """What the store applies for one entry, its frames read and checked (or
    its payload in an extent placement gave it)."""
    if entry.spec is None:
        return UploadEntry(entry.key, want_metadata=entry.want_metadata)
    if entry.withheld:
        return UploadEntry(entry.key, withheld=True)
    item = StoredItem(
        entry.spec,
        frames,
        entry.payload,
        entry.charged,
        entry.metadata,
        resident,
        entry.item_modality,
    )
    return UploadEntry(entry.key, item)
