"""A circuit breaker for one remote node: closed while it answers, open (calls
skip it at once) from a failure until a probe finds it answering again, with a
backoff between probes that doubles while it stays down. Transport-free: the
owner runs the probes and says what they found."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Breaker"]


class Breaker:
    def __init__(
        self,
        first_s: float = 0.25,
        most_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first_s = first_s
        self._most_s = most_s
        self._clock = clock
        self._backoff_s = first_s
        self.reason = ""  # the failure that opened it (empty while closed)
        self.since = 0.0  # when it opened

    @property
    def is_open(self) -> bool:
        return bool(self.reason)

    @property
    def backoff_s(self) -> float:
        """How long to wait before the next probe."""
        return self._backoff_s

    def trip(self, reason: str) -> bool:
        """A call failed on the node; True when this opens the breaker (a new
        outage), False when it was open already."""
        if self.is_open:
            return False
        self.reason = reason or "failed"
        self.since = self._clock()
        self._backoff_s = self._first_s
        return True

    def probe_failed(self, reason: str) -> None:
        self.reason = reason or self.reason
        self._backoff_s = min(self._backoff_s * 2, self._most_s)

    def reset(self) -> float:
        """A probe found the node answering: closed again. How long it was open."""
        down_s = self._clock() - self.since if self.is_open else 0.0
        self.reason = ""
        self._backoff_s = self._first_s
        return down_s
