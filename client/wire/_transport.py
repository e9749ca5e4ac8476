"""The calls of `mmcache.v1.MMCache` on one channel, in the client's values.

GetAndUpdate(One) and Fetch are raw-bytes calls (the frames are built and
read by mmcache._frames and the codec); the rest are ordinary protobuf calls,
their messages made and read by `_messages`.
Which upload method a call takes, and where a bulk call's header travels
(metadata or a frame of its own), are decided and undone here: callers see
the header's bytes and the chunk frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Sequence
from math import ceil
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from mmcache._errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
)
from mmcache._frames import (
    MAX_METADATA_HEADER_BYTES,
    UPDATE_HEADER_KEY,
    header_frame,
    header_frame_body,
)
from mmcache.v1 import cache_pb2 as pb

from ._messages import (
    allocated_of,
    cleared_of,
    feed_message_of,
    fetch_request,
    info_of,
    located_of,
    reply_of,
    report_message,
)
from ._sessions import SessionPool, end_writes
from ._status import broken_write, translate_errors
from ._types import Allocated, Cleared, FeedMessage, Located, Reply, Report, ServerInfo

__all__ = ["CacheTransport"]

BATCH_ID_BYTES = 16  # random: a name no other batch has
_MAX_TIMEOUT_MS = (1 << 32) - 1  # UpdateRequest.timeout_ms is a uint32

Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)

_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["MMCache"].full_name


@contextlib.contextmanager
def _expiry_as_deadline(deadline: float) -> Iterator[None]:
    """A streaming upload whose deadline passes while it writes is failed by
    grpc's core as INTERNAL ("Internal error from Core") or a broken stream:
    past the deadline, that is the deadline."""
    try:
        yield
    except (InternalError, UnavailableError) as exc:
        if asyncio.get_running_loop().time() < deadline:
            raise
        raise DeadlineExceededError(f"the upload did not finish in time ({exc})") from exc


class CacheTransport:
    """Typed callables for each method; every failure is a typed mmcache error."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float, sessions: int = 0) -> None:
        self._timeout = timeout
        self._info = _unary(channel, "Info", pb.InfoRequest, pb.InfoReply)
        self._touch = _unary(channel, "Touch", pb.TouchRequest, pb.TouchReply)
        self._clear = _unary(channel, "Clear", pb.ClearRequest, pb.ClearReply)
        self._release = _unary(channel, "Release", pb.ReleaseRequest, pb.ReleaseReply)
        self._locate = _unary(channel, "Locate", pb.LocateRequest, pb.LocateReply)
        self._read_shm: grpc.aio.UnaryUnaryMultiCallable[pb.FetchRequest, bytes] = (
            channel.unary_unary(
                f"{_SERVICE}/ReadShm", request_serializer=pb.FetchRequest.SerializeToString
            )
        )
        self._shm_allocate = _unary(
            channel, "ShmAllocate", pb.ShmAllocateRequest, pb.ShmAllocateReply
        )
        self._open_report_ring = _unary(
            channel, "OpenReportRing", pb.OpenReportRingRequest, pb.ShmAllocateReply
        )
        self._subscribe = channel.unary_stream(
            f"{_SERVICE}/Subscribe",
            request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=pb.FeedMessage.FromString,
        )
        # No serializers: these move raw frames (bytes in, bytes out).
        self._update: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(
            f"{_SERVICE}/GetAndUpdate"
        )
        self._update_one: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            f"{_SERVICE}/GetAndUpdateOne"
        )
        self._fetch: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            f"{_SERVICE}/Fetch"
        )
        self._sessions = (
            SessionPool(channel.stream_stream(f"{_SERVICE}/UpdateSession"), sessions)
            if sessions
            else None
        )

    async def close(self) -> None:
        """End the sessions kept open (before the channel closes)."""
        if self._sessions is not None:
            await self._sessions.close()

    async def info(self, timeout: float | None = None, wait_for_ready: bool = True) -> ServerInfo:
        with translate_errors():
            reply: pb.InfoReply = await self._info(
                pb.InfoRequest(), timeout=timeout or self._timeout, wait_for_ready=wait_for_ready
            )
        return info_of(reply)

    async def touch(
        self, mm_hashes: Sequence[str], timeout: float | None = None, wait_for_ready: bool = True
    ) -> int:
        """How many of the hashes the server holds (each touched)."""
        with translate_errors():
            reply: pb.TouchReply = await self._touch(
                pb.TouchRequest(mm_hashes=mm_hashes),
                timeout=timeout or self._timeout,
                wait_for_ready=wait_for_ready,
            )
        return reply.touched

    async def clear(self, wait_for_ready: bool = True) -> Cleared:
        with translate_errors():
            reply: pb.ClearReply = await self._clear(
                pb.ClearRequest(), timeout=self._timeout, wait_for_ready=wait_for_ready
            )
        return cleared_of(reply)

    async def locate(
        self,
        mm_hashes: Sequence[str],
        check_l2: bool,
        timeout: float | None = None,
        wait_for_ready: bool = True,
    ) -> Located:
        with translate_errors():
            reply: pb.LocateReply = await self._locate(
                pb.LocateRequest(mm_hashes=mm_hashes, check_l2=check_l2),
                timeout=timeout or self._timeout,
                wait_for_ready=wait_for_ready,
            )
        return located_of(reply)

    async def release(
        self, mm_hashes: Sequence[str], timeout: float | None = None, wait_for_ready: bool = True
    ) -> int:
        """How many leases the server gave back."""
        reply = await self._report(pb.ReleaseRequest(mm_hashes=mm_hashes), timeout, wait_for_ready)
        return reply.released

    async def report(
        self, report: Report, timeout: float | None = None, wait_for_ready: bool = True
    ) -> str:
        """A Release: leases given back, and a co-located client's report; the
        instance that answered."""
        reply = await self._report(report_message(report), timeout, wait_for_ready)
        return reply.instance_id

    async def _report(
        self, request: pb.ReleaseRequest, timeout: float | None, wait_for_ready: bool
    ) -> pb.ReleaseReply:
        with translate_errors():
            reply: pb.ReleaseReply = await self._release(
                request, timeout=timeout or self._timeout, wait_for_ready=wait_for_ready
            )
        return reply

    async def read_shm(
        self,
        mm_hashes: Sequence[str],
        release: bool,
        token: bytes,
        done: Sequence[int],
        wait: bool = True,
        timeout: float | None = None,
        *,
        hold: bool = True,
    ) -> bytes:
        """A serialised FetchHeader (`parse_fetched` reads it): where the items
        are in the region of `token`, each extent under a hold (or none: no
        room); `done`: holds ended before it is served."""
        request = fetch_request(mm_hashes, release, shm_token=token, shm_hold=hold, shm_done=done)
        with translate_errors():
            reply: bytes = await self._read_shm(
                request, timeout=timeout or self._timeout, wait_for_ready=wait
            )
        return reply

    async def shm_allocate(
        self,
        token: bytes,
        lengths: Sequence[int],
        trailers: Sequence[int],
        timeout: float | None = None,
    ) -> Allocated:
        with translate_errors():
            reply: pb.ShmAllocateReply = await self._shm_allocate(
                pb.ShmAllocateRequest(shm_token=token, lengths=lengths, trailers=trailers),
                timeout=timeout or self._timeout,
            )
        return allocated_of(reply)

    async def open_report_ring(self, token: bytes) -> Allocated:
        """A report ring in the region of `token` (one slot, or none)."""
        with translate_errors():
            reply: pb.ShmAllocateReply = await self._open_report_ring(
                pb.OpenReportRingRequest(shm_token=token), timeout=self._timeout
            )
        return allocated_of(reply)

    async def subscribe(self, gap_s: float = 0.0) -> AsyncGenerator[FeedMessage, None]:
        """The feed's messages, until the server ends the stream (no deadline);
        `gap_s`: the least time wanted between two (0: the server's)."""
        request = pb.SubscribeRequest(gap_ms=round(gap_s * 1000))
        call = self._subscribe(request, wait_for_ready=True)
        try:
            with translate_errors():
                async for message in call:
                    yield feed_message_of(message)
        finally:
            call.cancel()

    async def get_and_update(
        self,
        header: bytes,
        chunks: Callable[[], Iterable[bytes]],
        *,
        timeout: float | None = None,
        wait_for_ready: bool = True,
    ) -> Reply:
        """Send a serialised UpdateRequest and its chunk frames (`chunks()`, made
        again if the batch must be sent again); the server's reply.

        Over a session kept open when one is idle (`_sessions`).
        Otherwise a call: one with no frames (hashes and touches only, the
        steady state) is a unary GetAndUpdateOne whose request is the header
        frame: one send on each side, and no binary metadata to encode. A call
        with data streams, even a single frame, its header in metadata when
        small: the server then checks the header while the bytes arrive, which
        measured faster than a unary call for frames of 512 KiB and up
        (docs/wire.md).
        """
        timeout = self._timeout if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + timeout
        if self._sessions is not None:
            # Named, so that the server answers it once should it go again as
            # a call (its session lost before the reply: server._replays).
            # Fields appended to a serialised message are merged into it.
            # A session has no deadline of its own: the batch carries its time.
            header += pb.UpdateRequest(
                batch_id=os.urandom(BATCH_ID_BYTES),
                timeout_ms=min(ceil(timeout * 1000), _MAX_TIMEOUT_MS),
            ).SerializeToString()
            sent = await self._over_session(header, chunks, timeout, wait_for_ready)
            if sent is not None:
                return reply_of(pb.UpdateReply.FromString(sent))
            timeout = max(deadline - asyncio.get_running_loop().time(), 0.001)
        frames = iter(chunks())
        first = next(frames, None)
        if first is None:
            with translate_errors():
                reply_bytes: bytes = await self._update_one(
                    header_frame(header), timeout=timeout, wait_for_ready=wait_for_ready
                )
            return reply_of(pb.UpdateReply.FromString(reply_bytes))
        data = itertools.chain((first,), frames)
        return await self._stream_upload(header, data, timeout, deadline, wait_for_ready)

    async def _over_session(
        self,
        header: bytes,
        chunks: Callable[[], Iterable[bytes]],
        timeout: float,
        wait_for_ready: bool,
    ) -> bytes | None:
        """The batch over a session kept open (`header` names it); None when
        none was idle or it was lost before its reply (then it goes as a call,
        with the same name)."""
        assert self._sessions is not None
        try:
            async with asyncio.timeout(timeout):
                with translate_errors():
                    return await self._sessions.exchange(
                        header, chunks(), wait_for_ready=wait_for_ready
                    )
        except TimeoutError:
            raise DeadlineExceededError(
                f"GetAndUpdate did not answer within {timeout:g} s"
            ) from None

    async def _stream_upload(
        self,
        header: bytes,
        data: Iterable[bytes],
        timeout: float,
        deadline: float,
        wait_for_ready: bool,
    ) -> Reply:
        """The batch as a GetAndUpdate call streaming its frames."""
        if len(header) <= MAX_METADATA_HEADER_BYTES:  # a message fewer
            call = self._update(
                metadata=((UPDATE_HEADER_KEY, header),),
                timeout=timeout,
                wait_for_ready=wait_for_ready,
            )
            stream: Iterable[bytes] = data
        else:
            call = self._update(timeout=timeout, wait_for_ready=wait_for_ready)
            stream = itertools.chain((header_frame(header),), data)
        with _expiry_as_deadline(deadline), translate_errors():
            try:
                for frame in stream:
                    await call.write(frame)
                await call.done_writing()
            except asyncio.InvalidStateError:
                # The server answered early (an error): awaiting the call raises it.
                await end_writes(call)
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                if broken_write(exc):
                    raise UnavailableError(f"the upload stream broke: {exc.details()}") from exc
                raise
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:
                # grpc's core can fail a write outright (ExecuteBatchError) when
                # the call ends under it: the call's own status tells why.
                call.cancel()
                raise UnavailableError(f"the upload stream broke: {exc!r}") from exc
            reply_bytes: bytes = await call
        return reply_of(pb.UpdateReply.FromString(reply_bytes))

    async def fetch(
        self,
        mm_hashes: Sequence[str],
        release: bool,
        wait: bool = True,
        timeout: float | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """A serialised FetchHeader (`parse_fetched` reads it), then the chunk
        frames of a Fetch."""
        call = self._fetch(
            fetch_request(mm_hashes, release).SerializeToString(),
            timeout=timeout or self._timeout,
            wait_for_ready=wait,
        )
        try:
            with translate_errors():
                frames = aiter(call)
                first = await anext(frames, None)
                if first is None:
                    raise InvalidArgumentError("the Fetch reply carries no header")
                yield header_frame_body(first, "the first Fetch frame")
                async for frame in frames:
                    yield frame
        finally:
            call.cancel()


def _unary(
    channel: grpc.aio.Channel, method: str, request: type[Request], reply: type[Response]
) -> grpc.aio.UnaryUnaryMultiCallable[Request, Response]:
    """A protobuf unary method of the service on `channel`."""
    return channel.unary_unary(
        f"{_SERVICE}/{method}",
        request_serializer=request.SerializeToString,
        response_deserializer=reply.FromString,
    )
