"""One contract for every L2 backend: what the tier relies on of a shared
store, run on the in-memory backend (server/cache/_l2_memory.py, Python)
always and on Redis Cluster (server/cache/_l2_redis.py, Lua) where
redis-server is installed. The two are written twice; these cases hold them
to the same semantics: records whole or absent, replaced whole, TTLs; claims
(first, mine, others, counted askers), their windows, holds, take-overs and
ends; heartbeats and want lists.

Each case gets a fresh key space (its own prefix on Redis), so the cases are
independent of order and of each other."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from mmcache.server.cache._l2 import L2Backend, L2Record, Poll, Sighting, Want
from mmcache.server.cache._l2_memory import MemoryL2
from mmcache.server.cache._l2_redis import RedisClusterL2

from .redis_cluster import RedisCluster, redis_available, redis_cluster

MIB = 1 << 20
BACKENDS = ["memory", "redis"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster | None]:
    if not redis_available():
        yield None
        return
    with redis_cluster() as running:
        yield running


@pytest.fixture(params=BACKENDS)
async def l2(
    request: pytest.FixtureRequest, cluster: RedisCluster | None
) -> AsyncIterator[L2Backend]:
    if request.param == "memory":
        backend: L2Backend = MemoryL2()
    else:
        if cluster is None:
            pytest.skip("redis-server is missing: scripts/install-system-deps.sh")
        backend = RedisClusterL2(cluster.url, prefix=f"c{uuid.uuid4().hex[:8]}:", timeout_s=2.0)
    try:
        yield backend
    finally:
        await backend.close()


def record(*chunks: bytes, manifest: bytes = b"manifest") -> L2Record:
    return L2Record(manifest, chunks)


# -- records --


async def test_an_absent_record_reads_as_none_and_is_not_held(l2: L2Backend) -> None:
    assert await l2.read("absent") is None
    assert not await l2.holds("absent")
    assert await l2.poll("absent") == Poll.GONE


async def test_a_record_reads_back_whole_big_and_empty_chunks_alike(l2: L2Backend) -> None:
    written = record(os.urandom(3 * MIB + 5), b"", os.urandom(77))
    await l2.write("k", written, ttl_s=0)
    assert await l2.read("k") == written
    assert await l2.holds("k")
    assert await l2.poll("k") == Poll.HELD


async def test_a_write_replaces_the_record_whole(l2: L2Backend) -> None:
    await l2.write("k", record(b"a", b"b", b"c", manifest=b"one"), ttl_s=0)
    await l2.write("k", record(b"z", manifest=b"two"), ttl_s=0)
    assert await l2.read("k") == record(b"z", manifest=b"two")  # no chunk of the first left


async def test_a_record_with_a_ttl_is_gone_after_it(l2: L2Backend) -> None:
    await l2.write("k", record(b"x"), ttl_s=0.2)
    assert await l2.holds("k")
    await asyncio.sleep(0.35)
    assert await l2.read("k") is None and not await l2.holds("k")


async def test_keys_with_braces_and_nul_stay_apart(l2: L2Backend) -> None:
    """Namespaced store keys hold a NUL; clients' hashes may hold braces."""
    keys = ["ns\0h", "ns\0{h}", "{h}", "h"]
    for n, key in enumerate(keys):
        await l2.write(key, record(bytes([n])), ttl_s=0)
    assert [await l2.read(key) for key in keys] == [record(bytes([n])) for n in range(4)]


# -- claims --


async def test_the_first_to_ask_claims_the_claimer_sees_mine_others_see_the_claimer(
    l2: L2Backend,
) -> None:
    assert await l2.sight("k", 5.0, "a") == (Sighting.FIRST, "a")
    assert await l2.sight("k", 5.0, "a") == (Sighting.MINE, "a")
    assert await l2.sight("k", 5.0, "b") == (Sighting.OTHERS, "a")
    assert await l2.poll("k") == Poll.CLAIMED


async def test_a_claim_ends_with_its_window(l2: L2Backend) -> None:
    assert (await l2.sight("k", 0.2, "a"))[0] == Sighting.FIRST
    await asyncio.sleep(0.35)
    assert await l2.poll("k") == Poll.GONE
    assert await l2.sight("k", 5.0, "b") == (Sighting.FIRST, "b")


