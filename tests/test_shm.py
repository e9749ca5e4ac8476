"""The shared-memory fast path: real servers, real region files, real clients."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from mmcache._equal import nested_equal
from mmcache._frames import header_frame
from mmcache._wake import wake_path
from mmcache.client import CacheMissError, FailedPreconditionError, MMCacheClient
from mmcache.client._codec import ItemDecoder, encode_item
from mmcache.client.colocated import SPARE_BYTES, attach
from mmcache.client.wire import RegionInfo, Slot, Spec
from mmcache.server import MMCacheServer, ServerConfig, ShmConfig
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, eventually, region_of, sample, scrape, server_config, serving, store_of
from .items import image_item

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=generator, dtype=dtype)
    return torch.randint(-100, 100, (n,), generator=generator).to(dtype)


@pytest.fixture
async def shm_server(tmp_path: Path) -> AsyncIterator[MMCacheServer]:
    async with serving(shm_config(tmp_path, shm_bytes=256 * MIB)) as server:
        assert region_of(server) is not None
        yield server


def shm_config(
    directory: Path,
    *,
    shm_bytes: int = ShmConfig.bytes,
    shm_group: int | None = None,
    **overrides: object,
) -> ServerConfig:
    """A server with its region in `directory`."""
    shm = ShmConfig(dir=str(directory), bytes=shm_bytes, group=shm_group)
    return server_config(shm=shm, **overrides)


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(nested_equal(a[k], b[k]) for k in a)


def exists(path: str) -> bool:
    return os.path.exists(path)


def listing(directory: Path) -> list[Path]:
    return list(directory.iterdir())


def forged_copy(path: str, to: Path) -> Path:
    """The region file with another region id: same size, same magic."""
    shutil.copyfile(path, to)
    with open(to, "r+b") as file:
        file.seek(8)
        file.write(b"\x00" * 16)
    return to


def client(server: MMCacheServer, **kwargs: object) -> MMCacheClient:
    return MMCacheClient(f"127.0.0.1:{server.port}", follow=False, **kwargs)  # type: ignore[arg-type]


async def shm_bytes(server: MMCacheServer, direction: str) -> float:
    return (
        sample(await scrape(server.metrics_port), "mmcache_shm_bytes_total", direction=direction)
        or 0
    )


async def test_every_dtype_and_form_round_trips_bit_exact_through_shared_memory(
    shm_server: MMCacheServer,
) -> None:
    async with client(shm_server) as c:
        assert c.region is not None
        for i, dtype in enumerate(DTYPES):
            big = tensor(dtype, (2 << 20) // torch.empty(0, dtype=dtype).element_size(), i)
            mapping = {"big": big, "small": tensor(dtype, 7, i + 100), "n": 3, "nested": [big[:5]]}
            await c.get_and_update([mapping, image_item(i)], [f"m{i}", f"i{i}"], lease=False)
            fetched = await c.fetch([f"m{i}", f"i{i}"])
            assert same(fetched[0], mapping), dtype
            assert fetched[1] == image_item(i)
            out = fetched[0]["big"]
            assert out.is_contiguous() and not out.is_inference()
            out.add_(1) if dtype not in (torch.bool,) else out.logical_not_()  # writable, ours
    assert await shm_bytes(shm_server, "read") > 0
    assert await shm_bytes(shm_server, "write") > 0  # the 2 MiB+ uploads went through slots


async def handled(server: MMCacheServer, method: str) -> float:
    """Calls of `method` the server has answered, whatever their status."""
    samples = await scrape(server.metrics_port)
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "grpc_server_handled_total" and ("grpc_method", method) in labels
    )


async def test_resident_items_are_read_with_no_call_and_reported_after(
    shm_server: MMCacheServer,
) -> None:
    async with client(shm_server) as c:
        item = {"x": tensor(torch.float32, 1 << 20, 1)}  # 4 MiB: uploaded through a slot
        await c.get_and_update([item], ["r"])  # leased, for the engine's read
        stored = store_of(shm_server).peek("r")
        assert stored is not None and stored.resident is not None and stored.frames == ()
        calls = await handled(shm_server, "ReadShm") + await handled(shm_server, "Fetch")
        for _ in range(3):
            assert same((await c.fetch(["r"], release=False))[0], item)
        assert same((await c.fetch(["r"]))[0], item)
        assert await handled(shm_server, "ReadShm") + await handled(shm_server, "Fetch") == calls
        # What the reads owe the server goes in one Release, just after.
        await eventually(lambda: store_of(shm_server).leases == 0)
        assert await shm_bytes(shm_server, "read") == 4 * item["x"].nbytes


async def test_a_small_item_sent_resident_is_read_by_another_client_with_no_call(
    shm_server: MMCacheServer,
) -> None:
    """Under 1 MiB an upload goes over gRPC into the heap, where a read is a
    call; `resident=True` sends it through a write slot, resident at once, so
    another client on the host leases and reads it with no call."""
    async with client(shm_server) as writer, client(shm_server) as reader:
        small = {"x": tensor(torch.float32, 1024, 7)}  # 4 KiB
        await writer.get_and_update([small], ["heap"], lease=False)
        await writer.get_and_update([small], ["region"], lease=False, resident=True)
        in_heap, resident = (store_of(shm_server).peek(k) for k in ("heap", "region"))
        assert in_heap is not None and in_heap.resident is None and in_heap.frames
        assert resident is not None and resident.resident is not None and resident.frames == ()
        calls = await handled(shm_server, "ReadShm") + await handled(shm_server, "Fetch")
        assert reader.lease_resident(["heap", "region"]).held == [False, True]
        fetched = reader.fetch_resident(["region"])
        assert fetched is not None and same(fetched[0], small)
        assert await handled(shm_server, "ReadShm") + await handled(shm_server, "Fetch") == calls
        await eventually(lambda: store_of(shm_server).leases == 0)


async def test_an_item_uploaded_over_grpc_moves_into_the_region_on_its_first_read(
    shm_server: MMCacheServer,
) -> None:
    async with client(shm_server, shm=False) as remote, client(shm_server) as local:
        await remote.get_and_update([image_item(1)], ["g"], lease=False)
        before = store_of(shm_server).peek("g")
        assert before is not None and before.resident is None and before.frames
        used = store_of(shm_server).used
        assert (await local.fetch(["g"]))[0] == image_item(1)  # ReadShm moves it
        after = store_of(shm_server).peek("g")
        assert after is not None and after.resident is not None and after.frames == ()
        assert store_of(shm_server).used == used  # charged once, wherever it lives
        calls = await handled(shm_server, "ReadShm")
        assert (await local.fetch(["g"]))[0] == image_item(1)  # now with no call
        assert await handled(shm_server, "ReadShm") == calls
        # A client off the host still reads it, as chunk frames made from the region.
        assert (await remote.fetch(["g"]))[0] == image_item(1)


async def test_namespaces_read_their_own_resident_items(shm_server: MMCacheServer) -> None:
    async with client(shm_server, namespace="a") as a, client(shm_server, namespace="b") as b:
        mine = {"x": tensor(torch.float32, 1 << 19, 2)}
        theirs = {"x": tensor(torch.float32, 1 << 19, 3)}
        await a.get_and_update([mine], ["same"], lease=False)
        await b.get_and_update([theirs], ["same"], lease=False)
        for _ in range(2):
            assert same((await a.fetch(["same"]))[0], mine)
            assert same((await b.fetch(["same"]))[0], theirs)
        async with client(shm_server, namespace="c") as c:
            with pytest.raises(CacheMissError):
                await c.fetch(["same"])


async def test_items_past_the_index_are_read_through_readshm(tmp_path: Path) -> None:
    """A small region has few index buckets: items whose buckets are all taken
    are still resident, and ReadShm says where they are."""
    async with serving(shm_config(tmp_path, shm_bytes=4 * MIB)) as server:
        async with client(server) as c:
            items = [{"x": tensor(torch.int32, 256, i)} for i in range(300)]
            hashes = [f"n{i}" for i in range(300)]
            await c.get_and_update(items, hashes, lease=False)
            for _ in range(2):  # the first read moves them in, the second finds them
                fetched = await c.fetch(hashes)
                assert all(same(a, b) for a, b in zip(fetched, items, strict=True))
            assert region_of(server) is not None and len(region_of(server)._indexed) <= 256 < 300
            assert all(store_of(server).peek(h).resident is not None for h in hashes)  # type: ignore[union-attr]


async def test_region_pressure_moves_the_coldest_items_to_the_heap_while_the_cache_has_room(
    tmp_path: Path,
) -> None:
    config = shm_config(tmp_path, shm_bytes=24 * MIB, capacity_bytes=256 * MIB)
    async with serving(config) as server, client(server) as c:
        kept = {"x": tensor(torch.float32, 1 << 20, 99)}
        await c.get_and_update([kept], ["kept"])  # leased
        items = [{"x": tensor(torch.float32, 1 << 20, i)} for i in range(8)]  # 4 MiB each
        for i, item in enumerate(items):
            await c.get_and_update([item], [f"p{i}"], lease=False)
        assert await shm_bytes(server, "write") == 9 * 4 * MIB  # every one through a slot
        # Nothing evicted: the cache has room, the region's coldest moved out of it.
        assert all(f"p{i}" in store_of(server) for i in range(8)) and "kept" in store_of(server)
        assert store_of(server).peek("p0").resident is None  # type: ignore[union-attr]
        assert store_of(server).peek("p7").resident is not None  # type: ignore[union-attr]
        assert region_of(server) is not None and region_of(server).resident_bytes <= 24 * MIB
        for i, item in enumerate(items):
            assert same((await c.fetch([f"p{i}"]))[0], item)
        assert same((await c.fetch(["kept"]))[0], kept)


async def test_region_pressure_in_a_full_cache_evicts_the_coldest_never_leased_ones(
    tmp_path: Path,
) -> None:
    config = shm_config(tmp_path, shm_bytes=24 * MIB, capacity_bytes=24 * MIB)
    async with serving(config) as server, client(server) as c:
        kept = {"x": tensor(torch.float32, 1 << 20, 99)}
        await c.get_and_update([kept], ["kept"])  # leased: never evicted
        items = [{"x": tensor(torch.float32, 1 << 20, i)} for i in range(8)]
        for i, item in enumerate(items):
            await c.get_and_update([item], [f"p{i}"], lease=False)
        held = [i for i in range(8) if f"p{i}" in store_of(server)]
        assert (
            "kept" in store_of(server) and 7 in held and len(held) < 8
        )  # some evicted, never "kept"
        assert store_of(server).used <= 24 * MIB
        assert same((await c.fetch(["kept"]))[0], kept)
        for i in held:
            assert same((await c.fetch([f"p{i}"]))[0], items[i])


async def test_fetched_tensors_reuse_the_memory_of_dropped_ones_never_held_ones(
    shm_server: MMCacheServer,
) -> None:
    item = {"x": tensor(torch.float32, 1 << 21, 4)}  # 8 MiB
    async with client(shm_server) as c:
        await c.get_and_update([item], ["big"], lease=False)
        held = (await c.fetch(["big"]))[0]["x"]
        second = (await c.fetch(["big"]))[0]["x"]
        assert second.data_ptr() != held.data_ptr()  # still the caller's
        address = second.data_ptr()
        del second
        third = (await c.fetch(["big"]))[0]["x"]
        assert third.data_ptr() == address  # the dropped buffer, used again
        assert torch.equal(held, item["x"]) and torch.equal(third, item["x"])
        held.zero_()
        assert torch.equal(third, item["x"])
    async with client(shm_server, reuse_bytes=0) as c:
        assert torch.equal((await c.fetch(["big"]))[0]["x"], item["x"])


async def test_spare_write_slots_save_a_call_and_go_back_at_close(
    shm_server: MMCacheServer,
) -> None:
    region = region_of(shm_server)
    assert region is not None
    async with client(shm_server) as c:
        allocations = await handled(shm_server, "ShmAllocate")
        for i in range(4):
            await c.get_and_update([{"x": tensor(torch.float32, 1 << 20, i)}], [f"s{i}"])
        assert await handled(shm_server, "ShmAllocate") == allocations + 1  # three spares
        await c.get_and_update([{"x": tensor(torch.float32, 1 << 20, 9)}], ["s9"])
        assert region.slots == 3  # the next three spares
    await eventually(lambda: region.slots == 0)
    assert await shm_bytes(shm_server, "write") == 5 * 4 * MIB


async def test_concurrent_uploads_keep_spares_within_the_clients_caps(
    shm_server: MMCacheServer,
) -> None:
    region = region_of(shm_server)
    assert region is not None
    async with client(shm_server) as c:
        for r in range(4):  # eight 8 MiB uploads at once, each asking for spares
            items = [{"x": tensor(torch.float32, 2 << 20, 8 * r + i)} for i in range(8)]
            await asyncio.gather(
                *(c.get_and_update([x], [f"c{r}-{i}"], lease=False) for i, x in enumerate(items))
            )
            # Three of that size at most (24 MiB, within SPARE_BYTES): the
            # answers past the cap went back to the server.
            await eventually(lambda: region.slots == 3)
            assert region.leased_bytes <= SPARE_BYTES
    await eventually(lambda: region.slots == 0)


async def test_an_extent_freed_under_a_read_fails_the_read(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server, client(server) as c:
        item = image_item(3, numel=1 << 18)
        await c.get_and_update([item], ["s"], lease=False)
        assert c.region is not None
        raw = await c.transport.read_shm(["s"], False, c.region.token, [], hold=False)
        header = pb.FetchHeader.FromString(raw)
        store_of(server).clear()  # no hold: the extent is freed at once
        decoder = ItemDecoder(Spec(header.items[0].item))
        assert not c.region.read(header.items[0].shm, decoder)  # its word is gone: no torn read
        assert c.region.read_resident("s", None) is None


async def test_an_eviction_in_the_middle_of_a_call_free_read_is_a_miss_not_stale_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmcache.client.colocated import _shm

    async with serving(shm_config(tmp_path)) as server, client(server) as c:
        item = {"x": tensor(torch.float32, 1 << 20, 6)}
        await c.get_and_update([item], ["m"], lease=False)

        decode = _shm.decode_from_region

        def evicted_mid_copy(spec: bytes, payload: memoryview, pool: object) -> object:
            store_of(server).clear()  # the server frees the extent under the copy
            return decode(spec, payload, pool)  # type: ignore[arg-type]

        monkeypatch.setattr(_shm, "decode_from_region", evicted_mid_copy)
        with pytest.raises(CacheMissError):
            await c.fetch(["m"])


async def test_eviction_and_overwrite_during_a_held_read_do_not_touch_it(
    tmp_path: Path,
) -> None:
    config = shm_config(tmp_path, capacity_bytes=3 * MIB)
    async with serving(config) as server, client(server) as c:
        first = {"x": tensor(torch.float32, 1 << 18, 1)}
        await c.get_and_update([first], ["h"], lease=False)
        assert c.region is not None
        raw = await c.transport.read_shm(["h"], False, c.region.token, [])
        header = pb.FetchHeader.FromString(raw)
        # New data under the hash, and enough more to evict everything old.
        await c.get_and_update([{"x": tensor(torch.float32, 1 << 18, 2)}], ["h"], lease=False)
        for i in range(4):
            await c.get_and_update([{"x": tensor(torch.float32, 1 << 18, 10 + i)}], [f"e{i}"])
            await c.fetch([f"e{i}"], release=False)  # each moved into the region
            await c.release([f"e{i}"])  # now, not in the background: the next one needs room
        assert "h" not in store_of(server)
        decoder = ItemDecoder(Spec(header.items[0].item))
        assert c.region.read(header.items[0].shm, decoder)  # the hold kept it
        assert same(decoder.finish(), first)


async def test_without_the_mount_or_with_shm_off_everything_goes_over_grpc(
    tmp_path: Path,
) -> None:
    missing = shm_config(tmp_path / "no-such-dir")
    async with serving(missing) as server, client(server) as c:
        assert region_of(server) is None and c.region is None
        await c.get_and_update([image_item(1)], ["a"], lease=False)
        assert (await c.fetch(["a"]))[0] == image_item(1)
    async with (
        serving(shm=ShmConfig(enabled=False)) as server,
        client(server) as c,
    ):
        assert region_of(server) is None and c.region is None
    async with serving(shm_config(tmp_path)) as server:
        async with client(server, shm=False) as c:  # the client's switch
            assert c.region is None
            await c.get_and_update([{"x": torch.ones(1 << 20)}], ["b"], lease=False)
            assert (await c.fetch(["b"]))[0]["x"].sum() == 1 << 20
        assert await shm_bytes(server, "read") == 0 and await shm_bytes(server, "write") == 0


async def test_another_hosts_file_under_the_same_name_is_refused(tmp_path: Path) -> None:
    """The client maps a file at the announced path, but not the server's: it stays on gRPC."""
    async with serving(shm_config(tmp_path)) as server:
        assert region_of(server) is not None
        path = region_of(server).path
        impostor = forged_copy(path, tmp_path / "impostor")
        moved = path + ".real"
        os.rename(path, moved)
        os.rename(impostor, path)
        try:
            async with client(server) as c:
                assert c.region is None
                await c.get_and_update([{"x": torch.ones(1 << 20)}], ["c"], lease=False)
                assert (await c.fetch(["c"]))[0]["x"].sum() == 1 << 20
        finally:
            os.replace(moved, path)


