"""`MMCacheClient`: the frontend (P0) side of mmcache."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple

import grpc

from mmcache._errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from mmcache._frames import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
)
from mmcache._items import Item
from mmcache.v1 import cache_pb2 as pb

from ._batch import Lease
from ._colocated import CoLocated
from ._encoder import (
    EncoderBudget,
    EncoderCache,
    EncoderCacheStats,
    request_encoder_budget,
    request_encoder_cache_stats,
)
from ._feed import FeedFollower
from ._mirror import Mirror
from ._pool import BufferPool
from ._reads import Reads
from ._resident import ResidentLeases
from ._security import channel_credentials, metadata_interceptors, open_channel
from ._sessions import MAX_SESSIONS
from ._shm import ClientRegion
from ._stats import CacheInfo
from ._touch import OUT_OF_TOUCH, Touch
from ._transport import CHANNEL_OPTIONS, CacheTransport
from ._uploads import Call, UpdateResult, Uploads, check_hashes

__all__ = ["Location", "MMCacheClient", "UpdateResult"]

_LOGGER = logging.getLogger(__name__)

# Buffers of dropped fetched tensors (4 MiB and up) kept for the next reads
# of their size (client/_pool.py): pages already mapped, no zeroing.
DEFAULT_REUSE_BYTES = 256 << 20


class Location(NamedTuple):
    """Where an item is (`MMCacheClient.locate`): its tier, and the bytes held here."""

    tier: str | None  # "l1": this sidecar holds it; "l2": only the L2 tier; None: neither
    size: int  # bytes charged for it here (0 unless tier == "l1")


_TIERS = {pb.TIER_L1: "l1", pb.TIER_L2: "l2"}


class MMCacheClient:
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
    are leased (`lease=True`): they stay readable by the engine's `fetch`
    until it reads them or the server's lease time passes.

    With `fail_open=True` a frontend never waits on its cache longer than
    `fail_open_timeout`: when the server cannot answer in time,
    `get_and_update` hands every item back as a miss (for inline delivery),
    `is_cached` answers False until the client is back in touch, and
    `fail_opens` counts how often that happened (`on_fail_open` is called
    each time, e.g. to count it in a metric of the caller's).

    Beyond loopback (docs/security.md)::

        MMCacheClient(
            "mmcache.ns.svc:50051",
            tls_ca="/etc/mmcache/tls/ca.crt",  # verify the server; `credentials=` also works
            tls_cert="client.crt", tls_key="client.key",  # when it asks for mTLS
            token=os.environ["MMCACHE_TOKEN"],  # sent as `authorization: Bearer ...`
            namespace="qwen2-vl-7b@proc-2",  # this client's items live apart
        )

    The namespace and token apply to every call on the client's channel.

    Tensors that `fetch` hands out are the caller's; the memory of large ones
    (4 MiB and up) returns to the client when the caller drops them, and the
    next read of that size reuses it, which spares the kernel zeroing fresh
    pages (docs/shm.md). At most `reuse_bytes` are kept; 0 turns it off.

    `get_and_update` and `lookup` send their batches over up to `sessions`
    streams kept open (UpdateSession, docs/wire.md), which spares each batch
    the set-up of a call; 0 makes a call of each.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        namespace: str = "",
        shm: bool = True,
        reuse_bytes: int = DEFAULT_REUSE_BYTES,
        sessions: int = MAX_SESSIONS,
        channel_options: Sequence[tuple[str, Any]] = (),
        follow: bool = True,
        fail_open: bool = False,
        fail_open_timeout: float = 1.0,
        on_fail_open: Callable[[], None] | None = None,
    ) -> None:
        _check_settings(chunk_bytes, sessions)
        self._target = target
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._credentials = channel_credentials(credentials, tls_ca, tls_cert, tls_key)
        self._token = token
        self._interceptors = metadata_interceptors(token, namespace)
        self.namespace = namespace
        self._sessions = sessions
        self._shared_tier = False
        self._pool = BufferPool(reuse_bytes) if reuse_bytes > 0 else None
        self._co = CoLocated(
            namespace,
            shm,
            lambda: self._rpc,
            self._pool,
            connect_timeout=connect_timeout,
            allocate_timeout=fail_open_timeout if fail_open else None,
        )
        self._channel_options = _channel_options(tls_server_name, channel_options)
        self._follow = follow
        self._touch = Touch(fail_open, fail_open_timeout, on_fail_open)
        self._channel: grpc.aio.Channel | None = None
        self._transport: CacheTransport | None = None
        self._mirror = Mirror()
        self._follower: FeedFollower | None = None
        self._follower_task: asyncio.Task[None] | None = None
        self._stats = CacheInfo()
        self._stats_lock = threading.Lock()  # lease_resident counts from callers' threads
        self._last_delta = CacheInfo()
        rpc, mirror = lambda: self._rpc, lambda: self._mirror
        self._uploads = Uploads(rpc, self._co, mirror, self._touch, self._counted, chunk_bytes)
        self._reads = Reads(rpc, self._co, self._pool, self.forget)

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
        """Open the channel, learn the server's instance and capacity, start the feed.

        With `fail_open`, a server that does not answer is no error: the
        client starts out of touch and the feed keeps trying to reach it.
        """
        channel = open_channel(
            self._target,
            self._credentials,
            self._channel_options,
            self._interceptors,
            self._token,
        )
        self._channel = channel
        transport = self._transport = CacheTransport(channel, self._timeout, self._sessions)
        try:
            info = await transport.info(
                timeout=self._touch.timeout if self._touch.fail_open else self._connect_timeout
            )
        except OUT_OF_TOUCH as exc:
            if not self._touch.fail_open:
                await self.close()
                raise UnavailableError(
                    f"cannot reach the mmcache server at {self._target} ({exc}): is it "
                    "running there, and do the TLS settings match (a TLS server needs tls_ca= "
                    "or credentials=, one asking for client certificates also tls_cert= and "
                    "tls_key=; a plaintext server none)?"
                ) from exc
            self._touch.fell_open(exc)
        except BaseException:
            await self.close()
            raise
        else:
            self._mirror = Mirror(info.instance_id, info.capacity_bytes, info.max_items)
            self._touch.back()
            self._attach(info)
        if self._follow:
            self._follower = FeedFollower(
                transport.subscribe, lambda: self._mirror, self._touch.back
            )
            self._follower_task = asyncio.create_task(self._follower.run())

    async def close(self) -> None:
        if self._transport is not None:  # what reads owe the server: leases, holds, spares
            await self._co.flush(self._touch.timeout)
            await self._transport.close()
        self._co.close()
        if self._follower_task is not None:
            self._follower_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower_task
        self._follower_task = None
        self._follower = None
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._transport = None

    async def wait_following(self, timeout: float = 10.0) -> None:
        """Wait until the mirror follows the server's feed (a snapshot arrived).

        Raises DeadlineExceededError after `timeout` seconds, and
        InvalidArgumentError for a client made with `follow=False`.
        """
        if self._follower is None:
            raise InvalidArgumentError("this client does not follow the feed (follow=False)")
        try:
            await asyncio.wait_for(self._follower.live.wait(), timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the mirror feed was not live within {timeout}s: is the server reachable?"
            ) from None

    @property
    def channel(self) -> grpc.aio.Channel:
        """The client's channel, for other services of the same server."""
        if self._channel is None:
            raise RuntimeError("the client is not connected: use `async with MMCacheClient(...)`")
        return self._channel

    @property
    def _rpc(self) -> CacheTransport:
        if self._transport is None:
            raise RuntimeError("the client is not connected: use `async with MMCacheClient(...)`")
        return self._transport

    # -- the mirror --------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The server's capacity (0: caching disabled)."""
        return self._mirror.capacity

    @property
    def instance_id(self) -> str:
        """The server process the mirror describes; it changes on a restart."""
        return self._mirror.instance_id

    @property
    def following(self) -> bool:
        """Whether the mirror follows the server's feed right now."""
        return self._mirror.following

    @property
    def fail_opens(self) -> int:
        """How often a call failed open, or the client lost touch with the server."""
        return self._touch.fail_opens

    def is_cached(self, mm_hashes: Sequence[str], *, pending: bool = False) -> list[bool]:
        """Whether the mirror holds each hash. Local: no round trip, no reordering.

        With `pending`, also True for a hash another client is uploading now
        (seen on the feed): a frontend that skips its processor for it and
        sends the hash alone gets a hit once that upload lands, or, should it
        fail, a CacheMissError naming the hash (process it then). False for
        every hash while the client is out of touch (fail-open).
        """
        if not self._touch.in_touch:
            return [False] * len(mm_hashes)
        mirror = self._mirror
        return [h in mirror or (pending and mirror.is_pending(h)) for h in mm_hashes]

    def is_cached_item(self, mm_hash: str) -> bool:
        return self._touch.in_touch and mm_hash in self._mirror

    def touch(self, mm_hash: str) -> None:
        """Mark a held item recently used (sent to the server with the next batch).

        A hash that is not held is ignored.
        """
        self._mirror.touch(mm_hash)

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits and queries of this client; with `delta`, since the last delta call."""
        info = self._stats
        if delta:
            info, self._last_delta = info - self._last_delta, info
        return info

    # -- encoder books -----------------------------------------------------

    def encoder_cache(self, engine_id: str) -> EncoderCache:
        """The server's encoder-cache book of one engine (see `EncoderCache`)."""
        return EncoderCache(self.channel, engine_id, timeout=self._timeout)

    async def compute_encoder_budget(
        self,
        max_tokens_per_item_by_modality: Mapping[str, int],
        *,
        max_num_encoder_input_tokens: int,
        encoder_cache_size: int,
        max_num_batched_tokens: int,
        disable_chunked_mm_input: bool = False,
    ) -> EncoderBudget:
        """(compute budget, cache size) in encoder tokens, computed by the server."""
        return await request_encoder_budget(
            self.channel,
            self._timeout,
            max_tokens_per_item_by_modality,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size,
            max_num_batched_tokens=max_num_batched_tokens,
            disable_chunked_mm_input=disable_chunked_mm_input,
        )

    async def encoder_cache_stats(self) -> dict[str, EncoderCacheStats]:
        """Every engine's book on the server, by engine id."""
        return await request_encoder_cache_stats(self.channel, self._timeout)

    # -- calls -------------------------------------------------------------

    async def clear_cache(self) -> None:
        """Empty the server's cache (leased items stay until read) and the mirror.

        A following mirror waits (at most 2 s) for the feed to bring the
        removals, so it keeps the leased items; otherwise it forgets everything.
        """
        reply = await self._rpc.clear()
        mirror = self._mirror
        deadline = asyncio.get_running_loop().time() + 2.0
        while mirror.following and mirror.instance_id == reply.instance_id:
            if mirror.feed_seq >= reply.seq:
                return
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.002)
        mirror.clear(reply.instance_id)

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
    ) -> UpdateResult:
        """Upload what the server lacks; None where it already holds the item.

        `items[i]` may be None when the caller trusted `is_cached`; if the
        server turns out not to hold it, CacheMissError names every such hash.
        Any other miss the mirror did not foresee is re-sent in the same call.

        `metadata[i]` (at most 64 KiB) is stored with an uploaded item; with
        `want_metadata`, `result.metadata[i]` is what the server holds for a
        held item, so a frontend that never processed it can still use it.
        `lease=True`: every item reported held or stored stays readable by
        the engine's `fetch` until that read (or the server's lease time);
        `lease="hits"`: only the items returned as None (vLLM's P0, which
        sends the data of the others inline); `lease=False`: none.
        `resend[i]`: item i is data for a hash a `lookup` of the same request
        found missing: counted as a re-send, not as a second query.
        """
        if metadata is not None and len(metadata) != len(items):
            raise InvalidArgumentError(
                f"{len(metadata)} metadata blobs for {len(items)} items: give one per item "
                "(None where there is none)"
            )
        return await self._uploads.run(
            Call(
                items,
                mm_hashes,
                [modality] * len(mm_hashes),
                [b"" if m is None else m for m in metadata or [None] * len(items)],
                want_metadata=want_metadata,
                lease=lease,
                resend=resend,
            )
        )

    async def lookup(
        self,
        mm_hashes: Sequence[str],
        *,
        modality: str | None = None,
        want_metadata: bool = False,
        lease: Lease = "hits",
        wait_s: float | None = None,
    ) -> UpdateResult:
        """Ask the server which hashes it holds, sending no data.

        One query per hash, counted as `get_and_update` counts it; what is
        held is leased (by default) for the engine's read, with its metadata
        when asked. Unlike `get_and_update` with None items, a hash the server
        lacks is no error: `held[i]` is False (send its data later with
        `resend`). Usage, a frontend that wants to skip its processor::

            found = await client.lookup(hashes, want_metadata=True)
            for h, held, meta in zip(hashes, found.held, found.metadata): ...

        A hash whose upload is in flight elsewhere (another frontend, or
        another sidecar's through L2) is waited for, `wait_s` at most (the
        server's bounds when None: 0.5 s, `--l2-wait-ms`): a frontend gives
        its processing time, past which processing the item itself is as quick.
        """
        return await self._uploads.run(
            Call(
                [None] * len(mm_hashes),
                mm_hashes,
                [modality] * len(mm_hashes),
                [b""] * len(mm_hashes),
                want_metadata=want_metadata,
                lease=lease,
                missing_ok=True,
                wait_s=wait_s,
            )
        )

    async def inject_into_mm_cache(
        self,
        mm_hashes: Mapping[str, Sequence[str]],
        mm_kwargs: Mapping[str, list[Any]],
    ) -> None:
        """Insert items a frontend preprocessed itself, keeping the counters right.

        For each modality and index where an item is present, the item goes
        through get_and_update (one round trip for the whole call) and the
        caller's list entry is replaced in place by what it returned: None
        where the server held it (leased until the engine's `fetch` reads it),
        the item where it goes to the engine inline. Never raises: a failure
        is logged as a warning.
        """
        if self._transport is None or self._uploads.caching_disabled():
            return
        try:
            places: list[tuple[list[Any], int]] = []
            items: list[Item | None] = []
            hashes: list[str] = []
            modalities: list[str | None] = []
            for modality, modality_hashes in mm_hashes.items():
                listed = mm_kwargs.get(modality, [])
                for i, mm_hash in enumerate(modality_hashes):
                    if i < len(listed) and listed[i] is not None:
                        places.append((listed, i))
                        items.append(listed[i])
                        hashes.append(mm_hash)
                        modalities.append(modality)
            if not hashes:
                return
            results = await self._uploads.run(
                Call(items, hashes, modalities, [b""] * len(items), lease="hits")
            )
            for (listed, i), result in zip(places, results, strict=True):
                listed[i] = result
        except Exception:
            _LOGGER.warning("could not inject mm_kwargs into the mmcache server", exc_info=True)

    async def fetch(
        self, mm_hashes: Sequence[str], *, release: bool = True, wait: bool = True
    ) -> list[Item]:
        """The items under `mm_hashes`, as they were stored (the engine's read).

        Changes neither the eviction order nor the counters. With `release`
        (the engine's read of a request), one lease of each hash is given back
        once every item has arrived. Raises CacheMissError naming every hash
        the server does not hold.

        Where the server shares memory with this client (docs/shm.md), items
        resident there are copied straight out of it, with no call: their
        leases are then given back by a call in the background, just after.

        With `wait` (the default) a call waits for a server that is not
        reachable yet (one restarting) until the caller's deadline; without,
        it fails at once with UnavailableError, for a reader that has
        something better to do than wait (the EC connector encodes instead).
        """
        check_hashes(mm_hashes)
        return await self._reads.fetch(mm_hashes, release, wait)

    def lease_resident(
        self, mm_hashes: Sequence[str], *, usable: Callable[[int, bytes], bool] | None = None
    ) -> ResidentLeases:
        """Lease, with no call and on the caller's thread, the hashes whose items
        are resident in the server's shared-memory region, with the metadata
        stored with them; not held for the rest (and for all without a
        region): ask those with `lookup`. Each held hash is a lookup's hit
        (counted, touched, leased for the engine's read). `usable(i, metadata)`
        may refuse hash i before it is leased (say, metadata it cannot use:
        the lookup then says why). Thread-safe: for a frontend on its own
        thread, skipping the hop to the client's loop. Usage::

            leased = client.lease_resident(hashes)
            rest = [h for h, held in zip(hashes, leased.held) if not held]
            found = await client.lookup(rest, want_metadata=True) if rest else None
        """
        check_hashes(mm_hashes)
        leased = None if self._uploads.caching_disabled() else self._co.lease(mm_hashes, usable)
        if leased is None:
            return ResidentLeases([False] * len(mm_hashes), [b""] * len(mm_hashes))
        hits = sum(leased.held)
        self._counted(hits, hits)  # the rest are the lookup's to count
        return leased

    def _counted(self, hits: int, total: int) -> None:
        with self._stats_lock:
            self._stats = CacheInfo(self._stats.hits + hits, self._stats.total + total)

    def fetch_resident(
        self, mm_hashes: Sequence[str], *, release: bool = True
    ) -> list[Item] | None:
        """`fetch`, with no call and on the caller's thread, where every item is
        resident in the server's shared-memory region; None otherwise (then
        `fetch`, which reads what is not). Thread-safe. Usage, an engine::

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
        """The items as `fetch` gives them, but where the server shares memory with
        this client, their tensors are views of it: no copy on this side.

        The views are valid inside the block only, and only for reading (copy
        what must outlive it, e.g. `.to("cuda")`); the server holds the items'
        memory until the block ends. A block that outlives the server's lease
        (`--lease-s`) raises FailedPreconditionError at its end: the memory may
        have been reused. Without shared memory the items are fetched (and
        owned) as usual::

            async with client.view(hashes) as items:
                on_gpu = [item["pixel_values"].to("cuda") for item in items]
        """
        check_hashes(mm_hashes)
        async with self._reads.view(mm_hashes, release) as items:
            yield items

    async def locate(self, mm_hashes: Sequence[str], *, check_l2: bool = False) -> list[Location]:
        """Where each hash is, for a router choosing an engine: held by this
        sidecar (`"l1"`, with the bytes charged for it), only in the fleet's L2
        tier (`"l2"`, when `check_l2`), or nowhere (`None`). Changes nothing on
        the server: no query counted, no order or lease taken. Usage::

            where = await client.locate(hashes, check_l2=True)
            local_bytes = sum(w.size for w in where if w.tier == "l1")
        """
        check_hashes(mm_hashes)
        reply = await self._rpc.locate(mm_hashes, check_l2)
        return [
            Location(_TIERS.get(tier), size)
            for tier, size in zip(reply.tiers, reply.sizes, strict=True)
        ]

    async def refresh(self, mm_hashes: Sequence[str]) -> int:
        """Mark held items recently used on the server, now, in one call: `fetch`
        leaves the eviction order as it is, so a reader that keeps using what
        it fetches says so. How many the server held. (`touch` waits for the
        next batch instead.)"""
        check_hashes(mm_hashes)
        return int((await self._rpc.touch(mm_hashes)).touched)

    async def count_misses(self, modalities: Sequence[str]) -> None:
        """Tell the server of queries answered here as misses, one per modality
        named: items the caller asked about that were neither looked up (the
        mirror said not held) nor uploaded. The server counts them in
        `mmcache_queries_total`, so its counts equal the caller's. Sent in the
        background with the next report; never raises::

            await client.count_misses(["image"])  # processed, not worth uploading
        """
        if self._transport is not None and modalities:
            self._co.reports.add_misses(modalities)

    async def release(self, mm_hashes: Sequence[str]) -> int:
        """Give back one lease of each hash whose read will not happen (a dropped
        request); how many were leased. Leases also end by themselves."""
        check_hashes(mm_hashes)
        return int((await self._rpc.release(mm_hashes)).released)

    # -- internals ---------------------------------------------------------

    @property
    def region(self) -> ClientRegion | None:
        """The server's shared-memory region as this client maps it (docs/shm.md);
        None for a server on another host, with `shm=False`, or while a
        restarted server's new region is not mapped yet."""
        return self._co.region

    def forget(self, mm_hashes: Sequence[str]) -> None:
        """Drop hashes from the mirror: a caller that found an item gone (an
        engine's read that missed) says so, and the next lookup asks the server
        instead of trusting the mirror."""
        self._mirror.forget(mm_hashes)

    @property
    def shared_tier(self) -> bool:
        """Whether the server reads through to a tier other servers write (L2):
        then a hash the mirror lacks may still be a hit, if asked about."""
        return self._shared_tier

    def _attach(self, info: pb.InfoReply) -> None:
        self._shared_tier = info.shared_tier
        self._co.attach(info)


def _check_settings(chunk_bytes: int, sessions: int) -> None:
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidArgumentError(
            f"chunk_bytes must be {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}, got {chunk_bytes}"
        )
    if sessions < 0:
        raise InvalidArgumentError(f"sessions must be 0 (none) or more, got {sessions}")


def _channel_options(
    tls_server_name: str | None, extra: Sequence[tuple[str, Any]]
) -> tuple[tuple[str, Any], ...]:
    named = () if tls_server_name is None else (("grpc.ssl_target_name_override", tls_server_name),)
    return (*CHANNEL_OPTIONS, *named, *extra)
