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

__all__ = ["Admission", "ProcessingTime", "UploadCost"]

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


class Admission:
    """Whether an upload is worth what it costs (see the module)."""

    def __init__(self, *, explore: int = 10, reuse: float = 0.5) -> None:
        self._explore = explore
        self._reuse = reuse  # the share of items that were cached, smoothed
        self._cost = UploadCost()
        self._refused = 0
        self._lock = threading.Lock()

    @property
    def reuse(self) -> float:
        return self._reuse

    def queried(self, hits: int, total: int) -> None:
        """A request's items: `hits` of `total` were cached (about the last
        50 items weigh in: a refused upload may cost every later request of
        the image a processing, so the estimate turns slowly)."""
        with self._lock:
            for index in range(total):
                self._reuse += 0.02 * (float(index < hits) - self._reuse)

    def uploaded(self, seconds: float, nbytes: int) -> None:
        """An upload of `nbytes` took `seconds` of CPU."""
        with self._lock:
            self._cost.observe(seconds, nbytes)

    def admit(self, nbytes: int, processing_s: float) -> bool:
        """Upload an item of `nbytes` whose processing took about `processing_s` of CPU?"""
        with self._lock:
            # Where a share r of items hits, each miss is asked for again
            # r / (1 - r) times: the hits an upload may bring. And never an
            # upload dearer than processing the item again.
            repeats = min(1.0, self._reuse / max(1e-9, 1 - self._reuse))
            if self._cost.of(nbytes) <= repeats * processing_s:
                return True
            self._refused += 1
            return self._refused % self._explore == 0


class UploadCost:
    """An upload's CPU seconds as a fixed part (the calls) plus a part per byte
    (the copy), fitted to recent uploads (a least-squares line, older uploads
    weighing less): a 1 MB upload costs far more per byte than a 6 MB one."""

    def __init__(self, *, keep: float = 0.9) -> None:
        self._keep = keep
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, seconds: float, nbytes: int) -> None:
        if nbytes <= 0 or seconds < 0:
            return
        k, x = self._keep, float(nbytes)
        self._n = k * self._n + 1
        self._x = k * self._x + x
        self._y = k * self._y + seconds
        self._xx = k * self._xx + x * x
        self._xy = k * self._xy + x * seconds

    def of(self, nbytes: int) -> float:
        """The expected CPU seconds of uploading `nbytes` (0 before any upload)."""
        if not self._n:
            return 0.0
        mean_x, mean_y = self._x / self._n, self._y / self._n
        spread = self._xx / self._n - mean_x * mean_x
        if spread <= (0.05 * mean_x) ** 2:  # one size so far: proportional
            return mean_y * nbytes / mean_x
        per_byte = max(0.0, (self._xy / self._n - mean_x * mean_y) / spread)
        fixed = max(0.0, mean_y - per_byte * mean_x)
        return fixed + per_byte * nbytes
