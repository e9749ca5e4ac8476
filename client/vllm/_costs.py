"""What the plugin's P0 measures to decide how long to wait, and its sharing rule.

`ProcessingTime`: the processor's seconds per item, from this API process's
own requests, smoothed, so it follows the model, the image sizes and the
machine without settings. A lookup waits for an upload in flight elsewhere
about that long, no longer (past it, processing the item here is as quick).
Uploads need no estimate: every processed item goes (an upload costs a few
percent of a processing), unless it does not `fit` the sidecar, or the
uploads in flight are at their bound (runtime.BackgroundCalls); no outcome
of an earlier upload enters the rule.
"""

from __future__ import annotations

import threading

__all__ = ["ProcessingTime", "fits"]

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


def fits(sizes: list[int], capacity: int) -> list[bool]:
    """Which items of `sizes` bytes a sidecar of `capacity` bytes could hold
    (0: not known yet, all): one larger than the whole sidecar could never hit."""
    return [not capacity or size <= capacity for size in sizes]
