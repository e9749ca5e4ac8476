"""The feed without gRPC: batches in order, a snapshot to start, resync on lag."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from mmcache._spec import MAX_FEED_GAP_S
from mmcache.server import _feed as feed_module
from mmcache.server._feed import Feed, FeedState
from mmcache.v1 import cache_pb2 as pb


class Store:
    """Stands in for the item store: the key set a snapshot reads."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.reads = 0

    def state(self) -> FeedState:
        self.reads += 1
        return FeedState(list(self.keys), list(self.keys.values()), [], 1000, 0)


def stored(feed: Feed, store: Store, key: str, size: int = 1) -> None:
    store.keys[key] = size
    feed.emit(pb.CHANGE_STORED, key, size)


async def take(stream: AsyncIterator[bytes], n: int) -> list[pb.FeedMessage]:
    return [pb.FeedMessage.FromString(await asyncio.wait_for(anext(stream), 2)) for _ in range(n)]


async def test_a_subscriber_gets_a_snapshot_its_head_then_every_change_in_order() -> None:
    store = Store()
    feed = Feed("i", store.state, flush_s=0.001)
    stored(feed, store, "before")
    subscriber = feed.subscribe()
    stream = subscriber.messages()
    snapshot, head = await take(stream, 2)
    assert snapshot.snapshot.mm_hashes == ["before"] and snapshot.snapshot.last
    assert snapshot.seq == 1 and head.WhichOneof("body") is None and head.seq == 1
    for key in ("a", "b", "c"):
        stored(feed, store, key)
    (batch,) = await take(stream, 1)  # one batch for the three
    assert list(batch.changes.mm_hashes) == ["a", "b", "c"] and batch.seq == 4
    feed.unsubscribe(subscriber)


async def test_a_subscriber_left_behind_by_the_ring_gets_a_fresh_snapshot() -> None:
    store = Store()
    reasons: list[str] = []
    feed = Feed("i", store.state, flush_s=0.001, ring_bytes=300, on_snapshot=reasons.append)
    subscriber = feed.subscribe()
    stream = subscriber.messages()
    await take(stream, 2)
    for n in range(50):  # far more than 300 bytes of changes, none read
        stored(feed, store, f"key-{n:03d}-" + "x" * 20)
        feed.flush()
    messages = await take(stream, 2)
    assert [m.WhichOneof("body") for m in messages] == ["snapshot", None]
    assert len(messages[0].snapshot.mm_hashes) == 50 and messages[0].seq == 50
    assert reasons == ["subscribe", "lag"]
    feed.unsubscribe(subscriber)


async def test_subscribers_that_can_go_on_from_one_snapshot_share_it() -> None:
    store = Store()
    feed = Feed("i", store.state, flush_s=0.001)
    first = feed.subscribe()
    await take(first.messages(), 2)
    stored(feed, store, "a")
    feed.flush()
    second = feed.subscribe()
    stream = second.messages()
    snapshot, head = await take(stream, 2)
    # The snapshot of seq 0 is reused; the ring then brings "a".
    assert store.reads == 1 and snapshot.seq == 0 and head.seq == 1
    (batch,) = await take(stream, 1)
    assert list(batch.changes.mm_hashes) == ["a"]
    feed.unsubscribe(first)
    feed.unsubscribe(second)


async def test_changes_nobody_subscribes_to_cost_only_their_number() -> None:
    store = Store()
    feed = Feed("i", store.state)
    for n in range(100):
        stored(feed, store, f"k{n}")
    assert feed.seq == 100 and not feed._ring
    subscriber = feed.subscribe()
    snapshot, _ = await take(subscriber.messages(), 2)
    assert snapshot.seq == 100 and len(snapshot.snapshot.mm_hashes) == 100


async def test_a_snapshot_outrun_by_the_ring_while_it_is_built_is_built_again() -> None:
    store = Store()
    for n in range(3 * 8192):  # three parts: the build yields twice
        store.keys[f"k{n}"] = 1
    feed = Feed("i", store.state, flush_s=1, ring_bytes=200)
    subscriber = feed.subscribe()
    stream = subscriber.messages()

    async def churn() -> None:
        for n in range(200):
            stored(feed, store, f"new-{n}-" + "x" * 40)
            feed.flush()  # each flush overflows the ring: what follows a build is gone
            await asyncio.sleep(0)

    writer = asyncio.create_task(churn())
    parts = []
    while True:
        message = pb.FeedMessage.FromString(await asyncio.wait_for(anext(stream), 5))
        if message.WhichOneof("body") is None:
            break
        parts.append(message)
    await writer
    assert store.reads >= 2 and parts[-1].snapshot.last
    # Whatever snapshot it got, the ring holds every change after it.
    assert feed._index_after(parts[-1].seq) is not None
    feed.unsubscribe(subscriber)


async def test_close_ends_every_subscribers_messages_and_any_later_ones() -> None:
    store = Store()
    feed = Feed("i", store.state, flush_s=0.001)
    stream = feed.subscribe().messages()
    await take(stream, 2)
    waiting = asyncio.ensure_future(anext(stream))  # waits for a change
    await asyncio.sleep(0.01)
    feed.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 2)
    later = feed.subscribe().messages()
    assert [m async for m in later] == []


