"""The L2 tier's write-behind queues: keys to write, in order, bounded; and
the outbox of every job the write-behind does (writes, holds, unclaims).

A key another sidecar waits for goes to the head; when the queue is full a
plain key is dropped (counted), and a waiter's key takes the newest plain
one's place. A key is queued once however often it is sighted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mmcache.metrics import L2Metrics

from ._fleet import Job

__all__ = ["Outbox", "WriteQueue"]


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


class Outbox:
    """What the write-behind has to do, by key: end claims (`unclaims`, in
    order, once each), claim held items (`holds`, the newest 4096), and
    write (`writes`, a WriteQueue). Jobs only: the keys' state is the
    KeyBook's (server/cache/_fleet.py)."""

    def __init__(self, most_writes: int, metrics: L2Metrics, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.writes = WriteQueue(most_writes, metrics, wake)
        self._unclaims: dict[str, None] = {}  # insertion-ordered, once each
        self._holds: deque[str] = deque(maxlen=4096)

    def __bool__(self) -> bool:
        return bool(self.writes or self._unclaims or self._holds)

    def unclaim(self, key: str) -> None:
        self._unclaims[key] = None
        self._wake()

    def hold(self, key: str) -> None:
        self._holds.append(key)
        self._wake()

    def next_unclaim(self) -> str | None:
        if not self._unclaims:
            return None
        key = next(iter(self._unclaims))
        del self._unclaims[key]
        return key

    def next_hold(self) -> str | None:
        return self._holds.popleft() if self._holds else None

    def do(self, key: str, job: Job) -> None:
        """Queue what a KeyBook transition asked for."""
        if job == Job.WRITE:
            self.writes.add(key)
        elif job == Job.URGENT:
            self.writes.add(key, urgent=True)
        elif job == Job.HOLD:
            self.hold(key)
        elif job == Job.UNCLAIM:
            self.unclaim(key)
