"""The L2 tier's big reads (server/cache/_resp_reads.py): replies parsed as they
arrive, each bulk string received into its own buffer: against a real Redis
Cluster (one test, its cases on one cluster), and the parser alone."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, ResponseError

from mmcache.server.cache._l2 import L2Record
from mmcache.server.cache._l2_redis import RedisClusterL2, redis_key
from mmcache.server.cache._resp_reads import BulkReader, Reply, _Replies, encode_command

from .proxy import Proxy
from .redis_cluster import RedisCluster, needs_redis, redis_cluster

MIB = 1024 * 1024
PASSWORD = "s3cret"


@needs_redis
def test_the_reader_on_a_real_cluster_behind_a_password() -> None:
    """One cluster (requirepass: every connection logs in as redis-py's do),
    each case on its own keys; the last one kills and restarts a master."""
    with redis_cluster(password=PASSWORD) as cluster:
        for case in (
            _a_hash_with_big_and_small_fields_reads_as_redis_py_reads_it,
            _many_commands_at_once_each_get_their_own_reply,
            _a_burst_of_commands_opens_no_more_connections_than_the_most,
            _a_waiter_that_gives_up_leaves_the_connection_in_step,
            _error_replies_are_redis_pys_exceptions_and_the_connection_stays,
            _an_l2_behind_a_password_reads_and_writes_and_a_wrong_one_fails_clearly,
        ):
            asyncio.run(case(cluster))
        _a_reply_released_after_its_reader_gave_up_never_reaches_another(cluster)
        asyncio.run(_a_lost_connection_fails_its_waiters_and_the_next_command_reconnects(cluster))


def _master_of(cluster: RedisCluster, name: str) -> int:
    """The port of the master serving the key `name`."""
    slot = int(cluster.cli(cluster.ports[0], "CLUSTER", "KEYSLOT", name))
    for line in cluster.cli(cluster.ports[0], "CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "master" not in fields[2]:
            continue
        for span in fields[8:]:
            low, _, high = span.partition("-")
            if int(low) <= slot <= int(high or low):
                return int(fields[1].split(":")[1].split("@")[0])
    raise AssertionError(f"no master serves slot {slot}")


def _reader(port: int, **options: Any) -> BulkReader:
    return BulkReader("127.0.0.1", port, password=PASSWORD, **options)


def _plain(port: int) -> Redis:
    """redis-py's own client of one master."""
    return Redis(port=port, password=PASSWORD)


async def _a_hash_with_big_and_small_fields_reads_as_redis_py_reads_it(
    cluster: RedisCluster,
) -> None:
    name = "{t}big"
    port = _master_of(cluster, name)
    fields = {b"m": b"manifest", b"c0": os.urandom(3 * MIB + 7), b"c1": b"", b"c2": os.urandom(99)}
    async with _plain(port) as plain:
        await plain.delete(name)
        await plain.hset(name, mapping=fields)  # type: ignore[arg-type]
        reader = _reader(port)
        try:
            reply = await reader.command(b"HGETALL", name)
            assert isinstance(reply, list)
            assert dict(zip(reply[::2], reply[1::2], strict=True)) == fields
            assert all(type(v) is bytes for v in reply)  # grpc sends bytes only
            assert await reader.command("HGETALL", "{t}absent") == []
            assert await reader.command("PING") == b"PONG"
            assert await reader.command("HLEN", name) == 4
            assert await reader.command("GET", "{t}absent") is None
        finally:
            await reader.close()


async def _many_commands_at_once_each_get_their_own_reply(cluster: RedisCluster) -> None:
    """Pipelined on a few connections, big and small replies interleaved: each
    waiter takes its own, in order."""
    port = _master_of(cluster, "{p}0")
    values = {f"{{p}}{i}": os.urandom((i % 3) * MIB + i) for i in range(30)}
    async with _plain(port) as plain:
        await plain.mset(values)  # type: ignore[arg-type]
        reader = _reader(port, connections=2)
        try:
            replies = await asyncio.gather(*(reader.command("GET", key) for key in values))
            assert replies == list(values.values())
        finally:
            await reader.close()


async def _a_burst_of_commands_opens_no_more_connections_than_the_most(
    cluster: RedisCluster,
) -> None:
    port = cluster.ports[0]
    reader = _reader(port, connections=2)
    try:
        replies = await asyncio.gather(*(reader.command("PING") for _ in range(20)))
        assert replies == [b"PONG"] * 20
        assert len(reader._open) == 2
    finally:
        await reader.close()


async def _a_waiter_that_gives_up_leaves_the_connection_in_step(cluster: RedisCluster) -> None:
    """The command is on the wire (connected first) when its caller gives up:
    its 16 MiB reply is read and dropped, and the next waiter gets its own."""
    port = _master_of(cluster, "{g}big")
    big = os.urandom(16 * MIB)
    async with _plain(port) as plain:
        await plain.set("{g}big", big)
        await plain.set("{g}small", b"small")
        reader = _reader(port, connections=1)
        try:
            assert await reader.command("PING") == b"PONG"
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.command("GET", "{g}big"), 0.0001)
            (connection,) = reader._open
            assert len(connection.waiters) == 1  # sent: its place kept for its reply
            assert await reader.command("GET", "{g}small") == b"small"
            assert await reader.command("GET", "{g}big") == big
        finally:
            await reader.close()


