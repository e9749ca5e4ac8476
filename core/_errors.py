"""The error types of mmcache, shared by the server core and the client.

Each class carries the gRPC status it travels as (`code`, the name of a
`grpc.StatusCode`: the core imports no gRPC) and any other statuses that
mean the same to a caller (`also`). The server derives the status of an
error from its class (`mmcache.server._status`) and the client the class of
a status from the same attributes (`mmcache.client._status`): one mapping,
read both ways. A caller therefore catches the same exception whether the
failure came from its own input checks or from the server.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

__all__ = [
    "ERROR_CLASSES",
    "AbortedError",
    "AlreadyExistsError",
    "CacheMissError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "MMCacheError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
]


class MMCacheError(Exception):
    """Base class of every error mmcache raises."""

    code: ClassVar[str] = "INTERNAL"  # the grpc.StatusCode it travels as
    also: ClassVar[tuple[str, ...]] = ()  # other statuses a client reads as this class


class InvalidArgumentError(MMCacheError, ValueError):
    """The request is malformed: nothing was changed."""

    code = "INVALID_ARGUMENT"
    also = ("OUT_OF_RANGE",)


class NotFoundError(MMCacheError, LookupError):
    """A named thing (an engine's encoder book, say) does not exist."""

    code = "NOT_FOUND"


class CacheMissError(NotFoundError):
    """Items the caller relied on are not in the cache.

    `missing_hashes` names every one of them, in request order, so the caller
    can re-process and re-send exactly those.
    """

    def __init__(self, missing_hashes: Iterable[str], message: str | None = None) -> None:
        self.missing_hashes: list[str] = list(missing_hashes)
        super().__init__(message or f"not in the cache: {', '.join(self.missing_hashes)}")


class AlreadyExistsError(MMCacheError):
    """The thing to create exists already."""

    code = "ALREADY_EXISTS"


class FailedPreconditionError(MMCacheError):
    """The request is well formed but the current state does not allow it."""

    code = "FAILED_PRECONDITION"


class AbortedError(MMCacheError):
    """The request gave way to another (a copy of an upload batch sent again)."""

    code = "ABORTED"


class ResourceExhaustedError(MMCacheError):
    """There is not enough room (encoder tokens, in-flight bytes) for the request."""

    code = "RESOURCE_EXHAUSTED"


class UnavailableError(MMCacheError):
    """The server could not be reached, or went away during the call."""

    code = "UNAVAILABLE"
    also = ("CANCELLED",)  # the server went away mid-call


class DeadlineExceededError(MMCacheError):
    """The call did not finish within its deadline."""

    code = "DEADLINE_EXCEEDED"


class UnauthenticatedError(MMCacheError):
    """The call carries no token, or one the server does not accept."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(MMCacheError):
    """The call's token lacks the role (or the namespace) the call needs."""

    code = "PERMISSION_DENIED"


class InternalError(MMCacheError):
    """The server failed in a way the request did not cause (a bug: please report it)."""

    code = "INTERNAL"


# Every class a status names, the most specific first where two share one.
ERROR_CLASSES: tuple[type[MMCacheError], ...] = (
    InvalidArgumentError,
    NotFoundError,
    AlreadyExistsError,
    FailedPreconditionError,
    AbortedError,
    ResourceExhaustedError,
    UnavailableError,
    DeadlineExceededError,
    UnauthenticatedError,
    PermissionDeniedError,
    InternalError,
)
