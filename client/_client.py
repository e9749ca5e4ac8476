"""`MMCacheClient`: the frontend (P0) side of mmcache."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from mmcache._errors import CacheMissError, InvalidArgumentError
from mmcache._frames import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
)
from mmcache._items import Item
from mmcache._lru import Outcome
from mmcache._spec import check_name
from mmcache.v1 import cache_pb2 as pb

from ._codec import EncodedItem, ItemDecoder, encode_item, iter_chunk_frames, num_chunks
from ._encoder import (
    EncoderBudget,
    EncoderCache,
    EncoderCacheStats,
    request_encoder_budget,
    request_encoder_cache_stats,
)
from ._mirror import Mirror
from ._stats import CacheInfo
from ._transport import CHANNEL_OPTIONS, CacheTransport

__all__ = ["MMCacheClient"]

_LOGGER = logging.getLogger(__name__)

_HELD = (Outcome.HIT, Outcome.REPLACED)


class MMCacheClient:
    """An async client of an mmcache server, with a key-only mirror of it.

    Usage::

        async with MMCacheClient("127.0.0.1:50051") as client:
            to_send = await client.get_and_update(items, mm_hashes)
            # None where the server already held the item, the item where it
            # was a miss (and has now been uploaded).
            items = await client.fetch(mm_hashes)  # the engine's read

    One client keeps one mirror; share the client across tasks of a frontend.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"chunk_bytes must be {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}, got {chunk_bytes}"
            )
        self._target = target
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._chunk_bytes = chunk_bytes
        self._credentials = credentials
        self._channel_options = (*CHANNEL_OPTIONS, *channel_options)
        self._channel: grpc.aio.Channel | None = None
        self._transport: CacheTransport | None = None
        self._mirror = Mirror("", 0)
        self._stats = CacheInfo()
        self._last_delta = CacheInfo()

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
        """Open the channel and learn the server's instance and capacity."""
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self._target, options=self._channel_options)
        else:
            channel = grpc.aio.secure_channel(
                self._target, self._credentials, options=self._channel_options
            )
        self._channel = channel
        self._transport = CacheTransport(channel, self._timeout)
        try:
            info = await self._transport.info(timeout=self._connect_timeout)
        except BaseException:
            await self.close()
            raise
        self._mirror = Mirror(info.instance_id, info.capacity_bytes, info.max_items)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._transport = None

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

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        """Whether the mirror holds each hash. Local: no round trip, no reordering."""
        return [h in self._mirror for h in mm_hashes]

    def is_cached_item(self, mm_hash: str) -> bool:
        return mm_hash in self._mirror

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
        """Empty the server's cache and the mirror."""
        reply = await self._rpc.clear()
        self._mirror.clear()
        self._mirror.instance_id = reply.instance_id

    async def get_and_update(
        self,
        items: Sequence[Item | None],
        mm_hashes: Sequence[str],
        *,
        modality: str | None = None,
    ) -> list[Item | None]:
        """Upload what the server lacks; None where it already holds the item.

        `items[i]` may be None when the caller trusted `is_cached`; if the
        server turns out not to hold it, CacheMissError names every such hash.
        Any other miss the mirror did not foresee is re-sent in the same call.
        """
        return await self._update(items, mm_hashes, [modality] * len(mm_hashes))

    async def inject_into_mm_cache(
        self,
        mm_hashes: Mapping[str, Sequence[str]],
        mm_kwargs: Mapping[str, list[Any]],
    ) -> None:
        """Insert items a frontend preprocessed itself, keeping the counters right.

        For each modality and index where an item is present, the item goes
        through get_and_update (one round trip for the whole call) and the
        caller's list entry is replaced in place by what it returned. Never
        raises: a failure is logged as a warning.
        """
        if self._transport is None or self._mirror.capacity == 0:
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
            results = await self._update(items, hashes, modalities)
            for (listed, i), result in zip(places, results, strict=True):
                listed[i] = result
        except Exception:
            _LOGGER.warning("could not inject mm_kwargs into the mmcache server", exc_info=True)

    async def fetch(self, mm_hashes: Sequence[str]) -> list[Item]:
        """The items under `mm_hashes`, as they were stored (the engine's read).

        Changes neither the eviction order nor the counters. Raises
        CacheMissError naming every hash the server does not hold.
        """
        for h in mm_hashes:
            check_name("mm_hash", h)
        frames = self._rpc.fetch(pb.FetchRequest(mm_hashes=mm_hashes))
        try:
            return await _read_fetch(frames, len(mm_hashes))
        except CacheMissError as exc:
            self._mirror.forget(exc.missing_hashes)
            raise
        finally:
            await frames.aclose()

    # -- internals ---------------------------------------------------------

    async def _update(
        self,
        items: Sequence[Item | None],
        mm_hashes: Sequence[str],
        modalities: Sequence[str | None],
    ) -> list[Item | None]:
        if len(items) != len(mm_hashes):
            raise InvalidArgumentError(
                f"{len(items)} items but {len(mm_hashes)} hashes: give one hash per item"
            )
        for h in mm_hashes:
            check_name("mm_hash", h)
        rpc = self._rpc
        if self._mirror.capacity == 0:
            missing = [h for h, item in zip(mm_hashes, items, strict=True) if item is None]
            if missing:
                raise CacheMissError(missing, f"caching is disabled; no data for {missing}")
            return list(items)

        encoded = [
            None if item is None else encode_item(item, modality=m)
            for item, m in zip(items, modalities, strict=True)
        ]
        labels = [
            (e.modality if e is not None and e.modality else m) or ""
            for e, m in zip(encoded, modalities, strict=True)
        ]
        plan = self._mirror.plan(
            mm_hashes, [None if e is None else e.size.charged for e in encoded]
        )
        request = pb.UpdateRequest(touches=self._mirror.take_touches())
        sending: list[EncodedItem] = []
        for mm_hash, enc, label, predicted in zip(mm_hashes, encoded, labels, plan, strict=True):
            entry = request.entries.add(mm_hash=mm_hash, modality=label)
            if enc is None or predicted in (Outcome.HIT, Outcome.MISSING):
                continue
            self._attach(entry, enc, sending)
        reply = await rpc.get_and_update(request.SerializeToString(), self._frames(sending))
        outcomes = [Outcome(o) for o in reply.outcomes]
        if len(outcomes) != len(mm_hashes):
            raise InvalidArgumentError("the server answered a different number of entries")
        self._mirror.reconcile(
            reply.instance_id,
            reply.capacity_bytes,
            reply.max_items,
            mm_hashes,
            outcomes,
            reply.sizes,
        )
        hits = sum(o in _HELD for o in outcomes)
        self._stats = CacheInfo(self._stats.hits + hits, self._stats.total + len(outcomes))

        results: list[Item | None] = [
            None if outcome == Outcome.HIT else item
            for item, outcome in zip(items, outcomes, strict=True)
        ]
        drifted = [i for i, o in enumerate(outcomes) if o == Outcome.MISSING]
        if drifted:
            await self._resend(drifted, items, mm_hashes, encoded, labels)
        return results

    async def _resend(
        self,
        drifted: list[int],
        items: Sequence[Item | None],
        mm_hashes: Sequence[str],
        encoded: Sequence[EncodedItem | None],
        labels: Sequence[str],
    ) -> None:
        """Send the data the mirror wrongly thought held: drift never fails a call."""
        no_data = [mm_hashes[i] for i in drifted if items[i] is None]
        with_data = [i for i in drifted if encoded[i] is not None]
        _LOGGER.debug("re-sending %d items the server did not hold", len(with_data))
        if with_data:
            request = pb.UpdateRequest()
            sending: list[EncodedItem] = []
            for i in with_data:
                enc = encoded[i]
                assert enc is not None
                entry = request.entries.add(mm_hash=mm_hashes[i], modality=labels[i], resend=True)
                self._attach(entry, enc, sending)
            reply = await self._rpc.get_and_update(
                request.SerializeToString(), self._frames(sending)
            )
            self._mirror.reconcile(
                reply.instance_id,
                reply.capacity_bytes,
                reply.max_items,
                [mm_hashes[i] for i in with_data],
                [Outcome(o) for o in reply.outcomes],
                reply.sizes,
            )
        if no_data:
            raise CacheMissError(
                no_data,
                f"the server does not hold {no_data} and no data was given for them: "
                "process those items again and pass them in",
            )

    def _attach(self, entry: pb.UpdateEntry, enc: EncodedItem, sending: list[EncodedItem]) -> None:
        """Put an item's data on an entry: its spec, and its chunks unless it is
        larger than the whole cache (then withheld: it could never be stored)."""
        entry.item.CopyFrom(enc.spec)
        if enc.size.charged > self._mirror.capacity:
            entry.withheld = True
        else:
            entry.num_chunks = num_chunks(enc, self._chunk_bytes)
            sending.append(enc)

    def _frames(self, sending: Sequence[EncodedItem]) -> Iterator[bytes]:
        for enc in sending:
            yield from iter_chunk_frames(enc, self._chunk_bytes)


async def _read_fetch(frames: AsyncIterator[bytes], expected: int) -> list[Item]:
    # The transport gives the header's bytes first, wherever they travelled.
    header = pb.FetchHeader.FromString(await anext(frames))
    if len(header.items) != expected:
        raise InvalidArgumentError("the Fetch reply names a different number of items")
    items: list[Item] = []
    for fetched in header.items:
        # Each frame is copied into the item's tensors as it arrives and dropped.
        decoder = ItemDecoder(fetched.item)
        for _ in range(fetched.num_chunks):
            decoder.feed(await anext(frames))
        items.append(decoder.finish())
    # Read to the end so the call completes with its status: a call left
    # open would be cancelled, and grpc keeps a cancelled call (and its
    # buffers) alive until the garbage collector runs.
    if await anext(frames, None) is not None:
        raise InvalidArgumentError("the Fetch reply carries more frames than its header declares")
    return items
