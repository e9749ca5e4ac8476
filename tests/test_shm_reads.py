"""Co-located reads of items in the heap when the region is full: a hot set
larger than the region is served from transient extents, without pushing
residents out (docs/shm.md). Real servers, region files and clients."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from mmcache._frames import chunk_prefix
from mmcache.client import MMCacheClient
from mmcache.server import MMCacheServer, ServerConfig, ShmConfig
from mmcache.server.cache import parts_of
from mmcache.server.cache._placement import ReadRoom
from mmcache.server.cache._region import ITEM, READ, WRITE, Region, copy_payload, open_region
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, eventually, region_of, sample, scrape, server_config, serving, store_of
from .test_shm import same, tensor

# A 16 MiB region holds three 4 MiB items, two beside the reserve for one read.
REGION = 16 * MIB
ITEM_ELEMENTS = 1 << 20  # float32: 4 MiB


def shm_config(directory: Path, **overrides: object) -> ServerConfig:
    return server_config(shm=ShmConfig(dir=str(directory), bytes=REGION), **overrides)


def client(server: MMCacheServer, **kwargs: object) -> MMCacheClient:
    return MMCacheClient(f"127.0.0.1:{server.port}", follow=False, **kwargs)  # type: ignore[arg-type]


def items_of(count: int) -> tuple[list[dict[str, torch.Tensor]], list[str]]:
    return [{"x": tensor(torch.float32, ITEM_ELEMENTS, i)} for i in range(count)], [
        f"h{i}" for i in range(count)
    ]


@contextlib.asynccontextmanager
async def in_the_heap(
    directory: Path, count: int, **overrides: object
) -> AsyncIterator[tuple[MMCacheServer, Region, list[dict[str, torch.Tensor]], list[str]]]:
    """A server with the small region, and `count` 4 MiB items uploaded over
    gRPC (so kept in the heap): the server, its region, the items, their hashes."""
    async with (
        serving(shm_config(directory, **overrides)) as server,
        client(server, shm=False) as remote,
    ):
        assert region_of(server) is not None
        items, hashes = items_of(count)
        await remote.get_and_update(items, hashes, lease=False)
        yield server, region_of(server), items, hashes


async def copies(server: MMCacheServer) -> dict[str, float]:
    samples = await scrape(server.metrics_port)
    return {
        kind: sample(samples, "mmcache_shm_item_copies_total", kind=kind) or 0
        for kind in ("in", "out", "transient")
    }


def resident(server: MMCacheServer, hashes: list[str]) -> list[str]:
    return [h for h in hashes if getattr(store_of(server).peek(h), "resident", None) is not None]


class Clock:
    """The region's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stopped_clock(server: MMCacheServer) -> Clock:
    assert region_of(server) is not None
    clock = Clock()
    region_of(server).clock = clock
    return clock


