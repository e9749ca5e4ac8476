"""Prometheus metrics of the L2 tier (a shared store behind the sidecar's
cache), on a registry the caller injects. Exported from the start, as 0, by
every server, so dashboards and alerts need no `or vector(0)`; with no L2
configured they stay 0."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["L2_OPS", "L2_WRITE_RESULTS", "L2Metrics"]

L2_OPS = ("read", "write", "claim", "check")
L2_WRITE_RESULTS = ("written", "dropped", "gone", "failed")


class L2Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = Counter(
            "mmcache_l2_hits",
            "Items missing from this sidecar's cache that were read from L2 and stored here.",
            registry=registry,
        )
        self.misses = Counter(
            "mmcache_l2_misses",
            "Items missing from this sidecar's cache that L2 did not hold either (or not "
            "readable in time).",
            registry=registry,
        )
        self.read_bytes = Counter(
            "mmcache_l2_read_bytes", "Bytes of item records read from L2.", registry=registry
        )
        self.written_bytes = Counter(
            "mmcache_l2_written_bytes", "Bytes of item records written to L2.", registry=registry
        )
        self.writes = Counter(
            "mmcache_l2_writes",
            "Write-behind outcomes: written; dropped (queue full); gone (evicted here before "
            "its turn); failed (L2 error).",
            ["result"],
            registry=registry,
        )
        self.errors = Counter(
            "mmcache_l2_errors",
            "L2 operations that failed or timed out (the call went on without L2).",
            ["op"],
            registry=registry,
        )
        self.bad_records = Counter(
            "mmcache_l2_bad_records",
            "L2 records read and refused (a miss, never served): format (not an item "
            "record), key (written for another key, or by a release before 0.2), digest "
            "(other bytes than written).",
            ["reason"],
            registry=registry,
        )
        self.flight_waits = Counter(
            "mmcache_l2_flight_waits",
            "Cold items another sidecar was processing that this one waited for: arrived "
            "(read from L2 or uploaded here meanwhile), abandoned (its claimer evicted it "
            "unwritten) or timeout.",
            ["result"],
            registry=registry,
        )
        self.latency = Histogram(
            "mmcache_l2_latency_seconds",
            "Latency of L2 operations that succeeded.",
            ["op"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        for op in L2_OPS:
            self.errors.labels(op)
            self.latency.labels(op)
        for result in L2_WRITE_RESULTS:
            self.writes.labels(result)
        for reason in ("format", "key", "digest"):
            self.bad_records.labels(reason)
        for result in ("arrived", "abandoned", "timeout"):
            self.flight_waits.labels(result)
        # Read from the tier at scrape time (`set_function`, by whoever makes it).
        self.queued = Gauge(
            "mmcache_l2_queued_items",
            "Items waiting to be written to L2 (write-behind queue).",
            registry=registry,
        )
        self.up = Gauge(
            "mmcache_l2_up",
            "1 while L2 is connected and every Redis master serving slots answers; 0 when "
            "it is down in part or whole (its items miss), or not configured.",
            registry=registry,
        )
        self.nodes_down = Gauge(
            "mmcache_l2_nodes_down",
            "Redis masters skipped (their items miss at once) until a probe finds them "
            "answering again.",
            registry=registry,
        )
