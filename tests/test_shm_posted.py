"""Uploads posted in a report ring with no call (docs/shm.md, "Uploads with no
call"): real servers, real region files, real clients."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from mmcache._wake import wake_path
from mmcache.client import MMCacheClient
from mmcache.client._batch import Entry, build_batch
from mmcache.client._codec import encode_item
from mmcache.client.colocated._slots import size_of, spares_of
from mmcache.client.wire import Slot
from mmcache.server import MMCacheServer
from mmcache.server.cache import parts_of
from mmcache.v1 import cache_pb2 as pb

from .conftest import (
    MIB,
    eventually,
    parse_samples,
    reaches,
    region_of,
    sample,
    scrape,
    scrape_text,
    serving,
    store_of,
)
from .test_shm import client, exists, handled, same, shm_config, tensor


@pytest.fixture
async def shm_server(tmp_path: Path) -> AsyncIterator[MMCacheServer]:
    async with serving(shm_config(tmp_path, shm_bytes=64 * MIB)) as server:
        assert region_of(server) is not None
        yield server


def icon(seed: int) -> dict[str, torch.Tensor]:
    return {"x": tensor(torch.float32, 1024, seed)}  # 4 KiB: a small image's item


async def posted(server: MMCacheServer, result: str) -> float:
    samples = await scrape(server.metrics_port)
    return sample(samples, "mmcache_posted_uploads_total", result=result) or 0


async def uploads_by_call(server: MMCacheServer) -> float:
    """Upload batches (and slot allocations) the server answered, by any method."""
    methods = ("GetAndUpdate", "GetAndUpdateOne", "UpdateSession", "ShmAllocate")
    return sum([await handled(server, method) for method in methods])


async def with_ring(c: MMCacheClient) -> bytes:
    """The region's token, once the client holds its report ring."""
    region = c.region
    assert region is not None
    await eventually(lambda: c._co.reports.ring(region.token) is not None)
    return region.token


async def share(c: MMCacheClient, key: str, seed: int) -> str:
    """An upload as vLLM's P0 shares a small image it processed: "held" (by
    call: its reply said so) or "posted" (with no call)."""
    result = await c.get_and_update([icon(seed)], [key], lease=False, processed=True, resident=True)
    assert not (result.held[0] and result.posted[0])
    return "held" if result.held[0] else "posted" if result.posted[0] else "neither"


async def test_small_processed_uploads_go_with_no_call_while_spares_last(
    shm_server: MMCacheServer,
) -> None:
    """The first upload is a call and its reply brings spares of its size;
    each next one of that size is written into a spare and posted in the ring,
    stored by the server's next read of the rings, resident, on the feed,
    counted as a miss; the last spare goes by call, whose reply brings the
    spares back: one call per run, no ShmAllocate."""
    async with (
        MMCacheClient(f"127.0.0.1:{shm_server.port}") as writer,
        client(shm_server) as reader,
    ):
        await with_ring(writer)
        announced = (await writer.transport.info(timeout=5)).region
        assert announced is not None and announced.posted_uploads  # else the client posts none
        assert await share(writer, "k0", 0) == "held"
        calls = await uploads_by_call(shm_server)
        spares = spares_of(size_of(4096, 1))
        assert spares == 16  # small: a run of them, not MAX_SPARES
        keys = [f"k{i}" for i in range(1, spares)]
        for i, key in enumerate(keys, start=1):
            assert await share(writer, key, i) == "posted"
        assert await uploads_by_call(shm_server) == calls  # no call at all
        await eventually(lambda: all(store_of(shm_server).peek(k) is not None for k in keys))
        for key in keys:
            stored = store_of(shm_server).peek(key)
            assert stored is not None and stored.resident is not None and stored.frames == ()
        assert await posted(shm_server, "applied") == len(keys)
        assert await posted(shm_server, "refused") == 0
        samples = await scrape(shm_server.metrics_port)  # each upload a miss, posted or called
        assert sample(samples, "mmcache_queries_total", modality="unknown") == spares
        assert sample(samples, "mmcache_hits_total", modality="unknown") == 0
        # Another client reads them in the region, with no call, bit-exact.
        reads = await handled(shm_server, "ReadShm") + await handled(shm_server, "Fetch")
        assert reader.lease_resident(keys).held == [True] * len(keys)
        fetched = reader.fetch_resident(keys)
        assert fetched is not None
        assert all(same(item, icon(i)) for i, item in enumerate(fetched, start=1))
        assert await handled(shm_server, "ReadShm") + await handled(shm_server, "Fetch") == reads
        # The writer's mirror learns them from the feed, as any upload's.
        await eventually(lambda: all(writer.is_cached(keys)))
        # The last spare goes by call, and its reply brings a run back.
        assert await share(writer, "last", 99) == "held"
        assert await uploads_by_call(shm_server) == calls + 1
        assert await share(writer, "again", 98) == "posted"
        await eventually(lambda: store_of(shm_server).leases == 0)


