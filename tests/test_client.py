"""The client against a real server: mirror, drift, restart, inject, errors."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import socket
from typing import Any

import cachetools
import grpc
import pytest
import torch

from mmcache import FieldElem, MMItem, SharedField
from mmcache._dtypes import ITEMSIZE
from mmcache._equal import nested_equal
from mmcache._frames import MAX_METADATA_HEADER_BYTES
from mmcache.client import (
    CacheMissError,
    InvalidArgumentError,
    MMCacheClient,
    UnavailableError,
)
from mmcache.client._codec import encode_item
from mmcache.server import MMCacheServer
from mmcache.v1 import cache_pb2 as pb

from .conftest import (
    MIB,
    Samples,
    connected,
    eventually,
    reaches,
    sample,
    scrape,
    server_config,
    serving,
    store_of,
)
from .items import image_item
from .oracle import oracle_batch


def size_of(item: MMItem) -> int:
    return encode_item(item).size.charged


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    itemsize = ITEMSIZE[str(dtype).removeprefix("torch.")]
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype_name", sorted(ITEMSIZE))
async def test_every_dtype_and_shape_round_trips_bit_exact(
    client: MMCacheClient, dtype_name: str
) -> None:
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(len(dtype_name))
    data = [
        random_bits(dtype, (5, 7), gen),
        random_bits(dtype, (), gen),  # 0-d
        random_bits(dtype, (0, 3), gen),  # empty
        random_bits(dtype, (6, 4), gen).t(),  # non-contiguous
        (random_bits(dtype, (3,), gen), [random_bits(dtype, (2, 2), gen), 7, 2.5, True]),
    ]
    item = MMItem.from_elems(
        [FieldElem("image", f"k{i}", d, SharedField(batch_size=2)) for i, d in enumerate(data)]
    )
    mapping = {f"k{i}": d for i, d in enumerate(data)}
    sent = await client.get_and_update([item, mapping], [f"{dtype_name}-item", f"{dtype_name}-map"])
    assert sent[0] is item and sent[1] is mapping
    fetched = await client.fetch([f"{dtype_name}-item", f"{dtype_name}-map"])
    assert isinstance(fetched[0], MMItem) and fetched[0] == item
    assert type(fetched[1]) is dict and fetched[1].keys() == mapping.keys()
    assert all(nested_equal(fetched[1][k], mapping[k]) for k in mapping)
    assert fetched[0]["k3"].data.shape == (4, 6)


# The shapes of an upload, as grpc_server_started_total labels them: a call
# of either kind, or a batch over a session kept open.
_STREAM = ("GetAndUpdate", "client_stream")
_UNARY = ("GetAndUpdateOne", "unary")
_SESSION = ("UpdateSession", "bidi_stream")


def started(scraped: Samples, method: str, kind: str) -> float:
    """Calls of one method of the cache service the server has started."""
    labels = {"grpc_service": "mmcache.v1.MMCache", "grpc_type": kind}
    return sample(scraped, "grpc_server_started_total", grpc_method=method, **labels) or 0


async def test_hits_return_none_in_one_round_trip(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    items = [image_item(i) for i in range(3)]
    hashes = [f"img-{i}" for i in range(3)]
    assert await client.get_and_update(items, hashes) == items
    assert client.is_cached(hashes) == [True, True, True]
    before = await scrape(server.metrics_port)
    assert await client.get_and_update(items, hashes) == [None, None, None]
    after = await scrape(server.metrics_port)

    def calls(scraped: Samples) -> float:  # uploads of any shape
        return sum(started(scraped, *shape) for shape in (_STREAM, _UNARY, _SESSION))

    assert calls(after) == calls(before) + 1
    assert client.make_stats().hits == 3 and client.make_stats().total == 6


async def test_calls_without_data_are_unary_and_uploads_stream(server: MMCacheServer) -> None:
    async with connected(server, sessions=0) as client:
        await _unary_and_stream(server, client)


async def test_batches_go_over_one_session_kept_open(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    small, large = image_item(1), image_item(2, numel=MIB // 2)
    before = await scrape(server.metrics_port)
    assert await client.get_and_update([small], ["small"]) == [small]
    assert await client.get_and_update([large], ["large"]) == [large]
    assert await client.get_and_update([small, large], ["small", "large"]) == [None, None]
    after = await scrape(server.metrics_port)
    assert started(after, *_SESSION) == started(before, *_SESSION) + 3  # batches
    assert started(after, *_STREAM) + started(after, *_UNARY) == started(
        before, *_STREAM
    ) + started(before, *_UNARY)
    assert server.sessions.opened == 1  # one stream carried all three
    fetched = await client.fetch(["small", "large"])
    assert fetched[0] == small and fetched[1] == large


async def _unary_and_stream(server: MMCacheServer, client: MMCacheClient) -> None:
    small, large = image_item(1), image_item(2, numel=MIB // 2)  # 1 and 3 frames of 1 MiB
    before = await scrape(server.metrics_port)
    assert await client.get_and_update([small], ["small"]) == [small]
    assert await client.get_and_update([large], ["large"]) == [large]
    assert await client.get_and_update([small, large], ["small", "large"]) == [None, None]
    assert await client.get_and_update([None], ["large"]) == [None]
    after = await scrape(server.metrics_port)
    assert started(after, *_STREAM) == started(before, *_STREAM) + 2
    assert started(after, *_UNARY) == started(before, *_UNARY) + 2
    fetched = await client.fetch(["small", "large"])
    assert fetched[0] == small and fetched[1] == large


@pytest.mark.parametrize("seed", range(3))
async def test_mirror_agrees_with_an_lru_oracle_over_long_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    pool = {f"h{i}": image_item(i, numel=rng.randint(1, 2000)) for i in range(40)}
    capacity = sum(size_of(item) for item in pool.values()) // 3
    oracle: cachetools.LRUCache[str, int] = cachetools.LRUCache(capacity, getsizeof=lambda v: v)
    async with serving(capacity_bytes=capacity) as server:
        async with connected(server) as client:
            for _ in range(300):
                keys = rng.sample(list(pool), k=rng.randint(1, 4))
                expected = oracle_batch(oracle, [(k, size_of(pool[k])) for k in keys])
                # Leases keep promised items from eviction; the oracle is plain LRU.
                results = await client.get_and_update([pool[k] for k in keys], keys, lease=False)
                assert [r is None for r in results] == expected
                assert set(client.mirror.keys()) == set(oracle.keys())
            assert set(client.mirror.keys()) == set(store_of(server).keys())
            assert client.mirror.keys() == store_of(server).keys()  # same order too
            samples = await scrape(server.metrics_port)
            assert sample(samples, "mmcache_resends_total", modality="image") == 0


async def test_mirror_agrees_with_the_server_under_its_item_bound() -> None:
    rng = random.Random(11)
    pool = {f"h{i}": image_item(i, numel=rng.randint(1, 50)) for i in range(12)}
    # Bytes to spare: only the count binds, so an LRU of 4 entries is the oracle.
    oracle: cachetools.LRUCache[str, int] = cachetools.LRUCache(4)
    async with serving(max_items=4) as server:
        async with connected(server) as client:
            for _ in range(150):
                keys = rng.sample(list(pool), k=rng.randint(1, 3))
                expected = oracle_batch(oracle, [(k, 1) for k in keys])
                results = await client.get_and_update([pool[k] for k in keys], keys, lease=False)
                assert [r is None for r in results] == expected
                assert set(client.mirror.keys()) == set(oracle.keys())
            assert client.mirror.keys() == store_of(server).keys()
            assert len(store_of(server)) == 4


async def test_drift_between_frontends_is_repaired_within_the_call() -> None:
    items = {f"h{i}": image_item(i, numel=1000) for i in range(6)}
    capacity = 3 * size_of(items["h0"]) + 10
    async with serving(capacity_bytes=capacity) as server:
        target = f"127.0.0.1:{server.port}"
        async with MMCacheClient(target) as a, MMCacheClient(target, follow=False) as b:
            # No leases, and b does not follow the feed: a's uploads evict h0
            # and nothing tells b's mirror.
            await b.get_and_update([items["h0"]], ["h0"], lease=False)
            for key in ("h1", "h2", "h3"):
                await a.get_and_update([items[key]], [key], lease=False)
            assert b.is_cached(["h0"]) == [True] and "h0" not in store_of(server)
            result = await b.get_and_update([items["h0"]], ["h0"])
            assert result == [items["h0"]]  # re-sent, not claimed as cached
            assert "h0" in store_of(server)
            assert (await b.fetch(["h0"]))[0] == items["h0"]
            samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_resends_total", modality="image") == 1
    # the re-send is not a second query: 5 items were asked for in all
    assert sample(samples, "mmcache_queries_total", modality="image") == 5


async def test_missing_item_without_data_raises_cache_miss_naming_it(
    client: MMCacheClient,
) -> None:
    await client.get_and_update([image_item(1)], ["present"])
    with pytest.raises(CacheMissError) as info:
        await client.get_and_update([None, None], ["present", "never-sent"])
    assert info.value.missing_hashes == ["never-sent"]


async def test_server_restart_resets_the_mirror_and_resends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    item = image_item(3)
    first = MMCacheServer(server_config())
    await first.start()
    port = first.port
    async with MMCacheClient(f"127.0.0.1:{port}", timeout=20) as client:
        await client.get_and_update([item], ["h"])
        old_instance = client.instance_id
        await first.stop(grace=0)
        async with serving(port=port) as second:
            assert client.is_cached(["h"]) == [True]  # the mirror cannot know yet
            result = await client.get_and_update([item], ["h"])
            assert result == [item]  # re-sent: the new process did not hold it
            assert client.instance_id == second.instance_id != old_instance
            assert "h" in store_of(second)
            assert (await client.fetch(["h"]))[0] == item


async def test_item_larger_than_the_cache_is_served_uncached() -> None:
    small, big = image_item(1, numel=10), image_item(2, numel=100_000)
    async with serving(capacity_bytes=size_of(small) * 4) as server:
        async with connected(server) as client:
            await client.get_and_update([small], ["small"])
            assert await client.get_and_update([big], ["big"]) == [big]
            assert await client.get_and_update([big], ["big"]) == [big]  # never a hit
            assert client.is_cached(["small", "big"]) == [True, False]
            with pytest.raises(CacheMissError):
                await client.fetch(["big"])
            samples = await scrape(server.metrics_port)
    # withheld by the client: its bytes never crossed the wire
    assert sample(samples, "mmcache_received_bytes_total") == 40 + 24
    assert sample(samples, "mmcache_uncached_total", modality="image") == 2


async def test_inject_counts_like_vllm_and_replaces_entries_in_place(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    image = image_item(5)
    kwargs: dict[str, list[object]] = {"image": [image]}
    await client.inject_into_mm_cache({"image": ["cat"]}, kwargs)
    samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_queries_total", modality="image") == 1
    assert sample(samples, "mmcache_hits_total", modality="image") == 0
    assert kwargs["image"] == [image]
    kwargs = {"image": [image_item(5)]}
    await client.inject_into_mm_cache({"image": ["cat"]}, kwargs)
    samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_queries_total", modality="image") == 2
    assert sample(samples, "mmcache_hits_total", modality="image") == 1
    assert kwargs["image"] == [None]
    assert (client.make_stats().hits, client.make_stats().total) == (1, 2)


async def test_a_server_without_a_shared_tier_says_its_feed_is_the_whole_story(
    client: MMCacheClient,
) -> None:
    assert client.shared_tier is False


async def test_the_hit_and_query_series_are_at_zero_before_the_first_query(
    server: MMCacheServer,
) -> None:
    samples = await scrape(server.metrics_port)
    for modality in ("image", "video", "audio"):
        assert sample(samples, "mmcache_queries_total", modality=modality) == 0
        assert sample(samples, "mmcache_hits_total", modality=modality) == 0


async def test_misses_answered_by_the_client_are_counted_as_queries(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    async def queries(**labels: str) -> float:
        samples = await scrape(server.metrics_port)
        return sum(
            value
            for (name, labelled), value in samples.items()
            if name == "mmcache_queries_total" and set(labels.items()) <= set(labelled)
        )

    await client.count_misses(["image", "image", "video"])
    await client.count_misses(["image"])
    await reaches(queries, 4)
    assert (await queries(modality="image"), await queries(modality="video")) == (3, 1)
    samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_hits_total", modality="image") == 0
    # A client naming more modalities than a report may carry folds the rest
    # into "unknown": its totals stay exact.
    await client.count_misses([f"m{i}" for i in range(20)])
    await reaches(queries, 4 + 20)
    # A report naming too many is refused, saying the limit.
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    release = channel.unary_unary(
        "/mmcache.v1.MMCache/Release",
        request_serializer=pb.ReleaseRequest.SerializeToString,
        response_deserializer=pb.ReleaseReply.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await release(pb.ReleaseRequest(misses={f"m{i}": 1 for i in range(17)}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the limit is 16" in str(refused.value.details())
    # So are the hits of leases a client took with no call (client/colocated/_resident.py).
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await release(pb.ReleaseRequest(hits={f"m{i}": 1 for i in range(17)}))
    await channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "counts hits of 17 modalities; the limit is 16" in str(refused.value.details())
    assert await queries() == 24  # nothing of it counted


async def test_inject_covers_modalities_and_skips_absent_entries(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    video = image_item(9, modality="video")
    kwargs: dict[str, list[object]] = {"image": [None, image_item(1)], "video": [video]}
    await client.inject_into_mm_cache({"image": ["i0", "i1"], "video": ["v0", "v-extra"]}, kwargs)
    assert kwargs["video"] == [video] and kwargs["image"][0] is None
    samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_queries_total", modality="image") == 1
    assert sample(samples, "mmcache_queries_total", modality="video") == 1
    assert set(store_of(server).keys()) == {"i1", "v0"}


async def test_inject_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    server = MMCacheServer(server_config())
    await server.start()
    async with connected(server, timeout=1) as client:
        await server.stop(grace=0)
        kwargs: dict[str, list[object]] = {"image": [image_item(1)]}
        with caplog.at_level(logging.WARNING):
            await client.inject_into_mm_cache({"image": ["x"]}, kwargs)
        assert "could not inject" in caplog.text
        assert isinstance(kwargs["image"][0], MMItem)


async def test_inject_with_caching_disabled_returns_at_once_and_counts_nothing() -> None:
    async with serving(capacity_bytes=0) as server:
        async with connected(server) as client:
            item = image_item(1)
            kwargs: dict[str, list[object]] = {"image": [item]}
            await client.inject_into_mm_cache({"image": ["x"]}, kwargs)
            assert kwargs["image"] == [item]
            assert client.make_stats().total == 0
            samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_queries_total", modality="image") == 0


async def test_touch_is_local_and_reaches_the_server_with_the_next_batch() -> None:
    a, b, c = image_item(1), image_item(2), image_item(3)
    async with serving(capacity_bytes=2 * size_of(a) + 10) as server:
        async with connected(server) as client:
            await client.get_and_update([a, b], ["a", "b"], lease=False)
            client.touch("a")
            client.touch("ghost")  # not held: nothing happens
            await client.get_and_update([c], ["c"], lease=False)
            assert client.is_cached(["a", "b", "c"]) == [True, False, True]
            assert set(store_of(server).keys()) == {"a", "c"}


async def test_refresh_keeps_what_a_reader_uses_from_eviction_at_once() -> None:
    a, b, c = image_item(1), image_item(2), image_item(3)
    async with serving(capacity_bytes=2 * size_of(a) + 10) as server:
        async with connected(server) as writer:
            await writer.get_and_update([a, b], ["a", "b"], lease=False)
            async with connected(server) as reader:
                await reader.fetch(["a"], release=False)  # a read moves nothing
                assert await reader.refresh(["a", "ghost"]) == 1  # one call, one held
            await writer.get_and_update([c], ["c"], lease=False)
            assert set(store_of(server).keys()) == {"a", "c"}  # b, not a, was evicted


async def test_make_stats_delta(client: MMCacheClient) -> None:
    item = image_item(1)
    await client.get_and_update([item], ["x"])
    assert client.make_stats(delta=True).total == 1
    await client.get_and_update([item, item], ["x", "x"])
    delta = client.make_stats(delta=True)
    assert (delta.hits, delta.total) == (2, 2) and delta.hit_ratio == 1.0
    assert client.make_stats().total == 3


async def test_clear_cache_empties_server_and_mirror(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    await client.get_and_update([image_item(1)], ["x"], lease=False)
    await client.get_and_update([image_item(2)], ["leased"])
    await client.clear_cache()
    # A leased item is a promise to a request in flight: Clear keeps it.
    assert client.is_cached(["x"]) == [False] and store_of(server).keys() == ["leased"]
    await client.fetch(["leased"])  # the engine's read releases it
    await client.clear_cache()
    assert len(store_of(server)) == 0


async def test_fetch_of_missing_hashes_raises_typed_error(client: MMCacheClient) -> None:
    await client.get_and_update([image_item(1)], ["x"])
    with pytest.raises(CacheMissError) as info:
        await client.fetch(["a", "x", "b"])
    assert info.value.missing_hashes == ["a", "b"]


async def test_items_without_tensor_bytes_travel_beside_items_with_them(
    client: MMCacheClient,
) -> None:
    # The header rides with the first chunk of the batch, whichever entry has it.
    items: list[Any] = [{"n": 4, "e": torch.empty(0)}, {"x": torch.arange(5.0)}, {"t": (1.5,)}]
    sent = await client.get_and_update(items, ["s1", "t1", "s2"])
    assert all(a is b for a, b in zip(sent, items, strict=True))
    (again,) = await client.get_and_update(items[2:], ["s3"])
    assert again is items[2]
    fetched = await client.fetch(["s1", "t1", "s2", "s3"])
    for got, want in zip(fetched, [*items, items[2]], strict=True):
        assert list(got) == list(want) and nested_equal(list(got.values()), list(want.values()))


async def test_fetch_calls_end_without_the_garbage_collector(client: MMCacheClient) -> None:
    # A Fetch call left open after its last frame would be cancelled, and grpc
    # keeps a cancelled call in a reference cycle with its buffers: memory then
    # climbs by about the item's size per fetch until the collector runs.
    await client.get_and_update([{"x": torch.ones(MIB // 4)}], ["big"])

    def open_calls() -> int:
        return sum(type(o) is grpc.aio.UnaryStreamCall for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = open_calls()
        for _ in range(5):
            (item,) = await client.fetch(["big"])
            assert item["x"].numel() == MIB // 4
        await eventually(lambda: open_calls() == before)  # once grpc's callbacks ran
    finally:
        gc.enable()


async def test_server_errors_arrive_as_typed_errors(client: MMCacheClient) -> None:
    with pytest.raises(InvalidArgumentError, match="modality of entry 0 is 300 characters"):
        await client.get_and_update([{"k": torch.ones(2)}], ["x"], modality="m" * 300)
    with pytest.raises(InvalidArgumentError, match="mm_hash must not be empty"):
        await client.get_and_update([image_item(1)], [""])


async def test_unreachable_server_is_a_typed_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UnavailableError, match="cannot reach the mmcache server at"):
        async with MMCacheClient(f"127.0.0.1:{port}", connect_timeout=0.5):
            pass


async def test_a_batch_too_large_for_header_metadata_sends_a_header_frame(
    server: MMCacheServer,
) -> None:
    async with connected(server, sessions=0) as client:
        await _header_frame(server, client)


async def _header_frame(server: MMCacheServer, client: MMCacheClient) -> None:
    keys = [f"{i:064x}" for i in range(40)]
    items = [image_item(i, numel=16) for i in range(40)]
    # 40 specs and 64-character hashes: the upload's header goes as a frame,
    # not metadata; the hits that follow are a unary call whatever its size.
    assert len(keys) * 64 > MAX_METADATA_HEADER_BYTES
    before = await scrape(server.metrics_port)
    assert await client.get_and_update(items, keys) == items
    middle = await scrape(server.metrics_port)
    assert await client.get_and_update(items, keys) == [None] * len(keys)
    after = await scrape(server.metrics_port)
    assert started(middle, *_STREAM) == started(before, *_STREAM) + 1
    assert started(after, *_UNARY) == started(middle, *_UNARY) + 1
    fetched = await client.fetch(keys)
    assert all(f == i for f, i in zip(fetched, items, strict=True))


async def test_concurrent_calls_from_one_client_stay_correct(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    items = {f"h{i}": image_item(i, numel=5000) for i in range(20)}

    async def use(keys: list[str]) -> None:
        results = await client.get_and_update([items[k] for k in keys], keys)
        for key, result in zip(keys, results, strict=True):
            assert result is None or result is items[key]

    rng = random.Random(7)
    await asyncio.gather(*(use(rng.sample(list(items), 3)) for _ in range(40)))
    fetched = await client.fetch(list(items))
    assert all(f == items[k] for k, f in zip(items, fetched, strict=True))


@pytest.mark.slow
async def test_an_item_of_256_mib_moves_both_ways() -> None:
    big = {"pixel_values": torch.arange(64 * MIB, dtype=torch.float32)}  # 256 MiB
    async with serving(capacity_bytes=300 * MIB) as server:
        async with connected(server, chunk_bytes=4 * MIB) as client:
            assert await client.get_and_update([big], ["big"]) == [big]
            assert store_of(server).used == 256 * MIB
            (fetched,) = await client.fetch(["big"])
            assert torch.equal(fetched["pixel_values"], big["pixel_values"])
