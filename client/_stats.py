"""Hit statistics of a client, as vLLM's `CacheInfo`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["CacheInfo", "HitCounts"]


@dataclass(frozen=True)
class CacheInfo:
    """Items queried (`total`) and found already held by the server (`hits`)."""

    hits: int = 0
    total: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.total if self.total else 0.0

    def __sub__(self, other: CacheInfo) -> CacheInfo:
        return CacheInfo(self.hits - other.hits, self.total - other.total)


class HitCounts:
    """A client's running counts, added to from any thread (`lease_resident`
    counts on its caller's)."""

    def __init__(self) -> None:
        self._info = CacheInfo()
        self._last_delta = CacheInfo()
        self._lock = threading.Lock()

    def add(self, hits: int, total: int) -> None:
        with self._lock:
            self._info = CacheInfo(self._info.hits + hits, self._info.total + total)

    def stats(self, delta: bool) -> CacheInfo:
        """The counts so far; with `delta`, since the last delta asked."""
        info = self._info
        if delta:
            info, self._last_delta = info - self._last_delta, info
        return info
