"""The prompt updates P0 knows: those of the items this process processed.

A hit needs its prompt updates (vLLM applies them instead of processing).
This process's own are kept here, bounded (entries, not bytes: a few
hundred bytes each); the others travel with the items as metadata
(convert.encode_updates), unless this model's cannot be described as data:
then `undescribed` says why, once, and only this process's own items hit here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from vllm.logger import init_logger

from .convert import undescribed

__all__ = ["LOCAL_UPDATES", "KnownUpdates"]

LOCAL_UPDATES = 65536  # entries kept


class KnownUpdates:
    """Prompt updates by hash, least recently used dropped first. Thread-safe."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._updates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        # Why this model's prompt updates cannot travel as data (None: they can).
        self.undescribed: str | None = None

    def get(self, mm_hash: str) -> Any:
        """The item's updates if this process processed it (else None)."""
        with self._lock:
            updates = self._updates.get(mm_hash)
            if updates is not None:
                self._updates.move_to_end(mm_hash)
            return updates

    def remember(self, mm_hash: str, updates: Any) -> None:
        """An item processed here: its updates, and whether they can travel."""
        if self.undescribed is None and (why := undescribed(updates)) is not None:
            self.undescribed = why
            init_logger("vllm.mmcache").warning(
                "mmcache: %s: %s; its items are hits only in the API process that "
                "processed them, and the others neither look them up nor upload them again",
                self._model or "this model",
                why,
            )
        with self._lock:
            self._updates[mm_hash] = updates
            self._updates.move_to_end(mm_hash)
            while len(self._updates) > LOCAL_UPDATES:
                self._updates.popitem(last=False)

    def forget(self, mm_hash: str) -> None:
        with self._lock:
            self._updates.pop(mm_hash, None)

    def clear(self) -> None:
        with self._lock:
            self._updates.clear()
