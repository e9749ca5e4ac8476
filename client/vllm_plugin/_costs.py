"""What the plugin's P0 measures to decide how long to wait and what to upload.

Both are estimates from this API process's own traffic, smoothed, so they
follow the model, the image sizes and the machine without settings:

- `ProcessingTime`: the processor's seconds per item. A lookup waits for an
  upload in flight elsewhere about that long, no longer (past it, processing
  the item here is as quick).
- `Admission`: whether uploading an item pays. It saves the processing of
  each later request that hits it, so its worth is the chance of a repeat
  (this process's recent hit ratio) times the processing time; it costs the
  upload (this process's upload seconds per byte). An item worth less than
  its upload is not uploaded (it went inline to the engine anyway), except
  one in `explore`, so that the estimates follow the traffic when it turns
  to repeats again.
"""

from __future__ import annotations

import threading

__all__ = ["Admission", "ProcessingTime"]

FIRST_GUESS_S = 0.05  # the processor's time per item before any was measured
LEAST_WAIT_S = 0.002
MOST_WAIT_S = 0.5


class ProcessingTime:
    """Seconds this process's processor takes per item, smoothed over requests."""

    def __init__(self) -> None:
        self._per_item = FIRST_GUESS_S
        self._lock = threading.Lock()

    @property
    def per_item(self) -> float:
        return self._per_item

    def observe(self, seconds: float, items: int) -> None:
        if items > 0 and seconds >= 0:
            with self._lock:
                self._per_item += 0.2 * (seconds / items - self._per_item)

    def wait_for(self, items: int) -> float:
        """How long a lookup of `items` may wait: about what processing them takes."""
        with self._lock:
            return min(MOST_WAIT_S, max(LEAST_WAIT_S, self._per_item * items))


class Admission:
    """Whether an upload is worth what it costs (see the module)."""

    def __init__(self, *, explore: int = 10, reuse: float = 0.5) -> None:
        self._explore = explore
        self._reuse = reuse  # the chance an item is asked for again, smoothed
        self._seconds_per_byte = 0.0  # unknown until an upload was timed: uploads go
        self._refused = 0
        self._lock = threading.Lock()

    @property
    def reuse(self) -> float:
        return self._reuse

    def queried(self, hits: int, total: int) -> None:
        """A request's items: `hits` of `total` were cached (about the last
        50 items weigh in)."""
        with self._lock:
            for index in range(total):
                self._reuse += 0.02 * (float(index < hits) - self._reuse)

    def uploaded(self, seconds: float, nbytes: int) -> None:
        if nbytes > 0 and seconds >= 0:
            with self._lock:
                per_byte = seconds / nbytes
                if not self._seconds_per_byte:
                    self._seconds_per_byte = per_byte
                else:
                    self._seconds_per_byte += 0.2 * (per_byte - self._seconds_per_byte)

    def admit(self, nbytes: int, processing_s: float) -> bool:
        """Upload an item of `nbytes` whose processing took about `processing_s`?"""
        with self._lock:
            if self._seconds_per_byte * nbytes <= self._reuse * processing_s:
                return True
            self._refused += 1
            return self._refused % self._explore == 0
