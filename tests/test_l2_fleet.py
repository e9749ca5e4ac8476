"""The L2 tier's fleet protocol between real sidecars (gRPC, their own
stores) on an L2 in this process's memory (`memory://`, the backend that
tests/test_l2_contract.py holds to Redis's semantics): a cold image processed
once (by two sidecars, and by four at once), admission on a second sighting,
single flight and its waits, claims that end, holders asked, a stopped
sidecar's claims taken over, records no sidecar wrote. What needs a real
Redis Cluster (masters that die or hang, eviction there, its wire) is
tests/test_l2.py, tests/test_l2_heal.py and tests/test_resp_reads.py."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import TypeAlias

import pytest

from mmcache.client import MMCacheClient
from mmcache.server import EventsConfig, MMCacheServer
from mmcache.server.cache._l2 import L2Record
from mmcache.server.cache._l2_memory import shared_memory_l2

from .conftest import MIB, connected, eventually
from .items import image_item
from .l2_sidecars import sidecars, value

Fleet: TypeAlias = SimpleNamespace


@pytest.fixture
def fleet() -> Fleet:
    """An L2 of its own for the test's sidecars."""
    return SimpleNamespace(url=f"memory://fleet-{uuid.uuid4().hex[:8]}")


async def test_an_item_one_sidecar_stored_is_held_by_another(fleet: Fleet) -> None:
    async with sidecars(fleet, 2, admit="first") as [(a, ca), (b, cb)]:
        item = image_item(1, numel=300_000)  # 1.2 MB: more than one chunk
        await ca.get_and_update([item], ["h1"])
        await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 1)

        # B's mirror knows nothing of h1, and B says a hash it lacks may be held
        # by the tier: a frontend that wants every hit asks B anyway.
        assert cb.is_cached(["h1"]) == [False] and cb.shared_tier
        found = await cb.lookup(["h1"], modality="image")
        assert found.held == [True]  # read from L2 into B's cache before the answer
        assert "h1" in b.cache  # held in L1, as promised
        assert value(b, "mmcache_l2_hits_total") == 1
        assert value(b, "mmcache_hits_total", modality="image") == 1
        (fetched,) = await cb.fetch(["h1"])
        assert fetched == item


async def test_one_sighting_is_not_written_and_a_second_one_is(fleet: Fleet) -> None:
    async with sidecars(fleet, 2) as [(a, ca), (_, cb)]:
        await ca.get_and_update([image_item(2)], ["once"])
        await asyncio.sleep(0.3)  # several write-behind rounds
        assert value(a, "mmcache_l2_writes_total", result="written") == 0
        assert (await cb.lookup(["unrelated"])).held == [False]

        await ca.lookup(["once"])  # a second sighting, at A
        await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 1)
        assert (await cb.lookup(["once"])).held == [True]


async def test_two_sidecars_asking_for_a_cold_image_process_it_once(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 2, wait_s=5.0) as [(a, ca), (b, cb)]:
        first = await ca.lookup(["cold"])
        assert first.held == [False]  # A's frontend processes it
        # B asks while A's frontend is still processing: B waits for it.
        waiting = asyncio.create_task(cb.lookup(["cold"]))
        await eventually(lambda: value(b, "mmcache_l2_latency_seconds_count", op="check") > 0)
        assert not waiting.done()
        item = image_item(3)
        await ca.get_and_update([item], ["cold"], resend=[True])
        second = await waiting
        assert second.held == [True]
        assert value(b, "mmcache_l2_flight_waits_total", result="arrived") == 1
        assert value(a, "mmcache_l2_writes_total", result="written") == 1
        (fetched,) = await cb.fetch(["cold"])
        assert fetched == item


async def test_a_wait_for_another_sidecar_ends_in_time_and_the_call_succeeds(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 2, wait_s=0.3) as [(_, ca), (b, cb)]:
        assert (await ca.lookup(["stalled"])).held == [False]  # A never uploads it
        started = asyncio.get_running_loop().time()
        assert (await cb.lookup(["stalled"])).held == [False]
        assert asyncio.get_running_loop().time() - started < 2.0
        assert value(b, "mmcache_l2_flight_waits_total", result="timeout") == 1


