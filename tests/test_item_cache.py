"""The data plane alone: `ItemCache` and the L2 tier driven directly, with no
gRPC and no Redis (the tier on `MemoryL2`, the product's in-memory backend).
Metrics are read from each cache's registry."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import xxhash
from prometheus_client import CollectorRegistry

from mmcache._errors import CacheMissError, InvalidArgumentError
from mmcache._frames import MAX_CHUNK_BYTES
from mmcache._lru import Outcome
from mmcache.client._codec import encode_item, iter_chunk_frames
from mmcache.server import cache as server_cache
from mmcache.server._namespaces import Namespaces
from mmcache.server._records import WIRE_MANIFESTS
from mmcache.server._reports import parse_report
from mmcache.server._upload import parse_header
from mmcache.server.cache import (
    BatchResult,
    CacheConfig,
    Change,
    Deadline,
    EntryHeader,
    ItemCache,
    L2Settings,
    L2Target,
    Lease,
    Report,
    Tier,
    open_cache,
    parts_of,
    upload_entry,
)
from mmcache.server.cache._l2 import (
    BadRecord,
    L2Error,
    Poll,
    Sighting,
    Want,
    item_of_record,
    record_of_item,
)
from mmcache.server.cache._l2_memory import MemoryL2
from mmcache.server.cache._store import ItemStore
from mmcache.server.cache._tier import L2Tier
from mmcache.v1 import cache_pb2 as pb

from .items import image_item

MIB = 1 << 20
NO_DEADLINE = Deadline(None)


@dataclass
class Node:
    """One sidecar's data plane: its cache and its registry."""

    cache: ItemCache
    registry: CollectorRegistry

    @property
    def store(self) -> ItemStore:
        return parts_of(self.cache).store

    @property
    def tier(self) -> L2Tier | None:
        return parts_of(self.cache).tier

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
async def nodes() -> AsyncIterator[list[Node]]:
    """Three caches on one in-memory L2 (a fleet in one process), running."""
    fleet = f"memory://fleet-{uuid.uuid4().hex}"
    async with contextlib.AsyncExitStack() as running:
        made = [_node(fleet, name) for name in ("a", "b", "c")]
        for node in made:
            await running.enter_async_context(node.cache)
        yield made


def _node(
    l2_url: str | None,
    name: str = "a",
    capacity: int = 64 * MIB,
    inflight: int = 64 * MIB,
) -> Node:
    """One node's data plane, built (no region; `l2_url`: its L2 tier's backend)."""
    settings = L2Settings(beat_s=0.05, recheck_s=0.01, wait_s=2.0)
    config = CacheConfig(
        capacity_bytes=capacity,
        max_items=1 << 20,
        lease_s=30.0,
        inflight_bytes=inflight,
        manifests=WIRE_MANIFESTS,
        parse_report=parse_report,
        l2=None if l2_url is None else L2Target(l2_url, settings=settings),
        node=name,
    )
    registry = CollectorRegistry()
    return Node(open_cache(config, registry), registry)


def _header(h: str, seed: int | None, numel: int = 4096) -> tuple[EntryHeader, tuple[bytes, ...]]:
    """An entry's header as parsed from a request, and its chunk frames
    (seed None: the hash sent alone)."""
    if seed is None:
        (entry,) = parse_header(pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash=h)]))
        return entry, ()
    encoded = encode_item(image_item(seed, numel=numel))
    frames = tuple(iter_chunk_frames(encoded, MAX_CHUNK_BYTES))
    message = pb.UpdateEntry(mm_hash=h, item=encoded.spec.message, num_chunks=len(frames))
    (entry,) = parse_header(pb.UpdateRequest(entries=[message]))
    return entry, frames


async def _update(
    cache: ItemCache,
    sent: Sequence[tuple[str, int | None]],
    deadline: Deadline = NO_DEADLINE,
    said_wait_s: float | None = None,
    lease: Lease = Lease.NONE,
) -> BatchResult:
    """One batch, as the servicer runs it: prepared, its data read, committed."""
    parsed = [_header(h, seed) for h, seed in sent]
    entries = [entry for entry, _ in parsed]
    async with cache.prepare(b"", entries, deadline, said_wait_s) as prepared:
        uploads = [upload_entry(entry, frames) for entry, frames in parsed]
        return prepared.commit(uploads, [], lease)