async def raw_read_shm(server: MMCacheServer, request: pb.FetchRequest) -> pb.FetchHeader:
    """One ReadShm from a caller that never says a hold done (no client library)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary(
            "/mmcache.v1.MMCache/ReadShm",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=pb.FetchHeader.FromString,
        )
        header: pb.FetchHeader = await call(request)
        return header


async def test_a_hot_set_larger_than_the_region_is_read_without_pushing_residents_out(
    tmp_path: Path,
) -> None:
    # 24 MiB: 1.5x the region, kept in the heap
    async with in_the_heap(tmp_path, 6) as (server, region, items, hashes), client(server) as local:
        assert local.region is not None
        stopped_clock(server)  # no resident is in for longer than the tenure
        for _ in range(3):
            for mm_hash, item in zip(hashes, items, strict=True):
                assert same((await local.fetch([mm_hash]))[0], item)
        # The first two moved in while there was room beside the reserve, and
        # stayed; the other four were each read from a copy, staying in the heap.
        assert resident(server, hashes) == hashes[:2]
        assert all(store_of(server).peek(h).frames for h in hashes[2:])  # type: ignore[union-attr]
        assert await copies(server) == {"in": 2, "out": 0, "transient": 3 * 4}
        # Each copy's extent is freed once its reader is done (the next read says so).
        await eventually(lambda: region.transient_bytes == 0 and region.slots == 0)
        samples = await scrape(server.metrics_port)
        assert sample(samples, "mmcache_shm_transient_bytes") == 0
        reserve = server.cache.stats(drain=False).shm_reserve_bytes
        assert sample(samples, "mmcache_shm_reserve_bytes") == reserve > 4 * MIB
        assert region.expired == 0  # said done, not expired


async def test_an_item_read_again_takes_the_place_of_residents_in_for_longer(
    tmp_path: Path,
) -> None:
    async with in_the_heap(tmp_path, 4) as (server, _, items, hashes), client(server) as local:
        clock = stopped_clock(server)

        async def read(i: int) -> None:
            assert same((await local.fetch([hashes[i]]))[0], items[i])

        await read(0)
        await read(1)  # both moved in: the region is full but for its reserve
        clock.now += 5
        await read(2)  # a copy
        await read(2)  # read again, but the residents are in for less than the tenure
        assert region_of(server) is not None
        tenure_s = parts_of(server.cache).placement.room(region_of(server)).tenure_s
        clock.now += tenure_s - 2  # the residents' tenure is over, not the copy's
        await read(3)  # a first read never takes a resident's place
        assert resident(server, hashes) == hashes[:2]
        await read(2)  # read again: it takes the place of the resident in longest
        assert resident(server, hashes) == hashes[1:3]
        assert await copies(server) == {"in": 3, "out": 1, "transient": 3}
        for i in range(4):
            await read(i)


async def test_a_view_of_a_transient_copy_is_not_overwritten_by_other_reads(
    tmp_path: Path,
) -> None:
    async with in_the_heap(tmp_path, 5) as (server, region, items, hashes), client(server) as local:
        for mm_hash in hashes[:2]:
            await local.fetch([mm_hash])  # moved in: the region is full but for its reserve
        async with local.view([hashes[2]]) as viewed:
            assert region.transient_bytes > 0  # a copy, viewed in place under a hold
            # Other reads meanwhile need the reserve the view holds: they make
            # room elsewhere, and never reuse the viewed extent.
            for mm_hash, item in zip(hashes[3:], items[3:], strict=True):
                assert same((await local.fetch([mm_hash]))[0], item)
            assert same(viewed[0], items[2])
        await eventually(lambda: region.transient_bytes == 0 and region.slots == 0)
        for mm_hash, item in zip(hashes, items, strict=True):
            assert same((await local.fetch([mm_hash]))[0], item)


async def test_a_reader_that_never_says_done_has_its_transient_copy_freed_by_expiry(
    tmp_path: Path,
) -> None:
    async with (
        in_the_heap(tmp_path, 4, lease_s=3) as (server, region, items, hashes),
        client(server) as local,
    ):
        for mm_hash in hashes[:3]:
            header = await raw_read_shm(
                server, pb.FetchRequest(mm_hashes=[mm_hash], shm_token=region.token, shm_hold=True)
            )
            assert header.items[0].shm.hold
        assert resident(server, hashes) == hashes[:2]
        assert region.transient_bytes > 0  # the third's copy, under a hold never given back
        # Meanwhile reads are still served, right (making room elsewhere).
        assert same((await local.fetch([hashes[3]]))[0], items[3])
        await eventually(lambda: region.transient_bytes == 0 and region.slots == 0, timeout=15)
        assert region.expired == 3  # the server's sweep ended the three holds
        for mm_hash, item in zip(hashes, items, strict=True):
            assert same((await local.fetch([mm_hash]))[0], item)


async def test_a_read_that_asks_for_no_hold_moves_the_item_in_as_before(
    tmp_path: Path,
) -> None:
    async with in_the_heap(tmp_path, 4) as (server, region, _, hashes):
        for mm_hash in hashes:
            request = pb.FetchRequest(mm_hashes=[mm_hash], shm_token=region.token)
            header = await raw_read_shm(server, request)
            assert header.items[0].shm.length == 4 * MIB and not header.items[0].shm.hold
        # Nothing to say done with, so nothing transient: each moved in, the
        # oldest moved out to make room.
        assert region.transient_bytes == 0 and hashes[3] in resident(server, hashes)
        assert (await copies(server))["out"] >= 1


async def test_a_readshm_says_earlier_holds_done_before_it_is_served(tmp_path: Path) -> None:
    async with in_the_heap(tmp_path, 4) as (server, region, _, hashes):
        holds = []
        for mm_hash in hashes:
            request = pb.FetchRequest(
                mm_hashes=[mm_hash], shm_token=region.token, shm_hold=True, shm_done=holds
            )
            holds = [(await raw_read_shm(server, request)).items[0].shm.hold]
        # Each read's copy was freed by the next: the last took the reserve again.
        assert region.slots == 1 and (await copies(server))["out"] == 0
        assert (await copies(server))["transient"] == 2


async def test_too_many_holds_done_in_a_readshm_is_invalid_argument(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server:
        assert region_of(server) is not None
        request = pb.FetchRequest(shm_token=region_of(server).token, shm_done=range(16385))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await raw_read_shm(server, request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shm_done" in (raised.value.details() or "")


def test_residents_and_write_slots_leave_the_reserve_to_transient_extents(
    tmp_path: Path,
) -> None:
    region = open_region(str(tmp_path), REGION, lease_s=30)
    room = ReadRoom(region)
    try:
        assert room.reserve == 0
        room.need_read(4 * MIB)
        reserve = room.reserve
        assert 4 * MIB < reserve < 5 * MIB
        assert region.allocate(4 * MIB, ITEM, keep_free=reserve) is not None
        assert region.allocate(4 * MIB, WRITE, keep_free=reserve) is not None
        # A third would leave less than the reserve: only a read's copy takes it.
        assert region.allocate(4 * MIB, ITEM, keep_free=reserve) is None
        assert region.allocate(4 * MIB, WRITE, keep_free=reserve) is None
        copy = region.allocate(4 * MIB, READ)
        assert copy is not None and region.transient_bytes == copy.span
        assert region.allocate(4 * MIB, READ) is None  # full
        # The reserve is never more than half the region.
        room.need_read(15 * MIB)
        assert reserve < room.reserve <= REGION // 2
    finally:
        region.close()


def test_the_reserve_gives_its_room_back_when_no_read_needs_it(tmp_path: Path) -> None:
    region = open_region(str(tmp_path), REGION, lease_s=30)
    clock = region.clock = Clock()
    room = ReadRoom(region)
    try:
        room.need_read(4 * MIB)
        large = room.reserve
        clock.now += room.reserve_s / 2
        room.need_read(1 * MIB)  # smaller: the large one is still the window's max
        assert room.reserve == large
        assert region.allocate(4 * MIB, ITEM, keep_free=room.reserve)
        assert region.allocate(4 * MIB, ITEM, keep_free=room.reserve)
        assert region.allocate(4 * MIB, ITEM, keep_free=room.reserve) is None  # kept
        clock.now += room.reserve_s / 2 + 1  # no 4 MiB read for longer than reserve_s
        assert MIB < room.reserve < 2 * MIB
        # Its room is the residents' again.
        assert region.allocate(4 * MIB, ITEM, keep_free=room.reserve) is not None
        room.need_read(4 * MIB)  # a large read again: kept at once
        assert room.reserve == large
        clock.now += room.reserve_s + 1
        assert room.reserve == 0
    finally:
        region.close()


def test_an_item_too_large_to_sit_beside_the_reserve_still_gets_an_extent(
    tmp_path: Path,
) -> None:
    region = open_region(str(tmp_path), REGION, lease_s=30)
    room = ReadRoom(region)
    try:
        room.need_read(4 * MIB)
        # As before the reserve: 12 MiB beside a 4 MiB reserve could never be had.
        assert region.allocate(12 * MIB, WRITE, keep_free=room.reserve) is not None
    finally:
        region.close()


async def test_concurrent_reads_of_a_hot_set_larger_than_the_region_are_all_right(
    tmp_path: Path,
) -> None:
    async with in_the_heap(tmp_path, 6) as (server, region, items, hashes), client(server) as local:

        async def reader(offset: int) -> None:
            for step in range(12):
                i = (offset + step) % len(hashes)
                assert same((await local.fetch([hashes[i]]))[0], items[i])

        await asyncio.gather(*(reader(offset) for offset in range(3)))
        await eventually(lambda: region.transient_bytes == 0 and region.slots == 0)
        assert len(store_of(server)) == 6  # nothing evicted: the cache has room


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_a_large_item_copied_in_by_two_threads_lands_whole(kind: type) -> None:
    # 24 MiB in 4 MiB frames: over the two-thread threshold (bytes frames),
    # and the one-thread path for frames of another type.
    payloads = [os.urandom(4 << 20) for _ in range(6)]
    frames = [kind(chunk_prefix(len(p)) + p) for p in payloads]
    with mmap.mmap(-1, (24 << 20) + 8192) as memory:
        view = memoryview(memory)
        copy_payload(frames, view[4096 : 4096 + (24 << 20)])
        assert view[4096 : 4096 + (24 << 20)] == b"".join(payloads)
        assert view[:4096] == bytes(4096) and view[4096 + (24 << 20) :] == bytes(4096)
        view.release()
