"""The reference the mirror is checked against: vLLM's rule on cachetools' LRUCache."""

from __future__ import annotations

import cachetools


def oracle_batch(cache: cachetools.LRUCache[str, int], batch: list[tuple[str, int]]) -> list[bool]:
    """Touch every held key of the batch, then hit or insert in order; the hits."""
    for key, _ in batch:
        if key in cache:
            cache[key]  # a read is cachetools' touch
    hits = []
    for key, size in batch:
        hits.append(key in cache)
        if key in cache:
            cache[key]
        elif size <= cache.maxsize:
            cache[key] = size
    return hits
