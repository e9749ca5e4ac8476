"""mmcache: a remote cache for preprocessed multimodal model inputs.

The root package holds the transport-free core that client and server share:
the item model, the size function, the byte-bounded LRU and the error types.
The client lives in `mmcache.client`, the server in `mmcache.server`.
"""

from ._errors import (
    AbortedError,
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
from ._items import BatchedField, FieldElem, FlatField, MMItem, SharedField
from ._memory import keep_freed_memory

__version__ = "0.2.0"

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "BatchedField",
    "CacheMissError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FieldElem",
    "FlatField",
    "InternalError",
    "InvalidArgumentError",
    "MMCacheError",
    "MMItem",
    "NotFoundError",
    "ResourceExhaustedError",
    "SharedField",
    "UnavailableError",
    "__version__",
    "keep_freed_memory",
]