async def test_a_busy_feed_sends_at_most_one_message_per_gap_and_a_quiet_one_at_once() -> None:
    """Changes every 5 ms for half a second reach a subscriber in about one
    message per `gap_s`, every change in order; a change after a quiet spell
    comes within `flush_s`, not a whole gap."""
    store = Store()
    feed = Feed("i", store.state, flush_s=0.005, gap_s=0.1)
    subscriber = feed.subscribe()
    stream = subscriber.messages()
    await take(stream, 2)  # the snapshot and its head
    loop = asyncio.get_running_loop()
    started = loop.time()
    keys = [f"k{n}" for n in range(100)]
    for key in keys:
        stored(feed, store, key)
        await asyncio.sleep(0.005)
    got: list[str] = []
    messages = 0
    while len(got) < len(keys):
        (message,) = await take(stream, 1)
        got += message.changes.mm_hashes
        messages += 1
    elapsed = loop.time() - started
    assert got == keys
    assert messages <= elapsed / 0.1 + 2, (messages, elapsed)
    await asyncio.sleep(0.3)  # quiet
    sent = loop.time()
    stored(feed, store, "late")
    (message,) = await take(stream, 1)
    assert list(message.changes.mm_hashes) == ["late"]
    assert loop.time() - sent < 0.08
    feed.unsubscribe(subscriber)


async def test_a_subscriber_with_a_gap_of_its_own_gets_changes_joined_once_per_gap() -> None:
    """Beside a subscriber at the feed's own spacing, one that asked for a
    longer gap gets every change, in order and numbered without a gap (its
    messages are joined ring messages, parsed as one), its messages at least
    its gap apart while changes keep coming; the feed's close ends it at
    once, within its gap or while a message is being written."""
    store = Store()
    feed = Feed("i", store.state, flush_s=0.002, gap_s=0.01)
    streams = [feed.subscribe().messages(), feed.subscribe(gap_s=0.15).messages()]
    for stream in streams:
        await take(stream, 2)  # the snapshot and its head
    loop = asyncio.get_running_loop()
    keys = [f"k{n}" for n in range(100)]

    async def read(stream: AsyncIterator[bytes]) -> list[float]:
        got: list[str] = []
        seq = 0
        arrivals = []
        while len(got) < len(keys):
            (message,) = await take(stream, 1)
            arrivals.append(loop.time())
            assert message.seq - len(message.changes.kinds) == seq  # the next numbers
            assert message.instance_id == "i"
            seq = message.seq
            got += message.changes.mm_hashes
        assert got == keys
        return arrivals

    readers = [asyncio.ensure_future(read(stream)) for stream in streams]
    for key in keys:
        stored(feed, store, key)
        await asyncio.sleep(0.005)
    plain, spaced = await asyncio.gather(*readers)
    gaps = [b - a for a, b in itertools.pairwise(spaced)]
    assert len(spaced) >= 2 and min(gaps) >= 0.14, gaps
    assert len(plain) > 2 * len(spaced), (len(plain), len(spaced))
    stored(feed, store, "late")
    await take(streams[1], 1)  # once its gap has passed...
    waiting = asyncio.ensure_future(anext(streams[1]))  # ...then within its gap
    await asyncio.sleep(0.01)
    closed = loop.time()
    feed.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 2)
    assert loop.time() - closed < 0.1
    # Closed while a message was being written (the stream paused at it).
    feed = Feed("i", store.state, flush_s=0.002, gap_s=0.01)
    stream = feed.subscribe(gap_s=2.0).messages()
    await take(stream, 2)
    stored(feed, store, "written")
    await take(stream, 1)
    feed.close()
    closed = loop.time()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), 5)
    assert loop.time() - closed < 0.5


async def test_a_merged_message_is_bounded_and_what_the_bound_left_goes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What one spaced message joins stops at MERGED_BYTES; the rest follows
    in order at once, not a gap later each; a gap asked beyond MAX_FEED_GAP_S is
    MAX_FEED_GAP_S, and one under the feed's own is the feed's."""
    monkeypatch.setattr(feed_module, "MERGED_BYTES", 300)
    store = Store()
    feed = Feed("i", store.state, flush_s=0.001, gap_s=0.001)
    subscriber = feed.subscribe(gap_s=1.0)
    stream = subscriber.messages()
    await take(stream, 2)
    for n in range(40):
        stored(feed, store, f"key-{n:04d}")
        feed.flush()  # a ring message each
    largest = max(len(message) for _, _, message in feed._ring)
    assert 40 * largest > 3 * 300  # several merged messages, not one
    started = asyncio.get_running_loop().time()
    got: list[str] = []
    while len(got) < 40:
        raw = await asyncio.wait_for(anext(stream), 2)
        assert len(raw) <= 300
        got += pb.FeedMessage.FromString(raw).changes.mm_hashes
    assert got == [f"key-{n:04d}" for n in range(40)]
    assert asyncio.get_running_loop().time() - started < 0.5  # no gap between them
    assert feed.subscribe(gap_s=60)._gap_s == MAX_FEED_GAP_S
    assert feed.subscribe(gap_s=0.0005)._gap_s == 0
    feed.close()
