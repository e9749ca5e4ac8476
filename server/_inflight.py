"""A byte budget for uploads in flight, so that memory stays bounded.

Uploads are buffered whole before they are committed (a cut-off upload must
leave nothing behind), so their bytes sit beside the cache's. Each call
reserves its declared payload before reading it; calls wait while the budget
is spent. A single call larger than the whole budget still runs, alone, so
an item of any size up to the capacity can move.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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

    @asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        while self._used and self._used + nbytes > self._limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        self._used += nbytes
        try:
            yield
        finally:
            # No await here: a cancelled call must still give its bytes back.
            self._used -= nbytes
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