async def test_an_upload_posted_from_callers_threads_makes_no_call_and_is_bit_exact(
    shm_server: MMCacheServer,
) -> None:
    """`post_processed` on callers' threads, several at once while the loop
    uploads by call: each that says True is stored with no call, counted a
    miss, resident and bit-exact; each False took nothing (its get_and_update
    follows); no spare serves two uploads."""
    async with client(shm_server) as writer, client(shm_server) as reader:
        assert not writer.post_processed([icon(0)], ["early"])  # no ring yet: nothing taken
        await with_ring(writer)
        assert await share(writer, "warm", 0) == "held"  # by call: spares come back
        calls = await uploads_by_call(shm_server)
        before = writer.make_stats()
        assert await asyncio.to_thread(writer.post_processed, [icon(1)], ["one"])
        assert await uploads_by_call(shm_server) == calls  # no call at all
        after = writer.make_stats()
        assert (after.hits, after.total) == (before.hits, before.total + 1)
        await eventually(lambda: store_of(shm_server).peek("one") is not None, 2.0)

        def post_all(first: int) -> list[tuple[str, int, bool]]:
            out = []
            for n in range(first, first + 12):
                key = f"t{n}"
                out.append((key, n, writer.post_processed([icon(n)], [key])))
            return out

        threads = [asyncio.to_thread(post_all, 100 * (t + 1)) for t in range(4)]
        by_call = [share(writer, f"c{n}", 1000 + n) for n in range(8)]
        done = await asyncio.gather(*threads, *by_call)
        results = [r for batch in done[:4] for r in batch]  # type: ignore[union-attr]
        # Nothing taken where False: the upload goes by call, as the plugin's does.
        after_false = [await share(writer, key, n) for key, n, went in results if not went]
        keys = [key for key, _, _ in results] + [f"c{n}" for n in range(8)]
        await eventually(lambda: all(store_of(shm_server).peek(k) is not None for k in keys))
        posts = [*(went for _, _, went in results), *(r == "posted" for r in done[4:])]
        posts += [r == "posted" for r in after_false]
        assert await posted(shm_server, "applied") == 1 + sum(posts)
        assert await posted(shm_server, "refused") == 0
        fetched = await reader.fetch(keys)
        seeds = [n for _, n, _ in results] + [1000 + n for n in range(8)]
        assert all(same(item, icon(n)) for item, n in zip(fetched, seeds, strict=True))


async def test_a_post_that_cannot_go_gives_its_spare_back_from_a_thread_with_a_loop(
    shm_server: MMCacheServer,
) -> None:
    """A caller's thread may run an event loop of its own (vLLM's API server
    does): a post that took a spare and then cannot go (its header, with
    much metadata, is too large for the ring) gives the spare back through
    the client's own loop, and the client goes on."""
    async with client(shm_server) as writer:
        await with_ring(writer)
        blob = b"m" * 9000
        first = await writer.get_and_update(
            [icon(0)], ["big0"], metadata=[blob], lease=False, processed=True, resident=True
        )
        assert first.held == [True]  # by call (too large to post): its spares come back
        region = region_of(shm_server)
        assert region is not None
        await writer.transport.info()  # the rings read
        outstanding = region.slots

        async def on_a_loop() -> bool:
            return writer.post_processed([icon(1)], ["big1"], metadata=[blob])

        assert not await asyncio.to_thread(asyncio.run, on_a_loop())
        await writer.transport.info()
        assert region.slots == outstanding - 1  # the spare it took went back
        assert await share(writer, "after", 2) != "neither"
        await eventually(lambda: store_of(shm_server).peek("after") is not None, 2.0)


async def test_a_posted_upload_that_leases_or_asks_is_not_posted(
    shm_server: MMCacheServer,
) -> None:
    """Only what needs no reply is posted: an upload that leases, or of items
    not all processed, goes by call with spares held."""
    async with client(shm_server) as c:
        await with_ring(c)
        await share(c, "warm", 0)  # spares held from here
        calls = await uploads_by_call(shm_server)
        await c.get_and_update([icon(1)], ["leased"], lease=True, processed=True, resident=True)
        await c.get_and_update([icon(2)], ["looked"], lease=False, resident=True)
        assert await uploads_by_call(shm_server) == calls + 2
        await c.release(["leased"])


