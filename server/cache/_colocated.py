"""What co-located clients report: a Release call's, and the records their
report rings carry with no call (_report_rings.py). Either ends leases,
counts the lookups a client answered itself, and gives back its holds of
the region's extents (placement's region: the rings live in it). A ring's
record may also carry an upload posted with no call: handed to `posted`
(the servicer's, which applies it as the GetAndUpdate it stands for)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mmcache._errors import InvalidArgumentError
from mmcache._shm_layout import ADVICE_SMALL_PAUSED
from mmcache._spec import check_count, check_counts
from mmcache.metrics import CacheMetrics

from ._placement import Placement
from ._region import Region, Slot
from ._report_rings import ReportRings
from ._reuse import SmallReuse
from ._store import ItemStore
from ._types import Report, Scope

__all__ = ["POSTED_DRAIN_S", "POSTING_S", "CoLocatedReports"]

# A client that posts an upload in its ring pokes the wake pipe (mmcache._wake):
# the rings are read at once. While a client that does not (an older one)
# posts, the last time within POSTING_S, they are read every POSTED_DRAIN_S
# besides the cache's timer (0.2 s): its posted item is resident for other
# processes within a few ms, for a wake-up (tens of µs) each time.
POSTED_DRAIN_S = 0.005
POSTING_S = 5.0


class CoLocatedReports:
    def __init__(
        self,
        store: ItemStore,
        metrics: CacheMetrics,
        placement: Placement,
        parse_report: Callable[[bytes], Report],  # a ring's record (the wire's format)
        reuse: SmallReuse,
    ) -> None:
        self._store = store
        self._reuse = reuse
        self._metrics = metrics
        self._placement = placement
        self._parse_report = parse_report
        self.rings: ReportRings | None = None  # the region's, made at the first asked for
        # Takes a ring record's upload (its namespace, the serialised header);
        # unset (a cache with no servicer), such an upload is refused.
        self.posted: Callable[[Scope, bytes], None] | None = None
        self._posted_at = -POSTING_S  # when the last upload was posted (monotonic)
        self._next_read: asyncio.TimerHandle | None = None

    def release(self, namespace: Scope, keys: list[str], report: Report) -> int:
        """A Release call: the leases it ended."""
        if report.upload:
            raise InvalidArgumentError(
                "a Release call carries an upload: post uploads in a report ring's record "
                "only; by call, send them with GetAndUpdate"
            )
        region = self._placement.region
        # Only a client that maps the region reports; one of a region gone is
        # too late, but its leases are still given back.
        mapped = region is not None and region.matches(report.shm_token)
        return self._apply(namespace, keys, report, region if mapped else None)

    def open_ring(self, token: bytes, namespace: Scope, *, uploads: bool = False) -> Slot | None:
        """A report ring for a co-located client; None when there is no room.
        `uploads`: the client may post uploads in it."""
        region = self._placement.region_of(token)
        return self._rings_of(region).open(namespace, uploads=uploads)

    def drain(self) -> int:
        """Apply what co-located clients wrote in their report rings; how many
        reports. The region's heartbeat too: a server that serves a call is alive."""
        region = self._placement.region
        if region is None:
            return 0
        region.beat()
        drained = 0 if self.rings is None else self._rings_of(region).drain()
        region.advise(ADVICE_SMALL_PAUSED if self._reuse.paused else 0)
        return drained

    def woken(self, leases: list[int]) -> None:
        """Clients poked the wake pipe, the rings of `leases` (mmcache._wake):
        read every ring now."""
        if self.rings is not None:
            self.rings.poked(leases)
        self.drain()

    def _apply(
        self,
        namespace: Scope,
        keys: list[str],
        report: Report,
        region: Region | None,
    ) -> int:
        """Apply a Release, or a report ring's record; the leases it ended.
        `region`: the client maps it (its holds and its bytes read count)."""
        check_count("shm_done", len(report.shm_done))
        check_count("shm_leases", len(report.shm_leases))
        check_counts("misses", report.misses)
        check_counts("hits", report.hits)
        metrics, store = self._metrics, self._store
        # Queries a client answered itself count as lookups would.
        for modality, count in report.misses.items():
            metrics.queried(modality, hit=False, count=count)
        for modality, count in report.hits.items():
            metrics.queried(modality, hit=True, count=count)
        if region is None:
            return store.release(keys)
        for hold in report.shm_done:
            region.release(hold)
        metrics.shm_bytes.labels("read").inc(report.shm_read_bytes)
        metrics.sent_bytes.inc(report.shm_read_bytes)  # as if Fetch had sent them
        metrics.shm_client_cpu.inc(report.client_cpu_ns / 1e9)
        if report.shm_leases:  # taken with no call: as a lookup's hits are
            leased = namespace.checked_keys([mm_hash for mm_hash, _ in report.shm_leases])
            store.lease(leased)
            for key in leased:
                self._reuse.hit(store.size_of(key))
        if region.orphans:  # a lease of an extent kept after its item left
            for key in [key for key in keys if not store.is_leased(key)]:
                region.end_orphan(key)
        return store.release(keys)

    def _post(self, namespace: Scope, upload: bytes, uploads: bool, pokes: bool) -> None:
        if self.posted is None or not uploads:
            self._metrics.posted_uploads.labels("refused").inc()
            why = (
                "this server takes no uploads posted in report rings"
                if self.posted is None
                else "the ring's client may not upload (the token it opened the ring with "
                "has no write role)"
            )
            raise InvalidArgumentError(f"a posted upload was refused: {why}")
        self.posted(namespace, upload)
        if not pokes:  # nothing will wake the server for its next post
            self._posted_at = time.monotonic()
            self._read_soon()

    def _read_soon(self) -> None:
        if self._next_read is None:
            loop = asyncio.get_running_loop()
            self._next_read = loop.call_later(POSTED_DRAIN_S, self._read_again)

    def _read_again(self) -> None:
        self._next_read = None
        self.drain()
        posting = time.monotonic() - self._posted_at < POSTING_S
        if posting and self._placement.region is not None:  # (none: the cache closed)
            self._read_soon()

    def _rings_of(self, region: Region) -> ReportRings:
        if self.rings is None or self.rings.region is not region:

            def apply(namespace: Scope, report: Report, uploads: bool, pokes: bool) -> None:
                self._apply(namespace, namespace.checked_keys(report.mm_hashes), report, region)
                if report.upload:  # after the record's releases: room they made is there
                    self._post(namespace, report.upload, uploads, pokes)

            rings = self.rings = ReportRings(region, apply, self._parse_report)

            def keep_leased(generation: int, key: str) -> bool:
                # An item still in the store (moved to the heap) is leased there.
                return key not in self._store and rings.leased(generation)

            region.keep_leased = keep_leased
        return self.rings
