"""Reads of big Redis replies: each bulk string is received straight into a
buffer of its own (`asyncio.BufferedProtocol`, the transport's `recv_into`).

redis-py's asyncio parser copies each byte of a reply five times (the
transport's chunk, the stream's buffer, `readexactly`, `tail + data`, `[:-2]`),
which made an L2 hit of a 6.4 MB item cost 2.3 ms of a 2-core machine, most of
it copies. Here a byte is copied once, by the kernel. Only the replies the L2
tier's reads get are parsed (RESP2: simple strings, errors, integers, bulk
strings, arrays); redis-py keeps every other command.

A few connections per node carry pipelined commands: replies come in the
order of the commands, so each command's waiter stays in its place in the
queue until its own reply arrives, and a command goes on an idle connection
where there is one (a small reply does not wait behind a big one; Redis
interleaves the replies of its connections). One reply per waiter, always: a
waiter that gave up (its caller's deadline) keeps its place, and its reply,
when it comes, is read and dropped; it is never handed to the next waiter,
which would be another key's value. A connection whose state is in doubt (a
command not wholly written, a reply that does not parse) is aborted before
anything else is sent on it.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Sequence
from typing import TypeAlias

from redis.exceptions import ClusterDownError, MovedError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["BulkReader", "Reply", "encode_command"]

Reply: TypeAlias = bytes | int | list["Reply"] | None

_HEAD_BYTES = 64 * 1024  # line parsing; a bulk larger than the room left gets its own buffer
# A bulk string is received into a buffer reused across replies (warm pages,
# no zeroing), then copied once into its bytes: grpc sends bytes only.
_SCRATCH_MOST = 4 * 1024 * 1024  # larger ones get a buffer of their own
_CRLF = b"\r\n"


def encode_command(args: Sequence[bytes | str | int]) -> bytes:
    """A command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _error(text: str) -> ResponseError:
    """A Redis error reply as redis-py's exception, so routing treats both alike."""
    kind, _, rest = text.partition(" ")
    if kind == "MOVED":
        return MovedError(rest)
    if kind == "CLUSTERDOWN":
        return ClusterDownError(text)
    return ResponseError(text)


