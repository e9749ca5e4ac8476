"""Prometheus metrics of the item cache, on a registry the caller injects.

Queries and hits count items as vLLM counts them: one query per item of a
get_and_update (or inject), a hit when the server already held the item.
Gauges of what is stored are read from the store at scrape time, so they can
never disagree with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CacheMetrics", "StoreGauges"]


# vLLM's modalities: their query and hit series exist before the first query.
STARTING_MODALITIES = ("image", "video", "audio")


class CacheMetrics:
    """The counters of the item cache."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter(
            "mmcache_queries",
            "Items asked for by get_and_update or inject (one query per item).",
            ["modality"],
            registry=registry,
        )
        self.hits = Counter(
            "mmcache_hits",
            "Queried items the server already held.",
            ["modality"],
            registry=registry,
        )
        self.resends = Counter(
            "mmcache_resends",
            "Items re-sent because a client's mirror thought the server held them (drift).",
            ["modality"],
            registry=registry,
        )
        self.uncached = Counter(
            "mmcache_uncached",
            "Items not stored because they are larger than the room the batch left.",
            ["modality"],
            registry=registry,
        )
        self.evictions = Counter(
            "mmcache_evictions", "Items evicted to make room.", registry=registry
        )
        self.evicted_bytes = Counter(
            "mmcache_evicted_bytes", "Bytes of the items evicted.", registry=registry
        )
        self.received_bytes = Counter(
            "mmcache_received_bytes", "Tensor payload bytes received.", registry=registry
        )
        self.shm_bytes = Counter(
            "mmcache_shm_bytes",
            "Tensor payload bytes moved through the shared-memory region, by direction "
            "(read: Fetch, write: uploads); also counted in sent/received bytes.",
            ["direction"],
            registry=registry,
        )
        for direction in ("read", "write"):  # exported from the start, as 0
            self.shm_bytes.labels(direction)
        self.shm_client_cpu = Counter(
            "mmcache_shm_client_cpu_seconds",
            "CPU seconds co-located clients spent, on their own threads, on what they "
            "did in the shared-memory region with no call (reads, leases), as they report it.",
            registry=registry,
        )
        # Set to read the server's judgement at scrape time (server/cache/_reuse.py).
        self.small_paused = Gauge(
            "mmcache_small_sharing_paused",
            "1 while the last 32 small items (under 1 MiB) stored drew fewer than 4 hits "
            "in the time they took to come: co-located clients then share only a sample "
            "(one in 8) of small images (docs/vllm.md); else 0.",
            registry=registry,
        )
        self.small_hits_per_store = Gauge(
            "mmcache_small_hits_per_store",
            "Hits of small items (under 1 MiB) per small item stored, over the span of "
            "the last 32 stored: what mmcache_small_sharing_paused is judged on.",
            registry=registry,
        )
        self.posted_uploads = Counter(
            "mmcache_posted_uploads",
            "Uploads co-located clients posted in their report rings with no call, by "
            "result: applied (as a GetAndUpdate would be), or refused (logged; the "
            "items were not stored and their write slots end with their lease).",
            ["result"],
            registry=registry,
        )
        for result in ("applied", "refused"):
            self.posted_uploads.labels(result)
        self.shm_copies = Counter(
            "mmcache_shm_item_copies",
            "Items the server copied between its heap and the shared-memory region, by "
            "kind (in: moved into the region for a read, out: moved back to the heap to "
            "make room, transient: copied into a transient extent for one read).",
            ["kind"],
            registry=registry,
        )
        for kind in ("in", "out", "transient"):
            self.shm_copies.labels(kind)
        self.sent_bytes = Counter(
            "mmcache_sent_bytes", "Tensor payload bytes sent by Fetch.", registry=registry
        )
        self.lease_expiries = Counter(
            "mmcache_lease_expiries",
            "Lease grants that ended by time, not by the engine's read (a dropped request, "
            "or an engine that reads without release).",
            registry=registry,
        )
        self.upload_waits = Counter(
            "mmcache_upload_waits",
            "Hash-only entries that waited for another call's upload of the same hash.",
            registry=registry,
        )
        self.claims = Counter(
            "mmcache_claims",
            "Hashes a lookup claimed for its caller to process (single flight across clients).",
            registry=registry,
        )
        self.claim_expiries = Counter(
            "mmcache_claim_expiries",
            "Claims whose time ran out with no upload of the hash (its claimer died or declined).",
            registry=registry,
        )
        self.feed_snapshots = Counter(
            "mmcache_feed_snapshots",
            "Snapshots sent to feed subscribers: on subscribing, or after lagging behind.",
            ["reason"],
            registry=registry,
        )
        # Label children by modality, bound once: labels() locks and checks.
        self._by_modality: dict[str, tuple[Counter, Counter]] = {}
        # Their sums, for Info (`mmcache stats`) to read without a scrape.
        self.total_queries = 0
        self.total_hits = 0
        # At 0 from the start, so a dashboard's hit rate has series to divide.
        for modality in STARTING_MODALITIES:
            self.queried(modality, hit=False, count=0)
            self.resends.labels(modality)
            self.uncached.labels(modality)

    def evicted(self, size: int) -> None:
        self.evictions.inc()
        self.evicted_bytes.inc(size)

    def queried(self, modality: str, *, hit: bool, count: int = 1) -> None:
        children = self._by_modality.get(modality)
        if children is None:
            label = modality or "unknown"
            children = self._by_modality[modality] = (
                self.queries.labels(label),
                self.hits.labels(label),
            )
        children[0].inc(count)
        # inc(0) too, so that the hits series exists from the first query on.
        children[1].inc(count if hit else 0)
        self.total_queries += count
        self.total_hits += count if hit else 0


