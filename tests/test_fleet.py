"""Many frontends, one cache: leases, the mirror feed, metadata, concurrency, fail-open.

Real servers on loopback, real clients; frontends in processes of their own
where the behaviour is about several processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmcache.client import (
    CacheMissError,
    FailOpen,
    InvalidArgumentError,
    MMCacheClient,
)
from mmcache.client._codec import EncodedItem, encode_item
from mmcache.server import MMCacheServer, ServerConfig
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, connected, eventually, sample, scrape, server_config, serving, store_of
from .items import image_item
from .raw import SERVICE, chunk, data_entry, tensor_spec

ROOT = Path(__file__).resolve().parent.parent


def size_of(seed: int, numel: int) -> int:
    return encode_item(image_item(seed, numel=numel)).size.charged


# ---------------------------------------------------------------- leases


async def test_a_promised_item_survives_other_frontends_filling_the_cache() -> None:
    # The first scenario: 5 reads of 5 failed before leases.
    item_bytes = size_of(0, 2000)
    async with serving(capacity_bytes=8 * item_bytes) as server:
        async with connected(server) as a, connected(server) as b, connected(server) as engine:
            for request in range(5):
                mine = f"a-{request}"
                assert await a.get_and_update([image_item(request, 2000)], [mine]) is not None
                # b serves other requests meanwhile, many times the cache.
                for j in range(20):
                    key = f"b-{request}-{j}"
                    await b.get_and_update([image_item(100 + j, 2000)], [key], lease=False)
                (got,) = await engine.fetch([mine])
                assert got == image_item(request, 2000)
            assert store_of(server).leases == 0 and store_of(server).leased_bytes == 0


async def test_leased_bytes_count_in_the_capacity_and_what_cannot_fit_is_handed_back() -> None:
    item_bytes = size_of(0, 2000)
    async with serving(capacity_bytes=3 * item_bytes + 100) as server:
        async with connected(server) as client:
            items = [image_item(i, 2000) for i in range(4)]
            hashes = [f"h{i}" for i in range(4)]
            result = await client.get_and_update(items[:3], hashes[:3])
            assert list(result) == items[:3] and store_of(server).leased_bytes == 3 * item_bytes
            # No room beside three leased items: the fourth is handed back to
            # be delivered inline, nothing leased is evicted.
            result = await client.get_and_update([items[3]], [hashes[3]])
            assert result[0] is items[3]
            assert store_of(server).keys() == hashes[:3] and not client.is_cached([hashes[3]])[0]
            assert store_of(server).used <= store_of(server).capacity
            # Reads release: then the fourth fits.
            await client.fetch(hashes[:3])
            assert store_of(server).leases == 0
            assert (await client.get_and_update([items[3]], [hashes[3]]))[0] is items[3]
            assert hashes[3] in store_of(server)
            samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_uncached_total", modality="image") == 1


async def test_64_requests_in_flight_over_a_small_cache_never_fail_at_the_read() -> None:
    # The second scenario: 233 of 320 requests failed before leases.
    item_bytes = size_of(0, 2000)
    async with serving(capacity_bytes=40 * item_bytes) as server:
        async with connected(server) as frontend, connected(server) as engine:
            rng = random.Random(3)

            async def request(n: int) -> None:
                seeds = rng.sample(range(400), 3)
                items = [image_item(s, 2000) for s in seeds]
                hashes = [f"img-{s}" for s in seeds]
                sent = await frontend.get_and_update(items, hashes)
                await asyncio.sleep(rng.random() * 0.02)  # the request's way to the engine
                # The engine reads what the server holds for it; the rest
                # (no room beside leased items) travelled inline.
                wanted = [i for i, held in enumerate(sent.held) if held]
                assert all(sent[i] is not None or sent.held[i] for i in range(3))
                got = await engine.fetch([hashes[i] for i in wanted])
                assert got == [items[i] for i in wanted]

            results = await asyncio.gather(
                *(request(n) for n in range(320)), return_exceptions=True
            )
            failures = sum(isinstance(r, BaseException) for r in results)
            assert failures == 0, [r for r in results if isinstance(r, BaseException)][:3]
            assert store_of(server).used <= store_of(server).capacity


async def test_a_lease_nobody_reads_expires_and_the_item_becomes_evictable() -> None:
    item_bytes = size_of(0, 2000)
    async with serving(capacity_bytes=2 * item_bytes + 50, lease_s=2) as server:
        async with connected(server) as client:
            await client.get_and_update([image_item(0, 2000)], ["dropped"])
            assert store_of(server).leases == 1
            await eventually(lambda: store_of(server).leases == 0, timeout=10)
            for i in (1, 2):
                await client.get_and_update([image_item(i, 2000)], [f"new-{i}"], lease=False)
            assert "dropped" not in store_of(server)
            samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_lease_expiries_total") == 1


async def test_hits_only_leases_what_the_engine_must_read(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    old, new = image_item(1), image_item(2)
    await client.get_and_update([old], ["old"], lease=False)
    sent = await client.get_and_update([old, new], ["old", "new"], lease="hits")
    assert list(sent) == [None, new] and sent.held == [True, True]
    assert store_of(server).leases == 1 and store_of(server).leased_items == 1  # "old" alone
    # inject (a frontend that processed the items itself) leases the same way.
    listed: list[object] = [old, image_item(3)]
    await client.inject_into_mm_cache({"image": ["old", "third"]}, {"image": listed})
    assert listed[0] is None and store_of(server).leases == 2
    await client.fetch(["old", "old"])
    assert store_of(server).leases == 0
    with pytest.raises(InvalidArgumentError, match="lease"):
        await client.get_and_update([old], ["old"], lease="all")  # type: ignore[arg-type]


async def test_a_leased_item_survives_a_reupload_that_cannot_be_stored() -> None:
    item_bytes = size_of(0, 2000)
    async with serving(capacity_bytes=2 * item_bytes + 1000) as server:
        async with connected(server) as a, connected(server, follow=False) as b:
            x, w = image_item(0, 2000), image_item(1, 2000)
            await a.get_and_update([x, w], ["x", "w"])  # both leased: the cache is full
            # b (which never heard of x) sends x again with metadata: no room
            # beside the leases, so its copy is UNCACHED and goes inline...
            sent = await b.get_and_update([x], ["x"], metadata=[b"m" * 60_000])
            assert sent[0] is x and sent.held == [False]
            # ... and withheld data (a client that believes x larger than the
            # whole cache keeps its bytes home): the same.
            async with connected(server, follow=False) as c:
                c.mirror._capacity = item_bytes - 1  # c believes x larger than the cache
                assert (await c.get_and_update([x], ["x"])).held == [False]
            # The promise to a's request holds.
            assert await a.fetch(["x", "w"]) == [x, w]
            assert store_of(server).leases == 0


async def test_data_sent_again_without_metadata_keeps_the_stored_metadata() -> None:
    async with serving() as server, connected(server) as a, connected(server) as b:
        await a.get_and_update([image_item(1)], ["x"], metadata=[b"prompt-updates"])
        await b.get_and_update([image_item(1)], ["x"], lease=False)  # REPLACED, no metadata
        hit = await a.get_and_update([None], ["x"], want_metadata=True, lease=False)
        assert hit.metadata == [b"prompt-updates"]


async def test_a_reply_carries_at_most_6_mib_of_metadata() -> None:
    blob = b"z" * (64 * 1024)
    hashes = [f"m{i}" for i in range(120)]
    async with serving(capacity_bytes=64 * MIB) as server, connected(server) as client:
        for start in (0, 60):  # a call's header must fit 8 MiB: 60 blobs at a time
            part = hashes[start : start + 60]
            await client.get_and_update(
                [image_item(i, 16) for i in range(len(part))], part, metadata=[blob] * 60,
                lease=False,
            )  # fmt: skip
        hit = await client.get_and_update([None] * 120, hashes, want_metadata=True, lease=False)
        got = [m for m in hit.metadata if m is not None]
        assert list(hit) == [None] * 120 and got == [blob] * len(got)
        assert 80 <= len(got) < 120  # 6 MiB of blobs; the others come back None
        with pytest.raises(InvalidArgumentError, match="send fewer items per call"):
            await client.get_and_update(
                [image_item(i, 16) for i in range(130)], [f"n{i}" for i in range(130)],
                metadata=[blob] * 130,
            )  # fmt: skip


async def test_release_gives_back_a_lease_whose_read_will_not_happen(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    await client.get_and_update([image_item(1), image_item(1)], ["twice", "twice"])
    assert store_of(server).leases == 2  # one grant per entry: two reads to come
    assert await client.release(["twice", "never-leased"]) == 1
    await client.fetch(["twice"])
    assert store_of(server).leases == 0
    await client.fetch(["twice"], release=True)  # nothing left to release: no error
    assert store_of(server).leases == 0


async def test_a_call_that_fails_for_want_of_data_gives_its_leases_back(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    await client.get_and_update([image_item(1)], ["held"], lease=False)
    with pytest.raises(CacheMissError) as info:
        await client.get_and_update([None, None], ["held", "gone"])
    assert info.value.missing_hashes == ["gone"]
    assert store_of(server).leases == 0  # the request failed: nothing will read "held"


async def test_a_frontend_killed_mid_request_releases_by_expiry() -> None:
    async with serving(lease_s=3) as server:  # outlives the frontend's start on a slow machine
        target = f"127.0.0.1:{server.port}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "tests.frontend_proc", target, "1", "2", "--hold"),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line.split()[0] == b"uploaded"
            assert store_of(server).leases == 2 and store_of(server).leased_bytes > 0
            proc.send_signal(signal.SIGKILL)  # dies before its engine reads
            await asyncio.wait_for(proc.wait(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await eventually(lambda: store_of(server).leases == 0, timeout=15)
        assert store_of(server).leased_bytes == 0 and len(store_of(server)) == 2


async def test_after_a_server_restart_the_read_names_the_hashes_and_the_frontend_resends() -> None:
    first = MMCacheServer(server_config())
    await first.start()
    port = first.port
    items = [image_item(i) for i in range(3)]
    hashes = [f"r{i}" for i in range(3)]
    async with MMCacheClient(f"127.0.0.1:{port}", timeout=20) as frontend:
        await frontend.get_and_update(items, hashes)
        await first.stop(grace=0)
        async with serving(port=port) as second:
            async with MMCacheClient(f"127.0.0.1:{port}", timeout=20) as engine:
                with pytest.raises(CacheMissError) as info:
                    await engine.fetch(hashes)
                assert info.value.missing_hashes == hashes
                # vLLM's retry path: the frontend sends the items again.
                assert list(await frontend.get_and_update(items, hashes)) == items
                assert await engine.fetch(hashes) == items
            assert store_of(second).leases == 0


# ---------------------------------------------------------------- the feed


async def test_every_mirror_learns_what_any_frontend_stored_and_what_was_evicted() -> None:
    item_bytes = size_of(0, 2000)
    async with serving(capacity_bytes=4 * item_bytes + 50) as server:
        async with connected(server) as a, connected(server) as b:
            await a.get_and_update([image_item(0, 2000)], ["x"], lease=False)
            took = await eventually(lambda: b.is_cached(["x"]) == [True])
            assert took < 0.5  # tens of ms on loopback; generous for a loaded CI
            # b's own uploads evict x; a learns it from the feed.
            for i in range(1, 5):
                await b.get_and_update([image_item(i, 2000)], [f"y{i}"], lease=False)
            assert "x" not in store_of(server)
            await eventually(lambda: a.is_cached(["x"]) == [False])
            await eventually(lambda: sorted(a.mirror.keys()) == sorted(store_of(server).keys()))


async def test_mirrors_agree_with_the_server_after_random_traffic_from_three_frontends() -> None:
    item_bytes = size_of(0, 500)
    rng = random.Random(5)
    async with serving(capacity_bytes=12 * item_bytes, max_items=10) as server:
        async with connected(server) as a, connected(server) as b, connected(server) as c:
            clients = [a, b, c]

            async def traffic(client: MMCacheClient) -> None:
                for _ in range(60):
                    seeds = rng.sample(range(30), rng.randint(1, 3))
                    hashes = [f"k{s}" for s in seeds]
                    leased = rng.random() < 0.5
                    sent = await client.get_and_update(
                        [image_item(s, 500) for s in seeds], hashes, lease=leased
                    )
                    if leased:  # what the call promised is there for the engine
                        await client.fetch(
                            [h for h, held in zip(hashes, sent.held, strict=True) if held]
                        )

            await asyncio.gather(*(traffic(c) for c in clients))
            await eventually(lambda: all(c.mirror.feed_seq == server.feed.seq for c in clients))
            truth = store_of(server).keys()
            for client in clients:
                assert client.mirror.keys() != [] and sorted(client.mirror.keys()) == sorted(truth)
                for key in truth:
                    assert client.mirror.size_of(key) == store_of(server).peek(key).size  # type: ignore[union-attr]


async def test_a_subscriber_too_slow_for_the_feed_is_resynced_not_buffered() -> None:
    async with serving(feed_buffer_bytes=4096) as server:
        target = f"127.0.0.1:{server.port}"
        # No BDP probing: the stream's window stays small, so a subscriber
        # that does not read stalls the server's writes to it.
        options = (("grpc.http2.bdp_probe", 0),)
        async with (
            grpc.aio.insecure_channel(target, options=options) as channel,
            connected(server) as writer,
        ):
            call = channel.unary_stream(
                f"{SERVICE}/Subscribe",
                request_serializer=pb.SubscribeRequest.SerializeToString,
                response_deserializer=pb.FeedMessage.FromString,
            )(pb.SubscribeRequest())
            stream = aiter(call)
            first = await anext(stream)
            assert first.WhichOneof("body") == "snapshot" and first.snapshot.last
            # The slow subscriber reads nothing while far more than the ring
            # holds changes hands (each upload is a few changes).
            for i in range(100):
                seeds = range(10 * i, 10 * i + 10)
                await writer.get_and_update(
                    [image_item(s, 10) for s in seeds], [f"k{s}-" + "x" * 200 for s in seeds]
                )
            await asyncio.sleep(0.05)
            snapshots = 0
            changes_after = 0
            seq_known = 0
            while seq_known < server.feed.seq:
                message = await asyncio.wait_for(anext(stream), 5)
                if message.WhichOneof("body") == "snapshot":
                    snapshots += 1
                    if message.snapshot.last:
                        seq_known = message.seq
                else:
                    changes_after += 1
                    seq_known = max(seq_known, message.seq)
            call.cancel()
            assert snapshots >= 1
            samples = await scrape(server.metrics_port)
    assert (sample(samples, "mmcache_feed_snapshots_total", reason="lag") or 0) >= 1


async def test_a_mirror_stopped_past_the_feeds_ring_is_resynced_to_the_servers_state() -> None:
    item_bytes = size_of(0, 10)
    async with serving(capacity_bytes=50 * item_bytes, feed_buffer_bytes=4096) as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "tests.mirror_proc", f"127.0.0.1:{server.port}"),
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"live\n"
            proc.send_signal(signal.SIGSTOP)
            async with connected(server, follow=False) as writer:
                # ~9 MB of changes, past what the stopped client's window
                # holds; 200x the cache, so most are evicted again.
                item = image_item(0, 10)
                for i in range(0, 10_000, 50):
                    keys = [f"k{n}-" + "x" * 200 for n in range(i, i + 50)]
                    await writer.get_and_update([item] * 50, keys, lease=False)
            proc.send_signal(signal.SIGCONT)
            while True:  # until its mirror has caught up with the server
                proc.stdin.write(b"dump\n")
                await proc.stdin.drain()
                state = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
                if state["seq"] == server.feed.seq:
                    break
                await asyncio.sleep(0.02)
            assert state["keys"] == sorted(store_of(server).keys())
            samples = await scrape(server.metrics_port)
            assert (sample(samples, "mmcache_feed_snapshots_total", reason="lag") or 0) >= 1
        finally:
            proc.kill()
            await proc.wait()


async def test_a_gap_in_the_feed_makes_the_client_subscribe_again() -> None:
    async with serving() as server, connected(server) as client:
        assert client.feed is not None
        await client.get_and_update([image_item(1)], ["before"], lease=False)
        server.feed._seq += 1  # a number never sent: what a faulty server would do
        async with connected(server, follow=False) as other:
            await other.get_and_update([image_item(2)], ["after"], lease=False)
        await eventually(lambda: client.feed is not None and client.feed.resubscribes)
        await eventually(
            lambda: client.following and client.is_cached(["before", "after"]) == [True, True]
        )
        await eventually(lambda: client.mirror.feed_seq == server.feed.seq)  # (a slow machine)


async def test_a_client_asking_a_longer_feed_gap_follows_in_fewer_messages() -> None:
    """A subscriber that asks for a 200 ms gap gets the changes of 40 uploads
    made over half a second in a few messages (each the ring's messages
    joined, parsed as one over the wire), every one in order; a client with
    that gap follows to the server's last change; one asking past 5 s is told
    the range."""
    async with serving() as server, connected(server, feed_gap_s=0.2) as spaced:
        target = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_stream(f"{SERVICE}/Subscribe")(
                pb.SubscribeRequest(gap_ms=200).SerializeToString()
            )
            stream = aiter(call)
            while not pb.FeedMessage.FromString(await anext(stream)).HasField("snapshot"):
                pass
            keys = [f"gap-{n}" for n in range(40)]
            started = time.monotonic()
            async with connected(server, follow=False) as writer:
                for n, key in enumerate(keys):
                    await writer.get_and_update([image_item(n)], [key], lease=False)
                    await asyncio.sleep(0.01)
            stored: list[str] = []
            messages = 0
            while len(stored) < len(keys):
                message = pb.FeedMessage.FromString(await asyncio.wait_for(anext(stream), 5))
                if message.HasField("changes"):
                    messages += 1
                    changes = message.changes
                    stored += [
                        h
                        for k, h in zip(changes.kinds, changes.mm_hashes, strict=True)
                        if k == pb.CHANGE_STORED
                    ]
            elapsed = time.monotonic() - started
            call.cancel()
        assert stored == keys
        assert messages <= elapsed / 0.2 + 2, (messages, elapsed)
        # The client's own gap reached the server.
        assert 0.2 in {subscriber._gap_s for subscriber in server.feed._subscribers}
        await eventually(lambda: spaced.mirror.feed_seq == server.feed.seq)
        assert spaced.is_cached(keys) == [True] * len(keys)
        with pytest.raises(InvalidArgumentError, match="feed_gap_s must be 0"):
            MMCacheClient(target, feed_gap_s=6)


async def test_a_mirror_resyncs_after_a_server_restart() -> None:
    first = MMCacheServer(server_config())
    await first.start()
    port = first.port
    async with MMCacheClient(f"127.0.0.1:{port}", timeout=20) as client:
        await client.wait_following()
        await client.get_and_update([image_item(1)], ["old"], lease=False)
        old = client.instance_id
        await first.stop(grace=0)
        await eventually(lambda: not client.following)
        async with serving(port=port) as second:
            async with MMCacheClient(f"127.0.0.1:{port}") as other:
                await other.get_and_update([image_item(2)], ["new"], lease=False)
            await eventually(lambda: client.following and client.instance_id == second.instance_id)
            assert client.instance_id != old
            await eventually(lambda: client.is_cached(["old", "new"]) == [False, True])


_SLOW_SUBSCRIBER = """
import asyncio, sys, grpc
from mmcache.v1 import cache_pb2 as pb
async def main():
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(sys.argv[1], options=options) as channel:
        call = channel.unary_stream("/mmcache.v1.MMCache/Subscribe")(b"")
        await anext(aiter(call))
        print("subscribed", flush=True)
        await asyncio.sleep(600)  # reads nothing more
