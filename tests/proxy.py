"""A TCP proxy on a free loopback port, for connections that fail on cue.

It forwards bytes both ways; `hold_replies()` stops what comes from the
server short of the client (buffered, never delivered), and `drop()` cuts
every connection through it, as a dead link or a node going away would.
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

    def drop(self) -> None:
        """Cut every connection now (reset, not closed); new ones are forwarded."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        self._holding = False

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
                writer.write(data)
                await writer.drain()
        writer.close()
