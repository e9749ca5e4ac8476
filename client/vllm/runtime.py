"""The vLLM side's runtime: vLLM's threads calling the async client.

vLLM calls its caches and connectors synchronously: P0 from the renderer's
thread pool, P1 and the EC scheduler from the engine core's thread, the EC
worker from the model runner's; Dynamo's transport from its own event loop.
`SyncClient` runs one `MMCacheClient` on an event loop of its own, in a
daemon thread, and is the one way each of them reaches it:

- `call`: wait for a result, at most a deadline (DeadlineExceededError past
  it, the call cancelled on the loop), so a caller never hangs on its cache;
- `wait`: the same, awaited from another event loop (Dynamo's);
- `submit`: a call nobody waits for (a release, a count), its failure logged;
- `BackgroundCalls`: calls vLLM's thread does not wait for, at most so many
  at once (uploads: past the bound a call is not made, and the caller counts
  it), so memory stays bounded when the sidecar is slow.

The client itself fails open (`fail_open=True`): a server that is down or
slow makes `get_and_update` hand the items back, `lookup` say "not held".
Local reads of the mirror (`client.is_cached`) need no round trip to the
loop: the mirror's maps are read under the GIL while the loop thread updates them.

`process_client` makes one per process and target, shared by the plugin's
caches, the EC connector and Dynamo's transport (and one that does not
follow the feed for the engine's cache, in a process with no other).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mmcache._errors import DeadlineExceededError, MMCacheError, UnavailableError
from mmcache.client import FailOpen, MMCacheClient

from ._metrics import plugin_metrics
from ._settings import Settings

__all__ = ["THREAD_NAME", "BackgroundCalls", "SyncClient", "process_client"]

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

# The loop thread's name, to the OS too: `top -H` and /proc/PID/task/*/comm
# show what mmcache's calls cost a vLLM process (bench/vllm.py reads it).
THREAD_NAME = "mmcache-client"


class SyncClient:
    """Usage::

    sync = SyncClient("127.0.0.1:50051", deadline_s=1.0)
    sent = sync.call(sync.client.get_and_update(items, hashes))
    sync.close()
    """

    def __init__(
        self,
        target: str,
        *,
        deadline_s: float = 1.0,
        on_fail_open: Callable[[], None] | None = None,
        **options: Any,
    ) -> None:
        self.deadline_s = deadline_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        try:
            fail_open = FailOpen(deadline_s, on_fail_open)
            self.client = MMCacheClient(target, fail_open=fail_open, **options)
            # Fails open: a server that does not answer is no error here; one
            # that refuses this client (its token, TLS) is, with its reason.
            self.call(self.client.connect(), timeout=deadline_s + 5)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            raise

    def _run(self) -> None:
        _name_this_thread(THREAD_NAME)
        self._loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the client's loop and wait for it (default: twice the deadline)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        wait_s = 2 * self.deadline_s if timeout is None else timeout
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceededError(f"mmcache did not answer within {wait_s:g}s") from None
        except concurrent.futures.CancelledError:  # the runtime closed under the call
            raise UnavailableError("mmcache's client closed during the call") from None

    async def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """`call` for a caller on another event loop: awaited, not blocking it;
        DeadlineExceededError past the deadline (the call cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.deadline_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"mmcache did not answer within {self.deadline_s:g}s"
            ) from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the client's loop without waiting for it; a failure
        is logged (DEBUG: the client failed open, or the call was refused)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.add_done_callback(_log_failure)
        return future

    def background(self, most_in_flight: int) -> BackgroundCalls:
        """Calls on this client no caller waits for, at most `most_in_flight` at once."""
        return BackgroundCalls(self, most_in_flight)

    def loop_cpu(self) -> float:
        """CPU seconds the client's thread has used: what its calls cost this
        process (its loop runs nothing else)."""
        ident = self._thread.ident
        if ident is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:  # the thread is gone
            return 0.0

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.call(self.client.close(), timeout=5)
        finally:
            with contextlib.suppress(MMCacheError):
                self.call(_cancel_the_rest(), timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


async def _cancel_the_rest() -> None:
    """Calls still running when the client closes (background calls nobody
    waits for) end cancelled, rather than destroyed pending with the loop."""
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


class BackgroundCalls:
    """Calls vLLM's thread starts and does not wait for, at most `most` in
    flight: past that (or once closed) a call is not made, and `start` says
    so, for the caller to count. Thread-safe."""

    def __init__(self, sync: SyncClient, most: int) -> None:
        self._sync = sync
        self._most = most
        self._in_flight = 0
        self._closed = False
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a call ended

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def closed(self) -> bool:
        """No call starts from now (`close`)."""
        return self._closed

    def start(
        self,
        make: Callable[[], Coroutine[Any, Any, T]],
        done: Callable[[concurrent.futures.Future[T]], None],
    ) -> bool:
        """Start the call `make` makes (made only if it goes: its data is
        prepared then), and `done` with its future when it ends, on the
        client's thread; False: not started, at the bound or closed."""
        with self._lock:
            if self._closed or self._in_flight >= self._most:
                return False
            self._in_flight += 1
        call: Coroutine[Any, Any, T] | None = None
        try:
            call = make()
            future = self._sync.submit(call)
        except BaseException:
            if call is not None:
                call.close()  # never scheduled: no "never awaited" warning
            self._ended()
            raise
        future.add_done_callback(lambda ended: self._finish(ended, done))
        return True

    def _finish(
        self,
        future: concurrent.futures.Future[T],
        done: Callable[[concurrent.futures.Future[T]], None],
    ) -> None:
        try:
            done(future)  # counted before `close` sees it end
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._settled.notify_all()

    def close(self, wait_s: float) -> None:
        """No call starts from now; wait up to `wait_s` for those in flight."""
        deadline = time.monotonic() + wait_s
        with self._settled:
            self._closed = True
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._settled.wait(left)


_lock = threading.Lock()
# This process's, per target and whether it follows the feed, made on first use.
_process_clients: dict[tuple[str, bool], SyncClient] = {}


def process_client(
    settings: Settings, *, follow: bool = True, feed_gap_s: float = 0.0
) -> SyncClient:
    """This process's SyncClient of `settings.target` (one per process and
    target: the first made sets its deadline and connection settings).

    `follow=False`, for a reader with no use for the mirror (vLLM's engine
    cache reads the region and `fetch`es): this process's following client
    where there is one, else one that does not follow the feed, so that the
    fleet's every upload does not wake a thread in the engine's process.
    `feed_gap_s`: the least time between two feed messages (0: the server's)."""
    with _lock:
        client = _process_clients.get((settings.target, True))
        if client is None and not follow:
            client = _process_clients.get((settings.target, False))
        if client is None:
            client = _process_clients[settings.target, follow] = SyncClient(
                settings.target,
                deadline_s=settings.deadline_s,
                on_fail_open=plugin_metrics().fail_opens.inc,
                follow=follow,
                feed_gap_s=feed_gap_s if follow else 0.0,
                **settings.client_options(),
            )
        return client


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        _LOGGER.debug("mmcache: a call in the background failed: %s", exc)


def _name_this_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