asyncio.run(main())
"""


async def test_an_idle_follower_forgets_removals_the_feed_has_passed() -> None:
    item_bytes = size_of(0, 100)
    async with serving(capacity_bytes=20 * item_bytes) as server:
        async with connected(server) as idle, connected(server, follow=False) as busy:
            for i in range(300):  # every upload past the 20th evicts one
                await busy.get_and_update([image_item(i, 100)], [f"k{i}"], lease=False)
            await eventually(lambda: idle.mirror.feed_seq == server.feed.seq)
            assert len(idle.mirror._gone) == 0
            assert sorted(idle.mirror.keys()) == sorted(store_of(server).keys())


async def test_clear_on_a_following_client_keeps_it_following(
    server: MMCacheServer,
) -> None:
    async with connected(server) as client:
        await client.get_and_update([image_item(1)], ["kept"])  # leased: Clear keeps it
        await client.get_and_update([image_item(2)], ["gone"], lease=False)
        await client.clear_cache()
        await eventually(lambda: client.is_cached(["kept", "gone"]) == [True, False])
        assert client.following and client.feed is not None
        assert client.feed.resubscribes == 0
        samples = await scrape(server.metrics_port)
        assert sample(samples, "mmcache_leases") == 1
        assert sample(samples, "mmcache_leased_bytes") == store_of(server).peek("kept").size  # type: ignore[union-attr]


async def test_a_subscriber_that_dies_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as server, connected(server, follow=False) as writer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-c", _SLOW_SUBSCRIBER, f"127.0.0.1:{server.port}"),
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"subscribed\n"
        assert server.feed.subscribers == 1
        for i in range(300):  # more than its window: the server's writes to it stall
            await writer.get_and_update([image_item(i, 10)], [f"k{i}" + "x" * 200], lease=False)
        proc.kill()
        await proc.wait()
        for i in range(300, 400):
            await writer.get_and_update([image_item(i, 10)], [f"k{i}" + "x" * 200], lease=False)
        await eventually(lambda: server.feed.subscribers == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_mirrors_in_other_processes_see_what_each_frontend_uploaded() -> None:
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"

        def frontend(*seeds: int) -> list[str]:
            done = subprocess.run(
                [sys.executable, "-m", "tests.frontend_proc", target, *map(str, seeds)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout.split()

        # Three frontend processes at once, overlapping images.
        outs = await asyncio.gather(
            *(asyncio.to_thread(frontend, *s) for s in ((1, 2, 3), (3, 4), (5, 1)))
        )
        assert all(out[0] == "uploaded" for out in outs)
        assert sorted(store_of(server).keys()) == [f"img-{s}" for s in range(1, 6)]
        # A later frontend process knows all of it before its first call.
        out = await asyncio.to_thread(frontend, 1, 2, 3, 4, 5)
        assert out == ["uploaded", "5", "5"]


# ---------------------------------------------------------------- metadata


async def test_a_frontend_that_never_processed_an_item_gets_its_metadata_with_the_hit() -> None:
    async with serving() as server, connected(server) as a, connected(server) as b:
        blob = b'{"prompt_updates": [{"modality": "image", "tokens": 64}]}'
        await a.get_and_update([image_item(1)], ["img"], metadata=[blob])
        result = await b.get_and_update([None], ["img"], want_metadata=True)
        assert list(result) == [None] and result.metadata == [blob]
        # Charged in the item's size, so the capacity bounds it too.
        assert store_of(server).peek("img").size == size_of(1, 256) + len(blob)  # type: ignore[union-attr]
        # Not asked for: not sent.
        assert (await b.get_and_update([None], ["img"])).metadata == [None]


async def test_lookup_asks_without_data_and_a_later_upload_is_no_second_query() -> None:
    async with serving() as server, connected(server) as a, connected(server) as b:
        await a.get_and_update([image_item(1)], ["held"], metadata=[b"m"], lease=False)
        found = await b.lookup(["held", "absent"], modality="image", want_metadata=True)
        assert found.held == [True, False] and found.metadata == [b"m", None]
        assert store_of(server).leases == 1  # the hit, for the engine's read
        # The frontend processes what was absent and sends it, as a re-send.
        await b.get_and_update([image_item(2)], ["absent"], resend=[True], lease=False)
        samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_queries_total", modality="image") == 3  # held x2, absent
    assert sample(samples, "mmcache_hits_total", modality="image") == 1
    assert sample(samples, "mmcache_resends_total", modality="image") == 1


async def test_a_hit_whose_metadata_the_caller_needs_and_lacks_counts_as_a_miss() -> None:
    # vLLM's frontend cannot use an item without its prompt updates: it
    # processes it, and counts a miss; so does the server.
    async with serving() as server, connected(server) as a, connected(server) as b:
        await a.get_and_update([image_item(1)], ["bare"], lease=False)  # no metadata
        await a.get_and_update([image_item(2)], ["full"], metadata=[b"m"], lease=False)
        found = await b.lookup(["bare", "full"], modality="image", want_metadata=True)
        assert found.held == [True, True] and found.metadata == [None, b"m"]
        await b.get_and_update([None], ["bare"], lease=False)  # not asked: a hit
        samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_queries_total", modality="image") == 5
    assert sample(samples, "mmcache_hits_total", modality="image") == 2  # full, bare unasked


async def test_metadata_over_the_limit_is_refused_with_the_limit(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    too_big = b"x" * (64 * 1024 + 1)
    with pytest.raises(InvalidArgumentError, match="65536"):
        await client.get_and_update([image_item(1)], ["m"], metadata=[too_big])
    # The server refuses it too, for a client that does not check.
    spec = tensor_spec("uint8", [3])
    request = pb.UpdateRequest(entries=[data_entry("m", spec, 1, metadata=too_big)])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_unary(f"{SERVICE}/GetAndUpdate")

        async def frames() -> AsyncIterator[bytes]:
            yield pb.UpdateFrame(header=request).SerializeToString()
            yield chunk(b"abc")

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(frames(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "65536" in (info.value.details() or "") and "m" not in store_of(server)


# ---------------------------------------------------------------- one hash, two uploads


def upload_begun(channel: grpc.aio.Channel, mm_hash: str, encoded: EncodedItem) -> Any:
    """Another frontend's raw upload of `mm_hash`: its header is in, its bytes not yet."""
    request = pb.UpdateRequest(lease=pb.LEASE_HELD)
    request.entries.add(mm_hash=mm_hash, modality="image", item=encoded.spec.message, num_chunks=1)
    return channel.stream_unary(f"{SERVICE}/GetAndUpdate")(
        metadata=(("mmcache-update-header-bin", request.SerializeToString()),)
    )


