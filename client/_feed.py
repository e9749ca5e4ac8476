"""The client's end of the mirror feed: a background task that keeps the
mirror following the server.

It subscribes, applies the snapshot and then every batch of changes to the
mirror. When the stream ends (a restart, a network fault) or skips a number
(which a correct server never does), the mirror stops trusting itself to
follow, and the task subscribes again after a short backoff: the new snapshot
repairs whatever was missed. Meanwhile the replies of the client's own calls
keep the mirror as right as it was without a feed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from mmcache._errors import MMCacheError

from ._mirror import Mirror
from .wire import FeedMessage

__all__ = ["FeedFollower"]

_LOGGER = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0


class FeedFollower:
    """Runs `subscribe()` into `mirror` until cancelled."""

    def __init__(
        self,
        subscribe: Callable[[], AsyncIterator[FeedMessage]],
        mirror: Callable[[], Mirror],
        on_live: Callable[[], None],
        on_instance: Callable[[str], None] = lambda _: None,
    ) -> None:
        self._subscribe = subscribe
        self._mirror = mirror
        self._on_live = on_live
        self._on_instance = on_instance  # each snapshot's: a restart seen here too
        self.live = asyncio.Event()
        self.resubscribes = 0

    async def run(self) -> None:
        backoff = _BACKOFF_FIRST_S
        while True:
            try:
                async for _ in self._follow():
                    backoff = _BACKOFF_FIRST_S  # a snapshot arrived: healthy again
            except MMCacheError as exc:
                _LOGGER.debug("mirror feed interrupted: %s", exc)
            except Exception:
                # A message this client cannot apply (a bug somewhere): the
                # mirror must not go on believing it follows. Subscribe again.
                _LOGGER.warning("mirror feed failed; subscribing again", exc_info=True)
            self.live.clear()
            self._mirror().feed_lost()
            self.resubscribes += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _follow(self) -> AsyncIterator[None]:
        """Apply one subscription; yields after each snapshot applied.

        `live` is set once the mirror has caught up with the feed's head as
        of the snapshot (the snapshot may be a shared, older one).
        """
        hashes: list[str] = []
        sizes: list[int] = []
        pending: list[str] = []
        head: int | None = None  # caught up once the mirror has applied this far
        self._mirror().syncing = True
        stream = self._subscribe()
        try:
            async for message in stream:
                mirror = self._mirror()
                part = message.snapshot
                if part is not None:
                    hashes.extend(part.mm_hashes)
                    sizes.extend(part.sizes)
                    pending.extend(part.pending)
                    if not part.last:
                        continue
                    mirror.apply_snapshot(
                        message.instance_id,
                        message.seq,
                        hashes,
                        sizes,
                        pending,
                        part.capacity_bytes,
                        part.max_items,
                    )
                    hashes, sizes, pending = [], [], []
                    head = None
                    self._on_instance(message.instance_id)
                    yield
                elif message.changes is not None:
                    if not mirror.apply_changes(message.instance_id, message.seq, message.changes):
                        _LOGGER.info("mirror feed skipped a change: subscribing again")
                        return
                else:  # the head after a snapshot
                    head = message.seq
                if head is not None and mirror.following and mirror.feed_seq >= head:
                    head = None
                    self.live.set()
                    self._on_live()
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
