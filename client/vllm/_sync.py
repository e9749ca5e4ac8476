"""`SyncClient`: an `MMCacheClient` for synchronous callers, such as vLLM's caches.

vLLM calls its caches synchronously: P0 from the renderer's thread pool, P1
from the engine core's input thread. A `SyncClient` runs one async client on
an event loop of its own, in a daemon thread, and every call waits for its
result with a deadline, from any thread. A call that does not finish in time
raises DeadlineExceededError (it is cancelled on the loop), so a caller never
hangs on its cache; the client itself fails open (`fail_open=True`), so a
server that is down or slow makes `get_and_update` hand the items back.

Local reads of the mirror (`client.is_cached`) need no round trip to the loop:
the mirror's maps are read under the GIL while the loop thread updates them.

`process_client` makes one per process and target, shared by the plugin's
caches and the EC connector.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from mmcache._errors import DeadlineExceededError

from .._client import FailOpen, MMCacheClient
from ._metrics import plugin_metrics
from ._settings import Settings

__all__ = ["SyncClient", "process_client"]

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

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run `coro` on the client's loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

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
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


_lock = threading.Lock()
_process_clients: dict[str, SyncClient] = {}  # this process's, per target, made on first use


def process_client(settings: Settings) -> SyncClient:
    """This process's SyncClient of `settings.target` (one per process and
    target: the first made sets its deadline and connection settings)."""
    with _lock:
        client = _process_clients.get(settings.target)
        if client is None:
            client = _process_clients[settings.target] = SyncClient(
                settings.target,
                deadline_s=settings.deadline_s,
                on_fail_open=plugin_metrics().fail_opens.inc,
                **settings.client_options(),
            )
        return client


def _name_this_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