async def test_a_second_frontend_does_not_ship_an_item_whose_upload_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Room for a slow machine:
    monkeypatch.setattr("mmcache.server.cache._deadline.UPLOAD_WAIT_S", 5.0)
    item = image_item(9, numel=MIB // 4)  # 1 MiB of pixels
    encoded = encode_item(item)
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(target) as channel, connected(server) as b:
            call = upload_begun(channel, "same", encoded)  # frontend a's
            await eventually(lambda: b.mirror.is_pending("same"))
            assert b.is_cached(["same"]) == [False]  # pending is not cached
            # b has the item too: it sends the hash alone and the server waits.
            b_call = asyncio.create_task(b.get_and_update([item], ["same"]))
            await asyncio.sleep(0.1)
            assert not b_call.done()
            payload = b"".join(t.contiguous().view(-1).numpy().tobytes() for t in encoded.tensors)  # type: ignore[union-attr]
            await call.write(chunk(payload))
            await call.done_writing()
            assert list(pb.UpdateReply.FromString(await call).outcomes) == [pb.OUTCOME_STORED]
            assert list(await b_call) == [None]  # a hit: its bytes stayed home
            samples = await scrape(server.metrics_port)
            assert (await b.fetch(["same"]))[0] == item
    assert sample(samples, "mmcache_received_bytes_total") == len(payload)
    assert sample(samples, "mmcache_upload_waits_total") == 1
    assert sample(samples, "mmcache_hits_total", modality="image") == 1


async def test_a_lookup_waits_for_an_upload_in_flight_no_longer_than_it_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frontend gives its processing time (`wait_s`): past it the hash is a
    miss and it processes the item itself, rather than stall its requests."""
    monkeypatch.setattr("mmcache.server.cache._deadline.UPLOAD_WAIT_S", 5.0)
    item = image_item(9, numel=MIB // 4)
    encoded = encode_item(item)
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(target) as channel, connected(server) as b:
            call = upload_begun(channel, "slow", encoded)
            await eventually(lambda: b.mirror.is_pending("slow"))
            loop = asyncio.get_running_loop()
            started = loop.time()
            found = await b.lookup(["slow"], wait_s=0.05)
            waited = loop.time() - started
            assert found.held == [False]  # a miss: b processes it
            assert 0.04 <= waited < 2.0  # it waited its 50 ms, not the server's 5 s
            call.cancel()
        samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_upload_waits_total") == 1


async def test_a_new_item_claimed_by_one_frontend_is_processed_once() -> None:
    """Single flight: the first lookup that misses claims the item for its
    caller; another frontend's lookup waits for that caller's upload and hits,
    instead of processing the item a second time. The claim is not on the
    feed: the claimer's own mirror never takes it for an upload in flight."""
    item = image_item(3, numel=20_000)
    async with serving() as server:
        async with connected(server) as a, connected(server) as b:
            mine = await a.lookup(["new"], modality="image", wait_s=0.2, claim_s=5.0)
            assert mine.held == [False]  # a processes it
            await asyncio.sleep(0.05)  # a feed message would have come by now
            assert not a.mirror.is_pending("new") and not b.mirror.is_pending("new")
            loop = asyncio.get_running_loop()
            started = loop.time()
            waiting = asyncio.create_task(b.lookup(["new"], modality="image", wait_s=3.0))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # b waits for a's upload
            stored = await a.get_and_update([item], ["new"], resend=[True], processed=True)
            assert stored.held == [True]
            found = await waiting
            assert found.held == [True] and loop.time() - started < 2.0
            assert (await b.fetch(["new"]))[0] == item
            samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_claims_total") == 1
    assert sample(samples, "mmcache_claim_expiries_total") == 0
    assert sample(samples, "mmcache_upload_waits_total") == 1
    # a's lookup and upload are one query (a miss); b's, a hit.
    assert sample(samples, "mmcache_queries_total", modality="image") == 2
    assert sample(samples, "mmcache_hits_total", modality="image") == 1


async def test_a_claim_nobody_uploads_costs_a_waiter_its_own_bound_then_ends() -> None:
    """A claimer that died or declined: a waiter waits the server's bound at
    most (0.5 s, past its own `wait_s`: a claimer normally uploads sooner than
    the waiter would process), and the claim ends with its time; the next
    lookup claims it anew."""
    async with serving() as server:
        async with connected(server) as a, connected(server) as b:
            assert (await a.lookup(["gone"], claim_s=5.0)).held == [False]
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert (await b.lookup(["gone"], wait_s=0.1)).held == [False]
            assert 0.45 <= loop.time() - started < 2.0  # the server's 0.5 s, not the claim's 5 s
            assert (await a.lookup(["short"], claim_s=0.2)).held == [False]
            started = loop.time()
            assert (await b.lookup(["short"], wait_s=0.1, claim_s=1.0)).held == [False]
            assert loop.time() - started < 0.45  # the claim's 200 ms ran out first
            # b claimed it in turn: a's next lookup waits for b now.
            started = loop.time()
            assert (await a.lookup(["short"], wait_s=0.1)).held == [False]
            assert loop.time() - started >= 0.45
            with pytest.raises(InvalidArgumentError, match="claim_s"):
                await a.lookup(["x"], claim_s=-1.0)
            samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_claims_total") == 3
    assert sample(samples, "mmcache_claim_expiries_total") == 1


async def test_a_stalled_upload_costs_a_waiter_a_resend_not_a_hang() -> None:
    item = image_item(5, numel=1000)
    encoded = encode_item(item)
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(target) as channel, connected(server) as b:
            request = pb.UpdateRequest()
            request.entries.add(
                mm_hash="stuck", modality="image", item=encoded.spec.message, num_chunks=1
            )
            stalled = channel.stream_unary(f"{SERVICE}/GetAndUpdate")(
                metadata=(("mmcache-update-header-bin", request.SerializeToString()),)
            )  # its header is in; its bytes never come
            await eventually(lambda: b.is_cached(["stuck"], pending=True) == [True])
            assert b.is_cached(["stuck"]) == [False]
            # A frontend that trusted the pending mark and skipped its processor:
            start = time.monotonic()
            with pytest.raises(CacheMissError) as info:
                await b.get_and_update([None], ["stuck"])
            assert info.value.missing_hashes == ["stuck"]
            # One with the data: sends the hash alone, waits, then re-sends.
            sent = await b.get_and_update([item], ["stuck"])
            took = time.monotonic() - start
            assert sent[0] is item and sent.held == [True] and took < 3
            stalled.cancel()
            assert (await b.fetch(["stuck"]))[0] == item


async def test_the_same_new_item_from_two_frontends_at_once_is_stored_once() -> None:
    items = [image_item(i, numel=50_000) for i in range(8)]
    hashes = [f"both-{i}" for i in range(8)]
    async with serving() as server:
        async with connected(server, follow=False) as a, connected(server, follow=False) as b:
            ra, rb = await asyncio.gather(
                a.get_and_update(items, hashes), b.get_and_update(items, hashes)
            )
            assert len(store_of(server)) == 8 and store_of(server).leases == 16
            assert await a.fetch(hashes) == items
            samples = await scrape(server.metrics_port)
    # Every item was a query of each frontend; each stored exactly once.
    assert sample(samples, "mmcache_queries_total", modality="image") == 16
    assert all(x is None or x is items[i] for r in (ra, rb) for i, x in enumerate(r))


# ---------------------------------------------------------------- one client, many tasks


async def test_one_client_used_from_64_tasks_stays_exact() -> None:
    item_bytes = size_of(0, 1000)
    async with serving(capacity_bytes=30 * item_bytes) as server:
        async with connected(server) as client, connected(server) as engine:
            rng = random.Random(11)
            asked = 0

            async def task() -> None:
                nonlocal asked
                for _ in range(6):
                    seeds = rng.sample(range(80), rng.randint(1, 4))
                    hashes = [f"t{s}" for s in seeds]
                    asked += len(hashes)
                    sent = await client.get_and_update([image_item(s, 1000) for s in seeds], hashes)
                    await engine.fetch(
                        [h for h, held in zip(hashes, sent.held, strict=True) if held]
                    )

            await asyncio.gather(*(task() for _ in range(64)))
            samples = await scrape(server.metrics_port)
            await eventually(lambda: client.mirror.feed_seq == server.feed.seq)
            assert sorted(client.mirror.keys()) == sorted(store_of(server).keys())
    queries = sample(samples, "mmcache_queries_total", modality="image")
    hits = sample(samples, "mmcache_hits_total", modality="image")
    assert queries == asked == client.make_stats().total
    assert hits == client.make_stats().hits


# ---------------------------------------------------------------- fail-open


def _silent_listener() -> tuple[socket.socket, int]:
    """A TCP port that accepts connections and never answers (a hung server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()[1]


async def test_fail_open_hands_items_back_fast_when_the_server_hangs() -> None:
    sock, port = _silent_listener()
    try:
        async with MMCacheClient(f"127.0.0.1:{port}", fail_open=FailOpen(0.3)) as client:
            assert client.is_cached(["a"]) == [False]
            items = [image_item(1), image_item(2)]
            start = time.monotonic()
            result = await client.get_and_update(items, ["a", "b"])
            took = time.monotonic() - start
            assert list(result) == items and took < 2.0
            assert client.fail_opens >= 2  # the connect, then the call
            with pytest.raises(CacheMissError):  # no data to hand back
                await client.get_and_update([None], ["a"])
    finally:
        sock.close()


async def test_fail_open_comes_back_in_touch_when_the_server_returns() -> None:
    first = MMCacheServer(server_config())
    await first.start()
    port = first.port
    async with MMCacheClient(f"127.0.0.1:{port}", fail_open=FailOpen(0.5)) as client:
        await client.wait_following()
        await client.get_and_update([image_item(1)], ["a"])
        assert client.is_cached(["a"]) == [True]
        await first.stop(grace=0)
        result = await client.get_and_update([image_item(2)], ["b"])
        assert list(result) == [image_item(2)] and client.fail_opens == 1
        assert client.is_cached(["a"]) == [False]  # out of touch
        async with serving(port=port) as second:
            await eventually(lambda: client.following)
            assert client.instance_id == second.instance_id
            assert list(await client.get_and_update([image_item(2)], ["b"])) == [image_item(2)]
            assert client.is_cached(["b"]) == [True] and "b" in store_of(second)


def test_lease_flag_and_variable() -> None:
    from mmcache.server._config import parse_serve_args

    assert parse_serve_args([]).lease_s == ServerConfig().lease_s == 30.0
    assert parse_serve_args(["--lease-s", "2.5"]).lease_s == 2.5
    with pytest.raises(SystemExit):
        parse_serve_args(["--lease-s", "0"])
