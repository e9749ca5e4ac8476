"""The one place where gRPC errors become mmcache's typed errors on the client."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from google.rpc import status_pb2

from mmcache import _errors as errors
from mmcache.v1 import cache_pb2 as pb

__all__ = ["broken_write", "error_from_rpc", "error_from_status", "translate_errors"]

_DETAILS_KEY = "grpc-status-details-bin"

# A status's class, read from the classes themselves (mmcache._errors): the
# server derives its statuses from the same attributes.
_CLASSES: dict[grpc.StatusCode, type[errors.MMCacheError]] = {
    getattr(grpc.StatusCode, name): cls
    for cls in errors.ERROR_CLASSES
    for name in (cls.code, *cls.also)
}


def _status_details(exc: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for key, value in exc.trailing_metadata() or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    return None


def error_from_rpc(exc: grpc.aio.AioRpcError) -> errors.MMCacheError:
    """The typed error for a failed call, with the server's message."""
    code = exc.code()
    message = exc.details() or code.name
    if code == grpc.StatusCode.NOT_FOUND:
        status = _status_details(exc)
        for detail in status.details if status is not None else ():
            missing = pb.MissingItems()
            if detail.Unpack(missing):
                return errors.CacheMissError(missing.mm_hashes, message)
    return error_from_status(code, message)


def error_from_status(code: grpc.StatusCode, message: str) -> errors.MMCacheError:
    """The typed error for a status code (a failed call, or a failed op of a batch)."""
    cls = _CLASSES.get(code, errors.InternalError)
    return cls(f"{code.name}: {message}" if cls is errors.InternalError else message)


@contextmanager
def translate_errors() -> Iterator[None]:
    """Raise mmcache's typed error in place of a gRPC one."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc) from exc


def broken_write(exc: grpc.aio.AioRpcError) -> bool:
    """A write that grpc's core failed because the link went (it reports
    INTERNAL, "Internal error from Core", for a send on a broken pipe): the
    batch may be sent again, as for UNAVAILABLE."""
    return exc.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (
        exc.debug_error_string() or ""
    )
