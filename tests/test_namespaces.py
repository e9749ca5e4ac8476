"""Namespaces: two models on one sidecar never see each other's items."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mmcache.client import (
    CacheMissError,
    InvalidArgumentError,
    MMCacheClient,
    ResourceExhaustedError,
)
from mmcache.server import MMCacheServer
from mmcache.v1 import cache_pb2 as pb

from .conftest import sample, scrape, serving, store_of
from .items import image_item


def client(server: MMCacheServer, namespace: str = "", **kwargs: object) -> MMCacheClient:
    return MMCacheClient(f"127.0.0.1:{server.port}", namespace=namespace, **kwargs)  # type: ignore[arg-type]


async def test_the_same_hash_in_two_namespaces_is_two_items() -> None:
    async with (
        serving() as server,
        client(server, "qwen2-vl@proc-1") as qwen,
        client(server, "llava@proc-7") as llava,
        client(server) as default,
    ):
        await qwen.get_and_update([image_item(1)], ["same"])
        # llava's frontend has never seen it: a miss, and its own upload.
        sent = await llava.get_and_update([image_item(2)], ["same"])
        assert sent.held == [True] and sent[0] is not None  # stored: the item went up
        with pytest.raises(CacheMissError) as missing:
            await default.fetch(["same"])
        assert missing.value.missing_hashes == ["same"]  # the caller's hash, no namespace
        assert (await qwen.fetch(["same"]))[0] == image_item(1)
        assert (await llava.fetch(["same"]))[0] == image_item(2)
        assert len(store_of(server)) == 2


async def test_mirrors_follow_only_their_own_namespace() -> None:
    async with (
        serving() as server,
        client(server, "a") as a,
        client(server, "b") as b,
        client(server, "b") as b_follower,
    ):
        await b_follower.wait_following()
        await a.get_and_update([image_item(3)], ["x"])
        await b.get_and_update([image_item(4)], ["y"])
        await a.wait_following()
        for _ in range(200):
            if b_follower.is_cached(["y"]) == [True]:
                break
            await asyncio.sleep(0.01)
        assert b_follower.is_cached(["y", "x"]) == [True, False]
        assert a.is_cached(["x", "y"]) == [True, False]
        # A new subscriber's snapshot holds only its namespace's keys too.
        async with client(server, "a") as late:
            await late.wait_following()
            assert late.is_cached(["x", "y"]) == [True, False]


async def test_clear_clears_only_the_callers_namespace() -> None:
    async with (
        serving() as server,
        client(server, "a", follow=False) as a,
        client(server, "b", follow=False) as b,
    ):
        await a.get_and_update([image_item(5)], ["p"], lease=False)
        await b.get_and_update([image_item(6)], ["p"], lease=False)
        await a.clear_cache()
        with pytest.raises(CacheMissError):
            await a.fetch(["p"])
        assert (await b.fetch(["p"]))[0] == image_item(6)


async def test_namespaces_share_the_capacity_and_evict_in_one_lru_order() -> None:
    size = 256 * 4 + 64  # an image_item's charge, roughly
    async with serving(capacity_bytes=3 * size) as server:
        async with client(server, "a", follow=False) as a, client(server, "b", follow=False) as b:
            await a.get_and_update([image_item(7)], ["old"], lease=False)
            for i in range(3):
                await b.get_and_update([image_item(10 + i)], [f"new{i}"], lease=False)
            with pytest.raises(CacheMissError):  # b's uploads pushed a's out
                await a.fetch(["old"])


async def test_the_namespace_bound_refuses_one_more_with_the_fix() -> None:
    async with serving(max_namespaces=2) as server:
        async with client(server, "a", follow=False) as a:
            await a.get_and_update([image_item(8)], ["h"], lease=False)
            with pytest.raises(ResourceExhaustedError, match="--max-namespaces"):
                async with client(server, "b", follow=False):
                    pass
            await a.clear_cache()  # "a" holds nothing now: it may be forgotten
        await asyncio.sleep(1.05)  # (idle namespaces are looked for at most once a second)
        async with client(server, "b", follow=False) as b:
            await b.get_and_update([image_item(9)], ["h"])
        samples = await scrape(server.metrics_port)
        assert sample(samples, "mmcache_namespaces") == 2  # the default and "b"


def test_a_client_refuses_a_namespace_outside_the_alphabet() -> None:
    with pytest.raises(InvalidArgumentError, match="use letters, digits"):
        MMCacheClient("127.0.0.1:1", namespace="has space")
    with pytest.raises(InvalidArgumentError, match="limit is 128"):
        MMCacheClient("127.0.0.1:1", namespace="n" * 129)


async def test_the_server_refuses_a_bad_namespace_with_invalid_argument() -> None:
    async with (
        serving() as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        touch = channel.unary_unary(
            "/mmcache.v1.MMCache/Touch",
            request_serializer=pb.TouchRequest.SerializeToString,
            response_deserializer=pb.TouchReply.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await touch(pb.TouchRequest(mm_hashes=["h"]), metadata=(("mmcache-namespace", "a*b"),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'*'" in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as nul:
            await touch(pb.TouchRequest(mm_hashes=["a\0b"]))
        assert nul.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "NUL" in (nul.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as many:
            await touch(pb.TouchRequest(mm_hashes=["h"] * 16385))
        assert many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit is 16384 per call" in (many.value.details() or "")
