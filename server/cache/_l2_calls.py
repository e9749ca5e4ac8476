"""The L2 tier's calls to its backend: at most `concurrency` under way at
once, each bounded by a deadline, every failure one `L2Error`, counted and
timed in `mmcache_l2_*` by operation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from mmcache.metrics import L2Metrics

from ._l2 import L2Backend, L2Error

__all__ = ["L2Calls"]

T = TypeVar("T")


class L2Calls:
    def __init__(
        self,
        backend: L2Backend,
        metrics: L2Metrics,
        concurrency: int,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.backend = backend
        self._metrics = metrics
        self._gate = asyncio.Semaphore(concurrency)
        self._timeout_s = timeout_s
        self._clock = clock

    async def within(self, op: str, call: Callable[[], Awaitable[T]], deadline: float) -> T:
        """One backend call, bounded by `deadline` (the clock's); L2Error
        (counted) when it fails in any way."""
        left = deadline - self._clock()
        if left <= 0:
            raise L2Error("no time left for L2")
        try:
            return await asyncio.wait_for(self._gated(op, call), left)
        except (L2Error, TimeoutError) as exc:
            self._metrics.errors.labels(op).inc()
            raise L2Error(f"L2 {op}: {exc or 'timed out'}") from None

    async def quietly(self, op: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """A background call, bounded by the tier's timeout: its failure is
        counted, and skipped (None)."""
        try:
            return await self.within(op, call, self._clock() + self._timeout_s)
        except L2Error:
            return None

    async def _gated(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        async with self._gate:
            started = time.perf_counter()
            try:
                result = await call()
            except L2Error:
                raise
            except Exception as exc:  # a backend's surprise is a failure like any other
                raise L2Error(f"{type(exc).__name__}: {exc}") from None
            self._metrics.latency.labels(op).observe(time.perf_counter() - started)
            return result
