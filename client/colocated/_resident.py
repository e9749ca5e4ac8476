"""Hits with no call: leases and reads of items resident in the shared-memory
region, done on the caller's own thread (docs/shm.md, "Hits with no call").

A lookup call costs a frontend and the server about half a millisecond each,
as much as processing a small image saves. Where the server's region holds
the item, a frontend leases it itself: it finds the extent in the index,
writes the extent's generation in its report ring (a lease record), and
then checks the extent is live yet. The server, before it frees an extent,
zeroes its word and then looks at the rings' unread records
(server/cache/_region.py): so either the client's check fails (it asks by call
instead) or the server sees the lease and keeps the extent (mmcache._rings.fence
orders each side's write before its read). The hits it confirmed go in a
second record, so the server counts each query once.

An engine reads such items the same way, copying them out on its own
thread, and gives their leases back in its ring. Both report the CPU they
spent here, so the server's mmcache_shm_client_cpu_seconds_total shows
what hits cost the callers' threads.

Thread-safe: the region is only read here, the pool and the ring have locks;
a region the client's loop unmaps meanwhile (a restarted server) fails the
lease or read, which the caller then makes by call. A server killed never
says so: its heartbeat in the region stops, and after STALE_S nothing is
leased or read there with no call.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from mmcache._items import Item
from mmcache._rings import fence
from mmcache._spec import store_key

from .._pool import BufferPool
from ..wire import Report, report_bytes
from ._plans import modality_of
from ._reports import Reports
from ._shm import ClientRegion

__all__ = ["ResidentHits", "ResidentLeases"]

# What reading a region the client's loop has just unmapped raises (its
# reads here are of an mmap and views of it, which fail cleanly once closed).
_UNMAPPED = (ValueError, BufferError, struct.error)


class ResidentLeases(NamedTuple):
    """What `lease_resident` took: per hash, whether it is held (leased), and
    the metadata stored with it (empty when none, or not held)."""

    held: list[bool]
    metadata: list[bytes]


class ResidentHits:
    """Leases and reads with no call, for one client (one namespace)."""

    def __init__(self, namespace: str, reports: Reports, pool: BufferPool | None) -> None:
        self._namespace = namespace
        self._reports = reports
        self._pool = pool
        # A report's own writing is counted in the next one.
        self._carried_ns = 0
        self._carry_lock = threading.Lock()

    def _post(self, token: bytes, report: Report, started: int) -> None:
        """Send `report` with the CPU spent since `started` (and what the last
        report's writing cost): into the ring, or by the client's loop."""
        with self._carry_lock:
            carried, self._carried_ns = self._carried_ns, 0
        now = time.thread_time_ns()
        report.client_cpu_ns = now - started + carried
        self._reports.post(token, report)
        self._carry(time.thread_time_ns() - now)

    def _carry(self, spent: int) -> None:
        with self._carry_lock:
            self._carried_ns += spent

    def lease(
        self,
        region: ClientRegion,
        mm_hashes: Sequence[str],
        usable: Callable[[int, bytes], bool] | None = None,
    ) -> ResidentLeases:
        """Lease each hash resident in `region` (and `usable`, given its index
        and stored metadata), counted as a lookup's hit; not held where it is
        not (or the client has no ring): ask those by call."""
        leased = ResidentLeases([False] * len(mm_hashes), [b""] * len(mm_hashes))
        try:
            self._lease(region, mm_hashes, usable, leased)
        except _UNMAPPED:  # the client's loop unmapped the region meanwhile (a new server)
            return ResidentLeases([False] * len(mm_hashes), [b""] * len(mm_hashes))
        return leased

    def _lease(
        self,
        region: ClientRegion,
        mm_hashes: Sequence[str],
        usable: Callable[[int, bytes], bool] | None,
        leased: ResidentLeases,
    ) -> None:
        started = time.thread_time_ns()
        ring = self._reports.ring(region.token)
        if ring is None or not region.serving():
            return
        found = [region.locate(store_key(self._namespace, h)) for h in mm_hashes]
        if usable is not None:
            found = [
                f if f is not None and usable(i, f.metadata) else None for i, f in enumerate(found)
            ]
        leases = [(h, f.generation) for h, f in zip(mm_hashes, found, strict=True) if f is not None]
        if not leases or not ring.write(report_bytes(Report(shm_leases=leases))):
            self._carry(time.thread_time_ns() - started)  # reported with the next report
            return
        fence()  # the record before the check: see mmcache._rings.fence
        hits: Counter[str] = Counter()
        for i, f in enumerate(found):
            if f is not None and region.still(f.start, f.generation):
                leased.held[i] = True
                leased.metadata[i] = f.metadata
                hits[modality_of(f.spec)] += 1
        # A lease whose check failed is kept, if the server took it, until it expires.
        self._post(region.token, Report(hits=hits), started)

    def read(
        self, region: ClientRegion, mm_hashes: Sequence[str], release: bool
    ) -> list[Item] | None:
        """The items, copied out of `region`, their leases given back (`release`);
        None unless every one is resident (the caller reads them by call)."""
        try:
            return self._read(region, mm_hashes, release)
        except _UNMAPPED:
            return None

    def _read(
        self, region: ClientRegion, mm_hashes: Sequence[str], release: bool
    ) -> list[Item] | None:
        started = time.thread_time_ns()
        if not region.serving():
            return None
        items: list[Item] = []
        nbytes = 0
        for mm_hash in mm_hashes:
            got = region.read_resident(store_key(self._namespace, mm_hash), self._pool)
            if got is None:
                self._post(region.token, Report(), started)
                return None
            items.append(got[0])
            nbytes += got[1]
        report = Report(mm_hashes=list(mm_hashes) if release else [], shm_read_bytes=nbytes)
        self._post(region.token, report, started)
        return items