_SIZES = st.sampled_from([0, 5, 40_000, 70_000, MIB + 3, 3 * MIB])


def _a_reply_released_after_its_reader_gave_up_never_reaches_another(
    cluster: RedisCluster,
) -> None:
    """Replies held past their readers' deadline (a master stalling), then
    released before, during (cut inside them) or after the next command is
    sent: the next reader gets its own value, or an error; never another's."""
    port = _master_of(cluster, "{h}0")

    @settings(max_examples=40, deadline=None)
    @given(
        late=st.lists(_SIZES, min_size=1, max_size=3),
        asked=_SIZES,
        moment=st.sampled_from(["before", "during", "after"]),
        cut=st.integers(1, 3 * MIB),
        steps=st.integers(1, 4),
    )
    def released(late: list[int], asked: int, moment: str, cut: int, steps: int) -> None:
        asyncio.run(_released(port, late, asked, moment, cut, steps))

    released()


async def _released(
    port: int, late: list[int], asked: int, moment: str, cut: int, steps: int
) -> None:
    values = [os.urandom(size) for size in late]
    wanted = os.urandom(asked)
    async with _plain(port) as plain:
        await plain.mset({f"{{h}}{i}": v for i, v in enumerate([*values, wanted])})
    async with Proxy(port) as proxy:
        reader = _reader(proxy.port, connections=1)
        try:
            assert await reader.command("PING") == b"PONG"
            proxy.stall()
            for i in range(len(values)):
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(reader.command("GET", f"{{h}}{i}"), 0.05)
            await _until(lambda: proxy.held_bytes >= sum(len(v) for v in values))
            if moment == "before":
                proxy.release()
            elif moment == "during":
                proxy.release(min(cut, max(0, proxy.held_bytes - 1)))
            read = asyncio.ensure_future(reader.command("GET", f"{{h}}{len(values)}"))
            await asyncio.sleep(0.01)  # sent, its reply behind the late ones
            for _ in range(steps - 1):
                proxy.release(cut // steps + 1)
                await asyncio.sleep(0)
            proxy.release()
            assert await asyncio.wait_for(read, 10) == wanted
            assert await reader.command("GET", "{h}0") == values[0]
        finally:
            await reader.close()


async def _until(done: Callable[[], bool], within_s: float = 10.0) -> None:
    for _ in range(int(within_s / 0.005)):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not reached in time")


async def _error_replies_are_redis_pys_exceptions_and_the_connection_stays(
    cluster: RedisCluster,
) -> None:
    name = "{e}string"
    port = _master_of(cluster, name)
    other = next(p for p in cluster.ports if p != port)
    async with _plain(port) as plain:
        await plain.set(name, b"not a hash")
    reader = _reader(port)
    elsewhere = _reader(other)
    try:
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await reader.command("HGETALL", name)
        assert await reader.command("GET", name) == b"not a hash"
        with pytest.raises(MovedError) as moved:
            await elsewhere.command("GET", name)
        assert moved.value.port == port
    finally:
        await reader.close()
        await elsewhere.close()


async def _an_l2_behind_a_password_reads_and_writes_and_a_wrong_one_fails_clearly(
    cluster: RedisCluster,
) -> None:
    """The reads' own connections log in as redis-py's do (AUTH), or fail clearly."""
    l2 = RedisClusterL2(cluster.url, timeout_s=2.0)
    record = L2Record(b"manifest", (os.urandom(2 * MIB), b"tail"))
    try:
        await l2.write("k", record, ttl_s=60)
        assert await l2.read("k") == record
    finally:
        await l2.close()
    name = redis_key("mmcache:", "k")
    port = _master_of(cluster, name)
    for password, error in ((None, "NOAUTH"), ("wrong", "WRONGPASS|invalid password")):
        reader = BulkReader("127.0.0.1", port, password=password)
        try:
            with pytest.raises(ResponseError, match=error):
                await reader.command("HGETALL", name)
        finally:
            await reader.close()


async def _a_lost_connection_fails_its_waiters_and_the_next_command_reconnects(
    cluster: RedisCluster,
) -> None:
    port = cluster.ports[0]
    reader = _reader(port, connect_timeout_s=0.5)
    try:
        assert await reader.command("PING") == b"PONG"
        cluster.kill(port)
        with pytest.raises(RedisConnectionError):
            await reader.command("PING")
        cluster.restart(port)
        assert await reader.command("PING") == b"PONG"
    finally:
        await reader.close()


# -- the parser alone, on replies cut at every place ------------------------------


def _encode(reply: Reply | ResponseError) -> bytes:
    if isinstance(reply, ResponseError):
        return b"-%s\r\n" % str(reply).encode()
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, bytes):
        return b"$%d\r\n%s\r\n" % (len(reply), reply)
    return b"*%d\r\n" % len(reply) + b"".join(_encode(r) for r in reply)


