"""The L2 tier's read-through (server/cache/_tier.py says what it does):
items L1 lacks read from L2 within a call's time, and for a frontend, the
single flight across nodes (claim the cold item, or wait for the sidecar that
processes it). The keys' state is the KeyBook's; this module makes the calls."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from ._fleet import Claim
from ._l2 import BadRecord, L2Error, L2Record, Poll, Sighting, Want, item_of_record
from ._store import StoredItem
from ._tier_parts import TierParts

__all__ = ["ReadThrough"]

_LOGGER = logging.getLogger(__name__)


class _Budget:
    """The bytes one call may read from L2: what its L1 could take at most."""

    __slots__ = ("left",)

    def __init__(self, most: int) -> None:
        self.left = most


class ReadThrough:
    def __init__(self, parts: TierParts) -> None:
        self._p = parts
        # Claims being asked for now, so that two local calls ask once.
        self._sighting: dict[str, asyncio.Future[tuple[Sighting, str] | None]] = {}
        self._bad_logged: set[str] = set()  # reasons of refused records logged at WARNING

    async def pull(
        self, keys: Sequence[str], budget_s: float | None, flight: bool, wait_s: float | None
    ) -> list[tuple[str, StoredItem]]:
        settings = self._p.settings
        wait_s = settings.wait_s if wait_s is None else min(wait_s, settings.wait_s)
        most = settings.timeout_s + wait_s
        budget = most if budget_s is None else min(most, budget_s)
        if not keys or budget <= 0:
            return []
        deadline = self._p.clock() + budget
        room = _Budget(self._p.store.capacity)
        found = await asyncio.gather(
            *(self._pull_one(key, deadline, flight, room, wait_s) for key in keys)
        )
        return [(key, item) for key, item in zip(keys, found, strict=True) if item is not None]

    async def _pull_one(
        self, key: str, deadline: float, flight: bool, room: _Budget, wait_s: float
    ) -> StoredItem | None:
        p = self._p
        if room.left <= 0:  # L1 could not take more: the rest are misses
            p.metrics.misses.inc()
            return None
        try:
            record = await p.calls.within("read", lambda: p.backend.read(key), deadline)
        except L2Error:
            p.metrics.misses.inc()
            return None
        if record is not None:
            room.left -= record.nbytes
            return self.read_in(key, record)
        p.book.forget(key)  # L2 evicted it: write it again when seen again
        sighted = await self._sight(key, deadline) if flight else None
        sighting = None if sighted is None else sighted[0]
        if sighted is not None and sighting == Sighting.OTHERS:
            sighting = await self._ask_holder(key, sighted[1], deadline)
        if sighting is None or sighting == Sighting.FIRST:
            # An engine's read; an L2 failure; or this sidecar's frontend
            # processes it now.
            p.metrics.misses.inc()
            return None
        if sighting == Sighting.MINE and p.book.claim(key) != Claim.PROCESSING:
            # Processed here and stored already; L1 has evicted it since.
            p.metrics.misses.inc()
            return None
        return await self._wait_for(key, min(deadline, p.clock() + wait_s))

    async def _sight(self, key: str, deadline: float) -> tuple[Sighting, str] | None:
        """Claim `key` in L2, or learn whose it is: the sighting and the
        claimer (None: L2 failed). Local calls asking at once ask once: the
        first claims, the others find it MINE."""
        running = self._sighting.get(key)
        if running is not None:
            found = await asyncio.shield(running)
            if found is not None and found[0] == Sighting.FIRST:
                return Sighting.MINE, found[1]
            return found
        future: asyncio.Future[tuple[Sighting, str] | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._sighting[key] = future
        found = None
        p = self._p
        try:
            found = await p.calls.within(
                "claim", lambda: p.backend.sight(key, p.settings.window_s, p.node), deadline
            )
            if found[0] == Sighting.FIRST:
                p.book.claimed(key)
        except L2Error:
            pass
        finally:
            del self._sighting[key]
            future.set_result(found)
        return found

    async def _ask_holder(self, key: str, owner: str, deadline: float) -> Sighting | None:
        """`owner`, another sidecar, claims `key`: put it on that sidecar's want
        list (OTHERS: wait for it), or, when that sidecar is gone, take its
        claim over (FIRST: process it here)."""
        p = self._p
        try:
            if await p.calls.within("claim", lambda: p.backend.want(owner, key), deadline) == (
                Want.ASKED
            ):
                return Sighting.OTHERS
            taken = await p.calls.within(
                "claim",
                lambda: p.backend.take_over(key, owner, p.node, p.settings.window_s),
                deadline,
            )
        except L2Error:
            return Sighting.OTHERS  # the wait decides
        if taken:
            p.book.claimed(key)
            return Sighting.FIRST
        return Sighting.OTHERS  # a third sidecar took it over first: it processes

    async def _wait_for(self, key: str, until: float) -> StoredItem | None:
        """The item another sidecar is processing, once it reaches L2; None when it
        reaches L1 here instead (the batch finds it there), when its claimer
        gives it up (evicted before anyone wrote it), or not in time."""
        p = self._p
        while (left := until - p.clock()) > 0:
            await asyncio.sleep(min(p.settings.poll_s, left))
            if key in p.store:
                p.metrics.flight_waits.labels("arrived").inc()
                return None
            try:
                state = await p.calls.within("check", lambda: p.backend.poll(key), until)
                if state == Poll.GONE:
                    p.metrics.flight_waits.labels("abandoned").inc()
                    p.metrics.misses.inc()
                    return None
                if state == Poll.HELD:
                    record = await p.calls.within("read", lambda: p.backend.read(key), until)
                    if record is not None:
                        p.metrics.flight_waits.labels("arrived").inc()
                        return self.read_in(key, record)
            except L2Error:
                break
        p.metrics.flight_waits.labels("timeout").inc()
        p.metrics.misses.inc()
        return None

    def read_in(self, key: str, record: L2Record) -> StoredItem | None:
        p = self._p
        try:
            item = item_of_record(key, record, p.manifests)
        except BadRecord as exc:
            # Logged once per reason (a fleet upgrade makes many); counted always.
            log = _LOGGER.debug if exc.reason in self._bad_logged else _LOGGER.warning
            self._bad_logged.add(exc.reason)
            log(
                "L2 record refused (a miss; further ones counted in "
                "mmcache_l2_bad_records_total): %s",
                exc,
            )
            p.metrics.bad_records.labels(exc.reason).inc()
            p.metrics.errors.labels("read").inc()
            p.metrics.misses.inc()
            # Written over as soon as this sidecar stores the item (its caller
            # processes it now), not at a second sighting: every sidecar that
            # asks meanwhile reads the bad record whole, and misses.
            p.book.write_when_stored(key)
            return None
        p.metrics.hits.inc()
        p.metrics.read_bytes.inc(record.nbytes)
        p.book.know(key)
        return item
