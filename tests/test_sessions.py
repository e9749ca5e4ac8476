"""Upload sessions (UpdateSession): batch after batch over one stream kept open."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mmcache.client import CacheMissError, MMCacheClient, ResourceExhaustedError
from mmcache.server import MMCacheServer
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, connected, eventually, sample, scrape, server_config, serving, store_of
from .items import image_item
from .proxy import Proxy
from .raw import SERVICE, chunk, data_entry, header, tensor_spec

_SESSION = {"grpc_method": "UpdateSession", "grpc_type": "bidi_stream"}


def handled(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], code: str) -> float:
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "grpc_server_handled_total"
        and dict(labels).get("grpc_method") == "UpdateSession"
        and dict(labels).get("grpc_code") == code
    )


def session(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall[bytes, bytes]:
    method: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
        f"{SERVICE}/UpdateSession"
    )
    return method()


async def test_a_raw_session_answers_each_batch_in_order_and_a_bad_one_ends_it(
    server: MMCacheServer,
) -> None:
    spec = tensor_spec("float32", [4])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = session(channel)
        for i in range(3):
            await call.write(header(data_entry(f"s{i}", spec, 1)))
            await call.write(chunk(bytes(range(16))))
            reply = pb.UpdateReply.FromString(await call.read())
            assert list(reply.outcomes) == [pb.OUTCOME_STORED]
        await call.write(header(pb.UpdateEntry(mm_hash="s0")))  # a hit, no data
        assert list(pb.UpdateReply.FromString(await call.read()).outcomes) == [pb.OUTCOME_HIT]
        # Two chunks declared, one sent, then the next header: refused, the
        # session ends with the status GetAndUpdate would have had.
        await call.write(header(data_entry("bad", spec, 2)))
        await call.write(chunk(bytes(16)))
        await call.write(header(pb.UpdateEntry(mm_hash="s1")))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(f"s{i}" in store_of(server) for i in range(3)) and "bad" not in store_of(server)
    samples = await scrape(server.metrics_port)
    assert handled(samples, "OK") == 4 and handled(samples, "InvalidArgument") == 1


async def test_a_session_header_in_metadata_is_refused(server: MMCacheServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        method: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
            f"{SERVICE}/UpdateSession"
        )
        call = method(metadata=(("mmcache-update-header-bin", b"\x00"),))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "first frame" in (caught.value.details() or "")


async def test_concurrent_puts_share_a_few_sessions_and_the_rest_make_calls(
    server: MMCacheServer,
) -> None:
    async with connected(server, sessions=2) as client:
        items = [image_item(i, numel=MIB // 8) for i in range(24)]
        results = await asyncio.gather(
            *(client.get_and_update([item], [f"c{i}"]) for i, item in enumerate(items))
        )
        assert [r[0] for r in results] == items
        assert server.sessions.opened <= 2
        fetched = await client.fetch([f"c{i}" for i in range(24)])
        assert fetched == items
    samples = await scrape(server.metrics_port)
    calls = sum(
        value
        for (name, labels), value in samples.items()
        if name == "grpc_server_started_total"
        and dict(labels).get("grpc_method") in ("GetAndUpdate", "GetAndUpdateOne")
    )
    assert handled(samples, "OK") + calls == 24  # every put once, one way or the other


async def test_a_stopping_server_ends_idle_sessions_without_waiting_its_grace() -> None:
    server = MMCacheServer(server_config(grace_s=10))
    await server.start()
    try:
        # No feed: its stream would hold the stop for the grace, sessions apart.
        async with connected(server, follow=False) as client:
            await client.get_and_update([image_item(1)], ["a"])
            # Open, waiting for the next batch (it gets there just after its reply).
            await eventually(lambda: server.sessions.waiting == 1)
            started = time.monotonic()
            await server.stop()
            assert time.monotonic() - started < 5
            assert server.sessions.waiting == 0
    finally:
        await server.stop(grace=0)


async def test_a_put_after_a_restart_goes_through_on_the_new_server() -> None:
    first = MMCacheServer(server_config())
    await first.start()
    port = first.port
    async with MMCacheClient(f"127.0.0.1:{port}") as client:
        await client.get_and_update([image_item(1)], ["a"])  # a session is now open
        await first.stop(grace=0)
        second = MMCacheServer(server_config(port=port))
        await second.start()
        try:
            # The old session is gone: the batch goes again, as a call, and lands.
            assert await client.get_and_update([image_item(2)], ["b"]) == [image_item(2)]
            assert "b" in store_of(second)
        finally:
            await second.stop(grace=0)


async def test_a_put_cancelled_mid_session_leaves_nothing_and_the_next_one_works(
    server: MMCacheServer, client: MMCacheClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mmcache.server.cache._deadline.UPLOAD_WAIT_S", 5.0)
    await client.get_and_update([image_item(1)], ["warm"])  # the session opens
    big = image_item(2, numel=16 * MIB)  # 64 MiB: many chunk frames
    task = asyncio.create_task(client.get_and_update([big], ["big"]))
    # Cancelled once the server is reading it (a fixed sleep lets a fast machine finish).
    await eventually(lambda: server.cache.stats(drain=False).inflight_bytes > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The server sees the stream end, and drops the partial batch.
    await eventually(lambda: server.cache.stats(drain=False).inflight_bytes == 0)
    assert "big" not in store_of(server)
    # Its hash is no longer marked pending: a hash-only query does not wait on it.
    started = time.monotonic()
    with pytest.raises(CacheMissError):
        await client.get_and_update([None], ["big"])
    assert time.monotonic() - started < 2.5  # it did not wait out UPLOAD_WAIT_S
    assert await client.get_and_update([image_item(3)], ["after"]) == [image_item(3)]
    assert (await client.fetch(["after"]))[0] == image_item(3)


def queries(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(value for (name, _), value in samples.items() if name == "mmcache_queries_total")


def named(batch_id: bytes, *entries: pb.UpdateEntry) -> bytes:
    return pb.UpdateFrame(
        header=pb.UpdateRequest(entries=entries, batch_id=batch_id)
    ).SerializeToString()


async def test_a_batch_sent_again_under_its_id_gets_its_reply_and_is_not_applied_twice(
    server: MMCacheServer,
) -> None:
    spec = tensor_spec("float32", [4])
    frames = [named(b"batch-01", data_entry("s", spec, 1)), chunk(bytes(range(16)))]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = session(channel)
        for frame in frames:
            await call.write(frame)
        first = await call.read()
        assert list(pb.UpdateReply.FromString(first).outcomes) == [pb.OUTCOME_STORED]
        # The same batch again, as a call: the first reply, not a second query
        # (REPLACED, a hit).
        again: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(
            f"{SERVICE}/GetAndUpdate"
        )
        assert await again(iter(frames), timeout=10) == first
        # Another id is another batch.
        other = [named(b"batch-02", data_entry("s", spec, 1)), chunk(bytes(range(16)))]
        reply = pb.UpdateReply.FromString(await again(iter(other), timeout=10))
        assert list(reply.outcomes) == [pb.OUTCOME_REPLACED]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await again(iter([named(b"short", data_entry("t", spec, 1)), chunk(bytes(16))]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch_id has 5 bytes" in (caught.value.details() or "")
        await call.done_writing()
    assert queries(await scrape(server.metrics_port)) == 2
    assert "t" not in store_of(server)


async def test_a_copy_of_a_batch_still_under_way_ends_that_run_and_is_applied_once(
    server: MMCacheServer,
) -> None:
    spec = tensor_spec("float32", [8])
    entry = data_entry("w", spec, 2)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = session(channel)
        await call.write(named(b"batch-03", entry))
        await call.write(chunk(bytes(16)))  # one chunk of two: the run waits for the other
        await eventually(lambda: server.cache.stats(drain=False).inflight_bytes > 0)
        again: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(
            f"{SERVICE}/GetAndUpdate"
        )
        frames = [named(b"batch-03", entry), chunk(bytes(16)), chunk(bytes(range(16)))]
        reply = pb.UpdateReply.FromString(await again(iter(frames), timeout=10))
        assert list(reply.outcomes) == [pb.OUTCOME_STORED]
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # the run it took over from
            await call.read()
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "took over" in (caught.value.details() or "")
    assert queries(await scrape(server.metrics_port)) == 1
    assert server.cache.stats(drain=False).inflight_bytes == 0


async def test_a_session_dropped_before_its_reply_counts_the_batch_once() -> None:
    async with (
        serving() as server,
        Proxy(server.port) as proxy,
        connected(proxy, follow=False, timeout=10) as client,
    ):
        await client.get_and_update([image_item(1)], ["warm"])  # the session opens
        proxy.hold_replies()
        put = asyncio.create_task(client.get_and_update([image_item(2)], ["x"]))
        await eventually(lambda: "x" in store_of(server))  # applied; its reply held back
        proxy.drop()  # the link fails: the client sends the batch again, as a call
        assert await put == [image_item(2)]
        samples = await scrape(server.metrics_port)
        assert queries(samples) == 2  # warm and x, once each
        assert sample(samples, "mmcache_hits_total", modality="image") == 0
        assert store_of(server).leases == 2  # one lease each, not two on x
        assert (await client.fetch(["x"]))[0] == image_item(2)


async def test_a_session_names_its_namespace_again_with_each_batch() -> None:
    async with serving(max_namespaces=2) as server:
        target = f"127.0.0.1:{server.port}"
        async with MMCacheClient(target, namespace="a", follow=False) as a:
            with pytest.raises(CacheMissError):
                await a.get_and_update([None], ["x"])  # a session opens in "a", which holds nothing
            await asyncio.sleep(1.1)  # idle namespaces are looked for at most once a second
            async with MMCacheClient(target, namespace="b", follow=False) as b:
                await b.get_and_update([image_item(1)], ["y"])  # "a" forgotten, "b" made
            # Over the session opened in "a": refused, as a call in "a" would be.
            with pytest.raises(ResourceExhaustedError, match="namespace 'a' would be one more"):
                await a.get_and_update([image_item(2)], ["z"])
        assert len(server.namespaces) == 2


async def test_a_server_started_again_takes_sessions_again() -> None:
    server = MMCacheServer(server_config())
    await server.start()
    await server.stop()
    await server.start()
    try:
        async with connected(server, follow=False) as client:
            for i in range(3):
                await client.get_and_update([image_item(i)], [f"k{i}"])
        assert handled(await scrape(server.metrics_port), "OK") == 3  # all three over a session
    finally:
        await server.stop()


async def test_a_session_batch_waits_for_another_upload_only_within_its_own_time(
    server: MMCacheServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Times with room for a slow machine: a wait of 5 s, a batch's time of 2 s,
    # of which the server keeps 1 s to answer.
    monkeypatch.setattr("mmcache.server.cache._deadline.UPLOAD_WAIT_S", 5.0)
    monkeypatch.setattr("mmcache.server.cache._deadline.ANSWER_MARGIN_S", 1.0)
    spec = tensor_spec("float32", [8])
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        connected(server, follow=False, timeout=2.0) as client,
    ):
        await client.get_and_update([image_item(1)], ["warm"])  # the session opens
        # Another client's upload of "p" stalls halfway: "p" is pending.
        upload = session(channel)
        await upload.write(header(data_entry("p", spec, 2)))
        await upload.write(chunk(bytes(16)))
        await eventually(lambda: "p" in server.cache.pending)
        # A query of "p" over the session would wait 5 s for it; its batch
        # said 2 s, so it is answered MISSING in time, as a call would be.
        started = time.monotonic()
        with pytest.raises(CacheMissError):
            await client.get_and_update([None], ["p"])
        assert time.monotonic() - started < 2.0
        assert server.sessions.opened == 2  # the client's session lived on (and the raw one)
        upload.cancel()


async def test_past_the_servers_session_limit_batches_go_as_calls() -> None:
    async with serving(max_sessions=1) as server:
        target = f"127.0.0.1:{server.port}"
        async with (
            MMCacheClient(target, follow=False) as first,
            MMCacheClient(target, follow=False) as second,
        ):
            await first.get_and_update([image_item(1)], ["a"])  # the one session
            for i in range(3):  # refused a session once, then calls without asking again
                assert await second.get_and_update([image_item(2 + i)], [f"b{i}"]) == [
                    image_item(2 + i)
                ]
            samples = await scrape(server.metrics_port)
            assert handled(samples, "ResourceExhausted") == 1
            assert sample(samples, "mmcache_upload_sessions") == 1
            assert all(f"b{i}" in store_of(server) for i in range(3))
