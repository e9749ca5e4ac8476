"""Uploads in flight, by hash: so that a new item's bytes travel once.

A call that uploads a hash nobody is uploading marks it pending (the feed
says so, and mirrors that see it send the hash alone); a call that names a
pending hash without data waits for that upload to end, then finds the item
held. A call marks only after its own waits, so it never waits while holding
a mark another call may be waiting for: no two calls can wait on each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from ._changes import ItemChange, ItemChanges
from ._types import Change

__all__ = ["PendingUploads"]


class PendingUploads:
    def __init__(self, changes: ItemChanges) -> None:
        self._changes = changes
        self._ends: dict[str, asyncio.Future[None]] = {}

    def hashes(self) -> list[str]:
        """Hashes being uploaded now."""
        return list(self._ends)

    async def wait(self, mm_hashes: Iterable[str], timeout: float | None) -> int:
        """Wait (at most `timeout` s) for the uploads of these hashes; how many there were."""
        if not self._ends:
            return 0
        ends = {self._ends[h] for h in mm_hashes if h in self._ends}
        if ends:
            await asyncio.wait(ends, timeout=timeout)
        return len(ends)

    def mark(self, mm_hashes: Sequence[str]) -> list[str]:
        """Mark the hashes nobody uploads yet; the ones marked, to `settle` when done."""
        marked: list[str] = []
        loop = asyncio.get_running_loop()
        for h in mm_hashes:
            if h not in self._ends:
                self._ends[h] = loop.create_future()
                self._changes.publish(ItemChange(Change.PENDING, h))
                marked.append(h)
        return marked

    def settle(self, marked: Iterable[str]) -> None:
        """The upload ended (stored or not): wake its waiters."""
        for h in marked:
            self._ends.pop(h).set_result(None)
            self._changes.publish(ItemChange(Change.SETTLED, h))
