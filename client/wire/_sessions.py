"""GetAndUpdate over streams kept open (`UpdateSession`): no call set-up per batch.

Setting up a call is much of a small batch's time in CPython's gRPC: over a
stream kept open, a 1 MiB put takes about 0.8x the time of a call of its own,
and the commit of an 8 MiB upload through shared memory about 0.6x
(bench/transfer.py). So the transport keeps a few sessions open, each
carrying one batch at a time: a header frame and its chunk frames out, one
UpdateReply back. A batch that finds none idle, with MAX_SESSIONS open, makes
a call of its own.

A session that ends before answering, with OK (the server ends sessions
between batches when it stops), UNAVAILABLE or CANCELLED (a restarted
server, a dropped connection), or under the batch's writes with INTERNAL
(grpc's status for a stream cut short), is answered None: the caller sends
the batch again as a call, which waits for the channel as calls do and
reports the server's own status. The server may have applied the batch
before the link failed: the transport names each batch (`batch_id`), and
the server answers a copy of one it applied with the reply that was lost
(server._replays), so nothing is counted twice. A server from before
sessions (UNIMPLEMENTED) gets calls from then on. Any other status is the
batch's own failure, raised. A batch that times out or is cancelled takes
its session down with it: the stream is then mid-batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import grpc

from mmcache._frames import header_frame

from ._status import broken_write

__all__ = ["FULL_BACKOFF_S", "MAX_SESSIONS", "SessionPool", "end_writes"]

MAX_SESSIONS = 4  # per client: concurrent batches beyond this make calls of their own
FULL_BACKOFF_S = 10.0  # after the server refused a session for want of room

# A session ending with one of these before it answers did not fail for this
# batch: the caller sends it again as a call.
_SEND_AGAIN = frozenset(
    {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
)

_Call = grpc.aio.StreamStreamCall[bytes, bytes]


async def end_writes(
    call: grpc.aio.StreamStreamCall[Any, Any] | grpc.aio.StreamUnaryCall[Any, Any],
) -> None:
    """Close the request side of a write-style stream call the server has
    ended. With a client interceptor (tokens, namespaces), grpc feeds such a
    call from a queue through a task of its own, and when the server ends the
    call first (a refusal) that task would wait on the queue until collected,
    then be reported: "Task was destroyed but it is pending!" and "aclose():
    asynchronous generator is already running". Ending the writes ends it."""
    if call.done():
        with contextlib.suppress(Exception):
            await call.done_writing()


class SessionPool:
    """The UpdateSession streams of one channel; idle ones wait for the next batch."""

    def __init__(
        self, method: grpc.aio.StreamStreamMultiCallable[bytes, bytes], limit: int
    ) -> None:
        self._method = method
        self._limit = limit
        self._idle: list[_Call] = []
        self._open = 0
        self._full_until = 0.0  # no new session before (the server had no room)

    async def exchange(
        self, header: bytes, frames: Iterable[bytes], *, wait_for_ready: bool
    ) -> bytes | None:
        """The serialised UpdateReply to one batch sent over a session, or None
        where it must go as a call: no session to be had, or the one taken
        ended before answering. The batch's own failure raises grpc's error.
        The caller bounds the time."""
        taken = self._take(wait_for_ready)
        if taken is None:
            return None
        call, fresh = taken
        reply = None
        try:
            if fresh and not await self._opened(call):
                return None
            if not await self._written(call, header, frames):
                return None
            reply = await call.read()  # raises the status of a session ended otherwise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._limit = 0  # a server from before sessions: calls from now on
            elif exc.code() not in _SEND_AGAIN and not broken_write(exc):
                # (A write grpc's core failed under a session the server had
                # just ended, a refusal among them, ends the call INTERNAL and
                # hides the server's status: a call tells it.)
                raise
        finally:
            self._give_back(call, kept=isinstance(reply, bytes))
            await end_writes(call)
        # EOF: the server ended it with OK between batches (a status other than
        # OK would have raised).
        return reply if isinstance(reply, bytes) else None

    async def _opened(self, call: _Call) -> bool:
        """Whether a new session was taken. The server answers its headers
        before anything is written: a refusal (a token, a namespace) then comes
        with its own status, which a failed write would hide."""
        await call.initial_metadata()
        if not call.done():
            return True
        if await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # The server's sessions are all taken (--max-sessions): calls for a
            # while. (Its namespaces all taken: the call is refused too, and
            # says so.)
            self._full_until = asyncio.get_running_loop().time() + FULL_BACKOFF_S
            return False
        await call.read()  # raises the refusal; EOF: ended with OK
        return False

    async def _written(self, call: _Call, header: bytes, frames: Iterable[bytes]) -> bool:
        """The batch written to the session; False where it must go as a call."""
        try:
            await call.write(header_frame(header))
            for frame in frames:
                await call.write(frame)
        except Exception:  # grpc's core fails writes in several ways
            # The stream ended under the writes, so this batch never reached
            # the server whole and nothing of it was applied. A status of
            # the server's own (a revoked token) is the batch's answer;
            # INTERNAL (grpc's, for a stream cut under its writes) and
            # those of a session that ended say nothing of it: a call tells.
            code = await call.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self._limit = 0
            elif code not in _SEND_AGAIN and code != grpc.StatusCode.INTERNAL:
                raise grpc.aio.AioRpcError(
                    code,
                    await call.initial_metadata(),
                    await call.trailing_metadata(),
                    await call.details(),
                ) from None
            return False
        return True

    async def close(self) -> None:
        """End the idle sessions: the server sees each one end cleanly."""
        idle, self._idle = self._idle, []
        for call in idle:
            self._open -= 1
            try:
                await call.done_writing()
                await asyncio.wait_for(call.code(), 1.0)
            except (asyncio.InvalidStateError, grpc.aio.AioRpcError, TimeoutError):
                call.cancel()

    def _take(self, wait_for_ready: bool) -> tuple[_Call, bool] | None:
        """An idle session, or a new one (True), or None."""
        while self._idle:
            call = self._idle.pop()
            if not call.done():
                return call, False
            self._open -= 1  # the server ended it while idle
        if self._open >= self._limit or asyncio.get_running_loop().time() < self._full_until:
            return None
        self._open += 1
        return self._method(wait_for_ready=wait_for_ready), True

    def _give_back(self, call: _Call, *, kept: bool) -> None:
        if kept and not call.done():
            self._idle.append(call)
            return
        self._open -= 1
        call.cancel()  # a no-op on an ended call
