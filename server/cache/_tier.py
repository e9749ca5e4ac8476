"""The L2 tier behind the sidecar's cache (L1): read-through, write-behind,
admission and cross-node single flight, over any `L2Backend`.

Read-through: a hash a call names without data that L1 lacks is read from
L2 within the call's time, stored in L1 and only then answered: held, and
leased as any hit is. Nothing is promised from L2 alone.

Single flight: a hash neither tier holds is claimed in L2 by the first
sidecar to ask (for a window). It answers MISSING, so its frontend processes
the image; another sidecar that asks meanwhile waits (at most `wait_s`, within
the call's time) for that item to reach L2 or its own L1, then answers from
it; past the wait it answers MISSING and its frontend processes the image
itself. The claimer asking again waits only while its own frontend is still
processing the item (a second local request); once it stored the item, a
later miss means its L1 evicted it, and it answers MISSING at once.

Holding: once stored, the claim lasts as long as the item stays in this L1
(`hold_s` at most), so a sidecar asking for it any time later knows whom to
ask: it puts the key on the holder's want list and waits as above; the holder
takes its wants every `recheck_s` and writes them first. A claim ends when
its item leaves L1 or could not be stored there (nobody is left to write
it); an item uploaded without asking first is claimed by the writer. Each
sidecar keeps a heartbeat in L2 (`alive_s`): the claims of one that stopped
beating pass to the next sidecar that asks, which processes the image.

Write-behind, with admission so that one-off images do not flood L2: an item
is written once it is seen a second time, here (a hit in L1) or anywhere in
the fleet (another sidecar asked for it while any sidecar held it, however
long after). `admit="first"` writes every new item. Writes go through a
bounded queue of keys; an item evicted before its turn is not written.

Every L2 failure degrades to a miss or an unwritten item, counted in
`mmcache_l2_*`: L2 is optional, health does not depend on it. At most
`concurrency` operations run at once, and a call reads no more from L2 than
L1 could hold.

The parts: this facade makes them once and hands L1's changes (the change
stream's, _changes.py) to them; what it writes it publishes there too. Each
key's state and the protocol's transitions are the KeyBook's, the admission
rule its Admission's (_fleet.py, no awaits); the read-through
(_read_through.py) and the write-behind (_write_behind.py) make the calls
and feed the answers back; the outbox (_write_queue.py) holds the jobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial

from mmcache.metrics import L2Metrics

from ._changes import ItemChange, ItemChanges
from ._fleet import Admission, KeyBook
from ._l2 import L2Backend, L2Error, Manifests
from ._l2_calls import L2Calls
from ._read_through import ReadThrough
from ._store import ItemStore, StoredItem
from ._tier_parts import L2Settings, TierParts
from ._types import Change
from ._write_behind import WriteBehind
from ._write_queue import Outbox

__all__ = ["L2Settings", "L2Tier"]


class L2Tier:
    def __init__(
        self,
        backend: L2Backend,
        store: ItemStore,
        metrics: L2Metrics,
        settings: L2Settings,
        manifests: Manifests,
        changes: ItemChanges,
        clock: Callable[[], float] = time.monotonic,
        node: str = "",
    ) -> None:
        self._wake = asyncio.Event()
        outbox = Outbox(settings.queue_items, metrics, self._wake.set)
        book = KeyBook(
            Admission(settings.admit),
            settings.window_s,
            settings.known_items,
            clock,
            outbox.unclaim,
        )
        self._parts = TierParts(
            node=node or uuid.uuid4().hex,
            calls=L2Calls(backend, metrics, settings.concurrency, settings.timeout_s, clock),
            store=store,
            metrics=metrics,
            settings=settings,
            manifests=manifests,
            book=book,
            outbox=outbox,
            clock=clock,
        )
        self._reads = ReadThrough(self._parts)
        self._behind = WriteBehind(self._parts, self._wake, changes)
        self._writer: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None

    @property
    def backend(self) -> L2Backend:
        return self._parts.backend

    @property
    def queued(self) -> int:
        return len(self._parts.outbox.writes)

    def start(self) -> None:
        self._behind.stopping = False
        self._writer = asyncio.create_task(self._behind.run())
        # At start, not on first use: a wrong --l2 is logged now, at ERROR.
        self._watching = asyncio.create_task(self.backend.watch())

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None
        if self._writer is not None:
            # The flag too: a cancel that meets an operation just finishing can
            # be swallowed by asyncio.wait_for (Python < 3.12).
            self._behind.stopping = True
            self._wake.set()
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
            # Other sidecars take this one's claims over at once, not after alive_s.
            p = self._parts
            await p.calls.quietly("claim", partial(self.backend.leave, p.node))
        await self.backend.close()

    # -- read-through --

    async def pull(
        self,
        keys: Sequence[str],
        budget_s: float | None,
        *,
        flight: bool = True,
        wait_s: float | None = None,
    ) -> list[tuple[str, StoredItem]]:
        """Items under `keys` (absent from L1) read from L2 within `budget_s`
        (None: a call with no deadline; one read and one wait, at most), and
        no more bytes than L1 could take. `flight`: the caller processes what
        is missing (a frontend), so the misses are claimed and waited for as
        the module says, at most `wait_s` (the caller's processing time) when
        it is shorter than the tier's; an engine's read only reads."""
        return await self._reads.pull(keys, budget_s, flight, wait_s)

    async def holds(self, keys: Sequence[str], budget_s: float | None) -> list[bool]:
        """Whether L2 holds each key (False where it failed or ran out of time)."""
        p = self._parts
        budget = p.settings.timeout_s if budget_s is None else budget_s
        deadline = p.clock() + min(budget, p.settings.timeout_s)

        async def one(key: str) -> bool:
            try:
                return await p.calls.within("check", lambda: p.backend.holds(key), deadline)
            except L2Error:
                return False

        return list(await asyncio.gather(*(one(key) for key in keys)))

    # -- what L1 did: the admission's sightings --

    def stored(self, key: str, *, replaced: bool) -> None:
        """A client's data was stored in L1 under `key`; `replaced`: over data
        held (sent data wins, in L2 too, and it is a second sighting anyway)."""
        self._parts.outbox.do(key, self._parts.book.stored(key, replaced=replaced))

    def not_stored(self, key: str) -> None:
        """A client's data for `key` could not be stored (UNCACHED, withheld):
        this sidecar's claim on it, if any, ends: nobody waits for it."""
        self._parts.outbox.do(key, self._parts.book.not_stored(key))

    def changed(self, change: ItemChange) -> None:
        """The change stream's subscriber: L1's removals end claims."""
        if change.kind == Change.REMOVED and not change.in_l2:
            self.removed(change.key)

    def removed(self, key: str) -> None:
        """L1 no longer holds `key`. Its claim, if this sidecar holds one, ends:
        nobody waits for it, and the next sidecar to ask claims it."""
        self._parts.outbox.do(key, self._parts.book.removed(key))

    def hit(self, key: str) -> None:
        """L1 answered `key` held: a second sighting here of an item L2 may lack."""
        if key not in self._parts.outbox.writes:
            self._parts.outbox.do(key, self._parts.book.hit(key))
