"""Batches answered once: the replies to the latest batches, by their client's batch id.

A client sends a batch over an upload session and, when the session ends
before the reply comes (a dropped connection, a server that stopped between
batches), sends it again as a call. The server may have applied it already:
then the call gets the reply that was lost, and the batch is not applied a
second time (its queries counted twice, its leases granted twice). A run of
the batch still under way when the copy arrives (its stream dead, the server
not yet aware) is cancelled first: its client has given up on it, and a
batch is applied with its reply built in one step (no await between them),
so the run either ended before applying anything or has its reply here.

Bounded by bytes: a copy comes within moments of the loss, so the latest
replies are enough. Transport-free: it sees tasks and bytes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable

from mmcache._errors import AbortedError, InvalidArgumentError

__all__ = ["MAX_BATCH_ID_BYTES", "MIN_BATCH_ID_BYTES", "REPLAY_BYTES", "Replays", "batch_key"]

MIN_BATCH_ID_BYTES = 8
MAX_BATCH_ID_BYTES = 64
REPLAY_BYTES = 4 << 20  # the replies kept; about 40k small ones
_ENTRY_OVERHEAD = 160  # a key, an entry, a bytes object: roughly, in CPython


def batch_key(namespace: str, batch_id: bytes) -> tuple[str, bytes] | None:
    """A batch's key among the replies (ids are the client's, so scoped by its
    namespace); None when it names no id."""
    if not batch_id:
        return None
    if not MIN_BATCH_ID_BYTES <= len(batch_id) <= MAX_BATCH_ID_BYTES:
        raise InvalidArgumentError(
            f"batch_id has {len(batch_id)} bytes: give {MIN_BATCH_ID_BYTES} to "
            f"{MAX_BATCH_ID_BYTES} (16 random bytes name a batch well), or none"
        )
    return namespace, batch_id


class Replays:
    """The replies to the latest batches that named an id, and the runs of
    such batches under way."""

    def __init__(self, max_bytes: int = REPLAY_BYTES) -> None:
        self._max = max_bytes
        self._bytes = 0
        self._done: OrderedDict[Hashable, bytes] = OrderedDict()
        self._running: dict[Hashable, asyncio.Task[object]] = {}
        self._superseded: set[asyncio.Task[object]] = set()
        self.replayed = 0  # batches answered from here (tests and logs)

    def __len__(self) -> int:
        return len(self._done)

    async def once(
        self, key: Hashable, apply: Callable[[], Awaitable[bytes]], *, call: bool
    ) -> bytes:
        """The reply of the batch `key`, applied by `apply` unless it was
        already (`call`: the batch came as a call, perhaps a copy of a batch
        whose session lost its reply)."""
        if call:
            earlier = await self.earlier(key)
            if earlier is not None:
                return earlier
        self.start(key)
        reply = None
        try:
            reply = await apply()
            return reply
        except asyncio.CancelledError:
            if not self.superseded():
                raise
            raise AbortedError(
                "a copy of this batch (same batch_id) came as a call and took over: its "
                "reply answers the batch; this stream ends here"
            ) from None
        finally:
            self.end(key, reply)

    async def earlier(self, key: Hashable) -> bytes | None:
        """The reply this batch already got, if any. A run of it still under
        way is cancelled and waited for first."""
        running = self._running.get(key)
        if running is not None:
            self._superseded.add(running)
            running.cancel()
            await asyncio.wait([running])  # its handler, ended with ABORTED
        reply = self._done.get(key)
        if reply is not None:
            self.replayed += 1
        return reply

    def start(self, key: Hashable) -> None:
        """This task now runs the batch `key`."""
        task = asyncio.current_task()
        assert task is not None
        self._running[key] = task

    def superseded(self) -> bool:
        """Whether this task's cancel came from `earlier` (a copy of its batch
        took over), not from grpc; the cancel is then undone, for the run to
        end its stream with a status of its own (grpc sends none for a
        handler cancelled by anyone but itself)."""
        task = asyncio.current_task()
        if task is None or task not in self._superseded:
            return False
        self._superseded.discard(task)
        task.uncancel()
        return True

    def end(self, key: Hashable, reply: bytes | None) -> None:
        """The run of `key` ended: with its reply, or None when it applied nothing."""
        self._running.pop(key, None)
        if reply is None:
            return
        old = self._done.pop(key, None)
        if old is not None:
            self._bytes -= len(old) + _ENTRY_OVERHEAD
        self._done[key] = reply
        self._bytes += len(reply) + _ENTRY_OVERHEAD
        while self._bytes > self._max:
            _, dropped = self._done.popitem(last=False)
            self._bytes -= len(dropped) + _ENTRY_OVERHEAD