# -- ItemCache, one node ---------------------------------------------------------


async def test_an_upload_is_stored_and_the_next_lookup_hits_with_both_counted() -> None:
    node = _node(None)
    first = await _update(node.cache, [("x", 1)])
    again = await _update(node.cache, [("x", None)])
    assert first.outcomes == [Outcome.STORED] and again.outcomes == [Outcome.HIT]
    assert "x" in node.store and node.cache.stats().items == 1
    assert node.sample("mmcache_queries_total", modality="image") == 2
    assert node.sample("mmcache_hits_total", modality="image") == 1
    (item,) = await node.cache.read(["x"], NO_DEADLINE)
    assert list(node.cache.frames_of(item)) == list(_header("x", 1)[1])
    assert node.cache.chunk_count(item) == len(item.frames)


async def test_a_hash_sent_alone_waits_for_another_uploads_commit_and_hits() -> None:
    node = _node(None)
    entry, frames = _header("x", 1)
    async with node.cache.prepare(b"", [entry], NO_DEADLINE, None) as uploading:
        assert node.cache.pending == ["x"]
        waiter = asyncio.create_task(_update(node.cache, [("x", None)]))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # it waits for the upload in flight
        uploading.commit([upload_entry(entry, frames)], [], Lease.NONE)
    assert (await waiter).outcomes == [Outcome.HIT]
    assert node.cache.pending == []
    assert node.sample("mmcache_upload_waits_total") == 1


async def test_the_wait_for_another_upload_ends_at_the_clients_own_bound() -> None:
    node = _node(None)
    entry, _ = _header("x", 1)
    async with node.cache.prepare(b"", [entry], NO_DEADLINE, None):
        result = await _update(node.cache, [("x", None)], said_wait_s=0.01)
        assert result.outcomes == [Outcome.MISSING]  # it processes the item itself


async def test_an_upload_that_fails_before_commit_leaves_the_cache_as_it_was() -> None:
    node = _node(None)
    await _update(node.cache, [("kept", 1)])
    entry, _ = _header("x", 2)
    with pytest.raises(RuntimeError):
        async with node.cache.prepare(b"", [entry], NO_DEADLINE, None):
            raise RuntimeError("the client's stream broke")
    assert node.store.keys() == ["kept"] and node.cache.pending == []
    assert (await _update(node.cache, [("x", None)])).outcomes == [Outcome.MISSING]


async def test_bytes_in_flight_are_bounded_a_second_upload_waits_for_room() -> None:
    entry_bytes = _header("x", 1, numel=64 * 1024)[0].payload
    node = _node(None, inflight=entry_bytes)
    first, _ = _header("x", 1, numel=64 * 1024)
    async with node.cache.prepare(b"", [first], NO_DEADLINE, None):
        second = asyncio.create_task(_update(node.cache, [("y", 2)]))
        await asyncio.sleep(0.05)
        assert not second.done()
    assert (await second).outcomes == [Outcome.STORED]


async def test_a_read_names_the_missing_and_locate_tells_tiers_and_sizes() -> None:
    node = _node(None)
    await _update(node.cache, [("x", 1)])
    with pytest.raises(CacheMissError) as missing:
        await node.cache.read(["x", "y"], NO_DEADLINE)
    assert missing.value.missing_hashes == ["y"]
    found = await node.cache.locate(["x", "y"], True, NO_DEADLINE)
    assert [tier for tier, _ in found] == [Tier.L1, Tier.NONE]
    assert found[0][1] == node.store.size_of("x") > 0 and found[1][1] == 0


async def test_leases_taken_by_an_update_end_with_a_release() -> None:
    node = _node(None)
    await _update(node.cache, [("x", 1)], lease=Lease.HELD)
    assert node.store.leases == 1
    namespace = Namespaces("test", node.store.state, list).default
    released = node.cache.release(namespace, ["x"], Report(mm_hashes=["x"]))
    assert released == 1 and node.store.leases == 0


async def test_co_located_calls_without_a_region_are_refused_with_the_fix() -> None:
    node = _node(None)
    with pytest.raises(InvalidArgumentError, match="map the region Info announces"):
        node.cache.allocate(b"token", [(1024, 0)])
    assert node.cache.spares(b"token", [(1024, 0)], []) == []  # asking never fails an upload


