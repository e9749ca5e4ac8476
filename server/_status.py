"""The one place where exceptions become gRPC statuses on the server.

Every handler runs inside `guard`: mmcache's own errors become their status
code with the message a person can act on (and, for a cache miss, the missing
hashes as structured details); anything else is logged and answered INTERNAL.
Every error reply carries the instance id, as every success reply does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, status_pb2
from grpc_status import rpc_status

from mmcache import _errors as errors
from mmcache.v1 import cache_pb2 as pb

__all__ = [
    "INSTANCE_ID_KEY",
    "abort_with",
    "client_left",
    "failure_code",
    "guard",
    "protobuf_method",
    "status_code_of",
    "write",
]

_LOGGER = logging.getLogger(__name__)

INSTANCE_ID_KEY = "mmcache-instance-id"


def status_code_of(exc: errors.MMCacheError) -> grpc.StatusCode:
    """The status an error travels as: its class says (mmcache._errors)."""
    code: grpc.StatusCode = getattr(grpc.StatusCode, type(exc).code, grpc.StatusCode.INTERNAL)
    return code


def _status_of(exc: errors.MMCacheError) -> grpc.Status:
    code = status_code_of(exc)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=str(exc))
    if isinstance(exc, errors.CacheMissError):
        status.details.add().Pack(pb.MissingItems(mm_hashes=exc.missing_hashes))
    return rpc_status.to_status(status)


def client_left(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    """Whether the call's client cancelled it or its deadline has passed."""
    if context.cancelled():
        return True
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def failure_code(
    context: grpc.aio.ServicerContext[Any, Any], exc: BaseException
) -> grpc.StatusCode:
    """The status `guard` gives a handler that raised `exc` (for a stream's
    handler that counts the requests it carries itself)."""
    if isinstance(exc, errors.MMCacheError):
        return grpc.StatusCode.CANCELLED if client_left(context) else status_code_of(exc)
    if isinstance(exc, asyncio.CancelledError | _ClientGone):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


class _ClientGone(Exception):
    """A server stream's client left: its messages have nowhere to go."""


async def write(context: grpc.aio.ServicerContext[Any, Any], message: Any) -> None:
    """Write one message of a server stream.

    grpc's aio server fails the write of a stream whose client has gone
    (a crash, a cancel) with an internal error, before it marks the call
    cancelled; that is no failure of the server, so `guard` ends the call
    quietly instead of logging an error.
    """
    try:
        await context.write(message)
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        raise _ClientGone from exc


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], status: grpc.Status, instance_id: str
) -> None:
    metadata = (*status.trailing_metadata, (INSTANCE_ID_KEY, instance_id))
    await context.abort(status.code, status.details, metadata)


async def abort_with(
    context: grpc.aio.ServicerContext[Any, Any], exc: errors.MMCacheError, instance_id: str
) -> None:
    """End the call with the status of `exc` (for code outside a guarded handler)."""
    await _abort(context, _status_of(exc), instance_id)


H = TypeVar("H", bound=Callable[..., Awaitable[Any]])


def guard(instance_id: str) -> Callable[[H], H]:
    """Decorate a handler `(request, context)` so that errors map to statuses."""

    def decorate(handler: H) -> H:
        @functools.wraps(handler)
        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                return await handler(request, context)
            except errors.MMCacheError as exc:
                if client_left(context):
                    # The client left (a cancel, a deadline): a stream cut short
                    # by it is no bad request, and the answer has nowhere to go.
                    _LOGGER.debug("%s: the client left: %s", handler.__qualname__, exc)
                    return None
                status = _status_of(exc)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except _ClientGone:
                _LOGGER.debug("%s: the client left the stream", handler.__qualname__)
                return None
            except Exception:
                _LOGGER.exception("handler %s failed", handler.__qualname__)
                status = rpc_status.to_status(
                    status_pb2.Status(
                        code=code_pb2.INTERNAL,
                        message="internal error in the mmcache server; its log has the traceback",
                    )
                )
            await _abort(context, status, instance_id)

        return guarded  # type: ignore[return-value]

    return decorate


def protobuf_method(
    handler: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]],
    request_type: type[Message],
    instance_id: str,
) -> grpc.RpcMethodHandler[bytes, bytes]:
    """A unary protobuf method whose request is parsed inside `guard`.

    grpc answers a request its own deserializer cannot parse with UNKNOWN;
    parsed here, it is INVALID_ARGUMENT naming the message expected.
    """
    expected = request_type.DESCRIPTOR.full_name

    async def parse_and_handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            raise errors.InvalidArgumentError(
                f"the request does not parse as a {expected}: {exc}"
            ) from None
        reply = await handler(request, context)
        return reply.SerializeToString()

    parse_and_handle.__qualname__ = getattr(handler, "__qualname__", expected)
    return grpc.unary_unary_rpc_method_handler(guard(instance_id)(parse_and_handle))
