"""The EC connector's counters: counted on both sides, reported by the scheduler.

Each part counts in a `Counts` of its own; a worker's go back to the
scheduler in its step's metadata (_ec_metadata.WorkerCounts), and the
scheduler reports them all as vLLM's EC connector stats (`MMCacheECStats`),
which vLLM's API server turns into `mmcache_ec_*` on its /metrics
(`ECPromMetrics`; docs/vllm.md lists them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

__all__ = ["COUNTERS", "LOOKUPS", "Counts", "ECPromMetrics", "MMCacheECStats"]

# Counter names, as ECConnectorStats data keys and metric names (mmcache_ec_*).
COUNTERS = {
    "encoded": "Encoder outputs this engine computed (vLLM hands each to the connector).",
    "saved": "Encoder outputs uploaded to the sidecar.",
    "saved_bytes": "Bytes of encoder outputs uploaded to the sidecar.",
    "save_skipped": "Encoder outputs not uploaded: the sidecar already held them.",
    "save_failed": "Encoder outputs whose upload failed or was dropped (too many in flight).",
    "loaded": "Encoder outputs loaded into the engine instead of encoding them.",
    "loaded_bytes": "Bytes of encoder outputs loaded into the engine.",
}
# Lookup results: staged (cached for vLLM), or why an item is encoded instead.
LOOKUPS = (
    "staged",
    "absent",
    "evicted",
    "unavailable",
    "over_budget",
    "staging_error",
    "mismatch",
)


class Counts:
    """Counters bumped from the engine's and the client's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, value: int = 1) -> None:
        self.merge({name: value})

    def merge(self, counts: dict[str, int]) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] = self._counts.get(name, 0) + value

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


@dataclass
class MMCacheECStats(ECConnectorStats):  # type: ignore[misc]
    """Counters of one interval, summed over the engine's steps."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ECPromMetrics(ECConnectorPromMetrics):  # type: ignore[misc]
    """`mmcache_ec_*` on vLLM's /metrics, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in COUNTERS.items():
            counter = self._counter_cls(
                name=f"mmcache_ec_{name}", documentation=documentation, labelnames=labelnames
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }
        lookups = self._counter_cls(
            name="mmcache_ec_lookups",
            documentation="Items the scheduler looked up, by result: staged (ready to load), "
            "or why vLLM encodes it (absent, evicted, unavailable, over_budget, staging_error, "
            "mismatch).",
            labelnames=[*labelnames, "result"],
        )
        for result in LOOKUPS:
            self._counters[f"lookup_{result}"] = {
                engine: lookups.labels(*values, result)
                for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            children = self._counters.get(name)
            if children is not None and value:
                children[engine_idx].inc(value)