async def test_forged_handles_and_tokens_are_invalid_argument(shm_server: MMCacheServer) -> None:
    region = region_of(shm_server)
    assert region is not None
    spec = encode_item({"x": torch.ones(1024)})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{shm_server.port}") as channel:
        update = channel.unary_unary("/mmcache.v1.MMCache/GetAndUpdateOne")
        allocate = channel.unary_unary(
            "/mmcache.v1.MMCache/ShmAllocate",
            request_serializer=pb.ShmAllocateRequest.SerializeToString,
            response_deserializer=pb.ShmAllocateReply.FromString,
        )

        async def upload(slot: pb.ShmSlot, token: bytes) -> grpc.aio.AioRpcError:
            entry = pb.UpdateEntry(mm_hash="f", item=spec.spec.message, shm=slot)
            request = pb.UpdateRequest(entries=[entry], shm_token=token)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await update(header_frame(request.SerializeToString()))
            return refused.value

        real = (
            await allocate(pb.ShmAllocateRequest(shm_token=region.token, lengths=[4096]))
        ).slots[0]
        forged = pb.ShmSlot(offset=real.offset, length=4096, lease=real.lease ^ 1)
        for slot, token, says in (
            (forged, region.token, "no live write slot"),
            (real, b"x" * 32, "not this server's region"),
            (pb.ShmSlot(offset=1 << 40, length=4096, lease=real.lease), region.token, "not 4096"),
        ):
            refusal = await upload(slot, token)
            assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in (refusal.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as bad_token:
            await allocate(pb.ShmAllocateRequest(shm_token=b"guess", lengths=[4096]))
        assert bad_token.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing was stored, and the server still takes the real slot.
        assert "f" not in store_of(shm_server)
        async with client(shm_server) as c:
            await c.get_and_update([{"x": torch.ones(1 << 20)}], ["ok"], lease=False)
            assert len(await c.fetch(["ok"])) == 1


async def test_a_server_restart_invalidates_handles_and_clients_remap(tmp_path: Path) -> None:
    first = MMCacheServer(shm_config(tmp_path))
    await first.start()
    port = first.port
    async with client(first) as c:
        await c.get_and_update([image_item(1)], ["a"], lease=False)
        await c.fetch(["a"])
        assert c.region is not None and c.region.instance_id == first.instance_id
        old_path = region_of(first).path if region_of(first) else ""
        await first.stop(grace=0)
        assert not exists(old_path)  # a stopped server leaves no region behind
        async with serving(shm_config(tmp_path, port=port)) as second:
            await c.get_and_update([image_item(2)], ["b"], lease=False)
            assert (await c.fetch(["b"]))[0] == image_item(2)  # over gRPC: the old token fails
            for _ in range(100):
                if c.region is not None and c.region.instance_id == second.instance_id:
                    break
                await asyncio.sleep(0.02)
            assert c.region is not None and c.region.instance_id == second.instance_id
            assert (await c.fetch(["b"]))[0] == image_item(2)
            assert await shm_bytes(second, "read") > 0  # remapped: shared memory again


async def test_a_stopped_servers_region_serves_no_more_reads(tmp_path: Path) -> None:
    first = MMCacheServer(shm_config(tmp_path))
    await first.start()
    port = first.port
    async with client(first, timeout=2.0) as c:
        item = {"x": tensor(torch.float32, 1 << 20, 11)}
        await c.get_and_update([item], ["old"], lease=False)
        assert same((await c.fetch(["old"]))[0], item)  # with no call
        await first.stop(grace=0)
        async with MMCacheServer(shm_config(tmp_path, port=port)):
            # The old mapping still holds the bytes, but its server is gone.
            with pytest.raises(CacheMissError):
                await c.fetch(["old"])


async def test_the_region_file_is_private_and_a_dead_servers_file_is_removed(
    tmp_path: Path,
) -> None:
    stale = tmp_path / "mmcache-1-dead.shm"
    stale.write_bytes(b"\0" * 8192)  # left by a server that crashed: nobody holds its lock
    os.mkfifo(wake_path(str(stale)))  # and its wake pipe (mmcache._wake)
    async with serving(shm_config(tmp_path)) as server:
        assert region_of(server) is not None
        mode = stat.S_IMODE(os.stat(region_of(server).path).st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(os.stat(wake_path(region_of(server).path)).st_mode) == 0o600
        assert not stale.exists() and not exists(wake_path(str(stale)))
        async with serving(shm_config(tmp_path)) as neighbour:
            # Two servers, one directory: each keeps its own file.
            assert region_of(neighbour) is not None
            assert exists(region_of(server).path)
    gid = os.getgid()
    async with serving(shm_config(tmp_path, shm_group=gid)) as grouped:
        assert region_of(grouped) is not None
        for path in (region_of(grouped).path, wake_path(region_of(grouped).path)):
            info = os.stat(path)
            assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == gid
    assert listing(tmp_path) == []


async def test_a_full_region_sends_over_grpc(tmp_path: Path) -> None:
    config = shm_config(tmp_path, shm_bytes=2 * MIB)
    async with serving(config) as server, client(server) as c:
        big = {"x": tensor(torch.float32, 1 << 20, 5)}  # 4 MiB: more than the region
        await c.get_and_update([big], ["big"], lease=False)
        assert same((await c.fetch(["big"]))[0], big)
        assert await shm_bytes(server, "read") == 0 and await shm_bytes(server, "write") == 0


def test_attach_refuses_a_path_it_cannot_open(tmp_path: Path) -> None:
    announced = RegionInfo(str(tmp_path / "gone.shm"), 8192, b"x")
    assert attach("i", announced) is None


def test_an_expired_write_slot_is_not_reused_for_one_more_lease(tmp_path: Path) -> None:
    """A writer stalled past its lease must not land in another client's slot."""
    from mmcache.server.cache._region import WRITE, open_region

    now = [0.0]
    region = open_region(str(tmp_path), 1 << 20, lease_s=1.0)
    region.clock = lambda: now[0]
    try:
        stalled = region.allocate(4096, WRITE)
        assert stalled is not None
        now[0] = 1.5
        assert region.expire() == 1
        other = region.allocate(4096, WRITE)
        assert other is not None and other.start != stalled.start  # quarantined
        now[0] = 2.6
        region.expire()
        again = [region.allocate(4096, WRITE) for _ in range(200)]
        assert stalled.start in {s.start for s in again if s is not None}  # back in use
    finally:
        region.close()


async def test_an_upload_whose_slots_expired_goes_over_grpc(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path, lease_s=0.2)) as server, client(server) as c:
        assert c.region is not None and region_of(server) is not None
        item = {"x": tensor(torch.float32, 1 << 20, 7)}  # 4 MiB: through a slot
        real_write = c.region.write

        def stall_then_write(slot: Slot, encoded: object) -> None:
            import time

            time.sleep(0.3)  # past the lease: the server expires the slot meanwhile
            region_of(server).expire()  # type: ignore[union-attr]
            real_write(slot, encoded)  # type: ignore[arg-type]

        c.region.write = stall_then_write  # type: ignore[method-assign]
        await c.get_and_update([item], ["late"], lease=False)
        c.region.write = real_write  # type: ignore[method-assign]
        assert same((await c.fetch(["late"]))[0], item)
        assert await shm_bytes(server, "write") == 0  # the bytes went as chunk frames


async def test_a_read_retried_over_grpc_releases_the_store_lease_once(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server, client(server) as c:
        item = image_item(4, numel=1 << 16)
        await c.get_and_update([item], ["twice"])  # one lease
        await c.get_and_update([item], ["twice"])  # and another
        assert store_of(server).leases == 2
        region = c.region
        assert region is not None
        real_read = region.read
        region.read = lambda slot, decoder: False  # type: ignore[method-assign]
        try:
            assert (await c.fetch(["twice"]))[0] == item  # via gRPC, after the race
        finally:
            region.read = real_read  # type: ignore[method-assign]
        assert store_of(server).leases == 1  # one request's read: one lease given back


async def test_a_lease_holds_until_its_item_is_copied_out(tmp_path: Path) -> None:
    """ReadShm gives no lease back: an item moved out from under the copy is read
    again over gRPC, and its lease must still keep it."""
    async with serving(shm_config(tmp_path)) as server, client(server) as c:
        item = image_item(12, numel=1 << 16)
        await c.get_and_update([item], ["kept"])  # one lease; over gRPC, so not yet resident
        region = c.region
        assert region is not None

        def cleared_under_the_copy(slot: Slot, decoder: ItemDecoder) -> bool:
            store_of(server).clear()  # everything not leased goes
            return False

        region.read = cleared_under_the_copy  # type: ignore[method-assign]
        assert (await c.fetch(["kept"]))[0] == item  # over gRPC: still leased, still there
        assert store_of(server).leases == 0


async def test_call_free_reads_give_their_leases_back_once(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server, client(server) as c:
        item = {"x": tensor(torch.float32, 1 << 20, 5)}
        for _ in range(3):
            await c.get_and_update([item], ["thrice"])  # three requests' leases
        assert store_of(server).leases == 3
        await c.fetch(["thrice"])
        await c.fetch(["thrice"], release=False)
        await eventually(lambda: store_of(server).leases == 2)
        await c.fetch(["thrice", "thrice"])
        await eventually(lambda: store_of(server).leases == 0)


def test_attach_refuses_odd_announcements_without_raising(tmp_path: Path) -> None:
    empty = tmp_path / "empty.shm"
    empty.write_bytes(b"")
    for size in (0, 10, 8192):
        announced = RegionInfo(str(empty), size, b"x")
        assert attach("i", announced) is None
    assert attach("i", pb.ShmRegion(path=str(tmp_path), size_bytes=8192)) is None  # a directory


async def test_a_view_reads_in_place_and_gives_its_slots_back(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path)) as server, client(server) as c:
        assert region_of(server) is not None and c.region is not None
        mapping = {"x": tensor(torch.float32, 1 << 18, 8), "y": tensor(torch.int8, 5, 9), "n": 2}
        await c.get_and_update([mapping, image_item(6)], ["v", "w"], lease=False)
        async with c.view(["v", "w"]) as items:
            assert same(items[0], mapping) and items[1] == image_item(6)
            assert len(region_of(server)._holds) == 2
            # No copy: the tensor's bytes are the slot's, in the region.
            slot_view = c.region._view
            base = torch.frombuffer(slot_view, dtype=torch.uint8).data_ptr()
            assert base <= items[0]["x"].data_ptr() < base + len(slot_view)
            on_device = items[0]["x"].clone()
        assert torch.equal(on_device, mapping["x"])
        region = region_of(server)
        await eventually(lambda: not region._holds)  # given back just after the block


async def test_a_view_that_outlives_its_lease_says_so(tmp_path: Path) -> None:
    async with serving(shm_config(tmp_path, lease_s=0.2)) as server, client(server) as c:
        await c.get_and_update([image_item(7)], ["slow"], lease=False)

        async def hold_too_long() -> None:
            async with c.view(["slow"]):
                await asyncio.sleep(0.3)
                assert region_of(server) is not None
                region_of(server).expire()  # the hold ends, and then the item goes
                store_of(server).clear()

        with pytest.raises(FailedPreconditionError, match="outlived its lease"):
            await hold_too_long()


async def test_without_shared_memory_a_view_is_a_fetch(tmp_path: Path) -> None:
    async with serving() as server, client(server) as c:
        await c.get_and_update([image_item(8)], ["g"], lease=False)
        async with c.view(["g"]) as items:
            assert items == [image_item(8)]


ROOT = str(Path(__file__).resolve().parent.parent)
KILLED_READER = """
import asyncio, sys
from mmcache.client import MMCacheClient

async def main() -> None:
    async with MMCacheClient(sys.argv[1], follow=False) as client:
        assert client.region is not None
        # a hold taken, never said done
        await client.transport.read_shm(["held"], False, client.region.token, [])
        print("read", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_reader_killed_mid_read_gives_its_holds_back_by_expiry(tmp_path: Path) -> None:
    # Leases long enough to outlive the reader's start on a slow machine.
    async with serving(shm_config(tmp_path, lease_s=3)) as server, client(server) as c:
        assert region_of(server) is not None
        await c.get_and_update([image_item(9)], ["held"], lease=False)
        reader = await asyncio.create_subprocess_exec(
            sys.executable, "-c", KILLED_READER, f"127.0.0.1:{server.port}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert reader.stdout is not None
        assert (await asyncio.wait_for(reader.stdout.readline(), 30)).strip() == b"read"
        assert region_of(server).slots == 1
        reader.kill()
        await reader.wait()
        region = region_of(server)
        await eventually(lambda: region.slots == 0, timeout=15)  # the server's own sweep
        assert region.expired == 1
        assert (await c.fetch(["held"]))[0] == image_item(9)


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


async def test_the_capacity_bound_holds_with_shared_memory_on(tmp_path: Path) -> None:
    """A server process under churn through its region: peak RSS plus the region
    within the sizing rule (docs/deploy.md)."""
    capacity, inflight, region = 64, 32, 32  # MiB
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench._cache_server", "--capacity-mib", str(capacity),
        "--inflight-mib", str(inflight), "--shm-mib", str(region), "--shm-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(await asyncio.wait_for(server.stdout.readline(), 30))
        async with MMCacheClient(f"127.0.0.1:{port}", follow=False) as c:
            assert c.region is not None
            for i in range(6 * capacity // 4):  # 4 MiB items, 6x the capacity: all through slots
                await c.get_and_update(
                    [{"x": tensor(torch.float32, 1 << 20, i)}], [f"c{i}"], lease=False
                )
                await c.fetch([f"c{i}"])
            peak = status_kib(server.pid, "VmHWM") * 1024 + region * MIB
        rule = int(1.25 * capacity * MIB) + inflight * MIB + region * MIB + 256 * MIB
        assert peak <= rule, (peak // MIB, rule // MIB)
    finally:
        server.terminate()
        await server.wait()
