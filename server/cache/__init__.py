"""The server's data plane: what it holds and how it moves, behind one
`ItemCache` (the gRPC servicer parses, calls it, and replies), made by
`open_cache(config)` and run by `async with` (_open.py).

- `_store`: the byte-bounded LRU of items, with their leases (`_leases`);
  what it holds outside the heap it holds as an `Extent` (`_extent`);
- `_changes`: the one stream of what the cache holds, as it changes (the
  feed, the item events and the L2 tier subscribe to it);
- `_placement`: where an item's bytes live (heap or region), and what a
  read or an upload is given room by: the only part that knows `_region`,
  the co-located clients' shared memory; `_colocated` with
  `_report_rings`: what those clients report, by call or with none;
- `_tier` with `_l2`: the L2 tier's rules; `_backends`: the backend a URL
  names (`_l2_redis`, `_redis_nodes` and `_resp_reads`: Redis Cluster;
  `_l2_memory`: in memory);
- `_pending`, `_inflight`: uploads in flight and claims (single flight), and
  the bytes they may hold;
- `_deadline`: one call's time, for everything in it that waits;
- `_types`, `_entries`: the package's own types (it reads no protobuf: the
  servicer converts), and the one check of an item's frames.
"""

from ._backends import check_l2_url
from ._changes import ItemChange
from ._deadline import Deadline
from ._entries import EntryHeader, check_received, chunk_length, upload_entry
from ._item_cache import (
    CacheParts,
    CacheStats,
    ItemCache,
    PreparedUpdate,
    RegionInfo,
    ShmRead,
    Tier,
    parts_of,
)
from ._l2 import DEFAULT_PREFIX, BadRecord, Manifest, Manifests
from ._open import CacheConfig, L2Target, RegionConfig, open_cache
from ._region import Slot
from ._store import BatchResult, StoredItem
from ._tier_parts import L2Settings
from ._types import Change, FeedState, Lease, Report, Scope, ShmRef

__all__ = [
    "DEFAULT_PREFIX",
    "BadRecord",
    "BatchResult",
    "CacheConfig",
    "CacheParts",
    "CacheStats",
    "Change",
    "Deadline",
    "EntryHeader",
    "FeedState",
    "ItemCache",
    "ItemChange",
    "L2Settings",
    "L2Target",
    "Lease",
    "Manifest",
    "Manifests",
    "PreparedUpdate",
    "RegionConfig",
    "RegionInfo",
    "Report",
    "Scope",
    "ShmRead",
    "ShmRef",
    "Slot",
    "StoredItem",
    "Tier",
    "check_l2_url",
    "check_received",
    "chunk_length",
    "open_cache",
    "parts_of",
    "upload_entry",
]