# -- the L2 tier on MemoryL2: several nodes in one process ----------------------


async def test_an_item_seen_twice_on_one_node_is_read_by_another(nodes: list[Node]) -> None:
    a, b, _ = nodes
    await _update(a.cache, [("x", 1)])
    await _update(a.cache, [("x", None)])  # a second sighting: written behind to L2
    assert a.tier is not None
    for _ in range(200):
        if (await b.cache.locate(["x"], True, NO_DEADLINE))[0][0] == Tier.L2:
            break
        await asyncio.sleep(0.01)
    (item,) = await b.cache.read(["x"], NO_DEADLINE)
    assert "x" in b.store  # adopted into b's L1
    assert list(b.cache.frames_of(item)) == list(_header("x", 1)[1])
    assert b.sample("mmcache_l2_hits_total") == 1


async def test_a_cold_image_asked_by_two_nodes_at_once_is_processed_once(
    nodes: list[Node],
) -> None:
    a, b, _ = nodes
    first = await _update(a.cache, [("cold", None)])
    assert first.outcomes == [Outcome.MISSING]  # a claims it: its frontend processes it
    waiting = asyncio.create_task(_update(b.cache, [("cold", None)]))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # b waits for a's item rather than process it too
    await _update(a.cache, [("cold", 7)])  # a's frontend uploads what it processed
    assert (await waiting).outcomes == [Outcome.HIT]  # read from L2: no processing on b
    assert "cold" in b.store


async def test_an_item_goes_to_l2_on_its_second_sighting_not_its_first(
    nodes: list[Node],
) -> None:
    a = nodes[0]
    assert a.tier is not None
    backend = a.tier.backend
    await _update(a.cache, [("once", 1)])
    await asyncio.sleep(0.1)  # past a write-behind round
    assert not await backend.holds("once")  # seen once: not worth L2's room
    await _update(a.cache, [("once", None)])
    for _ in range(200):
        if await backend.holds("once"):
            break
        await asyncio.sleep(0.01)
    assert await backend.holds("once")
    assert a.sample("mmcache_l2_writes_total", result="written") == 1


async def test_the_claim_of_a_node_that_left_passes_to_the_next_asker(nodes: list[Node]) -> None:
    a, b, _ = nodes
    assert (await _update(a.cache, [("cold", None)])).outcomes == [Outcome.MISSING]
    assert a.tier is not None
    await a.tier.stop()  # a leaves before its frontend uploads: it will never write it
    started = asyncio.get_running_loop().time()
    assert (await _update(b.cache, [("cold", None)])).outcomes == [Outcome.MISSING]
    assert asyncio.get_running_loop().time() - started < 1.0  # not its whole wait_s (2 s)


async def test_a_record_that_fails_its_check_is_written_over_when_the_item_is_stored(
    nodes: list[Node],
) -> None:
    """A rule of the data plane alone (server/cache/_tier.py): the sidecar that
    found L2's record bad writes the item as soon as its frontend uploads it,
    not at a second sighting, so the next node reads it instead of the bad bytes."""
    a, b, c = nodes
    assert a.tier is not None
    good = record_of_item("x", await _stored_item(_node(None), "x"), WIRE_MANIFESTS)
    bad = replace(good, chunks=good.chunks[:-1])  # a chunk short: its check fails
    await a.tier.backend.write("x", bad, 0)
    assert (await _update(b.cache, [("x", None)])).outcomes == [Outcome.MISSING]
    assert b.sample("mmcache_l2_errors_total", op="read") == 1
    await _update(b.cache, [("x", 3)])  # b's frontend processed it: stored, seen once
    for _ in range(200):
        if await a.tier.backend.read("x") == good:
            break
        await asyncio.sleep(0.01)
    assert (await _update(c.cache, [("x", None)])).outcomes == [Outcome.HIT]
    assert c.sample("mmcache_l2_hits_total") == 1


