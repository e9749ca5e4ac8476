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
- `get_and_update_item(None, h)`: a confirmed hit, (None, its updates).
  With data: the item goes inline to the engine, as vLLM's miss does, and is
  queued for upload, so other processes can hit it.
- `is_cached_item` (asked by vLLM 0.33 on its output loop before it
  `invalidate`s what the engine found missing): the mirror alone, no call.
- `release_sender_touches`: the request's uploads leave in one call, in the
  background (the engine has the data already); touches reach the server with
  the next call. Only uploads worth their cost go (client/vllm/_costs.py:
  the chance of a repeat, from this process's hit ratio, times the processing
  time saved, against the upload's time): with traffic of distinct images an
  API process uploads one item in ten, not every one.

An item larger than the whole server is never uploaded (vLLM's
`cache_if_fits`, said once); `close` (0.33, at shutdown) lets the uploads in
flight end. Per-request state is thread-local: vLLM runs requests on a thread pool.
Counters are vLLM's: one query per item, a hit per item sent without data.

P1's cache, which reads what P0 shared: _receiver.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
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

from ._costs import Admission, ProcessingTime
from ._keys import scoped_key
from ._metrics import plugin_metrics
from ._sync import SyncClient
from .convert import decode_updates, encode_updates, from_vllm, undescribed

__all__ = ["MMCacheProcessorCache", "already_shared"]

_LOGGER = logging.getLogger(__name__)

# Prompt updates kept for items this process processed (entries, not bytes:
# a few hundred bytes each).
LOCAL_UPDATES = 65536
# Uploads in flight at once; past that a request's upload is skipped (its
# data went inline anyway): memory stays bounded when the server is slow.
MAX_UPLOADS_IN_FLIGHT = 8
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
    # Modalities of misses the server has not counted yet: processed items
    # neither looked up nor uploaded (sent with the request's uploads).
    misses: list[str] = field(default_factory=list)
    merged: bool = False  # vLLM has taken its items (get_and_update_item)
    observed: bool = False  # its processing time was measured
    # (wall, this thread's CPU) when is_cached last answered (the processor
    # starts then), and when the first processed item came back.
    asked: tuple[float, float] = (0.0, 0.0)
    first_back: tuple[float, float] = (0.0, 0.0)


class MMCacheProcessorCache(BaseMultiModalProcessorCache):  # type: ignore[misc]
    def __init__(self, sync: SyncClient, scope: str, model: str = "") -> None:
        super().__init__()
        self._sync = sync
        self._scope = scope
        self._model = model
        # Why this model's prompt updates cannot travel as data (None: they can).
        self._undescribed: str | None = None
        self._updates: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an upload ended
        self._closed = False
        self._local = threading.local()
        self._uploads_in_flight = 0
        self._hits = 0
        self._total = 0
        self._last = (0, 0)
        self._serving = False
        self._processing = ProcessingTime()
        self._metrics = plugin_metrics()
        self._admission = Admission()

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
        deadline = time.monotonic() + self._sync.deadline_s
        with self._settled:
            self._closed = True
            while self._uploads_in_flight and (left := deadline - time.monotonic()) > 0:
                self._settled.wait(left)

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
        if client.shared_tier and client.following:  # (not while out of touch)
            known = [True] * len(keys)
        else:
            known = client.is_cached(keys, pending=True)
        candidates = [
            i for i, held in enumerate(known) if held and mm_hashes[i] not in request.looked_up
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
        request.asked = _stamp()
        return [h in request.confirmed for h in mm_hashes]

    def _look_up(
        self, request: _Request, mm_hashes: list[str], keys: list[str], ask: list[int]
    ) -> None:
        """Ask the server about the hashes at `ask` (one call): those held with
        updates usable here are confirmed; a failure leaves them misses."""
        client = self._sync.client
        try:
            wait_s = self._processing.wait_for(len(ask))
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
            updates = request.confirmed.get(mm_hash)
            if updates is None:  # vLLM sends None only where is_cached said True
                raise MultiModalCacheMissError([mm_hash])
            with self._lock:
                self._hits += 1
            return None, updates
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
        request.uploads.append((mm_hash, modality, item, updates))
        request.processed += 1
        if not request.started:
            # Outside a request (vLLM's inject_into_mm_cache): nothing will
            # call release_sender_touches, so the item leaves now.
            self.release_sender_touches()
        elif not VLLM_RELEASES:
            self._send_uploads(request)  # vLLM 0.31 never says a request ended
        return mm_item

    @override
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        self._sync.client.touch(self.key(mm_hash))

    @override
    def release_sender_touches(self) -> None:
        """The end of a request: its uploads leave, in one call, in the background."""
        request = self._request()
        self._local.request = None
        if request.started:
            hits = len(request.confirmed)
            self._admission.queried(hits, hits + request.processed)
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

    def _upload(self, request: _Request) -> None:
        if not request.uploads:
            return
        if request.asked[0] and request.first_back[0] and not request.observed:
            # vLLM runs the processor on a request's misses between the two,
            # on this thread.
            request.observed = True
            (asked_s, asked_cpu), (back_s, back_cpu) = request.asked, request.first_back
            seconds, cpu_seconds = back_s - asked_s, back_cpu - asked_cpu
            self._processing.observe(seconds, cpu_seconds, len(request.uploads))
            self._metrics.processed.inc(len(request.uploads))
            self._metrics.processing_cpu.inc(max(0.0, cpu_seconds))
        per_item = self._processing.cpu_per_item
        sized = [(upload, _nbytes(upload[2])) for upload in request.uploads]
        chosen = [
            (upload, size)
            for upload, size in sized
            if self._fits(size) and (not request.started or self._admission.admit(size, per_item))
        ]
        admitted = [upload for upload, _ in chosen]
        nbytes = sum(size for _, size in chosen)
        uploads, request.uploads = request.uploads, []
        with self._lock:
            stopped = self._closed or self._uploads_in_flight >= MAX_UPLOADS_IN_FLIGHT
            if admitted and not stopped:
                self._uploads_in_flight += 1
        if admitted and stopped:
            _LOGGER.debug("mmcache uploads backed up or closed: %d items not shared", len(admitted))
            admitted = []
        self._metrics.not_uploaded.inc(len(uploads) - len(admitted))
        told = {upload[0] for upload in admitted} | request.looked_up
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
                resend=[h in request.looked_up for h in hashes],
                lease=False,  # the engine has this data inline
            )
        )
        future.add_done_callback(
            lambda done: self._upload_done(done, started, nbytes, len(admitted))
        )

    def _fits(self, nbytes: int) -> bool:
        """False for an item larger than the whole server (it could never be a
        hit): said once, as vLLM's own cache says it (`cache_if_fits`)."""
        capacity = self._sync.client.capacity_bytes
        if not capacity or nbytes <= capacity:
            return True
        init_logger("vllm.mmcache").warning_once(
            "mmcache: an item of %.1f MiB is larger than the sidecar's whole cache "
            "(%.1f MiB): such items are processed here and never shared; raise the "
            "sidecar's --capacity-gb to share them",
            nbytes / 2**20,
            capacity / 2**20,
        )
        return False

    def _upload_done(self, future: Any, started: float, nbytes: int, items: int) -> None:
        with self._lock:
            self._uploads_in_flight -= 1
            self._settled.notify_all()
        if future.cancelled():
            return
        if future.exception() is not None:
            _LOGGER.debug("mmcache upload failed: %s", future.exception())
        else:
            # CPU, not wall time: in a busy API process the upload's thread
            # waits for the GIL, which costs the process nothing.
            cpu_seconds = max(0.0, self._sync.loop_cpu() - started)
            self._admission.uploaded(cpu_seconds, nbytes)
            self._metrics.uploaded.inc(items)
            self._metrics.upload_cpu.inc(cpu_seconds)

    @override
    def invalidate(self, mm_hash: str) -> None:
        self._sync.client.forget([self.key(mm_hash)])
        with self._lock:
            self._updates.pop(mm_hash, None)

    @override
    def clear_cache(self) -> None:
        # The server is shared by every frontend: only this process forgets.
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
