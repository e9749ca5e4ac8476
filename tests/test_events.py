"""Item events for routers: a real ZMQ subscriber of a real server reads what
it holds in vLLM's KV-event framing (topic, 8-byte sequence number, msgpack
batch), replays what it missed, and `Locate` answers where items are."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from mmcache.client import MMCacheClient
from mmcache.server import EventsConfig, MMCacheServer
from mmcache.server._config import ConfigError, parse_serve_args
from mmcache.server._events import ItemEvents
from mmcache.server.cache import Change, ItemChange

from .conftest import MIB, connected, server_config, serving, store_of
from .items import image_item

TOPIC = b"mm-items"


@pytest.fixture
async def publishing() -> AsyncIterator[MMCacheServer]:
    events = EventsConfig("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    config = server_config(capacity_bytes=4 * MIB, events=events)
    async with serving(config) as server:
        yield server


async def replay(endpoint: str, first: int) -> list[tuple[int, list[Any]]]:
    """Ask the replay socket for every batch from `first` on. A DEALER, sending
    the empty delimiter a REQ would add: a REQ takes one reply per request."""
    context = zmq.asyncio.Context()
    req = context.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    try:
        await req.send_multipart([b"", first.to_bytes(8, "big")])
        batches = []
        while True:
            empty, seq_bytes, payload = await asyncio.wait_for(req.recv_multipart(), 5)
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                return batches
            batches.append((int.from_bytes(seq_bytes, "big"), msgspec.msgpack.decode(payload)))
            if len(batches) > 1000:
                raise AssertionError("no end marker")
    finally:
        req.close()
        context.term()


def events_of(batches: list[tuple[int, list[Any]]]) -> list[list[Any]]:
    return [event for _, (_, events, _) in batches for event in events]


async def test_a_new_server_says_all_cleared_first(publishing: MMCacheServer) -> None:
    _, replay_at = publishing.events.endpoints if publishing.events else (None, None)
    assert replay_at is not None
    batches = await replay(replay_at, 0)
    seq, (ts, events, instance_id) = batches[0]
    assert seq == 0 and ts > 0
    assert events == [["AllCleared", publishing.instance_id]]
    assert instance_id == publishing.instance_id


async def test_subscribers_see_items_stored_and_evicted(publishing: MMCacheServer) -> None:
    assert publishing.events is not None
    pub_at, replay_at = publishing.events.endpoints
    assert replay_at is not None
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(pub_at)
    await asyncio.sleep(0.2)  # a SUB socket misses what is sent before it joins
    try:
        async with connected(publishing, namespace="qwen") as client:
            item = image_item(1, numel=256 << 10)  # 1 MiB: four fill the 4 MiB cache
            await client.get_and_update([item], ["first"], lease=False)
            topic, seq_bytes, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == TOPIC
            _, events, _ = msgspec.msgpack.decode(payload)
            size = store_of(publishing).size_of("qwen\x00first")
            assert events == [["ItemStored", ["first"], [size], "l1", "qwen"]]

            hashes = [f"more{i}" for i in range(5)]
            for h in hashes:
                await client.get_and_update([image_item(2, numel=256 << 10)], [h], lease=False)
            last = int.from_bytes(seq_bytes, "big")
            seen: list[list[Any]] = []
            while not any(e[0] == "ItemRemoved" and "first" in e[1] for e in seen):
                _, seq_bytes, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
                seq = int.from_bytes(seq_bytes, "big")
                assert seq == last + 1  # no gap on loopback
                last = seq
                seen.extend(msgspec.msgpack.decode(payload)[1])
            removed = [h for e in seen if e[0] == "ItemRemoved" for h in e[1]]
            assert removed[0] == "first" and all(e[-2:] == ["l1", "qwen"] for e in seen)

            # A subscriber that missed everything gets it back from the replay socket.
            replayed = events_of(await replay(replay_at, 1))
            assert replayed[0] == ["ItemStored", ["first"], [size], "l1", "qwen"]
            # What the subscriber saw comes first; later evictions may follow.
            live = [e for e in seen if e[0] == "ItemRemoved"]
            assert [e for e in replayed if e[0] == "ItemRemoved"][: len(live)] == live
    finally:
        sub.close(linger=0)
        context.term()


async def test_a_malformed_replay_request_is_ignored(publishing: MMCacheServer) -> None:
    assert publishing.events is not None
    _, replay_at = publishing.events.endpoints
    assert replay_at is not None
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_at)
    await dealer.send_multipart([b"", b"not eight bytes long"])
    await asyncio.sleep(0.1)
    dealer.close()
    context.term()
    assert (await replay(replay_at, 0))[0][0] == 0  # still serving


async def test_an_endpoint_taken_stops_the_start_with_the_reason() -> None:
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        server = MMCacheServer(server_config(events=EventsConfig(f"tcp://127.0.0.1:{port}")))
        with pytest.raises(OSError, match="cannot publish item events"):
            await server.start()
        await server.stop(grace=0)
    finally:
        taken.close(linger=0)
        context.term()


def test_replay_without_a_publisher_is_refused() -> None:
    with pytest.raises(ConfigError, match="give both"):
        parse_serve_args([], {"MMCACHE_EVENTS_REPLAY_ENDPOINT": "tcp://127.0.0.1:5558"})


async def test_locate_says_where_items_are_and_counts_nothing(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    await client.get_and_update([image_item(3)], ["here"])
    leases = store_of(server).leases
    queries = server.registry.get_sample_value("mmcache_queries_total", {"modality": "image"})
    where = await client.locate(["here", "nowhere"], check_l2=True)
    assert where[0].tier == "l1" and where[0].size == store_of(server).size_of("here") > 0
    assert where[1].tier is None and where[1].size == 0
    after = server.registry.get_sample_value("mmcache_queries_total", {"modality": "image"})
    assert after == queries
    assert store_of(server).leases == leases


async def test_a_replay_to_a_slow_reader_skips_no_batch() -> None:
    """5,000 buffered batches (7 MB) asked for by a subscriber that reads only after a
    pause: past its high-water mark the ROUTER waits (ROUTER_MANDATORY) instead
    of dropping, so every batch comes, in order, then the end marker."""
    events = ItemEvents("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "mm", "inst", flush_s=0.001)
    events.start()
    try:
        for i in range(5000):  # one batch each, of 20 changes (about 1.5 KB)
            for j in range(20):
                events.changed(ItemChange(Change.STORED, f"{i:032d}{j:032d}", 10))
            events._flush()
        _, replay_at = events.endpoints
        assert replay_at is not None
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_at)
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            await asyncio.sleep(0.5)  # busy a moment: the replay meets its high-water mark
            seqs = []
            while True:
                _, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
                if not payload:
                    break
                seqs.append(int.from_bytes(seq, "big"))
        finally:
            dealer.close()
            context.term()
        assert len(seqs) >= 5000 and seqs == list(range(len(seqs)))  # every batch, in order
    finally:
        await events.stop()
