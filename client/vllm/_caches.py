"""vLLM's P0 multimodal cache, backed by one mmcache server: an adapter of
vLLM's interface over its parts.

P0 (`MMCacheProcessorCache`, in every API-server process). vLLM asks it, per
request, `is_cached(hashes)`; then, item by item, `get_and_update_item`; then
`release_sender_touches` once, in a `finally`. Each call goes to a part:

- `Lookup` (_p0_lookup.py): which items are hits, the sidecar's (confirmed,
  leased for the engine's read) or this process's own cache's (`LocalCache`,
  _local.py: vLLM alone's LRU of the same memory, so every hit of vLLM alone
  is a hit here: docs/vllm.md); and each hit as vLLM alone's cache hands it over.
- `Sharing` (_p0_sharing.py): what this process processed goes up in the
  background when the request ends, and the server hears of every query.
- `Ledger` (_ledger.py): what one request's calls share, one per thread
  (vLLM runs requests on a thread pool); `KnownUpdates` (_updates.py): the
  prompt updates of what this process processed.
- What differs by vLLM release: _p0_releases.py.

`is_cached_item` (vLLM 0.33, on its output loop) reads the mirror alone, with
no call; `close` (0.33, at shutdown) lets the uploads in flight end. The
process's `SyncClient` (runtime.py) carries every call. Counters are vLLM's:
one query per item, a hit per item vLLM did not process.

P1's cache, which reads what P0 shared: _receiver.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

from typing_extensions import override
from vllm.logger import init_logger
from vllm.multimodal.cache import BaseMultiModalProcessorCache
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.utils.cache import CacheInfo

from mmcache._errors import MMCacheError
from mmcache._spec import check_name

from ._costs import ProcessingTime
from ._digests import Shape
from ._keys import scoped_key
from ._ledger import Ledgers
from ._local import LocalCache
from ._p0_context import P0Context
from ._p0_lookup import Lookup
from ._p0_releases import RequestEnds
from ._p0_sharing import Sharing, stamp
from ._small import SmallImages, no_shape
from ._updates import KnownUpdates
from .runtime import SyncClient

__all__ = ["MMCacheProcessorCache", "already_shared"]

# vLLM's default --mm-processor-cache-gb: this process's own cache, where
# no vLLM config says otherwise.
VLLM_CACHE_GB = 4.0

# Set while items that are shared already (read from the sidecar, or sent by
# a frontend that uploads them itself) are injected: not uploaded again.
_ALREADY_SHARED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mmcache_already_shared", default=False
)


@contextlib.contextmanager
def already_shared() -> Iterator[None]:
    """Items vLLM's cache takes inside this block (`inject_into_mm_cache`) are
    shared already: counted as vLLM counts them, never uploaded again."""
    token = _ALREADY_SHARED.set(True)
    try:
        yield
    finally:
        _ALREADY_SHARED.reset(token)


class MMCacheProcessorCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    def __init__(
        self,
        sync: SyncClient,
        scope: str,
        model: str = "",
        local_gb: float = VLLM_CACHE_GB,
        # Which hashes are the fleet's (the factory's: vLLM's own digests, _digests.py).
        shareable: Callable[[str], bool] = lambda mm_hash: True,
        # Claim new images at the sidecar so that one process processes each (_p0_lookup.py).
        single_flight: bool = False,
        # An image's dimensions by its hash (the factory's: _digests.py), so
        # that small ones stay here (_small.py); the default knows none.
        shape_of: Callable[[str], Shape | None] = no_shape,
        # Whether small images kept here go up into the sidecar's shared memory
        # where single flight is on (_p0_sharing.py); False: not uploaded.
        share_kept: bool = True,
    ) -> None:
        super().__init__()
        self.sync = sync  # the process's client, which every call goes through
        self._scope = scope
        self._own = LocalCache(local_gb)  # vLLM alone's cache: _local.py
        self._known = KnownUpdates(model)
        self._processing = ProcessingTime()  # measured by Sharing, read by Lookup
        context = P0Context(
            sync,
            self.key,
            self._known,
            self._processing,
            shareable,
            SmallImages(shape_of),
            single_flight,
            share_kept,
        )
        self._lookup = Lookup(context, self._own)
        self._sharing = Sharing(context)
        self._ledgers = Ledgers()
        self._ends = RequestEnds()
        self._lock = threading.Lock()
        self._hits = 0
        self._total = 0
        self._last = (0, 0)
        self._serving = False

    def key(self, mm_hash: str) -> str:
        """The server's key for vLLM's hash: scoped to model and processor."""
        return scoped_key(self._scope, mm_hash)

    def hits_as_keys(self) -> None:
        """Every sidecar hit goes as its key (no small one inline): for a
        transport whose worker reads keys from its own sidecar (Dynamo's)."""
        self._lookup.hits_as_keys()

    @property
    def uploads_in_flight(self) -> int:
        """Uploads started and not ended (`close` waits for them)."""
        return self._sharing.in_flight

    @override
    def is_cached_item(self, mm_hash: str) -> bool:
        # The mirror alone, with no call and no request begun: vLLM 0.33 asks
        # this on its output loop, of the hashes the engine found missing,
        # before it invalidates them (the processor asks is_cached).
        # It asks to invalidate a hit the engine did not find in the sidecar:
        # this process's own cache is not the engine's, and keeps its copy.
        return bool(self.sync.client.is_cached([self.key(mm_hash)], pending=True)[0])

    @override
    def validate_input_item(self, mm_item: MultiModalKwargsItem, mm_hash: str) -> None:
        """vLLM 0.33's check of an item a client supplied processed: a hash no
        server would take is the client's error (400), not a silent non-share."""
        try:
            check_name("mm_hash", self.key(mm_hash))
        except MMCacheError as exc:
            raise ValueError(f"multimodal item hash refused by mmcache: {exc}") from None

    @override
    def close(self) -> None:
        """vLLM 0.33's renderer stops: no upload starts, those in flight end
        (within the deadline); the process's client stays for its other users."""
        self._sharing.close()

    @override
    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        if not self._serving:
            self._serving = True
            # Through vLLM's logger: its lines name the process (ApiServer_N).
            init_logger("vllm.mmcache").info("mmcache: this process's first request")
        ledger = self._ledgers.current()
        if self._ends.ended_unsaid(ledger):
            self.release_sender_touches()
            ledger = self._ledgers.current()
        ledger.started = True
        self._lookup.ask(ledger, mm_hashes)
        ledger.asked = stamp()  # the processor starts now, on this thread
        return [ledger.is_hit(h) for h in mm_hashes]

    @override
    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        ledger = self._ledgers.current()
        ledger.merged = True
        with self._lock:
            self._total += 1
        if mm_item is None:
            hit = self._lookup.take(ledger, mm_hash)
            with self._lock:
                self._hits += 1
            if self._ends.per_item():  # vLLM 0.31: counts (own hits) leave as they come
                self._sharing.send(ledger)
            return hit
        # vLLM alone's cache takes every item it is given: so does this process's.
        self._own.get_and_update_item(mm_item, mm_hash)
        if _ALREADY_SHARED.get() or not self._sharing.processed(ledger, mm_hash, *mm_item):
            return mm_item
        if not ledger.started:
            # Outside a request (vLLM's inject_into_mm_cache): nothing will
            # call release_sender_touches, so the item leaves now.
            self.release_sender_touches()
        elif self._ends.per_item():
            self._sharing.send(ledger)
        return mm_item

    @override
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        self._own.touch_sender_cache_item(mm_hash)  # as vLLM alone's cache is touched
        if mm_hash not in self._ledgers.current().kept:  # (kept: the sidecar's no concern)
            self.sync.client.touch(self.key(mm_hash))

    @override
    def release_sender_touches(self) -> None:
        """The end of a request: its uploads leave, in one call, in the background."""
        self._sharing.send(self._ledgers.end())

    @override
    def invalidate(self, mm_hash: str) -> None:
        # The engine did not find what the sidecar confirmed: the mirror was
        # stale. This process's own copy is good: the client's retry hits it.
        self.sync.client.forget([self.key(mm_hash)])
        self._known.forget(mm_hash)

    @override
    def clear_cache(self) -> None:
        # The server is shared by every frontend: only this process forgets,
        # as vLLM alone's cache would.
        self._own.clear_cache()
        self._known.clear()

    @override
    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        with self._lock:
            hits, total = self._hits, self._total
            if delta:
                last_hits, last_total = self._last
                self._last = (hits, total)
                hits, total = hits - last_hits, total - last_total
        return CacheInfo(hits=hits, total=total)
