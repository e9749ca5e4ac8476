"""Uploads in flight, by hash: so that a new item's bytes travel once.

A call that uploads a hash nobody is uploading marks it pending (the feed
says so, and mirrors that see it send the hash alone); a call that names a
pending hash without data waits for that upload to end, then finds the item
held. A call marks only after its own waits, so it never waits while holding
a mark another call may be waiting for: no two calls can wait on each other.

Claims, single flight across this server's clients: a lookup that asks to
(`claim_ms`) claims the hashes it sent alone that nobody holds or uploads,
as its caller is about to process them. A claim is waited for as an upload
in flight is (past the waiter's own bound, up to the server's: `wait`), but
is not on the feed (the claimer's own mirror must not take it for an upload
and send the hash alone). It ends when any upload of the hash ends, stored
or not, or when its time runs out (a claimer that died or declined): a
waiter loses at most the server's bound (0.5 s), then processes the item.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from ._changes import ItemChange, ItemChanges
from ._types import Change

__all__ = ["MOST_CLAIM_S", "PendingUploads"]

# The longest a claim lasts, whatever its caller asks: a claimer that died
# leaves it at most this long (each waiter waits the server's bound at most).
MOST_CLAIM_S = 10.0


class PendingUploads:
    def __init__(
        self, changes: ItemChanges, on_expire: Callable[[], object] = lambda: None
    ) -> None:
        self._changes = changes
        self._on_expire = on_expire  # a claim's time ran out with no upload
        self._ends: dict[str, asyncio.Future[None]] = {}
        self._claims: dict[str, tuple[asyncio.Future[None], asyncio.TimerHandle]] = {}

    def hashes(self) -> list[str]:
        """Hashes being uploaded now."""
        return list(self._ends)

    async def wait(
        self, mm_hashes: Sequence[str], timeout: float | None, claim_timeout: float | None
    ) -> int:
        """Wait for the uploads of these hashes, at most `timeout` s, or
        `claim_timeout` s where one is claimed; how many there were. A claim
        is waited for longer than the caller's own processing time: its
        claimer began processing first, so its upload normally ends sooner
        than a processing here would; the longer bound only binds where the
        claimer died or declined, or takes longer than it."""
        if not self._ends and not self._claims:
            return 0
        waiting = {h for h in mm_hashes if h in self._ends or h in self._claims}
        ends = {self._ends[h] for h in waiting if h in self._ends}
        claims = {self._claims[h][0] for h in waiting if h in self._claims}
        if claims and timeout is not None:
            timeout = None if claim_timeout is None else max(timeout, claim_timeout)
        if waiting:
            await asyncio.wait(ends | claims, timeout=timeout)
        return len(waiting)

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
        """The upload ended (stored or not): wake its waiters, and those of a
        claim of the hash."""
        for h in marked:
            self._ends.pop(h).set_result(None)
            self._changes.publish(ItemChange(Change.SETTLED, h))
            self._end_claim(h)

    def claim(self, mm_hashes: Iterable[str], seconds: float) -> int:
        """Claim, for `seconds` (MOST_CLAIM_S at most), the hashes nobody
        uploads or claims yet; how many were claimed."""
        loop = asyncio.get_running_loop()
        seconds = min(seconds, MOST_CLAIM_S)
        claimed = 0
        for h in mm_hashes:
            if h not in self._ends and h not in self._claims:
                timer = loop.call_later(seconds, self._expire, h)
                self._claims[h] = (loop.create_future(), timer)
                claimed += 1
        return claimed

    def _expire(self, mm_hash: str) -> None:
        self._on_expire()
        self._end_claim(mm_hash)

    def _end_claim(self, mm_hash: str) -> None:
        ended = self._claims.pop(mm_hash, None)
        if ended is not None:
            ended[1].cancel()
            ended[0].set_result(None)
