"""Prometheus metrics of the encoder-cache books, one series per engine.

Read from the books at scrape time, like the store gauges, so they can never
disagree with them; the counters are the books' own (a book created anew
under the same engine id starts them from zero, which Prometheus's `rate`
reads as a counter reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmcache._encoder import EncoderCacheStats

__all__ = ["EncoderBookCollector"]

_GAUGES: tuple[tuple[str, str, Callable[[EncoderCacheStats], int]], ...] = (
    (
        "mmcache_encoder_cache_size_tokens",
        "An encoder book's size in encoder tokens.",
        lambda s: s.cache_size,
    ),
    (
        "mmcache_encoder_free_tokens",
        "Encoder tokens neither referenced nor evictable.",
        lambda s: s.free_tokens,
    ),
    (
        "mmcache_encoder_evictable_tokens",
        "Encoder tokens of entries no request references (evicted oldest first).",
        lambda s: s.evictable_tokens,
    ),
    (
        "mmcache_encoder_referenced_tokens",
        "Encoder tokens of entries some live request references.",
        lambda s: s.referenced_tokens,
    ),
    ("mmcache_encoder_entries", "Entries in the encoder book.", lambda s: s.entries),
)
# Names without `_total`: prometheus-client adds it to the sample.
_COUNTERS: tuple[tuple[str, str, Callable[[EncoderCacheStats], int]], ...] = (
    (
        "mmcache_encoder_allocations",
        "allocate calls that took space in the encoder book.",
        lambda s: s.allocations,
    ),
    (
        "mmcache_encoder_evictions",
        "Encoder-book entries evicted to make room.",
        lambda s: s.evictions,
    ),
    (
        "mmcache_encoder_hits",
        "check_and_update_cache calls that found the entry.",
        lambda s: s.hits,
    ),
)


class EncoderBookCollector(Collector):
    """Gauges and counters of every book, labelled `engine`, from `stats()` at each scrape."""

    def __init__(self, stats: Callable[[], Mapping[str, EncoderCacheStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        snapshot = self._stats()
        for name, doc, read in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["engine"])
            for engine_id, stats in snapshot.items():
                gauge.add_metric([engine_id], read(stats))
            yield gauge
        for name, doc, read in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["engine"])
            for engine_id, stats in snapshot.items():
                counter.add_metric([engine_id], read(stats))
            yield counter
