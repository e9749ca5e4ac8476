"""Every item a get_and_update answers held is readable by any other client
until later traffic evicts it, uploads through shared memory included
(docs/shm.md). Real servers, region files and clients."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache.client import MMCacheClient
from mmcache.client._batch import Lease
from mmcache.server import MMCacheServer, ServerConfig, ShmConfig

from .conftest import MIB, eventually, server_config, serving, store_of
from .test_shm import same

KEYS = 6  # few, so that batches hit, repeat and evict one another
SIZES = st.sampled_from([300_000, 1 << 20, 1_700_000, 3_400_000, 4 << 20, 7 << 20])
LEASES: list[Lease] = [False, "hits", True]
STEPS = st.lists(
    st.tuples(
        st.booleans(),  # co-located (through the region), or over gRPC (to the heap)
        st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=3, unique=True),
        st.sampled_from(LEASES),
    ),
    min_size=1,
    max_size=8,
)


def item(key: int, size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(key)
    return {"x": torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8)}


def client(server: MMCacheServer, *, follow: bool = False, **kwargs: object) -> MMCacheClient:
    return MMCacheClient(f"127.0.0.1:{server.port}", follow=follow, **kwargs)  # type: ignore[arg-type]


async def check_held(
    reader: MMCacheClient,
    batch: dict[str, dict[str, torch.Tensor]],
    held: list[bool],
) -> None:
    """Right after an upload, before other traffic: every item answered held
    is readable by another client."""
    readable = [h for h, kept in zip(batch, held, strict=True) if kept]
    where = await reader.locate(readable)
    assert [w.tier for w in where] == ["l1"] * len(readable), (readable, where)
    for mm_hash in readable:
        assert same((await reader.fetch([mm_hash], release=False))[0], batch[mm_hash])


@pytest.mark.parametrize("lease", [False, "hits"])
@pytest.mark.parametrize("size", [3_400_000, 4 << 20])
async def test_an_upload_held_through_a_small_region_in_a_full_cache_is_readable(
    tmp_path: Path, lease: Lease, size: int
) -> None:
    # The reported case: the reply's spares made their room by evicting the
    # item itself (unleased, the cache full), though the reply said held.
    config = server_config(32 * MIB, shm=ShmConfig(dir=str(tmp_path), bytes=16 * MIB))
    async with (
        serving(config) as server,
        client(server) as local,
        client(server, shm=False) as remote,
        client(server) as reader,
    ):
        for i in range(18):  # the cache full, in the heap
            await remote.get_and_update([item(100 + i, 1_700_000)], [f"f{i}"], lease=False)
        for i in range(3):  # three items in the region
            await local.get_and_update([item(i, 1_700_000)], [f"r{i}"], lease=False)
        big = item(50, size)
        result = await local.get_and_update([big], ["big"], lease=lease)
        assert result.held == [True] and local.is_cached(["big"]) == [True]
        stored = store_of(server).peek("big")
        assert stored is not None and stored.resident is not None  # written into a slot
        assert [w.tier for w in await reader.locate(["big"])] == ["l1"]
        assert same((await reader.fetch(["big"]))[0], big)


@pytest.mark.parametrize("lease", [False, "hits"])
async def test_a_re_send_within_the_call_answers_held_only_what_it_left_held(lease: Lease) -> None:
    big, small, mine = item(1, 7 * MIB), item(2, 1_700_000), item(3, 1_700_000)
    async with (
        serving(capacity_bytes=8 * MIB) as server,
        client(server) as a,
        client(server) as b,
        client(server) as reader,
    ):
        await b.get_and_update([big], ["big"], lease=False)
        await a.get_and_update([small], ["small"], lease=False)  # evicts big
        assert b.is_cached(["big"]) == [True] and "big" not in store_of(server)  # b cannot know
        # "big" is sent alone, MISSING, then re-sent: a later batch, whose room
        # evicts "mine", stored by the first.
        result = await b.get_and_update([big, mine], ["big", "mine"], lease=lease)
        assert result.held == [True, False] and result[1] is mine
        assert b.is_cached(["big", "mine"]) == [True, False] and "mine" not in store_of(server)
        await check_held(reader, {"big": big, "mine": mine}, result.held)


@settings(max_examples=25, deadline=None, database=None)
@given(
    region_mb=st.sampled_from([2, 8, 16, 24]),
    capacity_mb=st.sampled_from([8, 16, 32]),
    sizes=st.lists(SIZES, min_size=KEYS, max_size=KEYS),
    steps=STEPS,
    follow=st.booleans(),
)
def test_every_item_answered_held_is_readable_right_after_its_upload(
    region_mb: int,
    capacity_mb: int,
    sizes: list[int],
    steps: list[tuple[bool, list[int], Lease]],
    follow: bool,
) -> None:
    items = {f"k{key}": item(key, size) for key, size in enumerate(sizes)}
    with tempfile.TemporaryDirectory() as directory:
        config = server_config(
            capacity_mb * MIB, shm=ShmConfig(dir=directory, bytes=region_mb * MIB)
        )
        asyncio.run(uploads(config, items, steps, follow=follow))


async def uploads(
    config: ServerConfig,
    items: dict[str, dict[str, torch.Tensor]],
    steps: list[tuple[bool, list[int], Lease]],
    *,
    follow: bool,
) -> None:
    """Each step's batch uploaded, with its lease mode, by a co-located client
    (through the region) or a remote one (to the heap), and checked at once.
    Without the feed, mirrors drift (each misses the other's evictions, and
    the region's), and calls re-send what they wrongly thought held."""
    keys = list(items)
    async with (
        serving(config) as server,
        client(server, follow=follow) as local,
        client(server, follow=follow, shm=False) as remote,
        client(server, shm=False) as reader,
    ):
        if follow:
            await local.wait_following()
            await remote.wait_following()
        for colocated, indices, lease in steps:
            uploader = local if colocated else remote
            batch = {keys[i]: items[keys[i]] for i in indices}
            result = await uploader.get_and_update(list(batch.values()), list(batch), lease=lease)
            await check_held(reader, batch, result.held)
            if not follow:
                continue
            # The feed brings both mirrors to the server's key set: no mirror
            # says cached what the server dropped.
            await eventually(
                lambda: (
                    local.is_cached(keys)
                    == remote.is_cached(keys)
                    == [key in store_of(server) for key in keys]
                )
            )
