"""The error types of mmcache, shared by the server core and the client.

The server core raises these; the servicer maps each to a gRPC status in one
place (`mmcache.server._status`), and the client maps statuses back to the
same classes in one place (`mmcache.client._status`). A caller therefore
catches the same exception whether the failure came from its own input
checks or from the server.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AlreadyExistsError",
    "CacheMissError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "MMCacheError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
]


class MMCacheError(Exception):
    """Base class of every error mmcache raises."""


class InvalidArgumentError(MMCacheError, ValueError):
    """The request is malformed: nothing was changed."""


class NotFoundError(MMCacheError, LookupError):
    """A named thing (an engine's encoder book, say) does not exist."""


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


class FailedPreconditionError(MMCacheError):
    """The request is well formed but the current state does not allow it."""


class ResourceExhaustedError(MMCacheError):
    """There is not enough room (encoder tokens, in-flight bytes) for the request."""


class UnavailableError(MMCacheError):
    """The server could not be reached, or went away during the call."""


class DeadlineExceededError(MMCacheError):
    """The call did not finish within its deadline."""


class InternalError(MMCacheError):
    """The server failed in a way the request did not cause (a bug: please report it)."""
