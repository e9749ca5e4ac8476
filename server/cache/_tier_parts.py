"""What the L2 tier's two halves share: its settings, and the parts the tier
makes once (server/cache/_tier.py) for its read-through
(_read_through.py) and its write-behind (_write_behind.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mmcache.metrics import L2Metrics

from ._fleet import KeyBook
from ._l2 import L2Backend, Manifests
from ._l2_calls import L2Calls
from ._store import ItemStore
from ._write_queue import Outbox

__all__ = ["L2Settings", "TierParts"]


@dataclass(frozen=True)
class L2Settings:
    admit: str = "second"  # "second": on a second sighting; "first": every new item
    timeout_s: float = 1.0  # one L2 operation, at most (and never past a call's time)
    ttl_s: float = 0.0  # an item's TTL in L2 (0: none; maxmemory + allkeys-lru evict)
    window_s: float = 10.0  # how long a claim lasts (a processor run and an upload)
    hold_s: float = 86400.0  # how long a claim of an item stored here lasts, at most
    alive_s: float = 3.0  # a sidecar silent for this long is gone: its claims pass on
    wait_s: float = 1.0  # how long a call waits for an item another sidecar processes
    queue_items: int = 4096  # write-behind queue, in items
    poll_s: float = 0.01  # how often a waiting call looks for the item
    recheck_s: float = 0.05  # how often a sidecar holding claims takes its wants
    beat_s: float = 1.0  # how often an idle sidecar beats
    known_items: int = 65536  # keys this sidecar keeps state of (claims, known in L2)
    concurrency: int = 32  # L2 operations under way at once (a call's reads, polls, writes)


@dataclass(frozen=True, eq=False)
class TierParts:
    node: str  # this sidecar, in claims and heartbeats
    calls: L2Calls  # every backend call, gated, bounded and counted
    store: ItemStore  # L1
    metrics: L2Metrics
    settings: L2Settings
    manifests: Manifests
    book: KeyBook  # the keys' state
    outbox: Outbox  # the write-behind's jobs
    clock: Callable[[], float]

    @property
    def backend(self) -> L2Backend:
        return self.calls.backend