_replies = st.recursive(
    st.none()
    | st.integers(-(2**63), 2**63 - 1)
    | st.binary(max_size=300)
    # Larger than half the line buffer, full of what looks like RESP:
    | st.integers(40_000, 140_000).map(lambda n: (b"\r\n$3\r\n*-:+" * (n // 11 + 1))[:n]),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    replies=st.lists(_replies, min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 70_000), max_size=30),
)
def test_replies_cut_anywhere_parse_to_what_was_sent(replies: list[Reply], cuts: list[int]) -> None:
    loop = asyncio.new_event_loop()
    try:
        protocol = _Replies()
        waiters = [loop.create_future() for _ in replies]
        protocol.waiters.extend(waiters)
        wire = memoryview(b"".join(_encode(r) for r in replies))
        at, turn = 0, 0
        while at < len(wire):
            buffer = protocol.get_buffer(-1)
            want = cuts[turn % len(cuts)] if cuts else len(wire)
            n = min(len(buffer), want, len(wire) - at)
            buffer[:n] = wire[at : at + n]
            protocol.buffer_updated(n)
            at, turn = at + n, turn + 1
        assert [w.result() for w in waiters] == replies
        assert not protocol.waiters
    finally:
        loop.close()


def test_an_error_inside_an_array_is_a_value_and_a_command_encodes_as_resp() -> None:
    loop = asyncio.new_event_loop()
    try:
        protocol = _Replies()
        waiter = loop.create_future()
        protocol.waiters.append(waiter)
        wire = b"*2\r\n-MOVED 12 127.0.0.1:7001\r\n:5\r\n"
        protocol.get_buffer(-1)[: len(wire)] = wire
        protocol.buffer_updated(len(wire))
        moved, five = waiter.result()
        assert isinstance(moved, MovedError) and moved.slot_id == 12 and five == 5
    finally:
        loop.close()
    assert encode_command([b"HGETALL", "k", 7]) == b"*3\r\n$7\r\nHGETALL\r\n$1\r\nk\r\n$1\r\n7\r\n"


def test_a_reply_with_no_command_waiting_aborts_the_connection() -> None:
    """Out of step means nothing after it can be matched: the connection goes."""

    class Transport(asyncio.Transport):
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    transport = Transport()
    protocol = _Replies()
    protocol.connection_made(transport)
    wire = b"+OK\r\n"
    protocol.get_buffer(-1)[: len(wire)] = wire
    protocol.buffer_updated(len(wire))
    assert transport.aborted
    assert isinstance(protocol.lost, RedisConnectionError)