async def test_a_hold_counts_the_others_that_asked(l2: L2Backend) -> None:
    await l2.sight("k", 5.0, "a")
    await l2.sight("k", 5.0, "b")
    await l2.sight("k", 5.0, "c")
    assert await l2.hold("k", "a", 60.0) == (Sighting.MINE, 2)


async def test_a_hold_with_no_claim_claims_and_another_nodes_hold_is_an_ask(
    l2: L2Backend,
) -> None:
    assert await l2.hold("k", "a", 60.0) == (Sighting.FIRST, 0)
    assert await l2.hold("k", "b", 60.0) == (Sighting.OTHERS, 1)
    assert await l2.hold("k", "a", 60.0) == (Sighting.MINE, 1)


async def test_a_hold_extends_the_claim_past_its_window(l2: L2Backend) -> None:
    await l2.sight("k", 0.2, "a")
    await l2.hold("k", "a", 60.0)
    await asyncio.sleep(0.35)
    assert await l2.sight("k", 5.0, "b") == (Sighting.OTHERS, "a")


async def test_an_unclaim_ends_the_owners_claim_only(l2: L2Backend) -> None:
    await l2.sight("k", 5.0, "a")
    await l2.unclaim("k", "b")  # not b's: nothing changes
    assert await l2.sight("k", 5.0, "b") == (Sighting.OTHERS, "a")
    await l2.unclaim("k", "a")
    assert await l2.poll("k") == Poll.GONE
    assert await l2.sight("k", 5.0, "b") == (Sighting.FIRST, "b")


async def test_a_dead_nodes_claim_is_taken_over_once(l2: L2Backend) -> None:
    await l2.sight("k", 5.0, "dead")
    assert await l2.take_over("k", "dead", "b", 5.0)
    assert await l2.sight("k", 5.0, "b") == (Sighting.MINE, "b")
    assert not await l2.take_over("k", "dead", "c", 5.0)  # b's now
    assert not await l2.take_over("absent", "dead", "c", 5.0)


async def test_a_claim_and_a_record_live_side_by_side(l2: L2Backend) -> None:
    await l2.sight("k", 5.0, "a")
    await l2.write("k", record(b"x"), ttl_s=0)
    assert await l2.poll("k") == Poll.HELD
    assert await l2.sight("k", 5.0, "b") == (Sighting.OTHERS, "a")  # the claim stays
    assert await l2.read("k") == record(b"x")


# -- nodes: heartbeats and want lists --


async def test_wants_reach_a_live_owner_in_order_and_once(l2: L2Backend) -> None:
    assert await l2.beat("a", 5.0, 10) == []
    for key in ("k1", "k2", "k3"):
        assert await l2.want("a", key) == Want.ASKED
    assert await l2.beat("a", 5.0, 2) == ["k1", "k2"]
    assert await l2.beat("a", 5.0, 2) == ["k3"]
    assert await l2.beat("a", 5.0, 2) == []


async def test_a_node_that_never_beat_or_left_is_gone(l2: L2Backend) -> None:
    assert await l2.want("never", "k") == Want.OWNER_GONE
    await l2.beat("a", 5.0, 10)
    await l2.want("a", "k")
    await l2.leave("a")
    assert await l2.want("a", "k2") == Want.OWNER_GONE
    assert await l2.beat("a", 5.0, 10) == []  # its wants went with it


async def test_a_node_silent_past_its_heartbeat_is_gone(l2: L2Backend) -> None:
    await l2.beat("a", 0.2, 10)
    assert await l2.want("a", "k") == Want.ASKED
    await asyncio.sleep(0.35)
    assert await l2.want("a", "k2") == Want.OWNER_GONE


async def test_nodes_keep_wants_of_their_own(l2: L2Backend) -> None:
    await l2.beat("a", 5.0, 10)
    await l2.beat("b", 5.0, 10)
    await l2.want("a", "for-a")
    await l2.want("b", "for-b")
    assert await l2.beat("b", 5.0, 10) == ["for-b"]
    assert await l2.beat("a", 5.0, 10) == ["for-a"]
