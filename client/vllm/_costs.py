"""What the plugin's P0 measures to decide how long to wait and what to upload.

Both are estimates from this API process's own traffic, smoothed, so they
follow the model, the image sizes and the machine without settings:

- `ProcessingTime`: the processor's seconds per item. A lookup waits for an
  upload in flight elsewhere about that long, no longer (past it, processing
  the item here is as quick).
- `Admission`: whether uploading an item pays. It saves the processing of
  each later request that hits it, so its worth is the repeats to expect
  (from this process's recent hit ratio r: r / (1 - r) per miss) times the
  processing CPU, and never more than one processing (an upload dearer than
  processing the item again does not pay); it costs the upload's CPU (a fixed part and a part per
  byte, fitted to this process's uploads). An item worth less than
  its upload is not uploaded (it went inline to the engine anyway), except
  one in `explore`, so that the estimates follow the traffic when it turns
  to repeats again.
"""

from __future__ import annotations

import threading
import time

__all__ = ["ProcessingTime", "Uploads"]

FIRST_GUESS_S = 0.05  # the processor's time per item before any was measured
LEAST_WAIT_S = 0.002
MOST_WAIT_S = 0.5


class ProcessingTime:
    """What this process's processor takes per item, smoothed over requests:
    wall seconds (how long a lookup may wait) and CPU seconds (what a hit
    saves, weighed against an upload's CPU)."""

    def __init__(self) -> None:
        self._per_item = FIRST_GUESS_S
        self._cpu_per_item = FIRST_GUESS_S
        self._lock = threading.Lock()

    @property
    def per_item(self) -> float:
        return self._per_item

    @property
    def cpu_per_item(self) -> float:
        return self._cpu_per_item

    def observe(self, seconds: float, cpu_seconds: float, items: int) -> None:
        if items > 0 and seconds >= 0 and cpu_seconds >= 0:
            with self._lock:
                self._per_item += 0.2 * (seconds / items - self._per_item)
                self._cpu_per_item += 0.2 * (cpu_seconds / items - self._cpu_per_item)

    def wait_for(self, items: int) -> float:
        """How long a lookup of `items` may wait: about what processing them takes."""
        with self._lock:
            return min(MOST_WAIT_S, max(LEAST_WAIT_S, self._per_item * items))


class Uploads:
    """The sharing rule (see the module): every processed item goes, unless it
    is larger than the sidecar or the uploads in flight are at their bound.
    Thread-safe; `declined` counts the items that did not go, exactly."""

    def __init__(self, *, most_in_flight: int = 8) -> None:
        self._most = most_in_flight
        self._in_flight = 0
        self._closed = False
        self.declined = 0
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an upload ended

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self, sizes: list[int], capacity: int) -> list[bool]:
        """Which of a request's items (of `sizes` bytes) go, in one upload:
        those that fit a sidecar of `capacity` bytes (0: unknown, all fit),
        none once closed or with `most_in_flight` uploads under way. If any
        go, the caller must call `ended` when the upload ends."""
        fits = [not capacity or size <= capacity for size in sizes]
        with self._lock:
            if self._closed or self._in_flight >= self._most:
                fits = [False] * len(sizes)
            if any(fits):
                self._in_flight += 1
            self.declined += fits.count(False)
        return fits

    def ended(self, *, failed: int = 0) -> None:
        """An upload ended; `failed` of its items were not stored."""
        with self._lock:
            self._in_flight -= 1
            self.declined += failed
            self._settled.notify_all()

    def close(self, deadline_s: float) -> None:
        """No upload starts from now; wait up to `deadline_s` for those in flight."""
        deadline = time.monotonic() + deadline_s
        with self._settled:
            self._closed = True
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._settled.wait(left)
