"""Hits with no call (client/colocated/_resident.py): a co-located client leases an item
resident in the region by a record in its report ring, checked against the
extent's word; an engine copies it out on its own thread and gives the lease
back in its ring. Real servers, region files and clients: the hit is counted
once, holds the item against eviction, and an extent whose item leaves the
store before the server read the lease is kept until the lease ends."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import torch

from mmcache._rings import read_records, write_record
from mmcache._shm_layout import EXTENT_HEAD, PAGE, STALE_S
from mmcache.client import MMCacheClient
from mmcache.server import MMCacheServer
from mmcache.server.cache import parts_of
from mmcache.server.cache._region import ITEM, open_region
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, eventually, region_of, sample, scrape, serving, store_of
from .test_process import MMCACHE, free_port, start, wait_serving
from .test_shm import tensor
from .test_shm_reads import client, shm_config


def item(seed: int, elements: int = 1 << 18) -> dict[str, torch.Tensor]:
    return {"x": tensor(torch.float32, elements, seed)}


async def calls(server: MMCacheServer, method: str) -> float:
    samples = await scrape(server.metrics_port)
    found = [
        value
        for (name, labels), value in samples.items()
        if name == "grpc_server_started_total" and ("grpc_method", method) in labels
    ]
    return sum(found)


async def counted(server: MMCacheServer) -> tuple[float, float]:
    """Queries and hits, over every modality."""
    samples = await scrape(server.metrics_port)

    def total(metric: str) -> float:
        return sum(value for (name, _), value in samples.items() if name == metric)

    return total("mmcache_queries_total"), total("mmcache_hits_total")


async def with_ring(*clients: MMCacheClient) -> None:
    await eventually(lambda: all(c.report_ring is not None for c in clients))


async def test_a_hit_leased_and_read_with_no_call_is_counted_once(tmp_path: Path) -> None:
    async with (
        serving(shm_config(tmp_path)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        await api.get_and_update([item(1)], ["a"], lease=False)
        await with_ring(api, engine)
        before = await counted(server)
        lookups = await calls(server, "GetAndUpdate") + await calls(server, "GetAndUpdateOne")
        assert api.lease_resident(["a", "absent"]).held == [True, False]
        await eventually(lambda: store_of(server).leases == 1, timeout=2)  # the ring was read
        got = engine.fetch_resident(["a"])
        assert got is not None and torch.equal(got[0]["x"], item(1)["x"])
        await eventually(lambda: store_of(server).leases == 0, timeout=2)  # given back in the ring
        assert await counted(server) == (before[0] + 1, before[1] + 1)
        after = await calls(server, "GetAndUpdate") + await calls(server, "GetAndUpdateOne")
        assert after == lookups
        assert await calls(server, "ReadShm") == 0 and await calls(server, "Release") == 0
        assert api.make_stats().hits == 1
        samples = await scrape(server.metrics_port)
        assert (sample(samples, "mmcache_shm_client_cpu_seconds_total") or 0) > 0
        # Not all resident: the engine reads by call instead.
        assert engine.fetch_resident(["a", "absent"]) is None


async def test_a_lease_taken_with_no_call_keeps_the_item_from_eviction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No timer: only calls read the report rings (and beat the region).
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    # 4 MiB of cache, 2 MiB items: the third upload evicts the oldest unleased.
    async with (
        serving(shm_config(tmp_path, capacity_bytes=4 * MIB)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        await api.get_and_update([item(1, 1 << 19)], ["a"], lease=False)
        await api.get_and_update([item(2, 1 << 19)], ["b"], lease=False)
        await with_ring(api, engine)
        assert api.lease_resident(["a"]).held == [True]  # in the ring, unread
        await api.get_and_update([item(3, 1 << 19)], ["c"], lease=False)  # reads it first
        assert "a" in store_of(server) and "b" not in store_of(server)
        got = engine.fetch_resident(["a"])
        assert got is not None and torch.equal(got[0]["x"], item(1, 1 << 19)["x"])


async def test_an_extent_leased_in_an_unread_record_outlives_its_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No timer: only calls read the report rings (and beat the region).
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    # The race the record and the check close: the item leaves the store after
    # the client checked its lease, before the server read the record.
    async with (
        serving(shm_config(tmp_path)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        await api.get_and_update([item(4), item(5)], ["a", "b"], lease=False)
        await with_ring(api, engine)
        region = region_of(server)
        assert region is not None
        assert api.lease_resident(["a"]).held == [True]
        store_of(server).clear()  # no ring is read: the lease of "a" waits in the ring
        assert "a" not in store_of(server)
        assert region.orphans == 1  # "b" went; "a"'s extent is kept, indexed
        got = engine.fetch_resident(["a"])
        assert got is not None and torch.equal(got[0]["x"], item(4)["x"])
        assert engine.fetch_resident(["b"]) is None
        server.cache.drain_reports()  # the lease (of nothing held), then its release
        assert region.orphans == 0
        assert engine.fetch_resident(["a"]) is None  # freed now
        assert api.lease_resident(["a"]).held == [False]


async def test_a_full_ring_leases_nothing_and_the_lookup_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No timer: only calls read the report rings (and beat the region).
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    async with serving(shm_config(tmp_path)) as server, client(server) as api:
        await api.get_and_update([item(6)], ["a"], lease=False)
        await with_ring(api)
        fill(api)
        before = await counted(server)
        assert api.lease_resident(["a"]).held == [False]
        assert (await api.lookup(["a"])).held == [True]  # by call: it reads the ring first
        assert await counted(server) == (before[0] + 1, before[1] + 1)


def test_a_torn_lease_record_is_not_read_as_one() -> None:
    # The server looks at unread records for leases: only whole ones count.
    ring = memoryview(bytearray(64 + 1024))
    lease = pb.ReleaseRequest(shm_leases=[pb.ShmLease(mm_hash="a", generation=7)])
    assert write_record(ring, lease.SerializeToString())

    assert read_records(ring, 0, commit=False)[0] == [lease.SerializeToString()]
    assert read_records(ring, 0, commit=False)[0] == [lease.SerializeToString()]  # still unread
    ring[64 + 16] ^= 0xFF
    assert read_records(ring, 0, commit=False)[0] == []


async def test_a_process_that_never_processed_an_item_leases_it_with_its_metadata(
    tmp_path: Path,
) -> None:
    # The metadata (vLLM's prompt updates) lives in the extent with the item:
    # another API process needs no lookup for it.
    async with (
        serving(shm_config(tmp_path)) as server,
        client(server) as one,
        client(server) as other,
    ):
        await one.get_and_update([item(7)], ["a"], metadata=[b'{"v": 1}'], lease=False)
        await one.get_and_update([item(8)], ["b"], lease=False)  # no metadata
        await with_ring(other)
        seen: list[tuple[int, bytes]] = []

        def usable(i: int, metadata: bytes) -> bool:
            seen.append((i, metadata))
            return bool(metadata)  # b's is none: the lookup will say so

        leased = other.lease_resident(["a", "b"], usable=usable)
        assert leased.held == [True, False]
        assert leased.metadata == [b'{"v": 1}', b""]
        assert seen == [(0, b'{"v": 1}'), (1, b"")]
        await eventually(lambda: store_of(server).leases == 1, timeout=2)  # b was not leased


def test_metadata_without_room_in_the_extent_is_left_out_not_the_item(tmp_path: Path) -> None:
    region = open_region(str(tmp_path), 1 << 20, lease_s=30.0)
    try:
        key, spec = "k", b"spec"
        # A page holds the head and the payload, and 95 bytes after key and spec.
        slot = region.allocate(PAGE - 64 - 100, ITEM, len(key) + len(spec))
        assert slot is not None
        resident = region.settle(slot, key, spec, b"m" * 200)
        assert resident is not None
        head = EXTENT_HEAD.unpack_from(region.view, slot.start)
        assert head[2:] == (1, 4, 0)  # key and spec; no metadata
        other = region.allocate(PAGE - 64 - 100, ITEM, 5)
        assert other is not None
        resident = region.settle(other, "j", spec, b"m" * 90)
        assert resident is not None
        assert EXTENT_HEAD.unpack_from(region.view, resident.slot.start)[2:] == (1, 4, 90)
    finally:
        region.close()


async def test_a_killed_server_is_read_with_no_call_no_longer(tmp_path: Path) -> None:
    # SIGKILL leaves the region mapped and its magic in place: only the
    # heartbeat's standing still tells the client its server is gone.
    port, metrics_port = free_port(), free_port()
    proc = start(
        [
            MMCACHE,
            "serve",
            *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)),
            *("--shm-dir", str(tmp_path), "--shm-mb", "64", "--capacity-gb", "0.25"),
        ]
    )
    try:
        wait_serving(port, proc)
        async with MMCacheClient(f"127.0.0.1:{port}", follow=False) as api:
            await api.get_and_update([item(9)], ["a"], lease=False)
            await with_ring(api)
            await asyncio.sleep(STALE_S + 0.5)  # idle, alive: its heartbeat goes on
            assert api.lease_resident(["a"]).held == [True]
            assert api.fetch_resident(["a"]) is not None
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            await asyncio.sleep(STALE_S + 0.5)
            assert api.lease_resident(["a"]).held == [False]
            assert api.fetch_resident(["a"]) is None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def fill(client: MMCacheClient) -> None:
    """Fill the client's ring with records the server has not read."""
    ring = client.report_ring
    assert ring is not None
    for size in (200, 1):  # to the last byte: no report fits
        while ring.write(b"x" * size):
            pass


async def test_what_a_full_ring_cannot_take_goes_by_call_and_the_ring_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No timer: only calls read the report rings (and beat the region).
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    async with (
        serving(shm_config(tmp_path)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        await api.get_and_update([item(10)], ["a"], lease=False)
        await with_ring(api, engine)
        assert api.lease_resident(["a"]).held == [True]
        server.cache.drain_reports()
        assert store_of(server).leases == 1
        fill(engine)
        # The engine's release, from its own thread, cannot go in its ring: by call.
        assert engine.fetch_resident(["a"]) is not None
        await eventually(lambda: store_of(server).leases == 0, timeout=2)
        # Hits the ring could not take; by the time the loop sends them, it can
        # (the server read it meanwhile): they still go, and the ring stays.
        before = await counted(server)
        region = api.region
        assert region is not None
        fill(api)
        api._co.reports.post(region.token, pb.ReleaseRequest(hits={"image": 2}, client_cpu_ns=1))
        server.cache.drain_reports()
        await eventually(lambda: api._co.reports._task is not None and api._co.reports._task.done())
        assert await counted(server) == (before[0] + 2, before[1] + 2)
        rings = parts_of(server.cache).rings
        assert rings is not None and len(rings) == 2
