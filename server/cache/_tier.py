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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from mmcache.metrics import L2Metrics

from ._l2 import (
    BadRecord,
    L2Backend,
    L2Error,
    L2Record,
    Manifests,
    Poll,
    Sighting,
    Want,
    item_of_record,
    record_of_item,
)
from ._l2_calls import L2Calls
from ._store import ItemStore, StoredItem
from ._write_queue import WriteQueue

__all__ = ["L2Settings", "L2Tier"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class L2Settings:
    admit: str = "second"  # "second": on a second sighting; "first": every new item
    timeout_s: float = 1.0  # one L2 operation, at most (and never past a call's time)
    ttl_s: float = 0.0  # an item's TTL in L2 (0: none; maxmemory + allkeys-lru evict)
    window_s: float = 10.0  # how long a claim lasts (a processor run and an upload)
    hold_s: float = 86400.0  # how long a claim of an item stored here lasts, at most
    alive_s: float = 3.0  # a sidecar silent for this long is gone: its claims pass on
    wait_s: float = 1.0  # how long a call waits for an item another sidecar processes
    queue_items: int = 4096  # write-behind queue, in items
    poll_s: float = 0.01  # how often a waiting call looks for the item
    recheck_s: float = 0.05  # how often a sidecar holding claims takes its wants
    beat_s: float = 1.0  # how often an idle sidecar beats
    known_items: int = 65536  # items this sidecar knows L2 holds (not written again)
    concurrency: int = 32  # L2 operations under way at once (a call's reads, polls, writes)


class _Budget:
    """The bytes one call may read from L2: what its L1 could take at most."""

    __slots__ = ("left",)

    def __init__(self, most: int) -> None:
        self.left = most


class L2Tier:
    def __init__(
        self,
        backend: L2Backend,
        store: ItemStore,
        metrics: L2Metrics,
        settings: L2Settings,
        manifests: Manifests,
        clock: Callable[[], float] = time.monotonic,
        on_written: Callable[[str, int], None] = lambda key, size: None,
        node: str = "",
    ) -> None:
        self._node = node or uuid.uuid4().hex
        self._on_written = on_written
        self._manifests = manifests
        self._calls = L2Calls(backend, metrics, settings.concurrency, settings.timeout_s, clock)
        self._store = store
        self._metrics = metrics
        self._settings = settings
        self._clock = clock
        self._wake = asyncio.Event()
        self._writes = WriteQueue(settings.queue_items, metrics, self._wake.set)
        # Keys whose claim this sidecar ends (it evicted or could not store them).
        # Deduplicated; bounded by the claims this sidecar holds (known_items each).
        self._unclaims: OrderedDict[str, None] = OrderedDict()
        # Items stored here, L2 lacking them: their claims to make or extend.
        self._to_hold: deque[str] = deque(maxlen=4096)
        # Keys whose claim this sidecar holds with the item in L1.
        self._held: OrderedDict[str, None] = OrderedDict()
        # Keys written as soon as they are stored here, within the window: wants
        # of items still being processed here, records that failed their check.
        self._write_on_store: OrderedDict[str, float] = OrderedDict()
        # Cold keys this sidecar claimed and its frontend has not stored yet:
        # key -> when, within the window.
        self._claims: OrderedDict[str, float] = OrderedDict()
        # Claims being asked for now, so that two local calls ask once.
        self._sighting: dict[str, asyncio.Future[tuple[Sighting, str] | None]] = {}
        # Keys L2 holds as far as this sidecar knows (it wrote or read them).
        self._known: OrderedDict[str, None] = OrderedDict()
        self._writer: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._stopping = False
        self._next_beat = 0.0
        self._bad_logged: set[str] = set()  # reasons of refused records logged at WARNING

    @property
    def backend(self) -> L2Backend:
        return self._calls.backend

    @property
    def queued(self) -> int:
        return len(self._writes)

    def start(self) -> None:
        self._stopping = False
        self._writer = asyncio.create_task(self._write_behind())
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
            self._stopping = True
            self._wake.set()
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            self._writer = None
            # Other sidecars take this one's claims over at once, not after alive_s.
            await self._calls.quietly("claim", partial(self.backend.leave, self._node))
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
        wait_s = self._settings.wait_s if wait_s is None else min(wait_s, self._settings.wait_s)
        most = self._settings.timeout_s + wait_s
        budget = most if budget_s is None else min(most, budget_s)
        if not keys or budget <= 0:
            return []
        deadline = self._clock() + budget
        room = _Budget(self._store.capacity)
        found = await asyncio.gather(
            *(self._pull_one(key, deadline, flight, room, wait_s) for key in keys)
        )
        return [(key, item) for key, item in zip(keys, found, strict=True) if item is not None]

    async def _pull_one(
        self, key: str, deadline: float, flight: bool, room: _Budget, wait_s: float
    ) -> StoredItem | None:
        if room.left <= 0:  # L1 could not take more: the rest are misses
            self._metrics.misses.inc()
            return None
        try:
            record = await self._calls.within("read", lambda: self.backend.read(key), deadline)
        except L2Error:
            self._metrics.misses.inc()
            return None
        if record is not None:
            room.left -= record.nbytes
            return self._read_in(key, record)
        self._known.pop(key, None)  # L2 evicted it: write it again when seen again
        sighted = await self._sight(key, deadline) if flight else None
        sighting = None if sighted is None else sighted[0]
        if sighted is not None and sighting == Sighting.OTHERS:
            sighting = await self._ask_holder(key, sighted[1], deadline)
        if sighting is None or sighting == Sighting.FIRST:
            # An engine's read; an L2 failure; or this sidecar's frontend
            # processes it now.
            self._metrics.misses.inc()
            return None
        if sighting == Sighting.MINE and key not in self._claims:
            # Processed here and stored already; L1 has evicted it since.
            self._metrics.misses.inc()
            return None
        return await self._wait_for(key, min(deadline, self._clock() + wait_s))

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
        try:
            found = await self._calls.within(
                "claim",
                lambda: self.backend.sight(key, self._settings.window_s, self._node),
                deadline,
            )
            if found[0] == Sighting.FIRST:
                self._claim(key)
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
        try:
            if await self._calls.within(
                "claim", lambda: self.backend.want(owner, key), deadline
            ) == (Want.ASKED):
                return Sighting.OTHERS
            taken = await self._calls.within(
                "claim",
                lambda: self.backend.take_over(key, owner, self._node, self._settings.window_s),
                deadline,
            )
        except L2Error:
            return Sighting.OTHERS  # the wait decides
        if taken:
            self._claim(key)
            return Sighting.FIRST
        return Sighting.OTHERS  # a third sidecar took it over first: it processes

    def _claim(self, key: str) -> None:
        now = self._clock()
        self._claims[key] = now
        self._claims.move_to_end(key)
        window = self._settings.window_s
        while self._claims and (
            len(self._claims) > self._settings.known_items
            or next(iter(self._claims.values())) < now - window
        ):
            self._claims.popitem(last=False)

    async def _wait_for(self, key: str, until: float) -> StoredItem | None:
        """The item another sidecar is processing, once it reaches L2; None when it
        reaches L1 here instead (the batch finds it there), when its claimer
        gives it up (evicted before anyone wrote it), or not in time."""
        while (left := until - self._clock()) > 0:
            await asyncio.sleep(min(self._settings.poll_s, left))
            if key in self._store:
                self._metrics.flight_waits.labels("arrived").inc()
                return None
            try:
                state = await self._calls.within("check", lambda: self.backend.poll(key), until)
                if state == Poll.GONE:
                    self._metrics.flight_waits.labels("abandoned").inc()
                    self._metrics.misses.inc()
                    return None
                if state == Poll.HELD:
                    record = await self._calls.within("read", lambda: self.backend.read(key), until)
                    if record is not None:
                        self._metrics.flight_waits.labels("arrived").inc()
                        return self._read_in(key, record)
            except L2Error:
                break
        self._metrics.flight_waits.labels("timeout").inc()
        self._metrics.misses.inc()
        return None

    def _read_in(self, key: str, record: L2Record) -> StoredItem | None:
        try:
            item = item_of_record(key, record, self._manifests)
        except BadRecord as exc:
            # Logged once per reason (a fleet upgrade makes many); counted always.
            log = _LOGGER.debug if exc.reason in self._bad_logged else _LOGGER.warning
            self._bad_logged.add(exc.reason)
            log(
                "L2 record refused (a miss; further ones counted in "
                "mmcache_l2_bad_records_total): %s",
                exc,
            )
            self._metrics.bad_records.labels(exc.reason).inc()
            self._metrics.errors.labels("read").inc()
            self._metrics.misses.inc()
            # Written over as soon as this sidecar stores the item (its caller
            # processes it now), not at a second sighting: every sidecar that
            # asks meanwhile reads the bad record whole, and misses.
            self._write_when_stored(key)
            return None
        self._metrics.hits.inc()
        self._metrics.read_bytes.inc(record.nbytes)
        self._know(key)
        return item

    async def holds(self, keys: Sequence[str], budget_s: float | None) -> list[bool]:
        """Whether L2 holds each key (False where it failed or ran out of time)."""
        budget = self._settings.timeout_s if budget_s is None else budget_s
        deadline = self._clock() + min(budget, self._settings.timeout_s)

        async def one(key: str) -> bool:
            try:
                return await self._calls.within("check", lambda: self.backend.holds(key), deadline)
            except L2Error:
                return False

        return list(await asyncio.gather(*(one(key) for key in keys)))

    # -- what L1 did: the admission's sightings --

    def stored(self, key: str, *, replaced: bool) -> None:
        """A client's data was stored in L1 under `key`; `replaced`: over data
        held (sent data wins, in L2 too, and it is a second sighting anyway)."""
        self._claims.pop(key, None)
        if self._write_on_store.pop(key, None) is not None:  # wanted, or L2's record is bad
            self._writes.add(key, urgent=True)
        elif replaced or self._settings.admit == "first":
            self._writes.add(key)
        elif key not in self._known:
            # Claimed from now (the claim made or extended in the background),
            # so that a later asker, anywhere, asks this sidecar.
            self._held[key] = None
            self._held.move_to_end(key)
            while len(self._held) > self._settings.known_items:
                self._unclaims[self._held.popitem(last=False)[0]] = None  # no longer tracked
            self._to_hold.append(key)
            self._wake.set()

    def not_stored(self, key: str) -> None:
        """A client's data for `key` could not be stored (UNCACHED, withheld):
        this sidecar's claim on it, if any, ends: nobody waits for it."""
        if self._claims.pop(key, None) is not None:
            self._unclaims[key] = None
            self._wake.set()

    def removed(self, key: str) -> None:
        """L1 no longer holds `key`. Its claim, if this sidecar holds one, ends:
        nobody waits for it, and the next sidecar to ask claims it."""
        if key in self._held:
            del self._held[key]
            self._unclaims[key] = None
            self._wake.set()

    def hit(self, key: str) -> None:
        """L1 answered `key` held: a second sighting here of an item L2 may lack."""
        if key not in self._known and key not in self._writes:
            self._writes.add(key)

    def _write_when_stored(self, key: str) -> None:
        """Write `key` to L2 at once if it is stored here within the window."""
        now = self._clock()
        self._write_on_store[key] = now + self._settings.window_s
        while self._write_on_store and next(iter(self._write_on_store.values())) < now:
            self._write_on_store.popitem(last=False)

    def _know(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self._settings.known_items:
            self._known.popitem(last=False)

    # -- the writer --

    async def _write_behind(self) -> None:
        while not self._stopping:
            if not (self._writes or self._unclaims or self._to_hold):
                self._wake.clear()
                timeout = max(0.0, self._next_beat - self._clock())
                woken = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({woken}, timeout=timeout)
                finally:
                    woken.cancel()
            try:
                await self._write_round()
            except Exception:  # never let one surprise stop every later write
                _LOGGER.exception("L2 write-behind round failed; going on")

    async def _write_round(self) -> None:
        while self._unclaims and not self._stopping:
            key, _ = self._unclaims.popitem(last=False)
            await self._beat()  # long rounds keep the heartbeat (and take wants)
            if key in self._held:  # stored here again since: the claim is live
                continue
            await self._calls.quietly("claim", partial(self.backend.unclaim, key, self._node))
        while self._to_hold and not self._stopping:
            await self._hold(self._to_hold.popleft())
            await self._beat()
        await self._beat()
        while self._writes and not self._stopping:
            key = self._writes.pop()
            await self._write(key)
            await self._beat()  # a waiter's item goes next, not last

    async def _hold(self, key: str) -> None:
        """Claim (or extend the claim of) an item stored here, for as long as
        L1 keeps it; written at once when another sidecar asked or claims it."""
        if key not in self._held:  # evicted meanwhile: nothing to claim
            return
        found = await self._calls.quietly(
            "claim", partial(self.backend.hold, key, self._node, self._settings.hold_s)
        )
        if found is None:
            return
        sighting, asked = found
        if sighting == Sighting.OTHERS:  # another sidecar claims it: not this one's
            self._held.pop(key, None)
        if sighting == Sighting.OTHERS or asked:  # a second sighting in the fleet
            self._writes.add(key, urgent=True)

    async def _beat(self) -> None:
        """Every `recheck_s` while this sidecar holds claims (else `beat_s`):
        say it is alive, and write first what other sidecars asked it for."""
        now = self._clock()
        if now < self._next_beat or self._stopping:
            return
        busy = self._held or self._claims
        self._next_beat = now + (self._settings.recheck_s if busy else self._settings.beat_s)
        wants = await self._calls.quietly(
            "check", partial(self.backend.beat, self._node, self._settings.alive_s, 256)
        )
        for key in wants or ():
            if key in self._store:
                self._known.pop(key, None)  # asked for: L2 lacks it now
                self._writes.add(key, urgent=True)
            elif key in self._claims:  # still being processed here: written once stored
                self._write_when_stored(key)
            else:  # a claim left behind (an unclaim that failed): end it
                self._unclaims[key] = None

    async def _write(self, key: str) -> None:
        item = self._store.peek(key)
        if item is None:
            self._metrics.writes.labels("gone").inc()
            return
        record, size = record_of_item(key, item, self._manifests), item.size
        del item  # a resident item's extent is not held while the write waits
        try:
            await self._calls.within(
                "write",
                lambda: self.backend.write(key, record, self._settings.ttl_s),
                self._clock() + self._settings.timeout_s,
            )
        except L2Error as exc:
            _LOGGER.debug("L2 write of %r failed: %s", key, exc)
            self._metrics.writes.labels("failed").inc()
            return
        self._metrics.writes.labels("written").inc()
        self._metrics.written_bytes.inc(record.nbytes)
        self._know(key)
        self._on_written(key, size)
