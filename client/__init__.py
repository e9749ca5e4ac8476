"""The mmcache client: an async library for frontends (P0).

    from mmcache.client import MMCacheClient

    async with MMCacheClient("127.0.0.1:50051") as client:
        sent = await client.get_and_update(items, mm_hashes)

Errors are mmcache's typed errors (re-exported here), never raw gRPC ones.
"""

from mmcache._errors import (
    AlreadyExistsError,
    CacheMissError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    MMCacheError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from mmcache._items import BatchedField, FieldElem, FlatField, MMItem, SharedField

from ._client import MMCacheClient
from ._stats import CacheInfo

__all__ = [
    "AlreadyExistsError",
    "BatchedField",
    "CacheInfo",
    "CacheMissError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FieldElem",
    "FlatField",
    "InternalError",
    "InvalidArgumentError",
    "MMCacheError",
    "MMCacheClient",
    "MMItem",
    "NotFoundError",
    "ResourceExhaustedError",
    "SharedField",
    "UnavailableError",
]
