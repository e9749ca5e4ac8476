"""`open_cache`: the data plane built from one `CacheConfig`, and run.

    cache = open_cache(config, registry)  # the store, placement, the L2 tier
    async with cache:                     # its region, the tier, its timers
        ...                               # cache.changes: what it holds, as it changes

What the server's other parts hear of the cache they subscribe to on its
change stream (_changes.py); the tier is subscribed here. The region is
opened when the cache starts running (a file other processes map), not when
it is built, and closed when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from mmcache._shm_layout import BEAT_S
from mmcache.metrics import CacheMetrics, L2Metrics

from ._backends import open_backend
from ._changes import ItemChanges
from ._colocated import CoLocatedReports
from ._inflight import InflightBudget
from ._item_cache import CacheParts, ItemCache
from ._l2 import DEFAULT_PREFIX, Manifests
from ._placement import Placement
from ._region import Region, open_region
from ._reuse import SmallReuse
from ._store import ItemStore
from ._tier import L2Tier
from ._tier_parts import L2Settings
from ._types import Report
from ._wake import WakePipe

__all__ = ["CacheConfig", "L2Target", "RegionConfig", "open_cache"]

_LOGGER = logging.getLogger(__name__)

# How long a report in a ring waits when no call drains the rings (and how
# often the region's heartbeat beats). Every call that may evict drains them
# first, so this bounds only how stale /metrics is; a shorter wait while
# reports come cost the sidecar more wake-ups than the hits it counted
# (0.1-0.3 ms of CPU a hit).
REPORT_DRAIN_S = BEAT_S


@dataclass(frozen=True)
class RegionConfig:
    """The shared-memory region for co-located clients (docs/shm.md)."""

    dir: str  # a tmpfs both containers mount
    bytes: int  # the region, taken from the capacity
    group: int | None = None  # a group whose members may map the region (0660)


@dataclass(frozen=True)
class L2Target:
    """The L2 tier's backend (`_backends.py` reads the URL) and its settings."""

    url: str
    prefix: str = DEFAULT_PREFIX
    settings: L2Settings = field(default_factory=L2Settings)


@dataclass(frozen=True)
class CacheConfig:
    """Everything the data plane is built from. The two codecs are the wire's
    formats, which the package never reads itself (the edge's: server/_records.py
    and server/_reports.py)."""

    capacity_bytes: int
    max_items: int
    lease_s: float
    inflight_bytes: int  # upload payloads buffered at once beside the cache
    manifests: Manifests  # an L2 record's manifest
    parse_report: Callable[[bytes], Report]  # a report ring's record
    region: RegionConfig | None = None  # None: gRPC only
    l2: L2Target | None = None  # None: no L2 tier
    node: str = ""  # this sidecar, in the L2 fleet's claims


def open_cache(config: CacheConfig, registry: CollectorRegistry) -> ItemCache:
    """The data plane, built, its metrics on `registry` (L2's too, with no tier):
    `async with` it to run it."""
    metrics = CacheMetrics(registry)
    changes = ItemChanges()
    store = ItemStore(
        config.capacity_bytes,
        max_items=config.max_items,
        lease_s=config.lease_s,
        changes=changes,
        on_evict=metrics.evicted,
        on_expire=metrics.lease_expiries.inc,
    )
    tier = _tier(config, store, changes, L2Metrics(registry))
    placement = Placement(store, metrics)
    reuse = SmallReuse()
    metrics.small_paused.set_function(lambda: reuse.paused)
    metrics.small_hits_per_store.set_function(lambda: reuse.hits_per_store)
    parts = CacheParts(
        store=store,
        inflight=InflightBudget(config.inflight_bytes),
        metrics=metrics,
        placement=placement,
        tier=tier,
        changes=changes,
        reports=CoLocatedReports(store, metrics, placement, config.parse_report, reuse),
        reuse=reuse,
    )
    return ItemCache(parts, Lifecycle(config, parts))


