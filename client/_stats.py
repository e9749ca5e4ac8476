"""Hit statistics of a client, as vLLM's `CacheInfo`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheInfo"]


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
