"""The server's end of the report rings (mmcache._rings): co-located clients'
reports, read with no call.

A client that maps the region asks once (OpenReportRing) for a ring, bound
to the namespace it asked in; what it would send as a Release (leases given
back, holds done, bytes read, queries it answered itself) it then writes
there. The server reads every ring before it acts on its store (each call
that may evict, allocate or count), and on a short timer, so a lease given
back is never held for longer than that; a report it reads is applied
exactly as the Release it stands for. A ring with nothing new costs a drain
one word's read.

A client may also lease a resident item with no call: it writes the extent's
generation in its ring, then checks the extent is still live. The region,
freeing an extent, first asks `leased` whether an unread record names it.

A client that closes writes an empty record: its ring is retired then. One
whose client has gone quiet for `idle_s` (one that died) is retired (its memory
waits a lease before reuse, server/cache/_region.py): the client finds it so and
reports by call until it asks for another. So is a ring that is corrupt, or
stuck on a record that never becomes whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from mmcache._errors import MMCacheError
from mmcache._rings import RING_BYTES, RingCorrupt, commit_tail, read_records, ring_head

from ._region import Region, Slot
from ._types import Report, Scope

__all__ = ["ReportRings"]

_LOGGER = logging.getLogger(__name__)

MAX_RINGS = 256  # 16 MiB of region at most
IDLE_S = 600.0  # a ring unused this long goes back
STUCK_S = 2.0  # a record that does not become whole within this is no record


@dataclass(slots=True)
class _Ring:
    slot: Slot
    view: memoryview  # the slot's payload: the ring itself
    namespace: Scope
    tail: int = 0
    used: float = 0.0  # when a record was last read
    stuck: float = 0.0  # since when records wait that never became whole (0: none)
    uploads: bool = False  # its client may post uploads (its token may call GetAndUpdate)
    pokes: bool = False  # its client pokes the wake pipe after a post (mmcache._wake)


class ReportRings:
    """The rings of one region; `apply` takes each report as the Release it
    stands for (with whether its ring may post uploads, and whether its client
    pokes the wake pipe); `parse` reads a record (InvalidArgumentError when it
    cannot: the record is in the wire's format, server/_reports.py)."""

    def __init__(
        self,
        region: Region,
        apply: Callable[[Scope, Report, bool, bool], None],
        parse: Callable[[bytes], Report],
        *,
        most: int = MAX_RINGS,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.region = region
        self._apply = apply
        self._parse = parse
        self._most = most
        self._idle_s = idle_s
        self._clock = clock
        self._rings: dict[int, _Ring] = {}

    def __len__(self) -> int:
        return len(self._rings)

    def open(self, namespace: Scope, *, uploads: bool = False) -> Slot | None:
        """A new ring for a client of `namespace`, or None (all taken, or no
        room); `uploads`: the client may post uploads in it."""
        if len(self._rings) >= self._most:
            return None
        slot = self.region.open_ring(RING_BYTES)
        if slot is not None:
            view = self.region.payload(slot)
            ring = _Ring(slot, view, namespace, used=self._clock(), uploads=uploads)
            self._rings[slot.lease] = ring
        return slot

    def drain(self) -> int:
        """Apply every whole report written since the last drain; how many."""
        if not self._rings:
            return 0
        now = self._clock()
        applied = 0
        for lease, ring in list(self._rings.items()):
            if ring_head(ring.view) == ring.tail:  # nothing new: the usual case, kept cheap
                if now - ring.used > self._idle_s:
                    self._retire(lease, "unused")
                continue
            try:
                payloads, tail = read_records(ring.view, ring.tail, commit=False)
            except RingCorrupt as exc:
                self._retire(lease, f"corrupt: {exc}")
                continue
            if payloads:
                ring.used, ring.stuck = now, 0.0
            # The records stay the ring's, and `leased` sees them, until all
            # are applied: a release applied first may free an extent that a
            # lease after it in the same ring keeps.
            for payload in payloads:
                applied += self._report(ring, payload) if payload else 0
            ring.tail = tail
            commit_tail(ring.view, tail)
            if b"" in payloads:  # its client closed: no record follows
                self._retire(lease, "its client closed")
            elif ring_head(ring.view) > ring.tail:  # a record that is not whole yet
                ring.stuck = ring.stuck or now
                if now - ring.stuck > STUCK_S:
                    self._retire(lease, "a record never became whole")
        return applied

    def poked(self, leases: list[int]) -> None:
        """The rings of `leases` poked the wake pipe: their clients do so after
        each post (an unknown lease, a forged poke, is no ring's)."""
        for lease in leases:
            ring = self._rings.get(lease)
            if ring is not None:
                ring.pokes = True

    def leased(self, generation: int) -> bool:
        """Whether a record not read yet leases the extent of `generation` (a
        client's lease with no call, server/cache/_region.py's `keep_leased`). Reads
        nothing for good: the records are applied at the next drain."""
        for ring in self._rings.values():
            if ring_head(ring.view) == ring.tail:
                continue
            try:
                payloads, _ = read_records(ring.view, ring.tail, commit=False)
            except RingCorrupt:
                continue  # the next drain retires it
            for payload in payloads:
                try:
                    leases = self._parse(payload).shm_leases
                except MMCacheError:
                    continue
                if any(leased == generation for _, leased in leases):
                    return True
        return False

    def _report(self, ring: _Ring, payload: bytes) -> int:
        try:
            self._apply(ring.namespace, self._parse(payload), ring.uploads, ring.pokes)
        except MMCacheError as exc:  # its client's mistake: the rest go on
            _LOGGER.warning("a report in a shared-memory ring was refused: %s", exc)
            return 0
        return 1

    def _retire(self, lease: int, why: str) -> None:
        ring = self._rings.pop(lease)
        self.region.retire(ring.slot)
        _LOGGER.info("retired a report ring (%s): its client reports by call", why)
