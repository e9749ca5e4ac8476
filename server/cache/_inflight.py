"""A byte budget for uploads in flight, so that memory stays bounded.

Uploads are buffered whole before they are committed (a cut-off upload must
leave nothing behind), so their bytes sit beside the cache's. Each call
reserves its declared payload before reading it; calls wait while the budget
is spent. A single call larger than the whole budget still runs, alone, so
an item of any size up to the capacity can move.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["InflightBudget"]


class InflightBudget:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def used(self) -> int:
        return self._used

    @property
    def limit(self) -> int:
        return self._limit

    def reserve(self, nbytes: int) -> _Reservation:
        """`async with budget.reserve(n):` holds n bytes of the budget."""
        return _Reservation(self, nbytes)

    async def _acquire(self, nbytes: int) -> None:
        while self._used and self._used + nbytes > self._limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        self._used += nbytes

    def _release(self, nbytes: int) -> None:
        # No await here: a cancelled call must still give its bytes back.
        self._used -= nbytes
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class _Reservation:
    # A plain class rather than @asynccontextmanager: it runs on every upload.
    __slots__ = ("_budget", "_nbytes")

    def __init__(self, budget: InflightBudget, nbytes: int) -> None:
        self._budget = budget
        self._nbytes = nbytes

    async def __aenter__(self) -> None:
        await self._budget._acquire(self._nbytes)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._budget._release(self._nbytes)
