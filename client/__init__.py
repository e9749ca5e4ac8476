"""The mmcache client: an async library for frontends (P0).

    from mmcache.client import MMCacheClient

    async with MMCacheClient("127.0.0.1:50051") as client:
        sent = await client.get_and_update(items, mm_hashes)

Errors are mmcache's typed errors (re-exported here), never raw gRPC ones.
"""

import importlib
from typing import TYPE_CHECKING, Any

from mmcache._errors import (
    AbortedError,
    AlreadyExistsError,
    CacheMissError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    MMCacheError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from mmcache._items import BatchedField, FieldElem, FlatField, MMItem, SharedField

if TYPE_CHECKING:  # imported on first use (below): the wire layer needs no torch
    from ._client import FailOpen, Location, MMCacheClient, Tls
    from ._stats import CacheInfo
    from .colocated import ResidentLeases
    from .wire._encoder import (
        AllocateOp,
        BatchResult,
        CanAllocateOp,
        CheckAndUpdateCacheOp,
        EncoderBatch,
        EncoderBatchError,
        EncoderBudget,
        EncoderBudgetInputs,
        EncoderCache,
        EncoderCacheStats,
        EncoderOp,
        FreeEncoderInputOp,
        FreeOp,
        GetCachedMmHashesOp,
        GetFreedMmHashesOp,
        OpResult,
        ResetOp,
    )

# Each name's module: importing `mmcache.client.wire` (the ops CLI) runs this
# file, and must not load torch, which the client's own parts do.
_LAZY = {
    "FailOpen": "._client",
    "Location": "._client",
    "MMCacheClient": "._client",
    "Tls": ".wire",
    "ResidentLeases": ".colocated",
    "CacheInfo": "._stats",
    **dict.fromkeys(
        (
            "AllocateOp",
            "BatchResult",
            "CanAllocateOp",
            "CheckAndUpdateCacheOp",
            "EncoderBatch",
            "EncoderBatchError",
            "EncoderBudget",
            "EncoderBudgetInputs",
            "EncoderCache",
            "EncoderCacheStats",
            "EncoderOp",
            "FreeEncoderInputOp",
            "FreeOp",
            "GetCachedMmHashesOp",
            "GetFreedMmHashesOp",
            "OpResult",
            "ResetOp",
        ),
        ".wire._encoder",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AbortedError",
    "AllocateOp",
    "AlreadyExistsError",
    "BatchResult",
    "BatchedField",
    "CacheInfo",
    "CacheMissError",
    "CanAllocateOp",
    "CheckAndUpdateCacheOp",
    "DeadlineExceededError",
    "EncoderBatch",
    "EncoderBatchError",
    "EncoderBudget",
    "EncoderBudgetInputs",
    "EncoderCache",
    "EncoderCacheStats",
    "EncoderOp",
    "FailOpen",
    "FailedPreconditionError",
    "FieldElem",
    "FlatField",
    "FreeEncoderInputOp",
    "FreeOp",
    "GetCachedMmHashesOp",
    "GetFreedMmHashesOp",
    "InternalError",
    "InvalidArgumentError",
    "Location",
    "MMCacheClient",
    "MMCacheError",
    "MMItem",
    "NotFoundError",
    "OpResult",
    "PermissionDeniedError",
    "ResetOp",
    "ResidentLeases",
    "ResourceExhaustedError",
    "SharedField",
    "Tls",
    "UnauthenticatedError",
    "UnavailableError",
]