def _tier(
    config: CacheConfig, store: ItemStore, changes: ItemChanges, metrics: L2Metrics
) -> L2Tier | None:
    target = config.l2
    if target is None:
        return None
    settings = target.settings
    backend = open_backend(target.url, target.prefix, settings.timeout_s)
    tier = L2Tier(backend, store, metrics, settings, config.manifests, changes, node=config.node)
    changes.subscribe(tier.changed)
    metrics.queued.set_function(lambda: tier.queued)
    metrics.up.set_function(lambda: float(backend.up))
    metrics.nodes_down.set_function(lambda: backend.nodes_down)
    _LOGGER.info(
        "L2 tier: %s, keys under %r, admit on %s sighting",
        backend.where,
        target.prefix,
        settings.admit,
    )
    return tier


class Lifecycle:
    """What a running cache has open, on one exit stack: its region, the L2
    tier (stopped before the region: a write may read from it), the timers."""

    def __init__(self, config: CacheConfig, parts: CacheParts) -> None:
        self._config = config
        self._parts = parts
        self._opened: contextlib.AsyncExitStack | None = None

    async def start(self, beat: Callable[[], None]) -> None:
        """Open and start it all (`beat`: the region's heartbeat and its rings read)."""
        parts = self._parts
        async with contextlib.AsyncExitStack() as opened:
            region = _open_region(self._config.region, self._config.lease_s)
            if region is not None:
                parts.placement.region = region
                opened.callback(self._close_region, region)
            if parts.tier is not None:
                parts.tier.start()
                opened.push_async_callback(parts.tier.stop)
            _run(opened, self._expire_leases())
            if region is not None:
                _run(opened, _beat(beat))
                self._wake_on_pokes(opened, region)
            self._opened = opened.pop_all()

    async def stop(self) -> None:
        """Close what `start` opened, in the reverse order (a no-op when not running)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            await opened.aclose()

    def _wake_on_pokes(self, opened: contextlib.AsyncExitStack, region: Region) -> None:
        """Read the rings whenever a client pokes the region's wake pipe
        (mmcache._wake): a posted upload is stored at once, with no timer."""
        assert self._config.region is not None
        pipe = WakePipe.open(region.path, group=self._config.region.group)
        if pipe is None:
            return
        reports, loop = self._parts.reports, asyncio.get_running_loop()
        loop.add_reader(pipe.fd, lambda: reports.woken(pipe.read()))
        opened.callback(pipe.close)
        opened.callback(loop.remove_reader, pipe.fd)  # first: before the pipe closes

    def _close_region(self, region: Region) -> None:
        self._parts.placement.region = None
        region.close()

    async def _expire_leases(self) -> None:
        # Calls expire leases as they come; this covers a server with none.
        interval = min(1.0, self._config.lease_s / 10)
        parts = self._parts
        while True:
            await asyncio.sleep(interval)
            parts.store.expire()
            if parts.placement.region is not None:
                parts.placement.region.expire()


async def _beat(beat: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(REPORT_DRAIN_S)  # read each time: tests stretch it
        beat()


def _run(opened: contextlib.AsyncExitStack, timer: Coroutine[Any, Any, None]) -> None:
    """A timer task, cancelled when `opened` closes."""
    opened.callback(asyncio.create_task(timer).cancel)


def _open_region(config: RegionConfig | None, lease_s: float) -> Region | None:
    """The shared-memory region, or None (gRPC only) with the reason logged."""
    if config is None:
        return None
    try:
        region = open_region(config.dir, config.bytes, lease_s=lease_s, group=config.group)
    except OSError as exc:
        _LOGGER.warning(
            "shared memory off (co-located clients use gRPC, slower for large items): "
            "%s: %s; give --shm-dir a writable tmpfs both containers mount, or --no-shm",
            config.dir,
            exc,
        )
        return None
    _LOGGER.info("shared-memory region %s: %d bytes", region.path, region.size)
    return region