async def test_an_engine_read_goes_through_to_l2(fleet: Fleet) -> None:
    async with sidecars(fleet, 2, admit="first") as [(a, ca), (_, cb)]:
        item = image_item(4)
        await ca.get_and_update([item], ["engine"])
        await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 1)
        (fetched,) = await cb.fetch(["engine"])  # B's engine, no lookup first
        assert fetched == item


async def test_namespaces_stay_apart_in_l2(fleet: Fleet) -> None:
    async with sidecars(fleet, 2, admit="first") as [(a, _), (b, _)]:
        async with (
            connected(a, namespace="red") as red,
            connected(b, namespace="blue") as blue,
            connected(b, namespace="red") as red_b,
        ):
            await red.get_and_update([image_item(5)], ["shared-name"])
            await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 1)
            assert (await blue.lookup(["shared-name"])).held == [False]
            assert (await red_b.lookup(["shared-name"])).held == [True]


async def test_locate_tells_l1_from_l2_and_l2_writes_are_published(fleet: Fleet) -> None:
    import msgspec
    import zmq
    import zmq.asyncio

    events = EventsConfig("tcp://127.0.0.1:*")
    async with sidecars(fleet, 2, admit="first", events=events) as [(a, ca), (b, cb)]:
        assert a.events is not None
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(a.events.endpoints[0])
        await asyncio.sleep(0.2)
        try:
            await ca.get_and_update([image_item(8)], ["where"])
            await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 1)
            tiers = []
            while "l2" not in tiers:
                _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
                tiers += [e[3] for e in msgspec.msgpack.decode(payload)[1] if e[0] == "ItemStored"]
            assert tiers == ["l1", "l2"]
        finally:
            sub.close(linger=0)
            context.term()
        here, nowhere = await cb.locate(["where", "nowhere"], check_l2=True)
        assert here.tier == "l2" and nowhere.tier is None
        assert (await cb.locate(["where"]))[0].tier is None  # L2 not asked
        assert (await ca.locate(["where"], check_l2=True))[0].tier == "l1"
        assert "where" not in b.cache  # locating reads nothing in


async def test_a_sidecar_waits_for_its_own_frontend_but_not_for_what_it_evicted(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 1, wait_s=3.0, capacity_bytes=2 * MIB) as [(a, ca)]:
        async with connected(a) as other_frontend:
            assert (await ca.lookup(["mine"])).held == [False]  # claimed: ca processes it
            # A second request for it on the same node waits for that upload.
            waiting = asyncio.create_task(other_frontend.lookup(["mine"]))
            # Its claim was asked (MINE), so it waits (not an upload that came first).
            await eventually(lambda: value(a, "mmcache_l2_latency_seconds_count", op="claim") >= 2)
            await asyncio.sleep(0.05)
            assert not waiting.done()
            await ca.get_and_update([image_item(9)], ["mine"], resend=[True], lease=False)
            assert (await waiting).held == [True]
            assert value(a, "mmcache_l2_flight_waits_total", result="arrived") == 1
            await other_frontend.release(["mine"])
        # Seen once (so not in L2), evicted here, asked for again: no wait.
        assert (await ca.lookup(["once"])).held == [False]
        await ca.get_and_update([image_item(10)], ["once"], resend=[True], lease=False)
        for i in range(3):
            await ca.get_and_update([image_item(i, numel=200_000)], [f"big{i}"], lease=False)
        assert "once" not in a.cache
        started = asyncio.get_running_loop().time()
        assert (await ca.lookup(["once"])).held == [False]
        assert asyncio.get_running_loop().time() - started < 1.0
        assert value(a, "mmcache_l2_flight_waits_total", result="timeout") == 0


async def test_a_claim_ends_when_its_sidecar_evicts_the_item_unwritten(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 2, wait_s=3.0, capacity_bytes=2 * MIB) as [(a, ca), (b, cb)]:
        assert (await ca.lookup(["brief"])).held == [False]  # A claims it
        await ca.get_and_update([image_item(11)], ["brief"], resend=[True], lease=False)
        for i in range(3):  # A evicts it, seen once: never written to L2
            await ca.get_and_update([image_item(i, numel=200_000)], [f"big{i}"], lease=False)
        assert "brief" not in a.cache
        await eventually(lambda: value(a, "mmcache_l2_latency_seconds_count", op="claim") >= 2)
        started = asyncio.get_running_loop().time()
        assert (await cb.lookup(["brief"])).held == [False]  # B claims it, no wait
        assert asyncio.get_running_loop().time() - started < 1.0
        assert value(b, "mmcache_l2_flight_waits_total", result="timeout") == 0


