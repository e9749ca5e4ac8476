"""`MMCacheClient`: the frontend (P0) side of mmcache."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple

import grpc

from mmcache._errors import InvalidArgumentError
from mmcache._frames import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from mmcache._items import Item
from mmcache._spec import MAX_FEED_GAP_S

from ._batch import Lease
from ._connection import Connection
from ._feed import FeedFollower
from ._legacy import translate
from ._mirror import Mirror
from ._pool import BufferPool
from ._reads import Reads
from ._stats import CacheInfo, HitCounts
from ._touch import FailOpen, Touch
from ._uploads import (
    UpdateResult,
    Uploads,
    check_hashes,
    inject_call,
    lookup_call,
    update_call,
)
from .colocated import ClientRegion, ClientRing, CoLocated, ResidentLeases
from .wire import MAX_SESSIONS, CacheTransport, ServerInfo, Tls
from .wire._encoder import EncoderBooksAPI

__all__ = ["FailOpen", "Location", "MMCacheClient", "Tls", "UpdateResult"]

_LOGGER = logging.getLogger(__name__)

# Buffers of dropped fetched tensors (4 MiB and up) kept for the next reads
# of their size (client/_pool.py): pages already mapped, no zeroing.
DEFAULT_REUSE_BYTES = 256 << 20


class Location(NamedTuple):
    """Where an item is (`MMCacheClient.locate`): its tier, and the bytes held here."""

    tier: str | None  # "l1": this sidecar holds it; "l2": only the L2 tier; None: neither
    size: int  # bytes charged for it here (0 unless tier == "l1")


class MMCacheClient(EncoderBooksAPI):
    """An async client of an mmcache server, with a key-only mirror of it.

    Usage::

        async with MMCacheClient("127.0.0.1:50051") as client:
            to_send = await client.get_and_update(items, mm_hashes)
            # None where the server already held the item, the item where it
            # was a miss (and has now been uploaded).
            items = await client.fetch(mm_hashes)  # the engine's read

    One client keeps one mirror; share the client across tasks of a frontend.
    The mirror follows the server's feed (`follow=True`), so it knows what
    every client of the server stored. Items a call reports held or stored
    are leased: they stay readable by the engine's `fetch` until it reads
    them or the server's lease time passes.

    With `fail_open=True` (or a `FailOpen`, with its time and a callback) a
    frontend never waits on its cache longer than that time (1 s): when the
    server cannot answer in time, `get_and_update` hands every item back as
    a miss (for inline delivery), `is_cached` answers False until the client
    is back in touch, and `fail_opens` counts how often that happened.

    Beyond loopback (docs/security.md)::

        MMCacheClient(
            "mmcache.ns.svc:50051",
            tls=Tls(ca="/etc/mmcache/tls/ca.crt"),  # + cert=, key= when it asks for mTLS
            token=os.environ["MMCACHE_TOKEN"],  # sent as `authorization: Bearer ...`
            namespace="qwen2-vl-7b@proc-2",  # this client's items live apart
        )

    The namespace and token apply to every call on the client's channel.
    `reuse_bytes`: the memory of dropped fetched tensors kept for the next
    reads (docs/shm.md; 0: none); `sessions`: streams kept open for batches
    (docs/wire.md; 0: a call each); `feed_gap_s`: the least time between two
    feed messages this client wants (0: the server's 50 ms while changes keep
    coming; at most 5 s). Each wakes this process: a client whose answers do
    not need the freshest mirror asks for more, and its mirror may be that
    much behind (a stale mirror costs a lookup or a re-send, never a wrong
    answer).
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        tls: Tls | None = None,
        token: str | None = None,
        namespace: str = "",
        shm: bool = True,
        reuse_bytes: int = DEFAULT_REUSE_BYTES,
        sessions: int = MAX_SESSIONS,
        channel_options: Sequence[tuple[str, Any]] = (),
        follow: bool = True,
        feed_gap_s: float = 0.0,
        fail_open: bool | FailOpen = False,
        **deprecated: Any,  # 0.1's tls_* and fail_open_* keywords, until 0.3 (client/_legacy.py)
    ) -> None:
        if deprecated:
            tls, fail_open = translate(deprecated, tls, fail_open)
        _check_settings(chunk_bytes, sessions, feed_gap_s)
        self.namespace = namespace
        self.feed_gap_s = feed_gap_s
        self._touch = Touch(FailOpen() if fail_open is True else fail_open or None)
        self._conn = Connection(
            target,
            self._touch,
            self._attach,
            lambda instance_id: self._co.answered(instance_id),
            timeout=timeout,
            connect_timeout=connect_timeout,
            sessions=sessions,
            tls=tls,
            token=token,
            namespace=namespace,
            channel_options=channel_options,
            follow=follow,
            feed_gap_s=feed_gap_s,
        )
        self._shared_tier = False
        self._pool = BufferPool(reuse_bytes) if reuse_bytes > 0 else None
        self._co = CoLocated(
            namespace,
            shm,
            lambda: self.transport,
            self._pool,
            connect_timeout=connect_timeout,
            touch=self._touch,
        )
        self._counts = HitCounts()
        rpc, mirror = lambda: self.transport, lambda: self._conn.mirror
        self._uploads = Uploads(rpc, self._co, mirror, self._touch, self._counts.add, chunk_bytes)
        self._reads = Reads(rpc, self._co, self._pool, self.forget, self._touch)

    # -- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> MMCacheClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the channel, learn the server's instance and capacity, start the
        feed. Failing open, a server that does not answer is no error."""
        await self._conn.open()

    async def close(self) -> None:
        try:
            if self._conn.connected:  # what reads owe the server: leases, holds, spares
                await self._co.flush(self._touch.timeout)
        finally:
            # The shared memory first (its ring retired, its report tasks
            # stopped), before anything that waits and may be cancelled.
            self._co.close()
            await self._conn.close()

    async def wait_following(self, timeout: float = 10.0) -> None:
        """Wait until the mirror follows the server's feed (DeadlineExceededError
        after `timeout`; InvalidArgumentError with `follow=False`)."""
        await self._conn.wait_following(timeout)

    @property
    def channel(self) -> grpc.aio.Channel:
        """The client's channel, for other services of the same server."""
        return self._conn.channel

    @property
    def _books_timeout(self) -> float:
        return self._conn.timeout

    @property
    def transport(self) -> CacheTransport:
        """The client's calls on its channel, one method per RPC, with no policy
        (no mirror, no fail-open): for tools and tests."""
        return self._conn.transport

    # -- the mirror --------------------------------------------------------

    @property
    def mirror(self) -> Mirror:
        """The key-only mirror of the server's store, to read (`keys()`,
        `size_of`, `feed_seq`, `is_pending`); the client alone changes it."""
        return self._conn.mirror

    @property
    def feed(self) -> FeedFollower | None:
        """What follows the server's feed into the mirror (None: `follow=False`)."""
        return self._conn.follower

    @property
    def capacity_bytes(self) -> int:
        """The server's capacity (0: caching disabled)."""
        return self._conn.mirror.capacity

    @property
    def instance_id(self) -> str:
        """The server process the mirror describes; it changes on a restart."""
        return self._conn.mirror.instance_id

    @property
    def following(self) -> bool:
        """Whether the mirror follows the server's feed right now."""
        return self._conn.mirror.following

    @property
    def fail_opens(self) -> int:
        """How often a call failed open, or the client lost touch with the server."""
        return self._touch.fail_opens

    def is_cached(self, mm_hashes: Sequence[str], *, pending: bool = False) -> list[bool]:
        """Whether the mirror holds each hash: local, no round trip. `pending`:
        also True for a hash another client is uploading now (sent alone, it
        hits once that lands, or CacheMissError names it). All False while
        out of touch (fail-open)."""
        if not self._touch.in_touch:
            return [False] * len(mm_hashes)
        mirror = self._conn.mirror
        return [h in mirror or (pending and mirror.is_pending(h)) for h in mm_hashes]

    def is_cached_item(self, mm_hash: str) -> bool:
        return self._touch.in_touch and mm_hash in self._conn.mirror

    def touch(self, mm_hash: str) -> None:
        """Mark a held item recently used (sent with the next batch; else ignored)."""
        self._conn.mirror.touch(mm_hash)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits and queries of this client; with `delta`, since the last delta call."""
        return self._counts.stats(delta)

    # -- calls -------------------------------------------------------------

    async def clear_cache(self) -> None:
        """Empty the server's cache (leased items stay until read) and the mirror."""
        await self._conn.clear()

    async def get_and_update(
        self,
        items: Sequence[Item | None],
        mm_hashes: Sequence[str],
        *,
        modality: str | None = None,
        metadata: Sequence[bytes | None] | None = None,
        want_metadata: bool = False,
        lease: Lease = True,
        resend: Sequence[bool] | None = None,
        processed: bool = False,
        resident: bool = False,
    ) -> UpdateResult:
        """Upload what the server lacks; None where it already holds the item.

        `items[i]` None: the caller trusted `is_cached` (CacheMissError names
        every such hash the server lacks); other misses are re-sent in the
        same call. `metadata[i]` (64 KiB at most) is stored with the item;
        `want_metadata` returns a held item's in `result.metadata[i]`.
        `lease`: True, every item held or stored stays readable by the
        engine's `fetch` until it reads it (or the server's lease time);
        "hits", only those returned as None (vLLM's P0); False, none.
        `resend[i]`: data for a hash a `lookup` found missing (no second query).
        Counted as vLLM counts: a hit is a hash sent alone and held; data sent
        is a miss. `processed`: the caller processed every item given (vLLM's
        P0 sharing its misses), so each carries its data and is a miss, even
        where the mirror knows another client stored it meanwhile (else its
        hash goes alone: a hit, and None in the result). `resident`: every
        payload goes through the co-located region, where one is mapped (else
        from 1 MiB up), so that the items are resident at once and every
        client on the host reads them with no call (docs/shm.md). With
        `processed` and `lease=False` as well, such an upload is posted in
        the client's report ring with no call while it holds spare write
        slots of the items' sizes: `posted[i]` then says so (`held[i]` is
        False: no reply said it); the server stores them at its next read of
        the ring (within a few ms while uploads come, else 0.2 s), and they
        come on the feed as any upload's (docs/shm.md).
        """
        call = update_call(
            items, mm_hashes, modality, metadata, want_metadata, lease, resend, processed, resident
        )
        return await self._uploads.run(call)

    def post_processed(
        self,
        items: Sequence[Item],
        mm_hashes: Sequence[str],
        *,
        modality: str | None = None,
        metadata: Sequence[bytes | None] | None = None,
        resend: Sequence[bool] | None = None,
    ) -> bool:
        """`get_and_update(items, mm_hashes, processed=True, lease=False,
        resident=True)` posted in the report ring on the caller's thread
        (thread-safe), with no call and no hop onto the client's event loop:
        True, and each item counted a miss. False where it cannot go so (no
        ring, a size with only its last spare write slot, a large header or a
        full ring, caching disabled, the region dropped meanwhile): nothing
        sent (a spare it took goes back to the server); make the
        `get_and_update` then. Touches wait for the next call (docs/shm.md)::

            if not client.post_processed(items, hashes):
                await client.get_and_update(items, hashes, processed=True, lease=False,
                                            resident=True)
        """
        call = update_call(items, mm_hashes, modality, metadata, False, False, resend, True, True)
        return self._uploads.post(call)

    async def lookup(
        self,
        mm_hashes: Sequence[str],
        *,
        modality: str | None = None,
        want_metadata: bool = False,
        lease: Lease = "hits",
        wait_s: float | None = None,
        claim_s: float = 0.0,
    ) -> UpdateResult:
        """Ask the server which hashes it holds, sending no data: queries counted
        as `get_and_update`'s, what is held leased for the engine's read. A miss
        is no error: `held[i]` False (send the data later with `resend`). An
        upload in flight elsewhere is waited for, `wait_s` at most (None: the
        server's bounds); give your processing time. `claim_s`: those still
        missing are claimed for you for that long (you process and upload
        them): another client's lookup of one waits for your upload, as for
        one in flight (single flight, docs/wire.md). Usage::

            found = await client.lookup(hashes, want_metadata=True)
            for h, held, meta in zip(hashes, found.held, found.metadata): ...
        """
        call = lookup_call(
            mm_hashes,
            modality,
            want_metadata=want_metadata,
            lease=lease,
            wait_s=wait_s,
            claim_s=claim_s,
        )
        return await self._uploads.run(call)

    async def inject_into_mm_cache(
        self,
        mm_hashes: Mapping[str, Sequence[str]],
        mm_kwargs: Mapping[str, list[Any]],
    ) -> None:
        """Insert items a frontend preprocessed itself, in one `get_and_update`:
        each present item in the caller's lists is replaced in place by its
        answer (None where the server held it, leased for the engine's read).
        Never raises: a failure is logged as a warning."""
        if not self._conn.connected or self._uploads.caching_disabled():
            return
        try:
            call, places = inject_call(mm_hashes, mm_kwargs)
            if places:
                results = await self._uploads.run(call)
                for (listed, i), result in zip(places, results, strict=True):
                    listed[i] = result
        except Exception:
            _LOGGER.warning("could not inject mm_kwargs into the mmcache server", exc_info=True)

    async def fetch(
        self, mm_hashes: Sequence[str], *, release: bool = True, wait: bool = True
    ) -> list[Item]:
        """The items under `mm_hashes`, as stored (the engine's read): changes
        neither the eviction order nor the counters; CacheMissError names every
        hash the server lacks. `release` gives one lease of each back once all
        arrived. Items resident in shared memory (docs/shm.md) are copied out
        with no call. `wait`: wait for a server not reachable yet (restarting)
        until the deadline; False fails at once with UnavailableError.
        """
        check_hashes(mm_hashes)
        async with self._touch.bounded("fetch"):
            return await self._reads.fetch(mm_hashes, release, wait)

    def lease_resident(
        self, mm_hashes: Sequence[str], *, usable: Callable[[int, bytes], bool] | None = None
    ) -> ResidentLeases:
        """Lease, with no call, on the caller's thread (thread-safe), the hashes
        resident in the server's shared-memory region, with their metadata;
        each is a lookup's hit (counted, touched, leased). `usable(i, metadata)`
        may refuse hash i first. Ask the rest with `lookup`::

            leased = client.lease_resident(hashes)
            rest = [h for h, held in zip(hashes, leased.held) if not held]
            found = await client.lookup(rest, want_metadata=True) if rest else None
        """
        check_hashes(mm_hashes)
        leased = None if self._uploads.caching_disabled() else self._co.lease(mm_hashes, usable)
        if leased is None:
            return ResidentLeases([False] * len(mm_hashes), [b""] * len(mm_hashes))
        hits = sum(leased.held)
        self._counts.add(hits, hits)  # the rest are the lookup's to count
        return leased

    def fetch_resident(
        self, mm_hashes: Sequence[str], *, release: bool = True
    ) -> list[Item] | None:
        """`fetch` with no call, on the caller's thread (thread-safe), when every
        item is resident in shared memory; None otherwise::

            items = client.fetch_resident(hashes)
            if items is None:
                items = await client.fetch(hashes)
        """
        check_hashes(mm_hashes)
        return self._co.read_all(mm_hashes, release)

    @contextlib.asynccontextmanager
    async def view(
        self, mm_hashes: Sequence[str], *, release: bool = True
    ) -> AsyncIterator[list[Item]]:
        """The items as `fetch` gives them, their tensors views of the server's
        shared memory (no copy), valid inside the block only, for reading; one
        that outlives the lease (`--lease-s`) raises FailedPreconditionError at
        its end. Without shared memory the items are fetched as usual::

            async with client.view(hashes) as items:
                on_gpu = [item["pixel_values"].to("cuda") for item in items]
        """
        check_hashes(mm_hashes)
        async with self._reads.view(mm_hashes, release) as items:
            yield items

    async def locate(self, mm_hashes: Sequence[str], *, check_l2: bool = False) -> list[Location]:
        """Where each hash is, for a router: `"l1"` (this sidecar, with its
        bytes), `"l2"` (only the fleet's L2, when `check_l2`), or None. Changes
        nothing on the server (no query counted, no order or lease)::

            where = await client.locate(hashes, check_l2=True)
            local_bytes = sum(w.size for w in where if w.tier == "l1")
        """
        check_hashes(mm_hashes)
        reply = await self._touch.answer(
            "locate",
            lambda timeout, wait: self.transport.locate(mm_hashes, check_l2, timeout, wait),
        )
        if reply is None:  # failed open: nowhere known, routed as without a cache
            return [Location(None, 0)] * len(mm_hashes)
        return [Location(t, size) for t, size in zip(reply.tiers, reply.sizes, strict=True)]

    async def refresh(self, mm_hashes: Sequence[str]) -> int:
        """Mark held items recently used on the server, now, in one call: `fetch`
        leaves the eviction order as it is, so a reader that keeps using what
        it fetches says so. How many the server held. (`touch` waits for the
        next batch instead.)"""
        check_hashes(mm_hashes)
        reply = await self._touch.answer(
            "refresh", lambda timeout, wait: self.transport.touch(mm_hashes, timeout, wait)
        )
        return 0 if reply is None else reply

    async def count_misses(self, modalities: Sequence[str]) -> None:
        """Count queries answered here as misses on the server, one per modality
        named (neither looked up nor uploaded), so its counts equal the
        caller's. Sent with the next report; never raises::

            await client.count_misses(["image"])  # processed, not worth uploading
        """
        if self._conn.connected and modalities:
            self._co.reports.add_queries(modalities, hits=False)

    async def count_hits(self, modalities: Sequence[str]) -> None:
        """Count queries answered here as hits on the server, one per modality
        named: items the caller had at hand (its own cache) that it never
        asked the server about, so the server's counts equal the caller's.
        Sent with the next report; never raises."""
        if self._conn.connected and modalities:
            self._co.reports.add_queries(modalities, hits=True)

    def count_posted(self, modalities: Sequence[str], *, hits: bool) -> bool:
        """`count_misses` (or `count_hits`) on the caller's thread (thread-safe),
        with no call and no hop onto the client's loop: written in the report
        ring of a co-located client. False where it was not (no ring, or a
        full one): count them with those instead::

            if not client.count_posted(["image"], hits=False):
                await client.count_misses(["image"])
        """
        if not (self._conn.connected and modalities):
            return True  # as `count_misses`: nothing to count, or no server to count it
        return self._co.reports.post_queries(modalities, hits=hits)

    def release_posted(self, mm_hashes: Sequence[str]) -> bool:
        """`release` from the caller's thread (thread-safe), with no wait: in the
        report ring of a co-located client, or sent by its loop with the next
        report. False for a client that maps no region: call `release`::

            if not client.release_posted(hashes):
                await client.release(hashes)
        """
        check_hashes(mm_hashes)
        if not (self._conn.connected and mm_hashes):
            return True  # as `release`: nothing to give back, or no server to take it
        return self._co.post_release(mm_hashes)

    async def release(self, mm_hashes: Sequence[str]) -> int:
        """Give back one lease of each hash whose read will not happen (a dropped
        request); how many were leased. Leases also end by themselves: failing
        open, a server that does not answer within the deadline gives 0."""
        check_hashes(mm_hashes)
        reply = await self._touch.answer(
            "release", lambda timeout, wait: self.transport.release(mm_hashes, timeout, wait)
        )
        return 0 if reply is None else reply

    # -- internals ---------------------------------------------------------

    @property
    def region(self) -> ClientRegion | None:
        """The server's shared-memory region as this client maps it (docs/shm.md);
        None for a server on another host, with `shm=False`, or while a
        restarted server's new region is not mapped yet."""
        return self._co.region

    @property
    def report_ring(self) -> ClientRing | None:
        """The ring in shared memory this client reports through with no call
        (docs/shm.md); None while it reports by call."""
        region = self._co.region
        return None if region is None else self._co.reports.ring(region.token)

    def forget(self, mm_hashes: Sequence[str]) -> None:
        """Drop hashes from the mirror: a caller that found an item gone (an
        engine's read that missed) says so, and the next lookup asks the server
        instead of trusting the mirror."""
        self._conn.mirror.forget(mm_hashes)

    @property
    def shared_tier(self) -> bool:
        """Whether the server reads through to a tier other servers write (L2):
        then a hash the mirror lacks may still be a hit, if asked about."""
        return self._shared_tier

    def _attach(self, info: ServerInfo) -> None:
        self._shared_tier = info.shared_tier
        self._co.attach(info)


def _check_settings(chunk_bytes: int, sessions: int, feed_gap_s: float) -> None:
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidArgumentError(
            f"chunk_bytes must be {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}, got {chunk_bytes}"
        )
    if sessions < 0:
        raise InvalidArgumentError(f"sessions must be 0 (none) or more, got {sessions}")
    if not 0 <= feed_gap_s <= MAX_FEED_GAP_S:
        raise InvalidArgumentError(
            f"feed_gap_s must be 0 (the server's spacing) to {MAX_FEED_GAP_S:g} s, got {feed_gap_s}"
        )