async def test_an_l2_that_fails_is_a_miss_never_an_error(nodes: list[Node]) -> None:
    a, b, _ = nodes
    backend = a.tier.backend if a.tier else None
    assert isinstance(backend, MemoryL2)
    backend.fail("unreachable")
    assert (await _update(b.cache, [("x", None)])).outcomes == [Outcome.MISSING]
    with pytest.raises(CacheMissError):
        await b.cache.read(["x"], NO_DEADLINE)
    assert not b.cache.stats().l2_up
    assert [t for t, _ in await b.cache.locate(["x"], True, NO_DEADLINE)] == [Tier.NONE]
    backend.heal()
    assert b.cache.stats().l2_up


async def test_a_read_with_no_time_left_does_not_ask_l2(nodes: list[Node]) -> None:
    a, b, _ = nodes
    assert b.tier is not None
    record = record_of_item("x", await _stored_item(a, "x"), WIRE_MANIFESTS)
    backend = b.tier.backend
    await backend.write("x", record, 0)
    with pytest.raises(CacheMissError):
        await b.cache.read(["x"], Deadline.within(0.0))
    assert b.sample("mmcache_l2_hits_total") == 0
    assert len(await b.cache.read(["x"], NO_DEADLINE)) == 1


async def _stored_item(node: Node, key: str):  # type: ignore[no-untyped-def]
    await _update(node.cache, [(key, 3)])
    return node.store.peek(key)


# -- MemoryL2 itself: the Redis backend's semantics ------------------------------


async def test_memory_l2_records_are_whole_bounded_and_expire() -> None:
    now = [0.0]
    record = record_of_item("x", await _stored_item(_node(None), "x"), WIRE_MANIFESTS)
    backend = MemoryL2(max_bytes=3 * record.nbytes, clock=lambda: now[0])
    await backend.write("a", record, ttl_s=10)
    await backend.write("b", record, ttl_s=0)
    assert await backend.read("a") == record and await backend.holds("b")
    now[0] = 11.0
    assert await backend.read("a") is None and await backend.poll("a") == Poll.GONE
    for key in ("c", "d", "e", "f"):
        await backend.write(key, record, ttl_s=0)
    assert backend.stored_bytes == 3 * record.nbytes
    assert not await backend.holds("b")  # the least recently used went first
    assert await backend.poll("f") == Poll.HELD


async def test_memory_l2_claims_wants_and_heartbeats_follow_the_redis_scripts() -> None:
    now = [0.0]
    backend = MemoryL2(clock=lambda: now[0])
    assert await backend.sight("k", 5.0, "a") == (Sighting.FIRST, "a")
    assert await backend.sight("k", 5.0, "a") == (Sighting.MINE, "a")
    assert await backend.sight("k", 5.0, "b") == (Sighting.OTHERS, "a")
    assert await backend.poll("k") == Poll.CLAIMED
    assert await backend.want("a", "k") == Want.OWNER_GONE  # a never beat
    await backend.beat("a", alive_s=3.0, most=10)
    assert await backend.want("a", "k") == Want.ASKED
    assert await backend.beat("a", alive_s=3.0, most=10) == ["k"]
    assert await backend.hold("k", "a", 60.0) == (Sighting.MINE, 1)
    assert not await backend.take_over("k", "b", "c", 5.0)  # b does not hold it
    now[0] = 4.0  # a is silent past alive_s
    assert await backend.want("a", "k") == Want.OWNER_GONE
    assert await backend.take_over("k", "a", "b", 5.0)
    await backend.unclaim("k", "b")
    assert await backend.poll("k") == Poll.GONE
    backend.fail("down")
    with pytest.raises(L2Error, match="down"):
        await backend.read("k")
    assert not backend.up and backend.nodes_down == 1


# -- the package's own types, and the edge that converts the wire to them --------


def test_the_data_plane_imports_neither_grpc_nor_protobuf() -> None:
    package = Path(server_cache.__file__).parent
    wire = ("grpc", "google.protobuf", "mmcache.v1")
    offenders = []
    for module in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom) and node.level > 1:
                names = [f"{'.' * node.level}{node.module or ''}"]  # out of the package
            offenders += [
                f"{module.name}: {name}"
                for name in names
                if name.startswith(wire) or name.startswith("..")
            ]
    assert offenders == []