async def test_an_image_asked_for_elsewhere_long_after_its_window_is_shared(
    fleet: Fleet,
) -> None:
    """Seen once on A, asked for on B well past the claim's window: B asks A
    (its holder) for it, A writes it, and B answers held: processed once."""
    async with sidecars(fleet, 2, window_s=0.2, wait_s=3.0) as [(a, ca), (b, cb)]:
        assert (await ca.lookup(["chat"])).held == [False]  # A claims and processes it
        await ca.get_and_update([image_item(21)], ["chat"], resend=[True], lease=False)
        await asyncio.sleep(1.0)  # the user thinks; the window ends
        assert value(a, "mmcache_l2_writes_total", result="written") == 0  # seen once
        assert (await cb.lookup(["chat"], lease=False)).held == [True]
        assert (await cb.fetch(["chat"], release=False)) == [image_item(21)]
        assert value(a, "mmcache_l2_writes_total", result="written") == 1
        assert value(b, "mmcache_l2_flight_waits_total", result="arrived") == 1


async def test_a_frontend_waits_for_another_node_no_longer_than_it_says(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 2, wait_s=3.0) as [(_, ca), (b, cb)]:
        assert (await ca.lookup(["cold"])).held == [False]  # A claims it, processes slowly
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await cb.lookup(["cold"], wait_s=0.1)).held == [False]
        assert loop.time() - started < 1.5  # its 0.1 s, not the sidecar's 3 s
        assert value(b, "mmcache_l2_flight_waits_total", result="timeout") == 1


async def test_the_claims_of_a_stopped_sidecar_pass_to_the_next_that_asks(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 1, wait_s=3.0) as [(b, cb)]:
        async with sidecars(fleet, 1) as [(a, ca)]:
            assert (await ca.lookup(["left"])).held == [False]
            await ca.get_and_update([image_item(22)], ["left"], resend=[True], lease=False)
            await eventually(lambda: value(a, "mmcache_l2_latency_seconds_count", op="claim") >= 2)
        started = asyncio.get_running_loop().time()
        assert (await cb.lookup(["left"])).held == [False]  # B takes it over: no wait
        assert asyncio.get_running_loop().time() - started < 1.0
        assert value(b, "mmcache_l2_flight_waits_total", result="timeout") == 0
        await cb.get_and_update([image_item(22)], ["left"], resend=[True], lease=False)


async def test_room_for_an_item_from_l2_is_never_taken_from_the_same_batch(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 2, admit="first", capacity_bytes=2 * MIB) as [(a, ca), (b, cb)]:
        big = 120_000  # 480 KB each: four fill B's 2 MiB
        await ca.get_and_update([image_item(20, numel=big)], ["from-l2"], lease=False)
        await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") >= 1)
        # B: "named" is its least recent item, then three more fill it.
        for h, seed in (("named", 21), ("x1", 22), ("x2", 23), ("x3", 26)):
            await cb.get_and_update([image_item(seed, numel=big)], [h], lease=False)
        found = await cb.lookup(["named", "from-l2"], lease=False)
        assert found.held == [True, True]  # room came from x1, not from "named"
        assert "named" in b.cache and "from-l2" in b.cache


async def test_data_it_could_not_keep_ends_its_claim(fleet: Fleet) -> None:
    async with sidecars(fleet, 2, wait_s=3.0, capacity_bytes=1 * MIB) as [(_, ca), (b, cb)]:
        assert (await ca.lookup(["huge"])).held == [False]  # A claims it
        sent = await ca.get_and_update(
            [image_item(24, numel=400_000)], ["huge"], resend=[True], lease=False
        )
        assert sent.held == [False]  # larger than A's cache: never stored
        await asyncio.sleep(0.2)  # the claim ends in the background
        started = asyncio.get_running_loop().time()
        assert (await cb.lookup(["huge"])).held == [False]
        assert asyncio.get_running_loop().time() - started < 1.0
        assert value(b, "mmcache_l2_flight_waits_total", result="timeout") == 0