class _Replies(asyncio.BufferedProtocol):
    """Parses replies as bytes arrive and hands each to the oldest waiter."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.waiters: collections.deque[asyncio.Future[Reply | ResponseError]] = collections.deque()
        self._head = bytearray(_HEAD_BYTES)
        self._start = 0  # parsed up to here
        self._end = 0  # received up to here
        self._bulk: memoryview | None = None  # a bulk string being received
        self._scratch = bytearray()
        self._filled = 0
        self._skip = 0  # the CRLF after a bulk received into its buffer
        self._into_bulk = False  # get_buffer gave the bulk's own buffer
        self._arrays: list[tuple[list[Reply], int]] = []  # open arrays: items, length

    # -- asyncio's side --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        self._into_bulk = (
            self._bulk is not None and len(self._bulk) - self._filled > _HEAD_BYTES // 2
        )
        if self._bulk is not None and self._into_bulk:
            return self._bulk[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._head) - self._end < _HEAD_BYTES // 2:  # room for a read
            kept = self._end - self._start
            self._head[:kept] = self._head[self._start : self._end]
            self._start, self._end = 0, kept
        return memoryview(self._head)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._bulk is not None and self._into_bulk:
            self._filled += nbytes
            if self._filled == len(self._bulk):
                self._bulk_done()
        else:
            self._end += nbytes
        try:
            self._parse()
        except ValueError as exc:  # not RESP: nothing after it can be trusted
            assert self.transport is not None
            self._fail(RedisConnectionError(f"an unreadable reply: {exc}"))
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    # -- parsing --

    def _parse(self) -> None:
        while True:
            if self._bulk is not None:
                take = min(len(self._bulk) - self._filled, self._end - self._start)
                if take:
                    self._bulk[self._filled : self._filled + take] = self._head[
                        self._start : self._start + take
                    ]
                    self._start += take
                    self._filled += take
                if self._filled < len(self._bulk):
                    return
                self._bulk_done()
            if self._skip:
                take = min(self._skip, self._end - self._start)
                self._start += take
                self._skip -= take
                if self._skip:
                    return
            at = self._head.find(_CRLF, self._start, self._end)
            if at < 0:
                if self._end - self._start >= _HEAD_BYTES // 2:
                    raise ValueError("a line longer than 32 KiB")
                return
            kind, line = self._head[self._start], bytes(self._head[self._start + 1 : at])
            self._start = at + 2
            self._line(kind, line)

    def _line(self, kind: int, line: bytes) -> None:
        if kind == ord("+"):
            self._value(line)
        elif kind == ord("-"):
            self._value(_error(line.decode(errors="replace")))
        elif kind == ord(":"):
            self._value(int(line))
        elif kind == ord("$"):
            size = int(line)
            if size < 0:
                self._value(None)
            elif self._end - self._start >= size + 2:  # all here already: small
                data = bytes(self._head[self._start : self._start + size])
                self._start += size + 2
                self._value(data)
            else:
                if size > _SCRATCH_MOST:
                    self._bulk = memoryview(bytearray(size))
                else:
                    if len(self._scratch) < size:
                        self._scratch = bytearray(size)
                    self._bulk = memoryview(self._scratch)[:size]
                self._filled = 0
        elif kind == ord("*"):
            size = int(line)
            if size < 0:
                self._value(None)
            elif size == 0:
                self._value([])
            else:
                self._arrays.append(([], size))
        else:
            raise ValueError(f"reply type {chr(kind)!r}")

    def _bulk_done(self) -> None:
        assert self._bulk is not None
        data, self._bulk = bytes(self._bulk), None
        self._skip = 2
        self._value(data)

    def _value(self, value: Reply | ResponseError) -> None:
        while self._arrays:
            items, size = self._arrays[-1]
            items.append(value)  # type: ignore[arg-type]  # errors nest as values
            if len(items) < size:
                return
            self._arrays.pop()
            value = items
        if not self.waiters:  # a reply nobody asked for: nothing after it can be trusted
            raise ValueError("a reply with no command waiting for it")
        waiter = self.waiters.popleft()
        if not waiter.done():  # done: its caller gave up, and this, its reply, is dropped
            waiter.set_result(value)

    def _fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)


class BulkReader:
    """Commands on one Redis node whose replies may be big, on one connection
    opened at first use (and again after it fails). Errors are redis-py's:
    `ResponseError` (and `MovedError`, `ClusterDownError`) for error replies,
    `ConnectionError` when there is no connection.

        reader = BulkReader("127.0.0.1", 7000)
        fields = await reader.command(b"HGETALL", b"key")
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout_s: float = 1.0,
        connections: int = 4,
    ) -> None:
        self._host, self._port = host, port
        self._username, self._password = username, password
        self._tls = tls
        self._connect_timeout_s = connect_timeout_s
        self._most = connections
        self._open: list[_Replies] = []
        self._opening = asyncio.Lock()

    async def command(self, *args: bytes | str | int) -> Reply:
        replies = await self._connected()
        reply = await self._send(replies, encode_command(args))
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def close(self) -> None:
        opened, self._open = self._open, []
        for replies in opened:
            if replies.transport is not None:
                replies.transport.close()

    def drop(self) -> None:
        """Close the connections now (the node failed); the next command opens one."""
        opened, self._open = self._open, []
        for replies in opened:
            if replies.transport is not None:
                replies.transport.abort()

    async def _send(self, replies: _Replies, command: bytes) -> Reply | ResponseError:
        if replies.lost is not None or replies.transport is None:
            raise replies.lost or RedisConnectionError("not connected")
        waiter: asyncio.Future[Reply | ResponseError] = asyncio.get_running_loop().create_future()
        replies.waiters.append(waiter)
        replies.transport.write(command)
        return await waiter

    async def _connected(self) -> _Replies:
        """An idle connection, a new one while there are fewer than the most,
        else the least busy. Connections are opened one at a time, so that a
        burst of commands at start opens no more than the most."""
        taken = self._taken()
        if taken is not None:
            return taken
        async with self._opening:
            taken = self._taken()
            if taken is not None:
                return taken
            replies = await self._connect()
            self._open.append(replies)
            return replies

    def _taken(self) -> _Replies | None:
        """An open connection to use now: an idle one, or with all open, the least busy."""
        self._open = [r for r in self._open if r.lost is None]
        least = min(self._open, key=lambda r: len(r.waiters), default=None)
        if least is not None and (not least.waiters or len(self._open) >= self._most):
            return least
        return None

    async def _connect(self) -> _Replies:
        loop = asyncio.get_running_loop()
        try:
            _, replies = await asyncio.wait_for(
                loop.create_connection(
                    _Replies,
                    self._host,
                    self._port,
                    ssl=self._tls,
                    server_hostname=self._host if self._tls is not None else None,
                ),
                self._connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(
                f"cannot connect to {self._host}:{self._port}: {exc or 'timed out'}"
            ) from None
        if self._password is None:
            return replies
        auth: list[bytes | str | int] = ["AUTH", self._password]
        if self._username is not None:
            auth.insert(1, self._username)
        assert replies.transport is not None
        try:
            reply = await self._send(replies, encode_command(auth))
        except BaseException:  # given up while authenticating: no half-open connection kept
            replies.transport.abort()
            raise
        if isinstance(reply, ResponseError):
            replies.transport.close()
            raise reply
        return replies