async def test_forged_posted_uploads_are_refused_and_nothing_is_lost(
    shm_server: MMCacheServer,
) -> None:
    """A record the server cannot apply is logged and counted; what is stored
    stays, the ring goes on, and the server answers."""
    async with client(shm_server) as c:
        token = await with_ring(c)
        await share(c, "kept", 0)
        stranger = Slot(4096, 4096, 123456789, 0)  # no slot this client holds
        entry = Entry("forged", "", encode_item(icon(5)), False, b"")
        forged = [
            b"\xff\x00not a header",
            pb.UpdateRequest(lease=pb.LEASE_HELD).SerializeToString(),
            pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash="forged")]).SerializeToString(),
            build_batch(
                [entry], [], lease=False, chunk_bytes=MIB, shm=(token, {0: stranger})
            ).header,
        ]
        for header in forged:
            assert c._co.reports.post_upload(token, header)
        await eventually(lambda: posted_now(shm_server, "refused", len(forged)))
        assert store_of(shm_server).peek("kept") is not None
        assert store_of(shm_server).peek("forged") is None
        assert await share(c, "after", 1) == "posted"  # the ring still carries uploads
        await eventually(lambda: store_of(shm_server).peek("after") is not None)


def posted_now(server: MMCacheServer, result: str, count: int) -> bool:
    samples = parse_samples(scrape_text(server.metrics_port))
    return sample(samples, "mmcache_posted_uploads_total", result=result) == count


async def test_a_release_call_that_carries_an_upload_is_invalid_argument(
    shm_server: MMCacheServer,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shm_server.port}") as channel:
        release = channel.unary_unary(
            "/mmcache.v1.MMCache/Release",
            request_serializer=pb.ReleaseRequest.SerializeToString,
            response_deserializer=pb.ReleaseReply.FromString,
        )
        upload = pb.UpdateRequest(touches=["x"]).SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await release(pb.ReleaseRequest(upload=upload))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "report ring" in (caught.value.details() or "")


async def test_a_ring_opened_with_a_read_token_carries_no_upload(tmp_path: Path) -> None:
    """Uploading needs the write role: a ring its client opened with a read
    token refuses posted uploads (counted), whatever slot they name."""
    read, write = "r" * 32, "w" * 32
    config = shm_config(tmp_path, shm_bytes=64 * MIB, tokens=f"write {write}; read {read}")
    async with (
        serving(config) as server,
        client(server, token=write) as writer,
        client(server, token=read) as reader,
    ):
        await with_ring(writer)
        token = await with_ring(reader)
        await share(writer, "warm", 0)  # the writer holds spares of an icon's size
        assert await share(writer, "mine", 1) == "posted"
        await eventually(lambda: store_of(server).peek("mine") is not None)
        # The reader names the writer's own spare, as a process mapping the file could.
        slot = writer._co.write_slots.take(writer._co.region, size_of(4096, 100))  # type: ignore[arg-type]
        assert slot is not None
        entry = Entry("theirs", "", encode_item(icon(2)), False, b"")
        header = build_batch([entry], [], lease=False, chunk_bytes=MIB, shm=(token, {0: slot}))
        assert reader._co.reports.post_upload(token, header.header)
        await eventually(lambda: posted_now(server, "refused", 1))
        assert store_of(server).peek("theirs") is None


async def test_a_posted_upload_wakes_the_server_and_is_stored_with_no_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client pokes the region's wake pipe after each post (mmcache._wake):
    with every timer that reads the rings stretched to an hour, each posted
    upload is still stored within moments, and no call read the rings."""
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    monkeypatch.setattr("mmcache.server.cache._colocated.POSTED_DRAIN_S", 3600.0)
    async with serving(shm_config(tmp_path, shm_bytes=64 * MIB)) as server, client(server) as c:
        region = region_of(server)
        assert region is not None
        assert stat.S_ISFIFO(os.stat(wake_path(region.path)).st_mode)
        await with_ring(c)
        await share(c, "warm", 0)  # by call: spares come back
        calls = await uploads_by_call(server)
        for n in range(1, 6):
            assert await share(c, f"icon-{n}", n) == "posted"
            await eventually(lambda n=n: store_of(server).peek(f"icon-{n}") is not None, 2.0)
        assert await uploads_by_call(server) == calls
        assert await posted(server, "applied") == 5
        assert parts_of(server.cache).reports._next_read is None  # no timer armed


async def test_a_client_pokes_once_its_ring_is_open_so_no_post_arms_a_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A post the server reads before the poke that follows it (another call
    drained the rings first) is still known to come from a client that pokes:
    the client poked when its ring opened. No timer reads the rings for it."""
    monkeypatch.setattr("mmcache.server.cache._colocated.POSTED_DRAIN_S", 3600.0)
    async with serving(shm_config(tmp_path, shm_bytes=64 * MIB)) as server, client(server) as c:
        await with_ring(c)
        await share(c, "warm", 0)  # by call: spares come back
        reports = parts_of(server.cache).reports
        await eventually(lambda: reports.rings is not None and reports.drain() == 0)
        assert c.post_processed([icon(1)], ["first"])  # on this loop: its poke is not read yet
        assert reports.drain() == 1  # read as a call's drain would, before the poke
        assert reports._next_read is None
        await eventually(lambda: store_of(server).peek("first") is not None, 2.0)


