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

from ._stats import CacheInfo
from .wire import Tls
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

if TYPE_CHECKING:
    from ._client import FailOpen, Location, MMCacheClient
    from .colocated import ResidentLeases

# The names whose modules load torch, imported on first use: importing the
# wire layer (`mmcache.client.wire`, as the ops CLI does) runs this file.
_LAZY = {
    "FailOpen": "._client",
    "Location": "._client",
    "MMCacheClient": "._client",
    "ResidentLeases": ".colocated",
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
