"""P0's sharing: what this process processed goes up to the sidecar, so other
processes hit it; and the server hears of every query no call told it of.

An item vLLM processed goes inline to the engine, as vLLM's miss does, and
is queued for upload; so is a hit of this process's own cache that the
sidecar lacks. When the request ends its uploads leave in one call, in the
background (the engine has the data already); small images kept here are
posted from this thread instead, with no call and no hop, while the client
holds spare write slots of their sizes (docs/shm.md). Touches reach the
server with the next call. Every item goes (client/vllm/_costs.py: an upload costs
a few percent of a processing), unless larger than the whole server or with
`MAX_UPLOADS_IN_FLIGHT` uploads in flight; those are counted
(`mmcache_vllm_not_uploaded_items_total`), and offered again when they come back.
An item larger than the whole server is never uploaded (vLLM's
`cache_if_fits`, said once). Counters are vLLM's: one query per item, a hit
per item vLLM did not process.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Coroutine
from concurrent.futures import Future
from typing import Any

from vllm.logger import init_logger

from mmcache._shm_layout import sampled
from mmcache.client import MMCacheClient

from ._costs import fits
from ._ledger import Ledger, Upload
from ._metrics import plugin_metrics
from ._p0_context import P0Context
from .convert import encode_updates, from_vllm, item_nbytes

__all__ = ["MAX_UPLOADS_IN_FLIGHT", "Sharing", "stamp"]

_LOGGER = logging.getLogger(__name__)

# An upload's items, keys, prompt updates and resend flags, as the client takes them.
Converted = tuple[list[Any], list[str], list[bytes | None], list[bool]]

# Uploads in flight at once; past that a request's upload is skipped (its
# data went inline anyway): memory stays bounded when the server is slow.
MAX_UPLOADS_IN_FLIGHT = 8


class Sharing:
    """A P0 cache's uploads and counts, on its sidecar."""

    def __init__(self, context: P0Context) -> None:
        self._p0 = context
        self._uploads = context.sync.background(MAX_UPLOADS_IN_FLIGHT)
        self._metrics = plugin_metrics()

    def processed(self, ledger: Ledger, mm_hash: str, item: Any, updates: Any) -> bool:
        """An item vLLM processed: queued to go up, or counted as a miss no
        upload tells the server of. True: queued."""
        if ledger.started and not ledger.first_back[0]:
            ledger.first_back = stamp()
        self._p0.known.remember(mm_hash, updates)
        # vLLM 0.32's field elements carry no modality; the updates usually do.
        modality = next((u.modality for u in updates), None) or "unknown"
        if (
            self._p0.known.undescribed is not None
            and ledger.started
            and mm_hash in ledger.held_elsewhere
        ):
            ledger.misses.append(modality)  # asked of no server
            return False  # the sidecar has it: its updates are now known here
        self._p0.small.processed(mm_hash, item_nbytes(item))
        if not self._p0.shareable(mm_hash):  # a client's uuid: never the fleet's
            ledger.misses.append(modality)
            self._metrics.not_uploaded.inc()
            return False
        # Small: kept here, as vLLM alone keeps it, unless shared through the region.
        if mm_hash in ledger.kept and not self._shares_kept(mm_hash):
            if not ledger.counted(mm_hash):  # (a region lease whose read failed: counted)
                ledger.misses.append(modality)
            self._metrics.kept_small.inc()
            return False
        ledger.uploads.append((mm_hash, modality, item, updates))
        ledger.processed += 1
        return True

    def _shares_kept(self, mm_hash: str) -> bool:
        """Whether a small image kept here goes up all the same: where other
        API processes share the sidecar (single flight on), into its shared
        memory, so that their hits of it cost no call; not where the sidecar
        holds it already, or is uploading it (_small.py); never where the
        setting keeps them here (MMCACHE_SHARE_SMALL=off); and while the
        sidecar finds small items seldom asked for again, only those of its
        sample (server/cache/_reuse.py), which keep its measure going."""
        if not (self._p0.single_flight and self._p0.share_kept):
            return False
        client = self._p0.sync.client
        region = client.region
        if region is None or not client.following:  # out of touch: the mirror knows nothing
            return False
        key = self._p0.key(mm_hash)
        if region.small_paused() and not sampled(key):
            self._metrics.small_paused.inc()
            return False
        return not client.is_cached([key], pending=True)[0]

    def send(self, ledger: Ledger) -> None:
        """The request's uploads so far leave, in one call, in the background;
        the server hears of the misses and own hits no call told it of."""
        client = self._p0.sync.client
        try:
            self._upload(ledger)
        finally:
            # Into the report ring from this thread where there is one: no hop.
            if ledger.misses and not client.count_posted(ledger.misses, hits=False):
                self._p0.sync.submit(client.count_misses(ledger.misses))
            if ledger.own_hits and not client.count_posted(ledger.own_hits, hits=True):
                self._p0.sync.submit(client.count_hits(ledger.own_hits))
            ledger.misses, ledger.own_hits = [], []

    @property
    def in_flight(self) -> int:
        return self._uploads.in_flight

    def close(self) -> None:
        """No upload starts from now; those in flight end (within the deadline)."""
        self._uploads.close(self._p0.sync.deadline_s)

    def _upload(self, ledger: Ledger) -> None:
        if not ledger.uploads:
            return
        self._observe(ledger)
        uploads, ledger.uploads = ledger.uploads, []
        # A small image kept here among them: all into the sidecar's shared
        # memory, where other processes lease it with no call (_small.py).
        resident = any(upload[0] in ledger.kept for upload in uploads)
        client = self._p0.sync.client
        sizes = [item_nbytes(upload[2]) for upload in uploads]
        capacity = client.capacity_bytes
        going = [u for u, go in zip(uploads, fits(sizes, capacity), strict=True) if go]
        cpu = self._p0.sync.loop_cpu()
        # Converted once, and only for an upload that goes (posted, or started).
        converted = functools.cache(lambda: self._converted(going, ledger))
        try:
            went = bool(going) and (
                (resident and not self._uploads.closed and self._posted(client, converted()))
                or self._uploads.start(  # not when backed up, or closed
                    lambda: self._update(client, converted(), resident),
                    lambda done: self._upload_done(done, cpu, len(going)),
                )
            )
        except Exception as exc:  # its data would not convert: not shared, still cached here
            _LOGGER.warning("mmcache: an upload was not made: %s", exc)
            went = False
        admitted = going if went else []
        if len(admitted) < len(uploads):
            self._said_declined(max(sizes), capacity)
            self._metrics.not_uploaded.inc(len(uploads) - len(admitted))
        # Processed items (not own hits offered again) that no call told the server of.
        told = {upload[0] for upload in admitted}
        ledger.misses += [m for h, m, _, _ in uploads if h not in told and not ledger.counted(h)]

    def _posted(self, client: MMCacheClient, converted: Converted) -> bool:
        """Small images into the sidecar's shared memory from this thread, with
        no call and no hop onto the client's loop, where its spare write slots
        allow (docs/shm.md): no thread woken but the sidecar's."""
        started = time.thread_time()
        items, keys, metadata, resend = converted
        if not client.post_processed(items, keys, metadata=metadata, resend=resend):
            return False
        self._metrics.uploaded.inc(len(items))
        self._metrics.upload_cpu.inc(time.thread_time() - started)
        return True

    def _update(
        self, client: MMCacheClient, converted: Converted, resident: bool
    ) -> Coroutine[Any, Any, int]:
        """One upload of items converted on vLLM's thread; it comes to the
        number the sidecar then holds. `resident`: all of it into the
        sidecar's shared memory (a small image kept here among them)."""
        items, keys, metadata, resend = converted
        call = client.get_and_update(
            items,
            keys,
            metadata=metadata,
            resend=resend,
            lease=False,  # the engine has this data inline
            resident=resident,
            # Processed here: each a miss, as vLLM counts it, even where
            # another process uploaded it meanwhile (its data goes anyway).
            processed=True,
        )
        return _held(call)

    def _converted(self, uploads: list[Upload], ledger: Ledger) -> Converted:
        """The uploads' items, keys, prompt updates and resend flags (looked up,
        or a hit of this process's own: counted already), converted now."""
        hashes, modalities, items, updates = zip(*uploads, strict=True)
        return (
            [from_vllm(item, m) for item, m in zip(items, modalities, strict=True)],
            [self._p0.key(h) for h in hashes],
            [encode_updates(u) for u in updates],
            [ledger.counted(h) for h in hashes],
        )

    def _observe(self, ledger: Ledger) -> None:
        """The processor's time on the request's misses: vLLM runs it between
        is_cached and the first processed item's return, on this thread."""
        if ledger.asked[0] and ledger.first_back[0] and not ledger.observed:
            ledger.observed = True
            (asked_s, asked_cpu), (back_s, back_cpu) = ledger.asked, ledger.first_back
            seconds, cpu_seconds = back_s - asked_s, back_cpu - asked_cpu
            self._p0.processing.observe(seconds, cpu_seconds, ledger.processed)
            self._metrics.processed.inc(ledger.processed)
            self._metrics.processing_cpu.inc(max(0.0, cpu_seconds))

    def _said_declined(self, largest: int, capacity: int) -> None:
        """Why items were not shared, once: larger than the whole server (it
        could never hit them, as vLLM's own `cache_if_fits` says), or uploads
        backed up (a slow or stopped sidecar: the items stay in this process's
        cache, and are offered again when they come back)."""
        if capacity and largest > capacity:
            init_logger("vllm.mmcache").warning_once(
                "mmcache: an item of %.1f MiB is larger than the sidecar's whole cache "
                "(%.1f MiB): such items are processed here and never shared; raise the "
                "sidecar's --capacity-gb to share them",
                largest / 2**20,
                capacity / 2**20,
            )
        _LOGGER.debug("mmcache uploads backed up or closed: items not shared")

    def _upload_done(self, future: Future[int], started: float, items: int) -> None:
        """Counts what the upload left held (a sidecar that did not answer
        fails open: nothing held, no error) and what it did not."""
        stored = 0 if future.cancelled() or future.exception() is not None else future.result()
        self._metrics.not_uploaded.inc(items - stored)
        if stored:
            # CPU, not wall time: in a busy API process the upload's thread
            # waits for the GIL, which costs the process nothing.
            cpu_seconds = max(0.0, self._p0.sync.loop_cpu() - started)
            self._metrics.uploaded.inc(stored)
            self._metrics.upload_cpu.inc(cpu_seconds)


async def _held(call: Awaitable[Any]) -> int:
    """How many of an upload's items the sidecar holds once it ends (or will:
    those posted with no call, stored at its next read of the ring)."""
    result = await call
    return int(sum(result.held) + sum(result.posted))


def stamp() -> tuple[float, float]:
    """Now: wall seconds, and this thread's CPU seconds."""
    return time.perf_counter(), time.thread_time()
