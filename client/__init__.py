"""The mmcache client: an async library for frontends (P0).

    from mmcache.client import MMCacheClient

    async with MMCacheClient("127.0.0.1:50051") as client:
        sent = await client.get_and_update(items, mm_hashes)

Errors are mmcache's typed errors (re-exported here), never raw gRPC ones.
"""

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

from ._client import FailOpen, Location, MMCacheClient, Tls
from ._encoder import (
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
from ._resident import ResidentLeases
from ._stats import CacheInfo

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
