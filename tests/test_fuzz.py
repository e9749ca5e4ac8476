"""Random bytes into every method of every service the server has (health and reflection too).

No request, however malformed, is answered UNKNOWN or INTERNAL (a person
gets INVALID_ARGUMENT or another code that says what is wrong), the server
stays up, and what it stored survives. Clear is sent last: random bytes
often parse as a valid (empty) ClearRequest, and a Clear clears.
"""

from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from mmcache.client import MMCacheClient
from mmcache.server import MMCacheServer
from mmcache.v1 import cache_pb2 as pb
from mmcache.v1 import encoder_pb2 as epb

from .conftest import connected, serving
from .items import image_item

_REFUSED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def methods() -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method we serve."""
    found = []
    services = (
        (pb, "MMCache"),
        (epb, "EncoderCache"),
        (health_pb2, "Health"),
        (reflection_pb2, "ServerReflection"),
    )
    for module, service in services:
        descriptor = module.DESCRIPTOR.services_by_name[service]
        for method in descriptor.methods:
            path = f"/{descriptor.full_name}/{method.name}"
            found.append((path, method.client_streaming, method.server_streaming))
    return found


def garbage(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if kind < 0.6:  # a plausible tag, then junk: gets past the first byte
        return bytes((rng.choice([0x0A, 0x12, 0x1A, 0x08, 0x10]),)) + rng.randbytes(
            rng.randrange(1, 40)
        )
    if kind < 0.8:  # a length that runs past the end
        return bytes((0x0A, 0xFF, 0xFF, 0x03)) + rng.randbytes(rng.randrange(8))
    return rng.randbytes(rng.randrange(1, 2000))


async def call(
    channel: grpc.aio.Channel, path: str, streams: tuple[bool, bool], body: bytes
) -> grpc.StatusCode:
    client_streaming, server_streaming = streams
    try:
        if client_streaming and server_streaming:  # reflection

            async def requests():  # type: ignore[no-untyped-def]
                yield body

            stream = channel.stream_stream(path)(requests(), timeout=5)
            async for _ in stream:
                pass
        elif client_streaming:

            async def frames():  # type: ignore[no-untyped-def]
                yield body
                yield body[::-1]

            await channel.stream_unary(path)(frames(), timeout=5)
        elif server_streaming:
            stream = channel.unary_stream(path)(body, timeout=5)
            async for _ in stream:  # a Subscribe or Watch that parses streams on: enough
                stream.cancel()
                break
        else:
            await channel.unary_unary(path)(body, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except Exception:  # a cancelled Subscribe
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


@pytest.mark.parametrize("seed", range(2))
async def test_random_bytes_into_every_method_never_unknown_and_nothing_lost(
    server: MMCacheServer, seed: int
) -> None:
    rng = random.Random(seed)
    kept = image_item(7)
    async with connected(server) as client:
        await client.get_and_update([kept], ["kept"], lease=False)
    target = f"127.0.0.1:{server.port}"
    answered: dict[str, set[grpc.StatusCode]] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        ordered = sorted(methods(), key=lambda m: m[0].endswith("/Clear"))
        for path, client_streaming, server_streaming in ordered:
            if path.endswith("/Clear"):
                async with MMCacheClient(target) as client:
                    assert await client.fetch(["kept"]) == [kept]  # survived the rest
            for _ in range(40):
                code = await call(channel, path, (client_streaming, server_streaming), garbage(rng))
                answered.setdefault(path, set()).add(code)
    bad = {path: codes & _REFUSED for path, codes in answered.items() if codes & _REFUSED}
    assert not bad, bad
    assert len(answered) == len(methods())
    # Still up, and still answering properly.
    async with MMCacheClient(target) as client:
        assert client.instance_id == server.instance_id


async def test_random_bytes_with_tokens_on_are_refused_before_any_parsing() -> None:
    """Without a token every method of ours is UNAUTHENTICATED; health still answers."""
    async with serving(tokens="admin " + "a" * 32) as server:
        rng = random.Random(3)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for path, client_streaming, server_streaming in methods():
                code = await call(channel, path, (client_streaming, server_streaming), garbage(rng))
                ours = "/mmcache." in path
                assert (code == grpc.StatusCode.UNAUTHENTICATED) == ours, (path, code)
                assert code not in _REFUSED, (path, code)
