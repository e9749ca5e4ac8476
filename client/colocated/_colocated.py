"""The client's side of its server's shared-memory region (docs/shm.md): the
mapping (made from Info, and made again when the server restarts), write
slots for uploads, reads and leases with no call, and the reports that tell
the server of them afterwards. A client of a server on another host has no
region: then `region` is None and every path goes over gRPC."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Sequence

from mmcache._errors import InvalidArgumentError, MMCacheError
from mmcache._items import Item
from mmcache._shm_layout import SHM_MIN_BYTES
from mmcache._spec import store_key

from .._batch import Entry
from .._fetched import decode_items, no_frames
from .._pool import BufferPool
from .._touch import Touch
from ..wire import CacheTransport, Report, ServerInfo, Slot, parse_fetched
from ._reports import Reports
from ._resident import ResidentHits, ResidentLeases
from ._shm import ClientRegion, ClientRing, attach
from ._slots import Size, WriteSlots, size_of

__all__ = ["SHM_MIN_BYTES", "CoLocated"]

_LOGGER = logging.getLogger(__name__)

# Uploads from SHM_MIN_BYTES up go through shared memory when the region is
# mapped: below it, the copy saves less than a slot's bookkeeping costs.
# After a region is dropped, Info is asked again at most this often (on the
# replies and feed messages that show the server answers).
REATTACH_S = 1.0


class CoLocated:
    """The region this client maps, if any, and what goes through it."""

    def __init__(
        self,
        namespace: str,
        enabled: bool,
        rpc: Callable[[], CacheTransport],
        pool: BufferPool | None,
        *,
        connect_timeout: float,
        touch: Touch,
    ) -> None:
        self._namespace = namespace
        self._enabled = enabled
        self._rpc = rpc
        self._pool = pool
        self._connect_timeout = connect_timeout
        self._touch = touch  # every call's bound on a request's path (docs/faults.md)
        self.region: ClientRegion | None = None
        self._posts = False  # an older server would drop posted uploads unread
        self.reports = Reports(
            lambda report: rpc().report(report, touch.call_timeout, touch.wait_for_ready),
            self.answered,
            self._open_report_ring,
        )
        self.resident = ResidentHits(namespace, self.reports, pool)
        self.write_slots = WriteSlots()
        self._reattach: asyncio.Task[None] | None = None
        self._reattach_tried = -REATTACH_S
        # No region mapped, and Info not asked since (a region dropped, or no
        # server at connect): the next answer maps the server's region.
        self._lost = enabled

    # -- the mapping -------------------------------------------------------

    def attach(self, info: ServerInfo) -> None:
        """Map the server's region, if it has one this host can map."""
        self.detach()
        self._lost = False  # what Info says is the whole answer, region or none
        if self._enabled and info.region is not None:
            self.region = attach(info.instance_id, info.region)
            self._posts = info.region.posted_uploads
            if self.region is not None:  # a ring now: leases with no call need one
                self.reports.open(self.region.token)

    def detach(self) -> None:
        region, self.region = self.region, None
        if region is not None:
            self.reports.forget(region.token)  # nothing more goes to its ring
            region.close()
        self.write_slots.drain()  # the old region's

    def answered(self, instance_id: str) -> None:
        """The server's instance, as a reply or the feed says it: another than
        the mapped region's means a restart; any, once the region was dropped
        (a restart, a heartbeat that stopped), a server to map anew."""
        region = self.region
        if region is not None:
            if instance_id and instance_id != region.instance_id:
                self.restarted()
        elif self._lost and instance_id and self._enabled:
            self._reattach_soon()

    def usable(self, region: ClientRegion) -> bool:
        """Whether `region` may be used with no call now: its server's heartbeat
        is fresh. If not, it is dropped (the next answer maps the server's
        region again): a killed server's region is never read or leased."""
        if region.serving():
            return True
        if region is self.region:
            _LOGGER.info("mmcache: the server's shared memory has no heartbeat; not used")
            self.restarted()
        return False

    def restarted(self) -> None:
        """The server is a new instance, or gone: drop its old region, and map
        the one the server now announces."""
        self.detach()
        self._lost = True
        self._reattach_soon()

    def _reattach_soon(self) -> None:
        now = time.monotonic()
        if self._reattach is not None and not self._reattach.done():
            return
        if now - self._reattach_tried < REATTACH_S:
            return  # asked lately: the next answer asks again
        self._reattach_tried = now
        self._reattach = asyncio.get_running_loop().create_task(self._attach_again())

    async def _attach_again(self) -> None:
        try:  # in the background: a server down makes it wait, never a request
            self.attach(await self._rpc().info(timeout=self._connect_timeout))
        except MMCacheError as exc:  # gone again: the next answer tries anew
            _LOGGER.debug("shared memory not remapped: %s", exc)

    async def _open_report_ring(self, token: bytes) -> ClientRing | None:
        """A report ring in the region of `token`, if the server gives one."""
        region = self.region
        if region is None or region.token != token:
            return None
        reply = await self._rpc().open_report_ring(token)
        if reply.instance_id != region.instance_id or len(reply.slots) != 1:
            return None
        try:
            return region.ring(reply.slots[0])
        except ValueError:
            return None

    async def flush(self, timeout: float) -> None:
        """Tell the server what reads and spare slots owe it, within `timeout`."""
        if self.region is not None:
            self.reports.add(self.region.token, done=self.write_slots.drain(close=True))
        await self.reports.flush(timeout)

    def close(self) -> None:
        self.reports.cancel()
        if self._reattach is not None:
            self._reattach.cancel()
            self._reattach = None
        self.detach()

    # -- uploads -----------------------------------------------------------

    async def slots_for(
        self, entries: Sequence[Entry], every: bool = False
    ) -> tuple[dict[int, Slot], list[Size]]:
        """Slots holding the payloads of this batch's larger uploads (`every`:
        all of them, so that they are resident at once; none: all over gRPC),
        by entry index; and the spares to ask for with its reply."""
        region = self.region
        if region is None or not self.usable(region):
            return {}, []
        least = 0 if every else SHM_MIN_BYTES
        sizes = {
            i: size_of(e.data.size.payload, self._trailer(e))
            for i, e in enumerate(entries)
            if e.data is not None and not e.withheld and e.data.size.payload >= least
        }
        slots: dict[int, Slot] = {}
        for index, size in sizes.items():
            spare = self.write_slots.take(region, size)
            if spare is not None:
                slots[index] = spare
        needed = [i for i in sizes if i not in slots]
        if needed:
            given = await self._allocate(region, [sizes[i] for i in needed])
            if given is None:  # no room: all over gRPC, the spares taken kept for later
                kept = self.write_slots.keep(slots.values(), [sizes[i] for i in slots], asked=False)
                self.give_back_slots(region, kept)
                return {}, []
            slots.update(zip(needed, given, strict=True))
        try:
            for index, slot in slots.items():
                region.write(slot, entries[index].data)  # type: ignore[arg-type]
        except ValueError as exc:
            _LOGGER.debug("upload over gRPC: %s", exc)  # the slots expire by themselves
            return {}, []
        return slots, self.write_slots.top_up(list(sizes.values()))

    def spare_slots_for(self, entries: Sequence[Entry]) -> tuple[bytes, dict[int, Slot]] | None:
        """For an upload posted with no call: every entry's payload written into
        a spare write slot of its size, by entry index, with the region's
        token; None (nothing taken) when there is no report ring, or a size
        has only its last spare left: that one goes by call, whose reply
        brings the spares back (one call per run of spares, no ShmAllocate)."""
        region = self.region
        if region is None or not self._posts:
            return None
        try:
            return self._spares_written(region, entries)
        except (ValueError, struct.error):  # the region dropped under a caller's thread
            return None  # (spares it took end with their lease)

    def _spares_written(
        self, region: ClientRegion, entries: Sequence[Entry]
    ) -> tuple[bytes, dict[int, Slot]] | None:
        # `serving`, not `usable`: this may run on a caller's thread, and only
        # the loop drops a region (the next call does).
        if not region.serving():
            return None
        if self.reports.ring(region.token) is None:
            return None
        encoded = [e.data for e in entries if e.data is not None and not e.withheld]
        if not encoded or len(encoded) < len(entries):
            return None
        sizes = [
            size_of(data.size.payload, self._trailer(entry))
            for data, entry in zip(encoded, entries, strict=True)
        ]
        slots = self.write_slots.take_spares(region, sizes)
        if slots is None:
            return None
        try:
            for slot, data in zip(slots, encoded, strict=True):
                region.write(slot, data)
        except ValueError as exc:  # expired while this client stalled
            _LOGGER.debug("upload by call: %s", exc)
            self.give_back_slots(region, [slot.lease for slot in slots])
            return None
        return region.token, dict(enumerate(slots))

    async def _allocate(self, region: ClientRegion, sizes: list[Size]) -> list[Slot] | None:
        """Write slots of `sizes` (and spares kept for the next uploads), or None."""
        extra = self.write_slots.top_up(sizes)
        spares: Sequence[Slot] = ()
        try:
            for asked in (sizes + extra, sizes) if extra else (sizes,):
                try:
                    reply = await self._rpc().shm_allocate(
                        region.token,
                        [payload for payload, _ in asked],
                        [room for _, room in asked],
                        timeout=self._touch.call_timeout,
                    )
                except InvalidArgumentError:
                    self.restarted()  # the token is not the server's: a restart
                    return None
                if reply.instance_id != region.instance_id:
                    self.restarted()
                    return None
                if len(reply.slots) == len(asked):
                    spares = reply.slots[len(sizes) :]
                    return list(reply.slots[: len(sizes)])
            return None  # no room (even without spares)
        finally:
            self.give_back_slots(region, self.write_slots.keep(spares, extra))

    def settle_spares(
        self, region: ClientRegion | None, given: Sequence[Slot], asked: list[Size]
    ) -> None:
        """The spares a batch asked for came (`given`, maybe none): kept up to the
        client's caps, the rest back to the server."""
        surplus = self.write_slots.keep(given, asked)
        if region is not None:
            self.give_back_slots(region, surplus)

    def give_back_slots(self, region: ClientRegion, leases: list[int]) -> None:
        """Spare slots beyond the client's caps go back to the server; from any
        thread (an upload posted from a caller's, which may run an event loop
        of its own: vLLM's API server does)."""
        if leases:
            self.reports.post(region.token, Report(shm_done=leases))

    def _trailer(self, entry: Entry) -> int:
        """Room after an upload's payload for its store key, spec and metadata
        (the item becomes resident where it is written)."""
        assert entry.data is not None
        key = store_key(self._namespace, entry.mm_hash)
        return len(key.encode()) + entry.data.spec.byte_size() + len(entry.metadata)

    # -- reads -------------------------------------------------------------

    def post_release(self, mm_hashes: Sequence[str]) -> bool:
        """Leases of `mm_hashes` given back with no call, from any thread: in the
        report ring, or sent by the loop with the next report; False where this
        client maps no region (the caller releases them by call)."""
        region = self.region
        # A server that stopped beating (killed, restarted): its leases went
        # with it, and the caller's call reaches the one that answers now.
        if region is None or not self.usable(region):
            return False
        self.reports.post(region.token, Report(mm_hashes=list(mm_hashes)))
        return True

    def lease(
        self, mm_hashes: Sequence[str], usable: Callable[[int, bytes], bool] | None
    ) -> ResidentLeases | None:
        """Leases with no call of the resident items (None: no region)."""
        region = self.region  # (the heartbeat is checked there, on the caller's thread)
        return None if region is None else self.resident.lease(region, mm_hashes, usable)

    def read_all(self, mm_hashes: Sequence[str], release: bool) -> list[Item] | None:
        """Every item copied out with no call, or None (one not resident, no region)."""
        region = self.region
        return None if region is None else self.resident.read(region, mm_hashes, release)

    def read_resident(
        self, region: ClientRegion, mm_hashes: Sequence[str]
    ) -> tuple[list[Item | None], int]:
        """The items resident in the region, copied out with no call (None for the
        rest), and the payload bytes read."""
        if not self.usable(region):  # stopped or killed: its items are not served
            return [None] * len(mm_hashes), 0
        found: list[Item | None] = []
        nbytes = 0
        for mm_hash in mm_hashes:
            got = region.read_resident(store_key(self._namespace, mm_hash), self._pool)
            found.append(None if got is None else got[0])
            nbytes += 0 if got is None else got[1]
        return found, nbytes

    async def read_shm(
        self,
        mm_hashes: Sequence[str],
        release: bool,
        region: ClientRegion,
        views: list[Slot] | None,
        wait: bool = True,
    ) -> list[Item] | None:
        """The items through the region (copied out, or viewed into `views` under
        holds), in one unary call; None when the server had no room (or is
        another server now). ShmRace: an extent was freed under the copy."""
        # Every extent under a hold, said done once copied (or viewed): an item
        # the region has no room for then comes in a transient copy, freed by
        # the done, instead of pushing another out. The holds done so far go
        # with the call, so the server frees their extents before this read.
        try:
            raw = await self._rpc().read_shm(
                mm_hashes,
                release,
                region.token,
                self.reports.done(region.token),
                wait,
                self._touch.call_timeout,
            )
        except InvalidArgumentError:
            self.restarted()  # the token is not the server's: a new server
            return None
        header = parse_fetched(raw)
        if header.instance_id != region.instance_id:  # another server now
            self.answered(header.instance_id)
            return None
        if not header.items and mm_hashes:
            return None
        held = [f.slot.hold for f in header.items if f.slot is not None and f.slot.hold]
        try:
            items = await decode_items(
                header, no_frames(), len(mm_hashes), self._pool, region, views
            )
        except BaseException:
            self.reports.add(region.token, done=held)
            raise
        if views is None:  # copied out; a view's block says them done when it ends
            self.reports.add(region.token, done=held)
        return items
