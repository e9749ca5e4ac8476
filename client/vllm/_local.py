"""Each API process's own cache, kept as vLLM alone would keep it.

vLLM alone keeps the items it processed in an LRU of `--mm-processor-cache-gb`
bytes: in the engine (P1, its metadata mirrored in the API process) with one
API server, in each API process (`MultiModalProcessorOnlyCache`) with more.
Either way the same keys, sizes and order, so one API process's hits are
those of a `MultiModalProcessorOnlyCache` fed that process's calls.

The plugin replaces those caches, so it keeps that very class of vLLM's
(`LocalCache`, same capacity) and makes on it every call vLLM alone would:
`touch_sender_cache_item` and `get_and_update_item` for every item of every
request, in vLLM's order, with the item's data (processed here, or read from
the sidecar when the sidecar answered it: `MMCacheProcessorCache._fill`).
Its keys are then, at every moment, those vLLM alone's would be, and every
hit of vLLM alone is in it, whatever the sidecar did: docs/vllm.md.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import cachetools
from vllm.multimodal.cache import MultiModalProcessorOnlyCache

__all__ = ["LocalCache"]


class LocalCache(MultiModalProcessorOnlyCache):  # type: ignore[misc]
    """vLLM's processor-only cache of `capacity_gb`, with a read that leaves its
    order alone (`is_cached` must not reorder; the item is kept for the
    request in case another request evicts it before vLLM takes it). Each
    call under one lock: the plugin's P0 is called from vLLM's request
    threads and its own, and an LRU's eviction is several steps."""

    def __init__(self, capacity_gb: float) -> None:
        # vLLM's class reads its capacity from a model config: the one field it reads.
        multimodal = SimpleNamespace(mm_processor_cache_gb=capacity_gb)
        super().__init__(SimpleNamespace(get_multimodal_config=lambda: multimodal))
        self._lock = threading.Lock()

    def peek(self, mm_hash: str) -> tuple[Any, Any] | None:
        """(item, prompt updates) if held, the LRU order unchanged."""
        with self._lock:
            if mm_hash not in self._cache:
                return None
            # cachetools' base read: LRUCache's own __getitem__ would reorder.
            entry = cachetools.Cache.__getitem__(self._cache, mm_hash)
            return entry.item, entry.prompt_updates

    def is_cached_item(self, mm_hash: str) -> bool:
        with self._lock:
            return bool(super().is_cached_item(mm_hash))

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        with self._lock:
            try:
                return super().get_and_update_item(mm_item, mm_hash)
            except ValueError:
                # vLLM 0.31's LRU raises for an item over the whole cache
                # (later releases skip it): served uncached, as they serve it.
                if mm_item is None:
                    raise
                return mm_item

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        with self._lock:
            super().touch_sender_cache_item(mm_hash)

    def clear_cache(self) -> None:
        with self._lock:
            super().clear_cache()
