"""vLLM's P0 multimodal cache, backed by one mmcache server.

P0 (`MMCacheProcessorCache`, in every API-server process). vLLM asks it, per
request, `is_cached(hashes)`; then, item by item, `get_and_update_item`; then
`release_sender_touches` once, in a `finally`. So:

- `is_cached`: the mirror names the candidates (behind a sidecar with an L2
  tier, every item is one: another node's sidecar may hold it). Those
  resident in the sidecar's shared memory are leased there, on vLLM's
  thread, with no call (client/_resident.py), their prompt updates this
  process's own or the metadata stored with them in the region; one
  `lookup` round trip confirms the rest with the server, leases them for the
  engine's read (hits only) and brings the prompt updates of those this
  process never processed.
  A candidate whose upload is still in flight (another API process's) is
  waited for at most about what processing it here takes (this process's
  processor time per item, measured on its own requests): past that it is
  processed here, so a slow upload elsewhere never stalls this process's
  requests, which vLLM processes on one thread.
  Only confirmed hits with usable prompt updates are cached: vLLM skips the
  processor for them and sends no data, and the engine's read finds them.
  A server that does not answer in time confirms nothing (fail-open).
- This process's own cache (`LocalCache`, _local.py): vLLM's own LRU of the
  same memory, told every call vLLM alone would make on its cache, with the
  data. What it holds and the sidecar does not (a sidecar slow, full or
  down) is a hit too, with no call: the item goes inline to the engine, as
  vLLM's processor-only cache sends it. A hit the sidecar answered that this
  cache lacks is read from the sidecar into it (`_fill`) before it counts;
  if the read fails it is a miss, as it is for vLLM alone, whose cache lacks
  it too. So every hit of vLLM alone is a hit here: docs/vllm.md.
- `get_and_update_item(None, h)`: a confirmed hit: (None, its updates) when
  the sidecar holds it (the engine reads it there), else (its data, its
  updates) from this process's cache. With data: the item goes inline to
  the engine, as vLLM's miss does, and is queued for upload, so other
  processes can hit it; so is a hit of this process's cache that the
  sidecar lacks.
- `is_cached_item` (asked by vLLM 0.33 on its output loop before it
  `invalidate`s what the engine found missing): the mirror alone, no call.
- `release_sender_touches`: the request's uploads leave in one call, in the
  background (the engine has the data already); touches reach the server with
  the next call. Every item goes (client/vllm/_costs.py, `Uploads`: an
  upload costs a few percent of a processing), unless larger than the whole
  server or with 8 uploads in flight; those are counted
  (`mmcache_vllm_not_uploaded_items_total`), and offered again when they
  come back.

An item larger than the whole server is never uploaded (vLLM's
`cache_if_fits`, said once); `close` (0.33, at shutdown) lets the uploads in
flight end. Per-request state is thread-local: vLLM runs requests on a thread pool.
Counters are vLLM's: one query per item, a hit per item vLLM did not process.

P1's cache, which reads what P0 shared: _receiver.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from typing_extensions import override
from vllm.logger import init_logger
from vllm.multimodal.cache import (
    BaseMultiModalProcessorCache,
    MultiModalCacheMissError,
)
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.utils.cache import CacheInfo

from mmcache._errors import MMCacheError
from mmcache._spec import check_name

from ._costs import ProcessingTime, Uploads
from ._keys import scoped_key
from ._local import LocalCache
from ._metrics import plugin_metrics
from ._sync import SyncClient
from .convert import decode_updates, encode_updates, from_vllm, to_vllm, undescribed

__all__ = ["MMCacheProcessorCache", "already_shared"]

_LOGGER = logging.getLogger(__name__)

# Prompt updates kept for items this process processed (entries, not bytes:
# a few hundred bytes each).
LOCAL_UPDATES = 65536
# Uploads in flight at once; past that a request's upload is skipped (its
# data went inline anyway): memory stays bounded when the server is slow.
MAX_UPLOADS_IN_FLIGHT = 8
# vLLM's default --mm-processor-cache-gb: this process's own cache, where
# no vLLM config says otherwise.
VLLM_CACHE_GB = 4.0
# vLLM 0.32 and later call release_sender_touches at each request's end;
# 0.31 (NVIDIA Dynamo 1.6's) has no such method and never does.
VLLM_RELEASES = hasattr(BaseMultiModalProcessorCache, "release_sender_touches")


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


@dataclass
class _Request:
    """What one request's calls share, from is_cached to release_sender_touches."""

    started: bool = False  # by is_cached: release_sender_touches will end it
    confirmed: dict[str, Any] = field(default_factory=dict)  # hash -> prompt updates
    looked_up: set[str] = field(default_factory=set)
    uploads: list[tuple[str, str, MultiModalKwargsItem, Any]] = field(default_factory=list)
    held_elsewhere: set[str] = field(default_factory=set)  # held, updates not usable here
    processed: int = 0  # items that came with data (misses)
    # Hits of this process's own cache: hash -> (item, updates), taken when
    # is_cached answered (another request may evict it before vLLM takes it).
    local: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    unshared: set[str] = field(default_factory=set)  # local hits the sidecar lacks
    # Sidecar hits this process's cache lacked: the data read for it.
    filled: dict[str, MultiModalKwargsItem] = field(default_factory=dict)
    # Modalities of misses the server has not counted yet: processed items
    # neither looked up nor uploaded (sent with the request's uploads).
    misses: list[str] = field(default_factory=list)
    # Modalities of this process's own hits no call told the server of (the
    # server counts them as vLLM does, from the next report), and the hashes
    # of those offered to the sidecar again (re-sends there, not queries).
    own_hits: list[str] = field(default_factory=list)
    offered: set[str] = field(default_factory=set)
    merged: bool = False  # vLLM has taken its items (get_and_update_item)
    observed: bool = False  # its processing time was measured
    # (wall, this thread's CPU) when is_cached last answered (the processor
    # starts then), and when the first processed item came back.
    asked: tuple[float, float] = (0.0, 0.0)
    first_back: tuple[float, float] = (0.0, 0.0)


class MMCacheProcessorCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    def __init__(
        self,
        sync: SyncClient,
        scope: str,
        model: str = "",
        local_gb: float = VLLM_CACHE_GB,
        shareable: Callable[[str], bool] = lambda mm_hash: True,
    ) -> None:
        super().__init__()
        self._sync = sync
        self._scope = scope
        self._model = model
        # Why this model's prompt updates cannot travel as data (None: they can).
        self._undescribed: str | None = None
        self._updates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._own = LocalCache(local_gb)  # vLLM alone's cache: _local.py
        # Which hashes are the fleet's (the factory's: vLLM's own digests, _digests.py).
        self._shareable = shareable
        self._uploads = Uploads(most_in_flight=MAX_UPLOADS_IN_FLIGHT)
        self._hits = 0
        self._total = 0
        self._last = (0, 0)
        self._serving = False
        self._processing = ProcessingTime()
        self._metrics = plugin_metrics()

    def key(self, mm_hash: str) -> str:
        """The server's key for vLLM's hash: scoped to model and processor."""
        return scoped_key(self._scope, mm_hash)

    def _request(self) -> _Request:
        request: _Request | None = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = _Request()
        return request

    def _local_updates(self, mm_hash: str) -> Any:
        with self._lock:
            updates = self._updates.get(mm_hash)
            if updates is not None:
                self._updates.move_to_end(mm_hash)
            return updates

    def _remember(self, mm_hash: str, updates: Any) -> None:
        with self._lock:
            self._updates[mm_hash] = updates
            self._updates.move_to_end(mm_hash)
            while len(self._updates) > LOCAL_UPDATES:
                self._updates.popitem(last=False)

    @override
    def is_cached_item(self, mm_hash: str) -> bool:
        # The mirror alone, with no call and no request begun: vLLM 0.33 asks
        # this on its output loop, of the hashes the engine found missing,
        # before it invalidates them (the processor asks is_cached).
        # It asks to invalidate a hit the engine did not find in the sidecar:
        # this process's own cache is not the engine's, and keeps its copy.
        return bool(self._sync.client.is_cached([self.key(mm_hash)], pending=True)[0])

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
        self._uploads.close(self._sync.deadline_s)

    @override
    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        if not self._serving:
            self._serving = True
            # Through vLLM's logger: its lines name the process (ApiServer_N).
            init_logger("vllm.mmcache").info("mmcache: this process's first request")
        request = self._request()
        if request.merged and not VLLM_RELEASES:
            # vLLM 0.31 never says a request ended: the next one on this thread says it.
            self.release_sender_touches()
            request = self._request()
        request.started = True
        client = self._sync.client
        keys = [self.key(h) for h in mm_hashes]
        # vLLM may ask more than once per request: each hash is looked up once.
        # Behind a shared tier (L2) the mirror's "no" is not the fleet's: every
        # hash is asked about (the server reads the tier through), in the same call.
        # Only items named by their content (vLLM's digest, not a client's uuid)
        # are the fleet's: the others stay in this process's cache (_digests.py).
        shared = [self._shareable(h) for h in mm_hashes]
        if client.shared_tier and client.following:  # (not while out of touch)
            known = shared
        else:
            held = client.is_cached(keys, pending=True)
            known = [h and s for h, s in zip(held, shared, strict=True)]
        candidates = [
            i
            for i, held in enumerate(known)
            if held and mm_hashes[i] not in request.looked_up and mm_hashes[i] not in request.local
        ]
        ask = candidates
        if self._undescribed is not None:
            # Updates that cannot travel: only what this process processed can
            # hit here; the rest is processed, and not uploaded again.
            ask = [i for i in candidates if self._local_updates(mm_hashes[i]) is not None]
            request.held_elsewhere.update(mm_hashes[i] for i in candidates if i not in ask)
        if ask:
            try:
                ask = self._lease_resident(request, mm_hashes, keys, ask)
            except MMCacheError as exc:  # a hash no server takes: the lookup says so
                _LOGGER.debug("mmcache lease with no call failed: %s", exc)
        if ask:
            self._look_up(request, mm_hashes, keys, ask)
        # What the sidecar did not confirm (slow, full, down, never sent it)
        # and this process's own cache holds is a hit all the same.
        self._own_hits(request, mm_hashes, known)
        self._fill(request, mm_hashes, keys)
        request.asked = _stamp()
        return [h in request.confirmed or h in request.local for h in mm_hashes]

    def _own_hits(self, request: _Request, mm_hashes: list[str], known: list[bool]) -> None:
        """This process's cache's hits the sidecar did not confirm: kept for the
        request (their data goes inline); those the sidecar lacks are offered
        to it again. The sidecar's hits go first: the engine reads those with
        no data sent, as vLLM alone's one-API-server hits send none."""
        for mm_hash, held in zip(mm_hashes, known, strict=True):
            if mm_hash in request.confirmed or mm_hash in request.local:
                continue
            entry = self._own.peek(mm_hash)
            # An injected item (inject_into_mm_cache gives none) has no prompt
            # updates to apply: a processor's hit on it would fail the request,
            # as it would in vLLM alone, so it is processed again instead.
            if entry is not None and entry[1]:
                request.local[mm_hash] = entry
                # Not in the sidecar, by its mirror or by its answer just now.
                if (
                    (not held or mm_hash in request.looked_up)
                    and self._undescribed is None
                    and self._shareable(mm_hash)
                ):
                    request.unshared.add(mm_hash)

    def _fill(self, request: _Request, mm_hashes: list[str], keys: list[str]) -> None:
        """The sidecar's hits this process's cache lacks are read into it, as
        vLLM alone would have cached them on processing them here; their
        leases stay for the engine. Where the read fails they are misses, as
        they are for vLLM alone, whose cache lacks them too."""
        own = self._own
        need = [
            i
            for i, h in enumerate(mm_hashes)
            if h in request.confirmed and h not in request.filled and not own.is_cached_item(h)
        ]
        if not need:
            return
        client, wanted = self._sync.client, [keys[i] for i in need]
        try:
            items = client.fetch_resident(wanted, release=False)
            if items is None:
                items = self._sync.call(client.fetch(wanted, release=False))
        except MMCacheError as exc:
            _LOGGER.debug("mmcache read into this process's cache failed: %s", exc)
            for i in need:
                del request.confirmed[mm_hashes[i]]
            self._sync.submit(client.release(wanted))
            return
        for i, stored in zip(need, items, strict=True):
            request.filled[mm_hashes[i]] = to_vllm(stored)

    def _look_up(
        self, request: _Request, mm_hashes: list[str], keys: list[str], ask: list[int]
    ) -> None:
        """Ask the server about the hashes at `ask` (one call): those held with
        updates usable here are confirmed; a failure leaves them misses."""
        client = self._sync.client
        try:
            # Waiting for an upload in flight elsewhere saves a processing
            # only for an item this process's own cache lacks.
            own = self._own
            wait_s = self._processing.wait_for(
                sum(not own.is_cached_item(mm_hashes[i]) for i in ask)
            )
            found = self._sync.call(
                client.lookup([keys[i] for i in ask], want_metadata=True, wait_s=wait_s)
            )
        except MMCacheError as exc:
            _LOGGER.debug("mmcache lookup failed, items are misses: %s", exc)
            return
        unusable: list[str] = []
        for i, held, blob in zip(ask, found.held, found.metadata, strict=True):
            mm_hash = mm_hashes[i]
            request.looked_up.add(mm_hash)
            if not held:
                continue
            updates = self._local_updates(mm_hash)
            if updates is None and blob is not None:
                updates = decode_updates(blob)
            if updates is None:  # held, but not usable here: process it
                unusable.append(keys[i])
            else:
                request.confirmed[mm_hash] = updates
        if unusable:
            self._sync.submit(client.release(unusable))

    def _lease_resident(
        self, request: _Request, mm_hashes: list[str], keys: list[str], ask: list[int]
    ) -> list[int]:
        """Confirm with no call, on this thread, the hits resident in the
        sidecar's shared memory whose prompt updates this process knows, or
        can read from the metadata stored with them; the rest of `ask`, to
        look up by call."""
        updates: dict[int, Any] = {}

        def usable(j: int, metadata: bytes) -> bool:
            known = self._local_updates(mm_hashes[ask[j]])
            if known is None and metadata and self._undescribed is None:
                known = decode_updates(metadata)
            if known is not None:
                updates[j] = known
            return known is not None

        leased = self._sync.client.lease_resident([keys[i] for i in ask], usable=usable)
        for j, held in enumerate(leased.held):
            if held:
                mm_hash = mm_hashes[ask[j]]
                request.looked_up.add(mm_hash)
                request.confirmed[mm_hash] = updates[j]
        return [i for i in ask if mm_hashes[i] not in request.confirmed]

    @override
    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        request = self._request()
        request.merged = True
        with self._lock:
            self._total += 1
        if mm_item is None:
            hit = self._hit(request, mm_hash)
            with self._lock:
                self._hits += 1
            return hit
        # vLLM alone's cache takes every item it is given: so does this process's.
        self._own.get_and_update_item(mm_item, mm_hash)
        item, updates = mm_item
        if _ALREADY_SHARED.get():
            return mm_item
        if request.started and not request.first_back[0]:
            request.first_back = _stamp()
        if self._undescribed is None and (why := undescribed(updates)) is not None:
            self._undescribed = why
            init_logger("vllm.mmcache").warning(
                "mmcache: %s: %s; its items are hits only in the API process that "
                "processed them, and the others neither look them up nor upload them again",
                self._model or "this model",
                why,
            )
        self._remember(mm_hash, updates)
        # vLLM 0.32's field elements carry no modality; the updates usually do.
        modality = next((u.modality for u in updates), None) or "unknown"
        if self._undescribed is not None and request.started and mm_hash in request.held_elsewhere:
            request.misses.append(modality)  # asked of no server
            return mm_item  # the sidecar has it: its updates are now known here
        if not self._shareable(mm_hash):  # a client's uuid: never the fleet's
            request.misses.append(modality)
            self._metrics.not_uploaded.inc()
            return mm_item
        request.uploads.append((mm_hash, modality, item, updates))
        request.processed += 1
        if not request.started:
            # Outside a request (vLLM's inject_into_mm_cache): nothing will
            # call release_sender_touches, so the item leaves now.
            self.release_sender_touches()
        elif not VLLM_RELEASES:
            self._send_uploads(request)  # vLLM 0.31 never says a request ended
        return mm_item

    def _hit(self, request: _Request, mm_hash: str) -> tuple[Any, Any]:
        """A hit is_cached confirmed, on this process's cache as vLLM alone's
        would take it: the sidecar's (None: the engine reads it there), or this
        process's own (its data inline; offered to a sidecar that lacks it)."""
        updates = request.confirmed.get(mm_hash)
        if updates is not None:
            filled = request.filled.get(mm_hash)
            if filled is not None or self._own.is_cached_item(mm_hash):
                taken = None if filled is None else (filled, updates)
                self._own.get_and_update_item(taken, mm_hash)
            return None, updates
        entry = request.local.get(mm_hash)
        if entry is None:  # vLLM sends None only where is_cached said True
            raise MultiModalCacheMissError([mm_hash])
        # vLLM's own read (reordering); the entry taken at is_cached if evicted since.
        item, updates = self._own.get_and_update_item(entry, mm_hash)
        modality = next((u.modality for u in updates), None) or "unknown"
        if mm_hash not in request.looked_up:
            request.own_hits.append(modality)
        if mm_hash in request.unshared:
            request.unshared.discard(mm_hash)
            request.offered.add(mm_hash)
            request.uploads.append((mm_hash, modality, item, updates))
        return item, updates

    @override
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        self._own.touch_sender_cache_item(mm_hash)  # as vLLM alone's cache is touched
        self._sync.client.touch(self.key(mm_hash))

    @override
    def release_sender_touches(self) -> None:
        """The end of a request: its uploads leave, in one call, in the background."""
        request = self._request()
        self._local.request = None
        self._send_uploads(request)

    def _send_uploads(self, request: _Request) -> None:
        """The request's uploads so far leave, in one call, in the background;
        the server hears of the misses no call told it of."""
        try:
            self._upload(request)
        finally:
            if request.misses:
                self._sync.submit(self._sync.client.count_misses(request.misses))
                request.misses = []
            if request.own_hits:
                self._sync.submit(self._sync.client.count_hits(request.own_hits))
                request.own_hits = []

    def _upload(self, request: _Request) -> None:
        if not request.uploads:
            return
        self._observe(request)
        uploads, request.uploads = request.uploads, []
        sizes = [_nbytes(upload[2]) for upload in uploads]
        goes = self._uploads.start(sizes, self._sync.client.capacity_bytes)
        admitted = [upload for upload, go in zip(uploads, goes, strict=True) if go]
        if len(admitted) < len(uploads):
            self._said_declined(max(sizes))
            self._metrics.not_uploaded.inc(len(uploads) - len(admitted))
        # Processed items (not own hits offered again) that no call told the server of.
        told = {upload[0] for upload in admitted} | request.looked_up | request.offered
        request.misses += [modality for h, modality, _, _ in uploads if h not in told]
        if not admitted:
            return
        hashes, modalities, items, updates = zip(*admitted, strict=True)
        started = self._sync.loop_cpu()
        future = self._sync.submit(
            self._sync.client.get_and_update(
                [from_vllm(item, m) for item, m in zip(items, modalities, strict=True)],
                [self.key(h) for h in hashes],
                metadata=[encode_updates(u) for u in updates],
                # Looked up, or a hit of this process's own: counted already.
                resend=[h in request.looked_up or h in request.offered for h in hashes],
                lease=False,  # the engine has this data inline
                # Processed here: each a miss, as vLLM counts it, even where
                # another process uploaded it meanwhile (its data goes anyway).
                processed=True,
            )
        )
        future.add_done_callback(lambda done: self._upload_done(done, started, len(admitted)))

    def _observe(self, request: _Request) -> None:
        """The processor's time on the request's misses: vLLM runs it between
        is_cached and the first processed item's return, on this thread."""
        if request.asked[0] and request.first_back[0] and not request.observed:
            request.observed = True
            (asked_s, asked_cpu), (back_s, back_cpu) = request.asked, request.first_back
            seconds, cpu_seconds = back_s - asked_s, back_cpu - asked_cpu
            self._processing.observe(seconds, cpu_seconds, request.processed)
            self._metrics.processed.inc(request.processed)
            self._metrics.processing_cpu.inc(max(0.0, cpu_seconds))

    def _said_declined(self, largest: int) -> None:
        """Why items were not shared, once: larger than the whole server (it
        could never hit them, as vLLM's own `cache_if_fits` says), or uploads
        backed up (a slow or stopped sidecar: the items stay in this process's
        cache, and are offered again when they come back)."""
        capacity = self._sync.client.capacity_bytes
        if capacity and largest > capacity:
            init_logger("vllm.mmcache").warning_once(
                "mmcache: an item of %.1f MiB is larger than the sidecar's whole cache "
                "(%.1f MiB): such items are processed here and never shared; raise the "
                "sidecar's --capacity-gb to share them",
                largest / 2**20,
                capacity / 2**20,
            )
        _LOGGER.debug("mmcache uploads backed up or closed: items not shared")

    def _upload_done(self, future: Any, started: float, items: int) -> None:
        """Counts what the upload left held (a sidecar that did not answer
        fails open: nothing held, no error) and what it did not."""
        if future.cancelled() or future.exception() is not None:
            stored = 0
            if not future.cancelled():
                _LOGGER.debug("mmcache upload failed: %s", future.exception())
        else:
            stored = sum(future.result().held)
        self._uploads.ended(failed=items - stored)
        self._metrics.not_uploaded.inc(items - stored)
        if stored:
            # CPU, not wall time: in a busy API process the upload's thread
            # waits for the GIL, which costs the process nothing.
            cpu_seconds = max(0.0, self._sync.loop_cpu() - started)
            self._metrics.uploaded.inc(stored)
            self._metrics.upload_cpu.inc(cpu_seconds)

    @override
    def invalidate(self, mm_hash: str) -> None:
        # The engine did not find what the sidecar confirmed: the mirror was
        # stale. This process's own copy is good: the client's retry hits it.
        self._sync.client.forget([self.key(mm_hash)])
        with self._lock:
            self._updates.pop(mm_hash, None)

    @override
    def clear_cache(self) -> None:
        # The server is shared by every frontend: only this process forgets,
        # as vLLM alone's cache would.
        self._own.clear_cache()
        with self._lock:
            self._updates.clear()

    @override
    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        with self._lock:
            hits, total = self._hits, self._total
            if delta:
                last_hits, last_total = self._last
                self._last = (hits, total)
                hits, total = hits - last_hits, total - last_total
        return CacheInfo(hits=hits, total=total)


def _stamp() -> tuple[float, float]:
    """Now: wall seconds, and this thread's CPU seconds."""
    return time.perf_counter(), time.thread_time()


def _nbytes(data: Any) -> int:
    """The tensor bytes of an item (or of a field's nested tensors)."""
    if isinstance(data, torch.Tensor):
        return data.nbytes
    if isinstance(data, MultiModalKwargsItem):
        return sum(_nbytes(elem.data) for elem in data.values())
    if isinstance(data, list | tuple):
        return sum(_nbytes(part) for part in data)
    return 0
