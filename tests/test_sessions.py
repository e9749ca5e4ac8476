"""Upload sessions (UpdateSession): batch after batch over one stream kept open."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mmcache.client import CacheMissError, MMCacheClient
from mmcache.server import MMCacheServer
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, eventually, scrape, server_config
from .items import image_item
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
    assert all(f"s{i}" in server.store for i in range(3)) and "bad" not in server.store
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
    async with MMCacheClient(f"127.0.0.1:{server.port}", sessions=2) as client:
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
        async with MMCacheClient(f"127.0.0.1:{server.port}", follow=False) as client:
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
            assert "b" in second.store
        finally:
            await second.stop(grace=0)


async def test_a_put_cancelled_mid_session_leaves_nothing_and_the_next_one_works(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    await client.get_and_update([image_item(1)], ["warm"])  # the session opens
    big = image_item(2, numel=16 * MIB)  # 64 MiB: many chunk frames
    task = asyncio.create_task(client.get_and_update([big], ["big"]))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):  # the server sees the stream end, and drops the partial batch
        if server.inflight.used == 0:
            break
        await asyncio.sleep(0.02)
    assert server.inflight.used == 0 and "big" not in server.store
    # Its hash is no longer marked pending: a hash-only query does not wait on it.
    started = time.monotonic()
    with pytest.raises(CacheMissError):
        await client.get_and_update([None], ["big"])
    assert time.monotonic() - started < 0.4  # UPLOAD_WAIT_S is 0.5
    assert await client.get_and_update([image_item(3)], ["after"]) == [image_item(3)]
    assert (await client.fetch(["after"]))[0] == image_item(3)