async def test_a_client_that_does_not_poke_has_its_posts_read_every_few_ms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client with no wake pipe (an older one; here the pipe's name is gone
    before it attached): the cache's timer reads the rings every 0.2 s
    (stretched here to an hour); once an upload was posted they are read every
    few ms as well, so the next posted upload is stored with no call and no
    timer."""
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    async with serving(shm_config(tmp_path, shm_bytes=64 * MIB)) as server:
        region = region_of(server)
        assert region is not None
        os.unlink(wake_path(region.path))
        async with client(server) as c:
            await with_ring(c)
            await share(c, "warm", 0)  # by call: spares come back
            assert await share(c, "first", 1) == "posted"
            await asyncio.sleep(0.3)
            assert store_of(server).peek("first") is None  # nothing read the ring yet
            await c.transport.info()  # a call reads the rings first
            await eventually(lambda: store_of(server).peek("first") is not None)
            assert await share(c, "second", 2) == "posted"
            await eventually(lambda: store_of(server).peek("second") is not None, timeout=2.0)


async def test_the_wake_pipe_takes_forged_pokes_and_goes_with_its_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that are no poke (a stray writer; a lease that is no ring's) cost
    a read of the rings and nothing else: the server stays up, and stores what
    it stored. The pipe has the region's mode, and goes when the server stops."""
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    async with serving(shm_config(tmp_path, shm_bytes=64 * MIB)) as server, client(server) as c:
        region = region_of(server)
        assert region is not None
        pipe = wake_path(region.path)
        assert stat.S_IMODE(os.stat(pipe).st_mode) == stat.S_IMODE(os.stat(region.path).st_mode)
        await with_ring(c)
        await share(c, "warm", 0)
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"abc")  # torn
            os.write(fd, (12345).to_bytes(8, "little"))  # no ring's
            os.write(fd, bytes(4096))
        finally:
            os.close(fd)
        assert await share(c, "after", 1) == "posted"
        await eventually(lambda: store_of(server).peek("after") is not None, 2.0)
        assert store_of(server).peek("warm") is not None
        await c.transport.info()  # still serving
    assert not exists(pipe)


async def test_small_items_seldom_asked_again_pause_their_sharing_until_hits_return(
    shm_server: MMCacheServer,
) -> None:
    """The server judges small items' reuse from what it sees (server/cache/
    _reuse.py): 40 icons stored and none asked for again pause their sharing
    (the region's advice, the gauge); a large item stored counts for
    nothing; hits of them, one per 8 of the last 32 stored, end the pause:
    leases in the region with no call, a lookup's hit, an upload of one held
    already (two processes processed it at once)."""
    async with (
        MMCacheClient(f"127.0.0.1:{shm_server.port}") as writer,
        client(shm_server) as reader,
    ):
        await with_ring(writer)
        region = writer.region
        assert region is not None and not region.small_paused()  # judged on nothing: shared

        async def gauge(name: str) -> float | None:
            return sample(await scrape(shm_server.metrics_port), name)

        async def hits_per_store() -> float | None:
            return await gauge("mmcache_small_hits_per_store")

        assert await gauge("mmcache_small_sharing_paused") == 0
        keys = [f"icon{i}" for i in range(40)]
        for i, key in enumerate(keys):
            assert await share(writer, key, i) in ("held", "posted")
        await eventually(lambda: region.small_paused())
        assert await gauge("mmcache_small_sharing_paused") == 1
        big = {"x": tensor(torch.float32, 1 << 19, 7)}  # 2 MiB: not small
        await writer.get_and_update([big], ["big"], lease=False, processed=True)
        assert reader.lease_resident(keys[:2]).held == [True] * 2  # with no call
        assert (await reader.lookup([keys[2]], lease=False)).held == [True]  # by call
        await reaches(hits_per_store, 3 / 32)
        assert region.small_paused()  # 3 hits per 32 stores: still too few
        assert await share(writer, keys[3], 3) in ("held", "posted")  # processed again
        await eventually(lambda: not region.small_paused())
        assert await gauge("mmcache_small_sharing_paused") == 0
        assert await hits_per_store() == 4 / 32
