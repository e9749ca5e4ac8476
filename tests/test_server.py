"""The server over real gRPC with hand-built frames: semantics and bad input."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import status_pb2

from mmcache.server import MMCacheServer
from mmcache.v1 import cache_pb2 as pb

from .conftest import MIB, sample, scrape, serving, store_of
from .raw import SERVICE, chunk, data_entry, fetch, header, tensor_spec, update, update_one


@pytest.fixture
async def channel(server: MMCacheServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def put_frames(mm_hash: str, data: bytes, dtype: str = "uint8") -> list[bytes]:
    spec = tensor_spec(dtype, [len(data)])
    return [header(data_entry(mm_hash, spec, 1, modality="image")), chunk(data)]


async def test_store_then_hit_then_fetch_returns_the_same_frames(
    server: MMCacheServer, channel: grpc.aio.Channel
) -> None:
    reply = await update(channel, put_frames("h1", b"\x01\x02\x03"))
    assert list(reply.outcomes) == [pb.OUTCOME_STORED]
    assert reply.instance_id == server.instance_id
    reply = await update(channel, [header(pb.UpdateEntry(mm_hash="h1", modality="image"))])
    assert list(reply.outcomes) == [pb.OUTCOME_HIT]
    frames = await fetch(channel, ["h1"])
    head = pb.FetchFrame.FromString(frames[0]).header
    assert [i.mm_hash for i in head.items] == ["h1"] and head.items[0].num_chunks == 1
    assert pb.FetchFrame.FromString(frames[1]).chunk == b"\x01\x02\x03"


async def test_the_unary_form_stores_and_looks_up_like_the_stream(
    server: MMCacheServer, channel: grpc.aio.Channel
) -> None:
    spec = tensor_spec("uint8", [3])
    put = pb.UpdateRequest(entries=[data_entry("h", spec, 1, modality="image")])
    reply = await update_one(channel, chunk(b"xyz"), metadata_header=put.SerializeToString())
    assert list(reply.outcomes) == [pb.OUTCOME_STORED] and list(reply.sizes) == [3]
    assert reply.instance_id == server.instance_id
    # No data: an empty request with the header in metadata ...
    hit = pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash="h", modality="image")])
    reply = await update_one(channel, b"", metadata_header=hit.SerializeToString())
    assert list(reply.outcomes) == [pb.OUTCOME_HIT]
    # ... or the header frame itself as the request.
    reply = await update_one(channel, header(pb.UpdateEntry(mm_hash="gone", modality="image")))
    assert list(reply.outcomes) == [pb.OUTCOME_MISSING]
    frames = await fetch(channel, ["h"])
    assert pb.FetchFrame.FromString(frames[1]).chunk == b"xyz"
    queried = await scrape(server.metrics_port)
    assert sample(queried, "mmcache_queries_total", modality="image") == 3
    assert sample(queried, "mmcache_hits_total", modality="image") == 1


@pytest.mark.parametrize(
    ("request_bytes", "metadata", "message"),
    [
        (b"", None, "GetAndUpdate got no header"),
        (chunk(b"123"), None, "first GetAndUpdate frame (the call has no"),
        (
            chunk(b"123"),
            pb.UpdateRequest(entries=[data_entry("h", tensor_spec("uint8", [3]), 2)]),
            "ended after 1 of the 2 chunks",
        ),
        (
            b"",
            pb.UpdateRequest(entries=[data_entry("h", tensor_spec("uint8", [3]), 1)]),
            "ended after 0 of the 1 chunks",
        ),
        (
            header(pb.UpdateEntry(mm_hash="h")),
            pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash="h")]),
            "send one or the other",
        ),
        (
            chunk(b"1234"),
            pb.UpdateRequest(entries=[data_entry("h", tensor_spec("uint8", [3]), 1)]),
            "declares 3 payload bytes",
        ),
    ],
    ids=["empty", "chunk-without-header", "too-few-chunks", "no-chunk", "two-headers", "sizes"],
)
async def test_bad_unary_input_is_invalid_argument_and_nothing_is_lost(
    server: MMCacheServer,
    channel: grpc.aio.Channel,
    request_bytes: bytes,
    metadata: pb.UpdateRequest | None,
    message: str,
) -> None:
    await update(channel, put_frames("kept", b"keep me"))
    md = None if metadata is None else metadata.SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await update_one(channel, request_bytes, metadata_header=md)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert dict(info.value.trailing_metadata())["mmcache-instance-id"] == server.instance_id
    assert "h" not in store_of(server) and len(store_of(server)) == 1
    assert list((await update_one(channel, header(pb.UpdateEntry(mm_hash="kept")))).outcomes) == [
        pb.OUTCOME_HIT
    ]


async def test_the_header_may_travel_as_metadata(
    server: MMCacheServer, channel: grpc.aio.Channel
) -> None:
    spec = tensor_spec("uint8", [5])
    request = pb.UpdateRequest(entries=[data_entry("h", spec, 2, modality="image")])
    reply = await update(
        channel, [chunk(b"abc"), chunk(b"de")], metadata_header=request.SerializeToString()
    )
    assert list(reply.outcomes) == [pb.OUTCOME_STORED]
    # A call of hash-only entries then needs no message at all.
    hit = pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash="h", modality="image")])
    reply = await update(channel, [], metadata_header=hit.SerializeToString())
    assert list(reply.outcomes) == [pb.OUTCOME_HIT]
    frames = await fetch(channel, ["h"])
    assert [pb.FetchFrame.FromString(f).chunk for f in frames[1:]] == [b"abc", b"de"]


async def test_a_header_frame_parses_as_the_protobuf_message(channel: grpc.aio.Channel) -> None:
    # What generated code writes for UpdateFrame(header=...) is what we read.
    request = pb.UpdateRequest(entries=[data_entry("h", tensor_spec("uint8", [2]), 1)])
    frame = pb.UpdateFrame(header=request).SerializeToString()
    assert frame == header(*request.entries)
    assert list((await update(channel, [frame, chunk(b"xy")])).outcomes) == [pb.OUTCOME_STORED]


async def test_hash_only_and_absent_is_reported_missing_not_an_error(
    channel: grpc.aio.Channel,
) -> None:
    reply = await update(channel, [header(pb.UpdateEntry(mm_hash="nobody"))])
    assert list(reply.outcomes) == [pb.OUTCOME_MISSING]


async def test_sent_data_replaces_the_entry(channel: grpc.aio.Channel) -> None:
    await update(channel, put_frames("h", b"old"))
    reply = await update(channel, put_frames("h", b"new!"))
    assert list(reply.outcomes) == [pb.OUTCOME_REPLACED]
    frames = await fetch(channel, ["h"])
    assert pb.FetchFrame.FromString(frames[1]).chunk == b"new!"


async def test_fetch_names_every_missing_hash(channel: grpc.aio.Channel) -> None:
    await update(channel, put_frames("here", b"x"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await fetch(channel, ["gone-1", "here", "gone-2"])
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "gone-1" in info.value.details() and "gone-2" in info.value.details()
    details = dict(info.value.trailing_metadata())["grpc-status-details-bin"]
    missing = pb.MissingItems()
    assert status_pb2.Status.FromString(details).details[0].Unpack(missing)
    assert list(missing.mm_hashes) == ["gone-1", "gone-2"]


async def test_fetch_changes_neither_order_nor_counters(server: MMCacheServer) -> None:
    async with serving(capacity_bytes=8) as small:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{small.port}") as ch:
            await update(ch, put_frames("a", b"1234"))
            await update(ch, put_frames("b", b"5678"))
            before = await scrape(small.metrics_port)
            await fetch(ch, ["a"])  # a read, not a use: a stays least recently used
            after = await scrape(small.metrics_port)
            await update(ch, put_frames("c", b"9abc"))
            assert "a" not in store_of(small) and "b" in store_of(small)
    for name in ("mmcache_queries_total", "mmcache_hits_total"):
        assert sample(before, name, modality="image") == sample(after, name, modality="image")


async def test_touch_of_missing_key_does_nothing_and_touch_reorders(
    server: MMCacheServer,
) -> None:
    async with serving(capacity_bytes=8) as small:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{small.port}") as ch:
            touch = ch.unary_unary(
                f"{SERVICE}/Touch",
                request_serializer=pb.TouchRequest.SerializeToString,
                response_deserializer=pb.TouchReply.FromString,
            )
            await update(ch, put_frames("a", b"1234"))
            await update(ch, put_frames("b", b"5678"))
            reply = await touch(pb.TouchRequest(mm_hashes=["a", "ghost"]))
            assert reply.touched == 1 and "ghost" not in store_of(small)
            await update(ch, put_frames("c", b"9abc"))
            assert "a" in store_of(small) and "b" not in store_of(small)


async def test_clear_empties_the_cache(server: MMCacheServer, channel: grpc.aio.Channel) -> None:
    await update(channel, put_frames("a", b"1"))
    clear = channel.unary_unary(
        f"{SERVICE}/Clear",
        request_serializer=pb.ClearRequest.SerializeToString,
        response_deserializer=pb.ClearReply.FromString,
    )
    assert (await clear(pb.ClearRequest())).removed == 1
    assert len(store_of(server)) == 0 and store_of(server).used == 0


async def test_the_item_bound_evicts_the_oldest_and_is_announced() -> None:
    async with serving(max_items=3) as bounded:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{bounded.port}") as ch:
            for i in range(5):  # a few bytes each: far below the byte capacity
                reply = await update(ch, put_frames(f"h{i}", b"xyz"))
                assert list(reply.outcomes) == [pb.OUTCOME_STORED] and reply.max_items == 3
            info = ch.unary_unary(
                f"{SERVICE}/Info",
                request_serializer=pb.InfoRequest.SerializeToString,
                response_deserializer=pb.InfoReply.FromString,
            )
            assert (await info(pb.InfoRequest())).max_items == 3
            samples = await scrape(bounded.metrics_port)
        assert store_of(bounded).keys() == ["h2", "h3", "h4"]
    assert sample(samples, "mmcache_max_items") == 3
    assert sample(samples, "mmcache_evictions_total") == 2


async def test_item_larger_than_capacity_is_not_stored_and_service_goes_on() -> None:
    async with serving(capacity_bytes=4) as small:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{small.port}") as ch:
            await update(ch, put_frames("kept", b"12"))
            reply = await update(ch, put_frames("huge", b"123456"))
            assert list(reply.outcomes) == [pb.OUTCOME_UNCACHED]
            withheld = pb.UpdateEntry(
                mm_hash="huge2", item=tensor_spec("float32", [100]), withheld=True
            )
            reply = await update(ch, [header(withheld)])
            assert list(reply.outcomes) == [pb.OUTCOME_UNCACHED]
            assert "kept" in store_of(small) and len(store_of(small)) == 1
            samples = await scrape(small.metrics_port)
    assert sample(samples, "mmcache_uncached_total", modality="unknown") == 1
    assert sample(samples, "mmcache_uncached_total", modality="image") == 1


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (
            [header(data_entry("h", tensor_spec("float99", [2]), 1)), chunk(b"12345678")],
            "unknown dtype 'float99'",
        ),
        (
            [header(data_entry("h", tensor_spec("float32", [4]), 1)), chunk(b"123")],
            "declares 16 payload bytes",
        ),
        (
            [header(data_entry("h", tensor_spec("uint8", [3]), 2)), chunk(b"123")],
            "ended after 1 of the 2 chunks",
        ),
        (
            [header(data_entry("h", tensor_spec("uint8", [3]), 1)), chunk(b"123"), chunk(b"4")],
            "more chunk frames",
        ),
        ([header(pb.UpdateEntry(mm_hash=""))], "mm_hash of entry 0 must not be empty"),
        (
            [header(data_entry("h", tensor_spec("uint8", [-3]), 1)), chunk(b"123")],
            "negative dimension",
        ),
        ([chunk(b"123")], "first GetAndUpdate frame (the call has no"),
        ([], "GetAndUpdate got no header"),
        (
            [header(data_entry("h", tensor_spec("uint8", [3]), 1)), b"\x12\x05abc"],
            "declares 5 bytes but carries 3",
        ),
        (
            [header(data_entry("h", tensor_spec("uint8", [8 << 20]), 1))],
            "cannot travel in 1 chunks",
        ),
        (
            [header(data_entry("h", tensor_spec("uint8", [3]), 1)) + chunk(b"123")],
            "must hold the header alone, with chunks in frames of their own",
        ),
        (
            [header(data_entry("h", tensor_spec("uint8", [3]), 1)), header(pb.UpdateEntry())],
            "expected a chunk frame (field 2)",
        ),
        ([b"\x0a\x7f" + header(pb.UpdateEntry(mm_hash="h"))[2:]], "declares a header of 127"),
        ([b"\x0a\xff"], "truncated length"),
        (
            [pb.UpdateFrame(header=pb.UpdateRequest(lease=7)).SerializeToString()],  # type: ignore[arg-type]
            "lease mode 7 is not one this server knows",
        ),
    ],
    ids=[
        "unknown-dtype",
        "sizes-disagree",
        "too-few-chunks",
        "too-many-chunks",
        "empty-hash",
        "negative-dim",
        "no-header",
        "empty-stream",
        "bad-frame-length",
        "chunk-count",
        "chunk-inside-the-header-frame",
        "second-header",
        "header-cut-short",
        "header-length-truncated",
        "unknown-lease-mode",
    ],
)
async def test_bad_input_is_invalid_argument_and_nothing_is_lost(
    server: MMCacheServer, channel: grpc.aio.Channel, frames: list[bytes], message: str
) -> None:
    await update(channel, put_frames("kept", b"keep me"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await update(channel, frames)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert dict(info.value.trailing_metadata())["mmcache-instance-id"] == server.instance_id
    assert "kept" in store_of(server) and "h" not in store_of(server)
    assert len(store_of(server)) == 1
    assert list((await update(channel, [header(pb.UpdateEntry(mm_hash="kept"))])).outcomes) == [
        pb.OUTCOME_HIT
    ]


@pytest.mark.parametrize(
    ("metadata_header", "frames", "message"),
    [
        (b"\xff\xff", [], "mmcache-update-header-bin metadata is not a serialised UpdateRequest"),
        (
            pb.UpdateRequest(entries=[pb.UpdateEntry(mm_hash="h")]).SerializeToString(),
            [header(pb.UpdateEntry(mm_hash="h"))],
            "a header frame arrived, but the header came as mmcache-update-header-bin metadata",
        ),
        (
            pb.UpdateRequest(
                entries=[data_entry("h", tensor_spec("uint8", [3]), 1)]
            ).SerializeToString(),
            [],
            "the upload ended after 0 of the 1 chunks",
        ),
    ],
    ids=["not-a-request", "header-twice", "chunks-missing"],
)
async def test_a_bad_metadata_header_is_invalid_argument(
    server: MMCacheServer,
    channel: grpc.aio.Channel,
    metadata_header: bytes,
    frames: list[bytes],
    message: str,
) -> None:
    await update(channel, put_frames("kept", b"keep me"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await update(channel, frames, metadata_header=metadata_header)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert "kept" in store_of(server) and "h" not in store_of(server)


async def test_cancelled_upload_leaves_nothing_behind(
    server: MMCacheServer, channel: grpc.aio.Channel
) -> None:
    spec = tensor_spec("uint8", [3 * MIB])
    call = channel.stream_unary(f"{SERVICE}/GetAndUpdate")(timeout=30)
    await call.write(header(data_entry("half", spec, 3)))
    await call.write(chunk(b"\0" * MIB))
    await asyncio.sleep(0.1)
    # Reserved while the upload is open.
    assert server.cache.stats(drain=False).inflight_bytes == 3 * MIB
    call.cancel()
    for _ in range(100):
        if server.cache.stats(drain=False).inflight_bytes == 0:
            break
        await asyncio.sleep(0.02)
    assert server.cache.stats(drain=False).inflight_bytes == 0
    assert "half" not in store_of(server) and store_of(server).used == 0


async def test_upload_past_its_deadline_leaves_nothing_behind(
    server: MMCacheServer, channel: grpc.aio.Channel
) -> None:
    spec = tensor_spec("uint8", [2 * MIB])
    call = channel.stream_unary(f"{SERVICE}/GetAndUpdate")(timeout=0.3)
    await call.write(header(data_entry("late", spec, 2)))
    await call.write(chunk(b"\0" * MIB))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.1)
    assert "late" not in store_of(server) and server.cache.stats(drain=False).inflight_bytes == 0


async def test_every_reply_carries_the_instance_id(channel: grpc.aio.Channel) -> None:
    info = channel.unary_unary(
        f"{SERVICE}/Info",
        request_serializer=pb.InfoRequest.SerializeToString,
        response_deserializer=pb.InfoReply.FromString,
    )
    first = await info(pb.InfoRequest())
    reply = await update(channel, put_frames("a", b"1"))
    assert first.instance_id and reply.instance_id == first.instance_id
    async with serving() as other:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{other.port}") as ch2:
            other_reply = await update(ch2, put_frames("a", b"1"))
    assert other_reply.instance_id != first.instance_id
