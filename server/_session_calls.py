"""UpdateSession's calls: each batch on the one stream admitted (its token
checked again, its namespace), applied as a GetAndUpdate is, and answered,
and counted as a request of its own. The sessions' bounds and ends are
server._sessions'."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from mmcache._errors import InvalidArgumentError, MMCacheError
from mmcache._frames import UPDATE_HEADER_KEY
from mmcache.metrics import RequestMetrics
from mmcache.v1 import cache_pb2 as pb

from ._auth import Metadata
from ._namespaces import Namespace
from ._sessions import Sessions, skip_batch
from ._status import failure_code, write
from ._upload import chunks_declared, header_metadata, request_of_frame

__all__ = ["SessionCalls"]

Context = grpc.aio.ServicerContext[Any, Any]
NamespaceOf = Callable[[Context], Namespace]
# The servicer's GetAndUpdate: context, namespace, request, frames, header in
# metadata; `last` False: more batches follow on the stream.
Update = Callable[..., Awaitable[bytes]]


class SessionCalls:
    """UpdateSession's handler, over the server's `Sessions`."""

    def __init__(
        self,
        sessions: Sessions,
        batch_metrics: RequestMetrics,
        authorize: Callable[[Metadata], MMCacheError | None] = lambda _: None,
    ) -> None:
        self._sessions = sessions
        self._batch_metrics = batch_metrics
        self._authorize = authorize

    async def serve(
        self,
        frames: AsyncIterator[bytes],
        context: Context,
        namespace_of: NamespaceOf,
        update: Update,
    ) -> None:
        """Batch after batch until the session ends (server._sessions)."""
        namespace_of(context)  # refused at open, not at its first batch
        if header_metadata(context) is not None:
            raise InvalidArgumentError(
                f"an UpdateSession carries each batch's header as the batch's first frame, "
                f"not as {UPDATE_HEADER_KEY} metadata"
            )
        with self._sessions.admitted():
            # Headers at once: the client waits for them before its first batch.
            await context.send_initial_metadata(())
            stream = aiter(frames)
            async for first in self._sessions.headers(stream):
                await self._batch(context, stream, first, namespace_of, update)

    async def _batch(
        self,
        context: Context,
        stream: AsyncIterator[bytes],
        first: bytes,
        namespace_of: NamespaceOf,
        update: Update,
    ) -> None:
        """One batch (`first`: its header), counted as a request."""
        t0 = self._batch_metrics.start()
        code = grpc.StatusCode.UNKNOWN
        try:
            namespace = await self._admit(context, stream, first, namespace_of)
            request: pb.UpdateRequest = request_of_frame(
                first, "the first frame of a session's batch"
            )
            reply = await update(context, namespace, request, stream, False, last=False)
            await write(context, reply)
            code = grpc.StatusCode.OK
        except BaseException as exc:
            code = failure_code(context, exc)
            raise
        finally:
            self._batch_metrics.end(t0, code)

    async def _admit(
        self,
        context: Context,
        stream: AsyncIterator[bytes],
        first: bytes,
        namespace_of: NamespaceOf,
    ) -> Namespace:
        """The namespace of a session's next batch. Its token may have been
        revoked since the last batch, and a namespace forgotten since (no
        items, no subscribers) comes back only within --max-namespaces; a
        batch refused is read to its end first, so that its client reads the
        refusal (server._sessions)."""
        try:
            refusal = self._authorize(context.invocation_metadata())
            if refusal is not None:
                raise refusal
            return namespace_of(context)
        except MMCacheError:
            await skip_batch(stream, chunks_declared(first))
            raise
