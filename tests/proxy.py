"""A TCP proxy on a free loopback port, for connections that fail on cue.

It forwards bytes both ways; `hold_replies()` stops what comes from the
server short of the client (buffered, never delivered), `stall()` holds it
back until `release()` lets it through (all of it, or its first bytes), as a
master that stalls would, and `drop()` cuts every connection through it, as
a dead link or a node going away would.
"""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._holding = False
        self._stalled = False
        self._held: list[tuple[asyncio.StreamWriter, bytearray]] = []  # in arrival order
        self.port = 0

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.drop()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()

    def hold_replies(self) -> None:
        """From now on, what the server sends goes no further."""
        self._holding = True

    def stall(self) -> None:
        """From now on, what the server sends waits for `release`."""
        self._stalled = True

    @property
    def held_bytes(self) -> int:
        return sum(len(data) for _, data in self._held)

    def release(self, nbytes: int | None = None) -> None:
        """Deliver what is held, in order: all of it (and stop stalling), or
        its first `nbytes` (still stalled), cutting a reply anywhere."""
        left = self.held_bytes if nbytes is None else nbytes
        while self._held and left > 0:
            writer, data = self._held[0]
            part = data[:left]
            del data[:left]
            left -= len(part)
            if not writer.is_closing():
                writer.write(bytes(part))
            if not data:
                self._held.pop(0)
        if nbytes is None:
            self._stalled = False

    def drop(self) -> None:
        """Cut every connection now (reset, not closed); new ones are forwarded."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        self._held.clear()
        self._holding = self._stalled = False

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._target)
        self._writers += [client_w, server_w]
        for task in (
            asyncio.create_task(self._pipe(client_r, server_w, replies=False)),
            asyncio.create_task(self._pipe(server_r, client_w, replies=True)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, replies: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(1 << 16):
                if replies and self._holding:
                    continue
                if replies and (self._stalled or any(w is writer for w, _ in self._held)):
                    self._hold(writer, data)  # behind what is held already, in order
                    continue
                writer.write(data)
                await writer.drain()
        writer.close()

    def _hold(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if self._held and self._held[-1][0] is writer:
            self._held[-1][1].extend(data)
        else:
            self._held.append((writer, bytearray(data)))
