"""The server's data plane: what it holds and how it moves, behind one
`ItemCache` (the gRPC servicer parses, calls it, and replies).

- `_store`: the byte-bounded LRU of items, with their leases (`_leases`);
- `_region`: the co-located clients' shared memory, allocation and index;
  `_report_rings`: what those clients write back with no call;
- `_placement`: where an item's bytes live (heap or region), and what a
  read or an upload is given room by;
- `_tier` with `_l2`: the L2 tier's rules; `_l2_redis`, `_redis_nodes` and
  `_resp_reads`: its backend on Redis Cluster;
- `_pending`, `_inflight`: uploads in flight, and the bytes they may hold;
- `_deadline`: one call's time, for everything in it that waits;
- `_types`, `_entries`: the package's own types (it reads no protobuf: the
  servicer converts), and the one check of an item's frames.
"""

from ._deadline import Deadline
from ._entries import EntryHeader, upload_entry
from ._inflight import InflightBudget
from ._item_cache import CacheStats, ItemCache, PreparedUpdate, ShmRead, Tier
from ._region import Region, open_region
from ._store import BatchResult, ItemStore, StoredItem
from ._types import Change, FeedState, Lease, Report, Scope, ShmRef

__all__ = [
    "BatchResult",
    "CacheStats",
    "Change",
    "Deadline",
    "EntryHeader",
    "FeedState",
    "InflightBudget",
    "ItemCache",
    "ItemStore",
    "Lease",
    "PreparedUpdate",
    "Region",
    "Report",
    "Scope",
    "ShmRead",
    "ShmRef",
    "StoredItem",
    "Tier",
    "open_region",
    "upload_entry",
]
