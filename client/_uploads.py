"""GetAndUpdate from the caller's items: encoded, planned against the mirror
(what to send, what to name alone), sent (larger payloads through the
shared-memory region), what drifted sent again, leases given back when the
call fails, and the reply applied to the mirror; with fail-open, a server
that does not answer in time hands the items back as misses."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import ceil
from typing import Any

from mmcache._errors import CacheMissError, InvalidArgumentError, MMCacheError
from mmcache._items import Item
from mmcache._lru import Outcome
from mmcache._spec import MAX_METADATA_BYTES, check_count, check_name

from ._batch import Entry, Lease, Reply, build_batch, check_lease, read_reply
from ._codec import EncodedItem, encode_item
from ._mirror import Mirror
from ._touch import OUT_OF_TOUCH, Touch
from .colocated import CoLocated, Size
from .wire import CacheTransport, Slot

__all__ = [
    "Call",
    "UpdateResult",
    "Uploads",
    "check_hashes",
    "claim_ms_of",
    "inject_call",
    "lookup_call",
    "update_call",
    "wait_ms_of",
]

_LOGGER = logging.getLogger(__name__)

# The largest header posted in the report ring (64 KiB, shared with the
# client's leases and releases); a larger upload goes by call.
MAX_POSTED_BYTES = 8 << 10


def check_hashes(mm_hashes: Sequence[str]) -> None:
    check_count("mm_hashes", len(mm_hashes))
    for h in mm_hashes:
        check_name("mm_hash", h)


def wait_ms_of(wait_s: float | None) -> int:
    """The wire's wait_ms: 0 leaves the server's bounds; any wait asked is 1 ms at least."""
    return 0 if wait_s is None else _ms("wait_s", wait_s)


def claim_ms_of(claim_s: float) -> int:
    """The wire's claim_ms: 0 claims nothing; a claim asked lasts 1 ms at least."""
    return 0 if claim_s == 0 else _ms("claim_s", claim_s)


def _ms(name: str, seconds: float) -> int:
    if seconds < 0:
        raise InvalidArgumentError(f"{name} is {seconds}: give seconds, 0 or more")
    return max(1, min(ceil(seconds * 1000), (1 << 32) - 1))


@dataclass(frozen=True, slots=True)
class Call:
    """What one get_and_update (or lookup, or inject) asks for."""

    items: Sequence[Item | None]
    mm_hashes: Sequence[str]
    modalities: Sequence[str | None]
    metadata: Sequence[bytes]
    want_metadata: bool = False
    lease: Lease = True
    resend: Sequence[bool] | None = None  # per item: data a lookup found missing
    missing_ok: bool = False  # a hash-only miss is an answer (lookup), not an error
    wait_s: float | None = None  # the longest wait for an upload in flight elsewhere
    claim_s: float = 0.0  # how long hash-only misses are claimed for the caller (0: not)
    processed: bool = False  # the caller processed the items: data sent, each a miss
    # Payloads of any size through the co-located region (else from
    # SHM_MIN_BYTES up): resident at once, read by every client there with no call.
    resident: bool = False


def update_call(
    items: Sequence[Item | None],
    mm_hashes: Sequence[str],
    modality: str | None,
    metadata: Sequence[bytes | None] | None,
    want_metadata: bool,
    lease: Lease,
    resend: Sequence[bool] | None,
    processed: bool = False,
    resident: bool = False,
) -> Call:
    """A get_and_update's call."""
    if metadata is not None and len(metadata) != len(items):
        raise InvalidArgumentError(
            f"{len(metadata)} metadata blobs for {len(items)} items: give one per item "
            "(None where there is none)"
        )
    blobs = [b"" if m is None else m for m in metadata or [None] * len(items)]
    modalities = [modality] * len(mm_hashes)
    return Call(
        items,
        mm_hashes,
        modalities,
        blobs,
        want_metadata,
        lease,
        resend,
        processed=processed,
        resident=resident,
    )


def lookup_call(
    mm_hashes: Sequence[str],
    modality: str | None,
    *,
    want_metadata: bool,
    lease: Lease,
    wait_s: float | None,
    claim_s: float = 0.0,
) -> Call:
    """A lookup's call: the hashes alone, a miss no error."""
    n = len(mm_hashes)
    return Call(
        [None] * n,
        mm_hashes,
        [modality] * n,
        [b""] * n,
        want_metadata,
        lease,
        missing_ok=True,
        wait_s=wait_s,
        claim_s=claim_s,
    )


