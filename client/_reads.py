"""The engine's reads and their routes: items resident in the server's
shared-memory region copied out with no call; the rest moved into the region
by ReadShm and copied from there (or viewed in place); else brought by the
chunk frames of a Fetch. The caller checks the hashes first."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from mmcache._errors import CacheMissError, FailedPreconditionError
from mmcache._items import Item

from ._fetched import ShmRace, decode_items
from ._pool import BufferPool
from ._touch import Touch
from .colocated import CoLocated
from .wire import CacheTransport, Slot, parse_fetched

__all__ = ["Reads"]


class Reads:
    """`MMCacheClient.fetch` and `view`, by the best route each item has."""

    def __init__(
        self,
        rpc: Callable[[], CacheTransport],
        co: CoLocated,
        pool: BufferPool | None,
        forget: Callable[[Sequence[str]], None],
        touch: Touch,
    ) -> None:
        self._rpc = rpc
        self._co = co
        self._pool = pool
        self._forget = forget  # a miss: the mirror's "held" was wrong
        self._touch = touch  # the bound of reads (the fail-open deadline)

    async def fetch(self, mm_hashes: Sequence[str], release: bool, wait: bool) -> list[Item]:
        region = self._co.region
        try:
            if region is None:
                return await self._fetch(mm_hashes, release, wait)
            found, nbytes = self._co.read_resident(region, mm_hashes)
            missing = [h for h, item in zip(mm_hashes, found, strict=True) if item is None]
            read = [h for h, item in zip(mm_hashes, found, strict=True) if item is not None]
            whole = False
            try:
                if missing:  # (a region found closed is unmapped by now)
                    fetched = iter(await self._through(missing, release, wait))
                    found = [next(fetched) if item is None else item for item in found]
                whole = True
            finally:
                # Leases go back only when the whole read succeeded, as a Fetch's
                # do: a caller whose read failed releases them itself.
                if read:
                    released = read if release and whole else ()
                    self._co.reports.add(region.token, released=released, read_bytes=nbytes)
            return found  # type: ignore[return-value]
        except CacheMissError as exc:
            self._forget(exc.missing_hashes)
            raise

    @contextlib.asynccontextmanager
    async def view(self, mm_hashes: Sequence[str], release: bool) -> AsyncIterator[list[Item]]:
        region = self._co.region
        slots: list[Slot] = []
        items = None
        async with self._touch.bounded("view"):  # its calls together, not the block
            if region is not None:
                try:
                    items = await self._co.read_shm(mm_hashes, release, region, slots)
                except CacheMissError as exc:
                    self._forget(exc.missing_hashes)
                    raise
            if items is None or region is None:  # no shared memory: owned, as fetch gives
                owned = await self.fetch(mm_hashes, release, True)
        if items is None or region is None:
            yield owned
            return
        try:
            yield items
        finally:
            outlived = [s.lease for s in slots if not region.live(s)]
            self._co.reports.add(region.token, done=[s.hold for s in slots])
        if outlived:
            raise FailedPreconditionError(
                f"a view of {len(outlived)} items outlived its lease (--lease-s on the "
                "server): their memory may have been reused under it; copy sooner"
            )

    async def _through(self, mm_hashes: Sequence[str], release: bool, wait: bool) -> list[Item]:
        """Items not (yet) resident: ReadShm moves them into the region and says
        where, or the chunk frames of a Fetch bring them."""
        region = self._co.region  # (a region found closed is unmapped by now)
        if region is not None:
            try:
                # Leases go back once the bytes are copied out, not with the reply:
                # an item moved out of the region under the copy is read again
                # below, and must still be there.
                read = await self._co.read_shm(mm_hashes, False, region, None, wait)
            except ShmRace:
                read = None
            if read is not None:
                if release:
                    self._co.reports.add(region.token, released=mm_hashes)
                return read
        return await self._fetch(mm_hashes, release, wait)

    async def _fetch(self, mm_hashes: Sequence[str], release: bool, wait: bool) -> list[Item]:
        """The items as the chunk frames of a Fetch."""
        frames = self._rpc().fetch(mm_hashes, release, wait, self._touch.call_timeout)
        try:
            header = parse_fetched(await anext(frames))
            self._co.answered(header.instance_id)  # a restart: its new region mapped
            return await decode_items(header, frames, len(mm_hashes), self._pool)
        finally:
            await frames.aclose()
