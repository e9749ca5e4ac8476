"""Upload sessions (`UpdateSession`): GetAndUpdate batch after batch over one stream.

A session waits between batches for its client's next header. It ends there,
never in the middle of a batch: when its client half-closes, and when the
server stops (the sessions waiting then end at once, so a stopping server
does not wait out its grace for streams that carry nothing). A batch whose
header a session never read is the client's to send again. Its token is
checked again with each batch (the servicer), so a revoked token stops
working at its next batch, as it would on its next call. A batch refused at
its header is read to its end first (`skip_batch`): refused while its client
still writes, grpc's core fails those writes and ends the call INTERNAL on
the client's side, hiding the refusal.

Transport-free: it sees the stream only as an async iterator of frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from mmcache._errors import ResourceExhaustedError

from ._config import ServerConfig

__all__ = ["SKIP_S", "Sessions", "skip_batch"]

SKIP_S = 5.0  # a refused batch's frames are read for at most this long


async def skip_batch(frames: AsyncIterator[bytes], count: int) -> None:
    """Read and drop the `count` frames after a refused batch's header (for at
    most SKIP_S, whatever the stream does meanwhile)."""

    async def skip() -> None:
        for _ in range(count):
            if await anext(frames, None) is None:
                return

    with contextlib.suppress(Exception):  # the refusal is the answer either way
        await asyncio.wait_for(skip(), SKIP_S)


class Sessions:
    """The sessions open on one server, at most `limit`, and when each must end.

    Each open session costs the server about 26 KiB while it waits (a call,
    a task, its buffers: measured with 2000 open), so their number is
    bounded; a client refused one sends its batch as a call.
    """

    def __init__(self, limit: int = ServerConfig.max_sessions) -> None:
        self._limit = limit
        self._waiting: set[asyncio.Task[object]] = set()
        self._stopping = False
        self.opened = 0  # sessions ever opened (tests and logs)
        self.live = 0  # sessions open now

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """One session open while in the block; RESOURCE_EXHAUSTED past the limit."""
        if self.live >= self._limit:
            raise ResourceExhaustedError(
                f"this server already has {self.live} upload sessions open, its limit "
                "(--max-sessions): send this batch as a GetAndUpdate call (the Python client "
                "does so by itself), or raise the limit"
            )
        self.live += 1
        self.opened += 1
        try:
            yield
        finally:
            self.live -= 1

    @property
    def waiting(self) -> int:
        """Sessions waiting for their client's next batch."""
        return len(self._waiting)

    async def headers(self, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Each batch's first frame, as its client sends it, until the session
        ends (the caller reads the rest of the batch from `frames`)."""
        task = asyncio.current_task()
        assert task is not None
        while not self._stopping:
            self._waiting.add(task)
            try:
                frame = await anext(frames, None)
            except asyncio.CancelledError:
                if not self._stopping:
                    raise
                task.uncancel()  # our own cancel (see stop): the session just ends
                return
            finally:
                self._waiting.discard(task)
            if frame is None:
                return
            yield frame

    def start(self) -> None:
        """Take sessions again (a server started after a stop)."""
        self._stopping = False

    def stop(self) -> None:
        """End every session at its next wait; the waiting ones now."""
        self._stopping = True
        for task in list(self._waiting):
            task.cancel()