def inject_call(
    mm_hashes: Mapping[str, Sequence[str]], mm_kwargs: Mapping[str, list[Any]]
) -> tuple[Call, list[tuple[list[Any], int]]]:
    """inject_into_mm_cache's call: each item present in the caller's lists,
    and the place (list, index) its answer goes back to."""
    places: list[tuple[list[Any], int]] = []
    items: list[Item | None] = []
    hashes: list[str] = []
    modalities: list[str | None] = []
    for modality, modality_hashes in mm_hashes.items():
        listed = mm_kwargs.get(modality, [])
        for i, mm_hash in enumerate(modality_hashes):
            if i < len(listed) and listed[i] is not None:
                places.append((listed, i))
                items.append(listed[i])
                hashes.append(mm_hash)
                modalities.append(modality)
    return Call(items, hashes, modalities, [b""] * len(items), lease="hits"), places


def _postable(call: Call, mode: Lease) -> bool:
    """Whether a call may be posted with no call: it needs no reply."""
    return call.resident and call.processed and mode is False and not call.want_metadata


def _checked(call: Call) -> list[bool]:
    """The call's resend flags, once its shape, hashes and metadata are checked."""
    items, mm_hashes = call.items, call.mm_hashes
    resent = [False] * len(items) if call.resend is None else list(call.resend)
    if len(items) != len(mm_hashes) or len(resent) != len(items):
        raise InvalidArgumentError(
            f"{len(items)} items, {len(mm_hashes)} hashes and {len(resent)} resend flags: "
            "give one hash (and flag) per item"
        )
    check_hashes(mm_hashes)
    for i, blob in enumerate(call.metadata):
        if len(blob) > MAX_METADATA_BYTES:
            raise InvalidArgumentError(
                f"the metadata of item {i} is {len(blob)} bytes; the limit is "
                f"{MAX_METADATA_BYTES} ({MAX_METADATA_BYTES // 1024} KiB): store less per item"
            )
    return resent


class UpdateResult(list[Item | None]):
    """What `get_and_update` returns: a list, None where the server held the
    item, the item where it was sent (or could not be stored). Beside it:

    - `held[i]`: the server holds item i for the engine's `fetch` (leased,
      when the call leased); where False, deliver the item inline;
    - `metadata[i]`: the metadata the server holds for a held item, when
      asked (`want_metadata=True`), else None;
    - `posted[i]`: item i went up with no call (docs/shm.md, "Uploads with no
      call"): the server stores it when it next reads the client's ring, and
      says so on the feed; `held[i]` is False, as no reply said it.
    """

    held: list[bool]
    metadata: list[bytes | None]
    posted: list[bool]

    def __init__(
        self,
        results: Sequence[Item | None],
        held: Sequence[bool] | None = None,
        metadata: Sequence[bytes | None] | None = None,
        posted: Sequence[bool] | None = None,
    ) -> None:
        super().__init__(results)
        self.held = [False] * len(results) if held is None else list(held)
        self.metadata = [None] * len(results) if metadata is None else list(metadata)
        self.posted = [False] * len(results) if posted is None else list(posted)