def test_the_enums_keep_the_wires_numbers() -> None:
    assert {c.name: int(c) for c in Change} == {
        name.removeprefix("CHANGE_"): number
        for name, number in pb.ChangeKind.items()
        if number != pb.CHANGE_UNSPECIFIED
    }
    assert {m.name: int(m) for m in Lease} == {
        name.removeprefix("LEASE_"): number for name, number in pb.LeaseMode.items()
    }


async def test_an_l2_record_names_its_key_and_the_digest_of_its_frames() -> None:
    """The manifest is the UpdateEntry a client would send, spec and all,
    inside an L2Manifest that names the key and the frames' XXH3-128."""
    item = await _stored_item(_node(None), "x")
    spec = pb.ItemSpec.FromString(item.spec)
    frames = len(item.frames)
    entry = pb.UpdateEntry(mm_hash="l2", item=spec, num_chunks=frames, metadata=b"m")
    record = record_of_item("x", replace(item, metadata=b"m"), WIRE_MANIFESTS)
    written = pb.L2Manifest.FromString(record.manifest)
    assert (written.key, written.entry) == ("x", entry)
    assert written.digest == xxhash.xxh3_128(b"".join(item.frames)).digest()
    read = item_of_record("x", record, WIRE_MANIFESTS)
    assert (read.spec, read.payload, read.frames) == (item.spec, item.payload, item.frames)


async def test_a_record_of_another_key_or_other_bytes_is_refused_with_its_reason() -> None:
    item = await _stored_item(_node(None), "x")
    record = record_of_item("x", item, WIRE_MANIFESTS)
    with pytest.raises(BadRecord, match="written for 'x'") as other:
        item_of_record("y", record, WIRE_MANIFESTS)
    assert other.value.reason == "key"
    flipped = bytearray(record.chunks[-1])
    flipped[-1] ^= 1
    changed = replace(record, chunks=(*record.chunks[:-1], bytes(flipped)))
    with pytest.raises(BadRecord, match="digest") as bytes_:
        item_of_record("x", changed, WIRE_MANIFESTS)
    assert bytes_.value.reason == "digest"
    # A record of a release before 0.2: a bare UpdateEntry, which named no key.
    spec = pb.ItemSpec.FromString(item.spec)
    before = pb.UpdateEntry(mm_hash="l2", item=spec, num_chunks=len(record.chunks))
    with pytest.raises(BadRecord) as old:
        item_of_record("x", replace(record, manifest=before.SerializeToString()), WIRE_MANIFESTS)
    assert old.value.reason in ("key", "format")
    with pytest.raises(BadRecord) as junk:
        item_of_record("x", replace(record, manifest=b"\xff\xff"), WIRE_MANIFESTS)
    assert junk.value.reason == "format"


async def test_a_record_under_another_key_is_a_miss_counted_and_never_stored(
    nodes: list[Node],
) -> None:
    """What a reply that reached the wrong read would be: x's record under y."""
    a, b, _ = nodes
    assert a.tier is not None
    x = record_of_item("x", await _stored_item(a, "x"), WIRE_MANIFESTS)
    await a.tier.backend.write("y", x, 0)
    assert (await _update(b.cache, [("y", None)])).outcomes == [Outcome.MISSING]
    assert "y" not in b.store
    assert b.sample("mmcache_l2_bad_records_total", reason="key") == 1
    assert b.sample("mmcache_l2_hits_total") == 0
    with pytest.raises(CacheMissError):
        await b.cache.read(["y"], NO_DEADLINE)


def test_a_ring_record_converts_whole_and_garbage_is_refused() -> None:
    release = pb.ReleaseRequest(
        mm_hashes=["a"],
        shm_token=b"t",
        shm_read_bytes=5,
        shm_done=[7],
        misses={"image": 2},
        hits={"video": 1},
        shm_leases=[pb.ShmLease(mm_hash="b", generation=9)],
        client_cpu_ns=11,
    )
    report = parse_report(release.SerializeToString())
    assert (list(report.mm_hashes), report.shm_token, report.shm_read_bytes) == (["a"], b"t", 5)
    assert (list(report.shm_done), dict(report.misses), dict(report.hits)) == (
        [7],
        {"image": 2},
        {"video": 1},
    )
    assert (list(report.shm_leases), report.client_cpu_ns) == ([("b", 9)], 11)
    with pytest.raises(InvalidArgumentError, match="does not parse"):
        parse_report(b"\xff\xff\xff")
