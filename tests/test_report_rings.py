"""Report rings (mmcache._rings): a co-located client's reports reach the
server through the region with no call. The ring's records against a model
(hypothesis), then real servers, region files and clients: leases given back
through the ring end with no Release call and before the next eviction,
and a ring the server retires sends its client back to calls."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache._rings import RECORD, RING_HEAD_BYTES, RingCorrupt, read_records, write_record
from mmcache.client import MMCacheClient
from mmcache.server import MMCacheServer
from mmcache.server.cache import parts_of

from .conftest import MIB, connected, eventually, reaches, sample, scrape, serving, store_of
from .test_shm import tensor
from .test_shm_reads import client, shm_config

RING = 1024  # small: laps come quickly


def ring_buffer(size: int = RING) -> memoryview:
    return memoryview(bytearray(RING_HEAD_BYTES + size))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=300), st.none()), max_size=80))
def test_records_come_out_in_order_whole_and_once(steps: list[bytes | None]) -> None:
    # None: the reader reads; bytes: the writer writes (or finds no room).
    ring = ring_buffer()
    sent: deque[bytes] = deque()
    tail = 0
    for step in steps:
        if step is None:
            got, tail = read_records(ring, tail)
            assert got == [sent.popleft() for _ in got]
        elif write_record(ring, step):
            sent.append(step)
    got, tail = read_records(ring, tail)
    assert got == list(sent)


def test_a_record_not_yet_whole_or_from_an_earlier_lap_is_not_read() -> None:
    ring = ring_buffer()
    assert write_record(ring, b"first")
    start = RING_HEAD_BYTES
    # Torn: the header is there, the payload not yet (crc fails).
    ring[start + RECORD.size] ^= 0xFF
    assert read_records(ring, 0) == ([], 0)
    ring[start + RECORD.size] ^= 0xFF
    assert read_records(ring, 0)[0] == [b"first"]
    # The writer has gone a lap on and claims a record at the same place, not
    # yet visible: what is there is the last lap's record, whose position is not
    # the reader's.
    ring[0:8] = (RING + 24).to_bytes(8, "little")
    assert read_records(ring, RING) == ([], RING)

    with pytest.raises(RingCorrupt):
        read_records(ring, 10**6)  # a tail past the head: no writer made that
    ring[0:8] = (10**9).to_bytes(8, "little")
    with pytest.raises(RingCorrupt):
        read_records(ring, 0)  # a head a whole ring ahead of the reader


def test_a_full_ring_refuses_until_read_and_a_record_larger_than_it_never_fits() -> None:
    ring = ring_buffer()
    written = 0
    while write_record(ring, b"x" * 100):
        written += 1
    assert written == RING // 120  # 16-byte header + 100, padded to 120
    got, _ = read_records(ring, 0)
    assert len(got) == written
    assert write_record(ring, b"x" * 100)
    assert not write_record(ring, b"y" * RING)


async def leases(server: MMCacheServer) -> float:
    return sample(await scrape(server.metrics_port), "mmcache_leases") or 0


async def release_calls(server: MMCacheServer) -> float:
    samples = await scrape(server.metrics_port)
    return (
        sample(
            samples,
            "grpc_server_started_total",
            grpc_service="mmcache.v1.MMCache",
            grpc_method="Release",
            grpc_type="unary",
        )
        or 0
    )


async def test_reads_give_their_leases_back_through_the_ring_with_no_call(
    tmp_path: Path,
) -> None:
    async with (
        serving(shm_config(tmp_path)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        items = [{"x": tensor(torch.float32, 1 << 18, i)} for i in range(6)]
        hashes = [f"r{i}" for i in range(6)]
        await api.get_and_update(items, hashes, lease=False)
        # The ring is asked for as the client maps the region: even the first
        # read's report goes there.
        await eventually(lambda: engine.report_ring is not None)
        calls = await release_calls(server)
        assert calls == 0
        for mm_hash in hashes:
            assert (await api.lookup([mm_hash])).held == [True]  # leased for the engine
            await engine.fetch([mm_hash])  # read from the region; its lease goes back
        await eventually(lambda: store_of(server).leases == 0, timeout=2)
        assert await leases(server) == 0
        assert await release_calls(server) == calls  # none since the ring
        samples = await scrape(server.metrics_port)
        read = sample(samples, "mmcache_shm_bytes_total", direction="read")
        assert read is not None and read >= 6 * MIB  # the ring's reports counted their bytes


async def test_queries_counted_on_a_callers_thread_go_in_the_ring_with_no_call(
    tmp_path: Path,
) -> None:
    async with serving(shm_config(tmp_path)) as server, client(server) as api:
        await api.get_and_update([{"x": tensor(torch.float32, 64, 1)}], ["m"], lease=False)
        await eventually(lambda: api.report_ring is not None)
        calls = await release_calls(server)
        # vLLM's thread, as the plugin counts a request's misses and own hits.
        posted = await asyncio.to_thread(
            lambda: (
                api.count_posted(["image", "image", "video"], hits=False),
                api.count_posted(["image"], hits=True),
            )
        )
        assert posted == (True, True)

        async def counted() -> tuple[float | None, ...]:
            samples = await scrape(server.metrics_port)
            return (
                sample(samples, "mmcache_queries_total", modality="image"),
                sample(samples, "mmcache_queries_total", modality="video"),
                sample(samples, "mmcache_hits_total", modality="image"),
            )

        await reaches(counted, (3, 1, 1))  # the timer reads the ring
        assert await release_calls(server) == calls
    async with serving(shm_config(tmp_path)) as server:
        async with connected(server, shm=False, follow=False) as remote:
            # No ring: the caller counts them by `count_misses` instead.
            assert not remote.count_posted(["image"], hits=False)
            assert remote.count_posted([], hits=False)  # nothing to count


async def test_leases_given_back_on_a_callers_thread_go_in_the_ring_with_no_call(
    tmp_path: Path,
) -> None:
    # vLLM's engine thread, as the plugin's engine gives back the leases of
    # hits it held already (no read to end them).
    async with serving(shm_config(tmp_path)) as server, client(server) as api:
        await api.get_and_update([{"x": tensor(torch.float32, 64, 1)}], ["m"], lease=False)
        await eventually(lambda: api.report_ring is not None)
        for _ in range(2):  # two leases
            assert (await api.lookup(["m"])).held == [True]
        assert await leases(server) == 2
        calls = await release_calls(server)
        assert await asyncio.to_thread(api.release_posted, ["m"])
        await eventually(lambda: store_of(server).leases == 1, timeout=2)
        assert await asyncio.to_thread(api.release_posted, ["m"])
        await eventually(lambda: store_of(server).leases == 0, timeout=2)
        assert await release_calls(server) == calls  # none: the ring took them
        assert api.release_posted([])  # nothing to give back
    async with serving(shm_config(tmp_path)) as server:
        async with connected(server, shm=False, follow=False) as remote:
            # No region: the caller releases them by `release` instead.
            assert not remote.release_posted(["m"])


async def test_a_lease_given_back_in_the_ring_counts_at_once_for_an_eviction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No timer: only calls read the report rings (and beat the region).
    monkeypatch.setattr("mmcache.server.cache._open.REPORT_DRAIN_S", 3600.0)
    # A cache of 4 MiB: a leased 2 MiB item cannot be evicted for two more.
    async with (
        serving(shm_config(tmp_path, capacity_bytes=4 * MIB)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        first = {"x": tensor(torch.float32, 1 << 19, 1)}
        await api.get_and_update([first], ["a"], lease=False)
        await api.lookup(["a"])
        await engine.fetch(["a"])  # by call; opens the ring
        await eventually(lambda: engine.report_ring is not None)
        await api.lookup(["a"])  # leased again
        await engine.fetch(["a"])  # given back in the ring, which nothing has read yet
        assert store_of(server).leases == 1
        others = [{"x": tensor(torch.float32, 1 << 19, i)} for i in (2, 3)]
        # The upload's call reads the ring first: "a" is free to go.
        await api.get_and_update(others, ["b", "c"], lease=False)
        assert store_of(server).leases == 0
        assert "a" not in store_of(server) and "b" in store_of(server) and "c" in store_of(server)


async def test_a_retired_ring_sends_its_client_back_to_calls(tmp_path: Path) -> None:
    async with (
        serving(shm_config(tmp_path)) as server,
        client(server) as api,
        client(server) as engine,
    ):
        item = {"x": tensor(torch.float32, 1 << 18, 7)}
        await api.get_and_update([item], ["h"], lease=False)
        await api.lookup(["h"])
        await engine.fetch(["h"])
        await eventually(lambda: engine.report_ring is not None)
        rings = parts_of(server.cache).rings
        assert rings is not None and len(rings) == 2  # each client asked for one as it mapped
        rings.drain()  # the read's report
        rings._idle_s = 0.0  # it is idle for longer than that
        await asyncio.sleep(0.01)
        rings.drain()
        assert len(rings) == 0
        calls = await release_calls(server)
        await api.lookup(["h"])
        await engine.fetch(["h"])  # the ring is gone: the report goes by call
        await eventually(lambda: store_of(server).leases == 0)
        assert await release_calls(server) == calls + 1
        assert engine.report_ring is None


async def test_a_client_that_closes_gives_its_ring_back(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server:
        async with client(server) as api, client(server) as engine:
            await api.get_and_update([{"x": tensor(torch.float32, 1 << 18, 5)}], ["h"])
            await engine.fetch(["h"])
            await eventually(lambda: engine.report_ring is not None)
            rings = parts_of(server.cache).rings
            assert rings is not None and len(rings) == 2
        await eventually(lambda: len(rings) == 0, timeout=1)  # the timer read its last record


async def test_a_client_without_shared_memory_asks_for_no_ring(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server:
        async with connected(server, shm=False, follow=False) as remote:
            await remote.get_and_update([{"x": tensor(torch.float32, 64, 1)}], ["z"])
            await remote.fetch(["z"])
        assert parts_of(server.cache).rings is None or len(parts_of(server.cache).rings) == 0


async def test_a_read_only_client_gets_a_ring_in_its_namespace(tmp_path: Path) -> None:
    # An engine's token may read, not write: a ring carries what its Release
    # would, so reading is enough. Its reports count in its own namespace.
    tokens = tmp_path / "tokens"
    write_token, read_token = "w" * 24, "r" * 24
    tokens.write_text(f"write {write_token} a\nread {read_token} a\n")
    async with serving(shm_config(tmp_path, tokens_file=str(tokens))) as server:
        target = f"127.0.0.1:{server.port}"
        async with (
            MMCacheClient(target, token=write_token, namespace="a", follow=False) as api,
            MMCacheClient(target, token=read_token, namespace="a", follow=False) as engine,
        ):
            item = {"x": tensor(torch.float32, 1 << 18, 3)}
            await api.get_and_update([item], ["h"], lease=False)
            for _ in range(3):
                await api.lookup(["h"])
                await engine.fetch(["h"])
            await eventually(lambda: engine.report_ring is not None)
            await eventually(lambda: store_of(server).leases == 0, timeout=2)