class Uploads:
    """The upload path of one client (`MMCacheClient.get_and_update`, `lookup`,
    `inject_into_mm_cache`)."""

    def __init__(
        self,
        rpc: Callable[[], CacheTransport],
        co: CoLocated,
        mirror: Callable[[], Mirror],
        touch: Touch,
        counted: Callable[[int, int], None],
        chunk_bytes: int,
    ) -> None:
        self._rpc_of = rpc
        self._co = co
        self._mirror = mirror
        self._touch = touch
        self._counted = counted
        self._chunk_bytes = chunk_bytes

    @property
    def _rpc(self) -> CacheTransport:
        return self._rpc_of()

    def caching_disabled(self) -> bool:
        # Known only once the server has answered: out of touch, ask it.
        return self._touch.in_touch and self._mirror().capacity == 0

    async def run(self, call: Call) -> UpdateResult:
        """One get_and_update (or lookup, or inject); with fail-open, the items
        handed back as misses when the server did not answer in time."""
        try:
            async with self._touch.bounded("get_and_update"):
                return await self._update(call)
        except OUT_OF_TOUCH as exc:
            if not self._touch.fail_open:
                raise
            self._touch.fell_open(exc)
        items = call.items
        no_data = [h for h, item in zip(call.mm_hashes, items, strict=True) if item is None]
        if no_data and not call.missing_ok:
            raise CacheMissError(
                no_data,
                f"the cache did not answer in time and no data was given for {no_data}: "
                "process those items and pass them in",
            )
        return UpdateResult(items)

    def post(self, call: Call) -> bool:
        """The call posted in the report ring on the caller's thread, with no
        call and no hop onto the client's loop (thread-safe): True. False
        where `_posted` would not take it (nothing sent; a spare it took goes
        back): `run` it then. Touches wait for the next call."""
        resent = _checked(call)
        if self.caching_disabled() or not _postable(call, check_lease(call.lease)):
            return False
        _, _, entries = self._entries(call, resent)
        if not self._posted(call, False, entries, ()):
            return False
        self._counted(0, len(entries))  # as a call's reply would: none a hit
        return True

    async def _update(self, call: Call) -> UpdateResult:
        items = call.items
        resent = _checked(call)
        mode = check_lease(call.lease)
        if self.caching_disabled():
            missing = [h for h, item in zip(call.mm_hashes, items, strict=True) if item is None]
            if missing:
                raise CacheMissError(missing, f"caching is disabled; no data for {missing}")
            return UpdateResult(items)
        encoded, labels, entries = self._entries(call, resent)
        touches = self._mirror().take_touches()
        if self._posted(call, mode, entries, touches):
            self._counted(0, len(entries))  # as a call's reply would: none a hit
            return UpdateResult(items, posted=[True] * len(items))
        reply = await self._send(
            entries,
            touches,
            mode,
            wait_ms=wait_ms_of(call.wait_s),
            claim_ms=claim_ms_of(call.claim_s),
            resident=call.resident,
        )
        outcomes = reply.outcomes
        self._counted(sum(o == Outcome.HIT for o in outcomes), len(outcomes))  # as the server
        held = await self._resend_drifted(call, encoded, labels, outcomes, mode)
        no_data = [
            call.mm_hashes[i]
            for i, o in enumerate(outcomes)
            if o == Outcome.MISSING and encoded[i] is None
        ]
        if no_data and not call.missing_ok:
            await self._fail_without_data(call, no_data, outcomes, held, mode)
        returned = reply.metadata or [b""] * len(outcomes)
        return UpdateResult(
            [
                None if o == Outcome.HIT and kept else item
                for item, o, kept in zip(items, outcomes, held, strict=True)
            ],
            held,
            [
                blob if o == Outcome.HIT and call.want_metadata and blob else None
                for o, blob in zip(outcomes, returned, strict=True)
            ],
        )

    def _entries(
        self, call: Call, resent: Sequence[bool]
    ) -> tuple[list[EncodedItem | None], list[str], list[Entry]]:
        """The call's items encoded, their modalities, and its batch's entries.
        Reads the mirror only for an upload not `processed` (`plan`)."""
        encoded = [
            None if item is None else encode_item(item, modality=m)
            for item, m in zip(call.items, call.modalities, strict=True)
        ]
        labels = [
            (e.modality if e is not None and e.modality else m) or ""
            for e, m in zip(encoded, call.modalities, strict=True)
        ]
        send = self._mirror().plan(
            call.mm_hashes, [e is not None for e in encoded], processed=call.processed
        )
        entries = [
            self._entry(
                h, label, enc if s else None, blob, want_metadata=call.want_metadata, resend=r and s
            )
            for h, label, enc, blob, s, r in zip(
                call.mm_hashes, labels, encoded, call.metadata, send, resent, strict=True
            )
        ]
        return encoded, labels, entries

    def _posted(
        self, call: Call, mode: Lease, entries: Sequence[Entry], touches: Sequence[str]
    ) -> bool:
        """Posted in the report ring with no call (docs/shm.md, "Uploads with
        no call"): a resident upload of processed items that leases nothing
        and asks nothing back, where every payload has a spare write slot. No
        reply comes: the mirror learns the outcome from the feed. Thread-safe
        (`post`)."""
        if not _postable(call, mode):
            return False
        written = self._co.spare_slots_for(entries)
        if written is None:
            return False
        token, slots = written
        batch = build_batch(
            entries, touches, lease=False, chunk_bytes=self._chunk_bytes, shm=(token, slots)
        )
        # A large header (much metadata) would crowd the ring's leases out: by call.
        if len(batch.header) <= MAX_POSTED_BYTES and self._co.reports.post_upload(
            token, batch.header
        ):
            return True
        region = self._co.region  # not posted: by call, and these slots back to the server
        if region is not None and region.token == token:
            self._co.give_back_slots(region, [slot.lease for slot in slots.values()])
        return False

    async def _resend_drifted(
        self,
        call: Call,
        encoded: Sequence[EncodedItem | None],
        labels: Sequence[str],
        outcomes: Sequence[Outcome],
        mode: Lease,
    ) -> list[bool]:
        """Drift: the mirror thought the server held these, and it did not. Send
        the data now: a miss the caller could not foresee never fails. What
        the call leaves held."""
        mm_hashes = call.mm_hashes
        held = [o in (Outcome.HIT, Outcome.STORED, Outcome.REPLACED) for o in outcomes]
        drifted = [
            i for i, o in enumerate(outcomes) if o == Outcome.MISSING and encoded[i] is not None
        ]
        if not drifted:
            return held
        _LOGGER.debug("re-sending %d items the server did not hold", len(drifted))
        # A later batch, which may evict what this one answered held: over
        # gRPC, so that all it evicts is named in its reply (room made in
        # the region is not), and `held` says what the call left held.
        again = await self._send(
            [
                self._entry(mm_hashes[i], labels[i], encoded[i], call.metadata[i], resend=True)
                for i in drifted
            ],
            [],
            mode,
            shm=False,
        )
        gone = set(again.evicted)
        held = [kept and h not in gone for h, kept in zip(mm_hashes, held, strict=True)]
        for i, outcome in zip(drifted, again.outcomes, strict=True):
            held[i] = outcome == Outcome.STORED
        return held

    async def _fail_without_data(
        self,
        call: Call,
        no_data: list[str],
        outcomes: Sequence[Outcome],
        held: Sequence[bool],
        mode: Lease,
    ) -> None:
        """The request fails here: nobody will read what it leased."""
        mm_hashes = call.mm_hashes
        if mode is True:
            await self._give_back([h for h, kept in zip(mm_hashes, held, strict=True) if kept])
        elif mode == "hits":
            await self._give_back(
                [h for h, o in zip(mm_hashes, outcomes, strict=True) if o == Outcome.HIT]
            )
        raise CacheMissError(
            no_data,
            f"the server does not hold {no_data} and no data was given for them: "
            "process those items again and pass them in",
        )

    def _entry(
        self,
        mm_hash: str,
        modality: str,
        data: EncodedItem | None,
        metadata: bytes,
        *,
        want_metadata: bool = False,
        resend: bool = False,
    ) -> Entry:
        if data is None:
            return Entry(mm_hash, modality, want_metadata=want_metadata)
        # Larger than the whole cache: it could never be stored, so its bytes
        # stay home (its spec still counts). Unknown capacity: let the server say.
        capacity = self._mirror().capacity
        withheld = self._touch.in_touch and data.size.charged + len(metadata) > capacity
        return Entry(mm_hash, modality, data, withheld, metadata, resend=resend)

    async def _give_back(self, mm_hashes: Sequence[str]) -> None:
        # Best effort: a lease not given back ends by itself.
        if mm_hashes:
            try:
                await self._rpc.release(
                    mm_hashes, self._touch.call_timeout, self._touch.wait_for_ready
                )
            except MMCacheError as exc:
                _LOGGER.debug("could not release %d leases: %s", len(mm_hashes), exc)

    async def _send(
        self,
        entries: Sequence[Entry],
        touches: Sequence[str],
        lease: Lease,
        *,
        shm: bool = True,
        wait_ms: int = 0,
        claim_ms: int = 0,
        resident: bool = False,
    ) -> Reply:
        """One round trip: the batch out (`shm`: larger payloads through the
        region, where there is one; `resident`: every payload), the reply
        applied to the mirror."""
        use_shm = shm and self._co.region is not None
        slots, spares = await self._co.slots_for(entries, resident) if use_shm else ({}, [])
        if slots:
            try:
                return await self._send_batch(
                    entries, touches, lease, slots, spares, wait_ms, claim_ms
                )
            except InvalidArgumentError as exc:
                # A slot that expired, or a server restarted since it gave them:
                # the same batch as chunk frames (a bad batch fails again there).
                _LOGGER.debug("upload through shared memory refused (%s): over gRPC", exc)
        return await self._send_batch(entries, touches, lease, {}, [], wait_ms, claim_ms)

    async def _send_batch(
        self,
        entries: Sequence[Entry],
        touches: Sequence[str],
        lease: Lease,
        slots: dict[int, Slot],
        spares: list[Size],
        wait_ms: int = 0,
        claim_ms: int = 0,
    ) -> Reply:
        region = self._co.region if slots else None
        mirror = self._mirror()
        call = mirror.call_started()
        given: Sequence[Slot] = ()
        try:
            batch = build_batch(
                entries,
                touches,
                lease=lease,
                chunk_bytes=self._chunk_bytes,
                shm=(b"" if region is None else region.token, slots),
                spares=spares if region is not None else (),
                wait_ms=wait_ms,
                claim_ms=claim_ms,
            )
            raw = await self._rpc.get_and_update(
                batch.header,
                batch.frames,
                timeout=self._touch.call_timeout,
                wait_for_ready=self._touch.wait_for_ready,
            )
            reply = read_reply(raw, len(entries))
            mirror.apply_reply(
                reply.instance_id,
                reply.capacity,
                reply.max_items,
                reply.seq,
                [e.mm_hash for e in entries],
                reply.outcomes,
                reply.sizes,
                reply.evicted,
            )
            if region is not None and reply.instance_id == region.instance_id:
                given = reply.spares
            self._co.answered(reply.instance_id)  # a restart: its new region mapped
        finally:
            mirror.call_ended(call)
            if spares:  # the ask settled, whatever became of the batch
                self._co.settle_spares(region, given, spares)
        self._touch.in_touch = True
        return reply
