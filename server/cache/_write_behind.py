"""The L2 tier's write-behind (server/cache/_tier.py says what it does): the
outbox's jobs in rounds (end claims, claim held items, write), and the
heartbeat that takes the wants other sidecars left this one. The keys' state
is the KeyBook's; this module makes the calls and feeds their answers back."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from ._changes import ItemChange, ItemChanges
from ._fleet import Claim
from ._l2 import L2Error, Sighting, record_of_item
from ._tier_parts import TierParts
from ._types import Change

__all__ = ["WriteBehind"]

_LOGGER = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self, parts: TierParts, wake: asyncio.Event, changes: ItemChanges) -> None:
        self._p = parts
        self._wake = wake
        self._changes = changes  # told of each write
        self._next_beat = 0.0
        self.stopping = False

    async def run(self) -> None:
        while not self.stopping:
            if not self._p.outbox:
                self._wake.clear()
                timeout = max(0.0, self._next_beat - self._p.clock())
                woken = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({woken}, timeout=timeout)
                finally:
                    woken.cancel()
            try:
                await self._round()
            except Exception:  # never let one surprise stop every later write
                _LOGGER.exception("L2 write-behind round failed; going on")

    async def _round(self) -> None:
        p, outbox = self._p, self._p.outbox
        while not self.stopping and (key := outbox.next_unclaim()) is not None:
            await self._beat()  # long rounds keep the heartbeat (and take wants)
            if p.book.claim(key) == Claim.HELD:  # stored here again since: live
                continue
            await p.calls.quietly("claim", partial(p.backend.unclaim, key, p.node))
        while not self.stopping and (key := outbox.next_hold()) is not None:
            await self._hold(key)
            await self._beat()
        await self._beat()
        while outbox.writes and not self.stopping:
            await self._write(outbox.writes.pop())
            await self._beat()  # a waiter's item goes next, not last

    async def _hold(self, key: str) -> None:
        """Claim (or extend the claim of) an item stored here, for as long as
        L1 keeps it; written at once when another sidecar asked or claims it."""
        p = self._p
        if p.book.claim(key) != Claim.HELD:  # evicted meanwhile: nothing to claim
            return
        found = await p.calls.quietly(
            "claim", partial(p.backend.hold, key, p.node, p.settings.hold_s)
        )
        if found is not None:
            sighting, asked = found
            others = sighting == Sighting.OTHERS
            p.outbox.do(key, p.book.hold_answered(key, others=others, asked=asked))

    async def _beat(self) -> None:
        """Every `recheck_s` while this sidecar holds claims (else `beat_s`):
        say it is alive, and write first what other sidecars asked it for."""
        p = self._p
        now = p.clock()
        if now < self._next_beat or self.stopping:
            return
        self._next_beat = now + (p.settings.recheck_s if p.book.busy else p.settings.beat_s)
        wants = await p.calls.quietly(
            "check", partial(p.backend.beat, p.node, p.settings.alive_s, 256)
        )
        for key in wants or ():
            p.outbox.do(key, p.book.wanted(key, in_l1=key in p.store))

    async def _write(self, key: str) -> None:
        p = self._p
        item = p.store.peek(key)
        if item is None:
            p.metrics.writes.labels("gone").inc()
            return
        record, size = record_of_item(key, item, p.manifests), item.size
        del item  # a resident item's extent is not held while the write waits
        try:
            await p.calls.within(
                "write",
                lambda: p.backend.write(key, record, p.settings.ttl_s),
                p.clock() + p.settings.timeout_s,
            )
        except L2Error as exc:
            _LOGGER.debug("L2 write of %r failed: %s", key, exc)
            p.metrics.writes.labels("failed").inc()
            return
        p.metrics.writes.labels("written").inc()
        p.metrics.written_bytes.inc(record.nbytes)
        p.book.know(key)
        self._changes.publish(ItemChange(Change.STORED, key, size, in_l2=True))
