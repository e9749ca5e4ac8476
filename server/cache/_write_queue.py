"""The L2 tier's write-behind queue: keys to write, in order, bounded.

A key another sidecar waits for goes to the head; when the queue is full a
plain key is dropped (counted), and a waiter's key takes the newest plain
one's place. A key is queued once however often it is sighted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mmcache.metrics import L2Metrics

__all__ = ["WriteQueue"]


class WriteQueue:
    def __init__(self, most: int, metrics: L2Metrics, wake: Callable[[], None]) -> None:
        self._most = most
        self._metrics = metrics
        self._wake = wake
        self._keys: deque[str] = deque()
        self._queued: set[str] = set()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._queued

    def add(self, key: str, *, urgent: bool = False) -> None:
        """Queue a write: `urgent` (another sidecar waits for it) at the head."""
        if key in self._queued:
            if urgent and self._keys[0] != key:  # a waiter's item: to the head
                self._keys.remove(key)
                self._keys.appendleft(key)
            return
        if len(self._keys) >= self._most:
            self._metrics.writes.labels("dropped").inc()
            if not urgent:
                return
            self._queued.discard(self._keys.pop())  # a waiter's item over the newest plain one
        if urgent:
            self._keys.appendleft(key)
        else:
            self._keys.append(key)
        self._queued.add(key)
        self._wake()

    def pop(self) -> str:
        """The next key to write (the queue is not empty)."""
        key = self._keys.popleft()
        self._queued.discard(key)
        return key