class StoreGauges(Collector):
    """Gauges read from the live store at each scrape."""

    def __init__(
        self,
        items: Callable[[], int],
        stored_bytes: Callable[[], int],
        capacity_bytes: Callable[[], int],
        max_items: Callable[[], int],
        inflight_bytes: Callable[[], int],
        leases: Callable[[], int],
        leased_bytes: Callable[[], int],
        feed_subscribers: Callable[[], int],
        namespaces: Callable[[], int],
        shm_leased_bytes: Callable[[], int],
        shm_resident_bytes: Callable[[], int],
        upload_sessions: Callable[[], int] = lambda: 0,
        shm_transient_bytes: Callable[[], int] = lambda: 0,
        shm_reserve_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        self._reads = (
            ("mmcache_items", "Items held.", items),
            ("mmcache_stored_bytes", "Bytes charged for the items held.", stored_bytes),
            ("mmcache_capacity_bytes", "The cache's capacity in bytes.", capacity_bytes),
            ("mmcache_max_items", "The most items the cache holds at once.", max_items),
            (
                "mmcache_inflight_bytes",
                "Payload bytes of uploads being received (beside the cache).",
                inflight_bytes,
            ),
            ("mmcache_leases", "Lease grants outstanding.", leases),
            (
                "mmcache_leased_bytes",
                "Bytes of the items leases hold (within the capacity; never evicted).",
                leased_bytes,
            ),
            (
                "mmcache_feed_subscribers",
                "Clients subscribed to the mirror feed.",
                feed_subscribers,
            ),
            (
                "mmcache_namespaces",
                "Namespaces in use (with items, uploads or subscribers; the default counts).",
                namespaces,
            ),
            (
                "mmcache_shm_leased_bytes",
                "Bytes of the shared-memory region in write slots now (uploads under way).",
                shm_leased_bytes,
            ),
            (
                "mmcache_shm_resident_bytes",
                "Bytes of the shared-memory region holding items (within the capacity).",
                shm_resident_bytes,
            ),
            (
                "mmcache_shm_transient_bytes",
                "Bytes of the shared-memory region in transient extents now (reads of items "
                "in the heap, until their readers are done).",
                shm_transient_bytes,
            ),
            (
                "mmcache_shm_reserve_bytes",
                "Bytes of the shared-memory region that residents and write slots leave free "
                "for reads' transient copies (the largest read of the last 5 minutes).",
                shm_reserve_bytes,
            ),
            (
                "mmcache_upload_sessions",
                "Upload sessions open (streams clients keep open for their uploads).",
                upload_sessions,
            ),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, read in self._reads:
            yield GaugeMetricFamily(name, doc, value=read())