async def test_an_item_uploaded_without_asking_is_claimed_and_shared(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, 2, wait_s=3.0) as [(a, ca), (b, cb)]:
        await ca.get_and_update([image_item(25)], ["direct"], lease=False)  # no lookup first
        await eventually(lambda: value(a, "mmcache_l2_latency_seconds_count", op="claim") >= 1)
        found = await cb.lookup(["direct"], lease=False)  # waits for A's write
        assert found.held == [True]
        assert value(b, "mmcache_l2_flight_waits_total", result="arrived") == 1


async def test_hundreds_of_items_in_one_lookup_all_come_from_l2(fleet: Fleet) -> None:
    hashes = [f"many-{{{i}}}" for i in range(400)]  # braces too: no effect on the slot
    async with sidecars(fleet, 2, admit="first") as [(a, ca), (b, cb)]:
        for start in range(0, 400, 100):
            chunk = hashes[start : start + 100]
            await ca.get_and_update([image_item(i) for i in range(len(chunk))], chunk, lease=False)
        await eventually(
            lambda: value(a, "mmcache_l2_writes_total", result="written") == 400, timeout=30
        )
        found = await cb.lookup(hashes, lease=False)
        assert all(found.held)
        assert value(b, "mmcache_l2_errors_total", op="read") == 0


async def test_a_record_no_sidecar_wrote_is_a_miss(fleet: Fleet) -> None:
    async with sidecars(fleet, 1) as [(a, ca)]:
        forged = L2Record(b"not a manifest", (b"junk",))
        await shared_memory_l2(fleet.url).write("forged", forged, ttl_s=0)
        assert (await ca.lookup(["forged"])).held == [False]
        assert value(a, "mmcache_l2_errors_total", op="read") >= 1
        assert "forged" not in a.cache


# -- four nodes at once --

NODES = 4


def total(servers: list[MMCacheServer], name: str, **labels: str) -> float:
    return sum(value(server, name, **labels) for server in servers)


async def frontend(port: int, mm_hash: str, seed: int) -> int:
    """A frontend's request with one image: 1 when it had to run the processor."""
    async with MMCacheClient(f"127.0.0.1:{port}") as client:
        found = await client.lookup([mm_hash], modality="image")
        if found.held[0]:
            (got,) = await client.fetch([mm_hash])  # its engine's read
            assert got == image_item(seed)
            return 0
        await asyncio.sleep(0.05)  # the processor
        await client.get_and_update([image_item(seed)], [mm_hash], resend=[True])
        (got,) = await client.fetch([mm_hash])
        assert got == image_item(seed)
        return 1


async def test_a_cold_image_asked_for_by_four_nodes_at_once_is_processed_once(
    fleet: Fleet,
) -> None:
    async with sidecars(fleet, NODES, wait_s=3.0) as pairs:
        servers = [server for server, _ in pairs]
        runs = await asyncio.gather(*(frontend(s.port, "cold-everywhere", 1) for s in servers))
        assert sum(runs) == 1
        assert total(servers, "mmcache_l2_hits_total") == NODES - 1
        # Those that asked before it reached L2 waited for it; a later one read it.
        arrived = total(servers, "mmcache_l2_flight_waits_total", result="arrived")
        assert 1 <= arrived <= NODES - 1
        assert total(servers, "mmcache_l2_flight_waits_total", result="timeout") == 0


async def test_an_image_seen_twice_on_one_node_is_read_by_the_others(fleet: Fleet) -> None:
    async with sidecars(fleet, NODES, wait_s=3.0) as pairs:
        servers = [server for server, _ in pairs]
        first, *others = [server.port for server in servers]
        assert await frontend(first, "multi-turn", 2) == 1  # turn 1: processed
        assert await frontend(first, "multi-turn", 2) == 0  # turn 2: a hit, and admitted to L2
        await eventually(lambda: total(servers, "mmcache_l2_writes_total", result="written") >= 1)
        runs = await asyncio.gather(*(frontend(port, "multi-turn", 2) for port in others))
        assert sum(runs) == 0
