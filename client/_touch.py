"""Whether a client is in touch with its server, and what failing open does
when it is not (`MMCacheClient(fail_open=True)`): calls give up after
`timeout`, and callers go on without the cache."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from mmcache._errors import DeadlineExceededError, InvalidArgumentError, UnavailableError

__all__ = ["OUT_OF_TOUCH", "FailOpen", "Touch"]

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

# What a call that fails open gives up on: the server did not answer in time.
OUT_OF_TOUCH = (UnavailableError, DeadlineExceededError)


@dataclass(frozen=True)
class FailOpen:
    """A client that never waits on its cache longer than `timeout_s`
    (`MMCacheClient(fail_open=FailOpen(...))`; `fail_open=True` takes these
    defaults). `on_fail_open` is called each time a call gives up, e.g. to
    count it in a metric of the caller's."""

    timeout_s: float = 1.0
    on_fail_open: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise InvalidArgumentError(
                f"FailOpen timeout_s must be more than 0, got {self.timeout_s}"
            )


class Touch:
    """In touch (the server answered last) or not, and how often the client
    failed open."""

    def __init__(self, fail_open: FailOpen | None) -> None:
        self.fail_open = fail_open is not None
        settings = fail_open or FailOpen()
        # Without failing open, still the bound of what a client owes the
        # server at close (leases, holds) and of a co-located allocation.
        self.timeout = settings.timeout_s
        self._on_fail_open = settings.on_fail_open
        self.in_touch = False
        self.fail_opens = 0

    @property
    def call_timeout(self) -> float | None:
        """A call's own bound: `timeout` when failing open, else the caller's."""
        return self.timeout if self.fail_open else None

    @property
    def wait_for_ready(self) -> bool:
        """Whether a call waits for the channel to connect: never when failing
        open (a server down answers UNAVAILABLE at once, not at the deadline)."""
        return not self.fail_open

    @contextlib.asynccontextmanager
    async def bounded(self, what: str) -> AsyncIterator[None]:
        """One request's whole bound when failing open: every call it makes (a
        retry, a second route, a lease given back) ends within `timeout`
        together; DeadlineExceededError past it. No bound otherwise (each call
        has the client's `timeout`)."""
        if not self.fail_open:
            yield
            return
        try:
            async with asyncio.timeout(self.timeout):
                yield
        except TimeoutError:
            raise DeadlineExceededError(
                f"{what} did not finish within the client's deadline ({self.timeout:g} s)"
            ) from None

    async def answer(
        self, what: str, call: Callable[[float | None, bool], Awaitable[T]]
    ) -> T | None:
        """One call on a request's path, given its timeout and wait_for_ready:
        bounded, and None where it failed open."""
        try:
            async with self.bounded(what):
                return await call(self.call_timeout, self.wait_for_ready)
        except OUT_OF_TOUCH as exc:
            if not self.fail_open:
                raise
            self.fell_open(exc)
            return None

    def back(self) -> None:
        self.in_touch = True

    def fell_open(self, exc: Exception) -> None:
        self.fail_opens += 1
        if self._on_fail_open is not None:
            self._on_fail_open()
        if self.in_touch or self.fail_opens == 1:
            _LOGGER.warning("mmcache did not answer in time, failing open: %s", exc)
        self.in_touch = False
