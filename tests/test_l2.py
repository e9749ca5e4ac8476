"""The L2 tier on a real Redis Cluster (three masters on loopback): sidecars
sharing items, admission, single flight, a master killed or stopped, eviction
in L2, and records no sidecar wrote."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmcache.client import MMCacheClient
from mmcache.server import EventsConfig, L2Config, MMCacheServer
from mmcache.server._config import ConfigError
from mmcache.server.cache._l2_redis import redis_key

from .conftest import MIB, MMCACHE, ROOT, connected, eventually, serving
from .items import image_item
from .proxy import Proxy
from .redis_cluster import RedisCluster, free_port, redis_available, redis_cluster

pytestmark = pytest.mark.skipif(
    not redis_available(), reason="redis-server is missing: scripts/install-system-deps.sh"
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with redis_cluster() as running:
        yield running


@pytest.fixture
def fresh(cluster: RedisCluster) -> RedisCluster:
    cluster.flushall()
    return cluster


def value(server: MMCacheServer, name: str, **labels: str) -> float:
    found = server.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


@contextlib.asynccontextmanager
async def sidecars(
    cluster: RedisCluster,
    count: int,
    *,
    capacity_bytes: int | None = None,
    events: EventsConfig | None = None,
    **l2: Any,
) -> AsyncIterator[list[tuple[MMCacheServer, MMCacheClient]]]:
    """`count` sidecars sharing `cluster` as L2 (`l2`: the rest of its L2Config),
    each with a client."""
    overrides: dict[str, Any] = {"events": events, "l2": L2Config(cluster.url, **l2)}
    if capacity_bytes is not None:
        overrides["capacity_bytes"] = capacity_bytes
    async with contextlib.AsyncExitStack() as stack:
        pairs = []
        for _ in range(count):
            server = await stack.enter_async_context(serving(**overrides))
            client = await stack.enter_async_context(MMCacheClient(f"127.0.0.1:{server.port}"))
            pairs.append((server, client))
        yield pairs


async def test_a_record_no_sidecar_wrote_is_a_miss(fresh: RedisCluster) -> None:
    async with sidecars(fresh, 1) as [(a, ca)]:
        key = redis_key("mmcache:", "forged")
        for port in fresh.ports:  # whichever master owns the slot takes it
            fresh.cli(port, "HSET", key, "m", "not a manifest", "c0", "junk")
        assert (await ca.lookup(["forged"])).held == [False]
        assert value(a, "mmcache_l2_errors_total", op="read") >= 1
        assert "forged" not in a.cache


async def test_an_item_evicted_from_l2_is_a_clean_miss() -> None:
    with redis_cluster(maxmemory_mb=8) as small:
        async with sidecars(small, 2, admit="first", capacity_bytes=512 * MIB) as [
            (a, ca),
            (b, cb),
        ]:
            hashes = [f"e{i}" for i in range(60)]  # 60 x 1 MiB into 3 x 8 MB
            for i, h in enumerate(hashes):
                await ca.get_and_update([image_item(i, numel=1 << 18)], [h])
            await eventually(
                lambda: (
                    value(a, "mmcache_l2_writes_total", result="written")
                    + value(a, "mmcache_l2_writes_total", result="failed")
                    == 60
                ),
                timeout=20,
            )
            found = await cb.lookup(hashes, lease=False)
            assert not all(found.held)  # the oldest were evicted, each whole
            assert any(found.held)
            assert value(b, "mmcache_l2_errors_total", op="read") == 0
            held = [h for h, ok in zip(hashes, found.held, strict=True) if ok]
            fetched = await cb.fetch(held)
            for h, got in zip(held, fetched, strict=True):
                assert got == image_item(int(h[1:]), numel=1 << 18)


@contextlib.asynccontextmanager
async def writer_and_reader(
    cluster: RedisCluster, reader_timeout_s: float
) -> AsyncIterator[tuple[MMCacheServer, MMCacheClient, MMCacheServer, MMCacheClient]]:
    """A sidecar that writes every new item to L2 (with the default timeout, so
    a loaded machine fails no write), and one that reads with a short one."""
    async with (
        serving(l2=L2Config(cluster.url, admit="first")) as a,
        connected(a) as ca,
        serving(l2=L2Config(cluster.url, timeout_s=reader_timeout_s)) as b,
        connected(b) as cb,
    ):
        yield a, ca, b, cb


async def test_a_killed_master_fails_no_call_and_health_stays_serving() -> None:
    with redis_cluster() as doomed:
        async with writer_and_reader(doomed, 1.0) as (a, ca, b, cb):
            hashes = [f"k{i}" for i in range(30)]
            items = [image_item(i) for i in range(30)]
            await ca.get_and_update(items, hashes)
            await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 30)
            await cb.lookup(["warm"], lease=False)  # B is connected: its timeout is the reads'
            doomed.kill(doomed.ports[1])
            started = asyncio.get_running_loop().time()
            found = await cb.lookup(hashes, lease=False)
            elapsed = asyncio.get_running_loop().time() - started
            assert 0 < sum(found.held) < 30  # the dead master's share misses
            assert elapsed < 5
            assert value(b, "mmcache_l2_errors_total", op="read") > 0
            # B's own uploads go on; A still serves from L1.
            await cb.get_and_update([image_item(99)], ["after"])
            assert (await ca.lookup(hashes)).held == [True] * 30
            assert await health_of(b.port) == health_pb2.HealthCheckResponse.SERVING


async def test_a_stopped_master_costs_calls_at_most_the_l2_timeout() -> None:
    with redis_cluster() as frozen:
        async with writer_and_reader(frozen, 0.5) as (a, ca, _, cb):
            hashes = [f"s{i}" for i in range(12)]
            await ca.get_and_update([image_item(i) for i in range(12)], hashes)
            await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 12)
            await cb.lookup(["warm"], lease=False)  # B is connected: its timeout is the reads'
            pid = frozen.procs[frozen.ports[2]].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                started = asyncio.get_running_loop().time()
                found = await cb.lookup(hashes, lease=False)
                elapsed = asyncio.get_running_loop().time() - started
            finally:
                os.kill(pid, signal.SIGCONT)
            assert 0 < sum(found.held) < 12
            # The reads run at once, then the claims of what they missed: two
            # timeouts of 0.5 s, not one per item (12 would be 6 s, or 12).
            assert elapsed < 3.5


async def test_a_hung_master_costs_one_timeout_not_one_per_call() -> None:
    """A breaker per master: after the first timeout the stopped master's
    items miss at once, and a probe finds it again once it answers."""
    with redis_cluster() as frozen:
        async with writer_and_reader(frozen, 0.5) as (a, ca, b, cb):
            hashes = [f"s{i}" for i in range(12)]
            await ca.get_and_update([image_item(i) for i in range(12)], hashes)
            await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 12)
            await cb.lookup(["warm"], lease=False)
            pid = frozen.procs[frozen.ports[2]].pid
            os.kill(pid, signal.SIGSTOP)
            loop = asyncio.get_running_loop()
            try:
                found = await cb.lookup(hashes, lease=False)  # the one timeout
                assert 0 < sum(found.held) < 12
                assert value(b, "mmcache_l2_nodes_down") == 1
                assert value(b, "mmcache_l2_up") == 0
                started = loop.time()
                for n in range(10):  # 4 cold hashes each: all but surely one on it
                    await cb.lookup([f"cold{n}-{i}" for i in range(4)], lease=False)
                # One timeout each would be 5 s at least.
                assert loop.time() - started < 1.5
            finally:
                os.kill(pid, signal.SIGCONT)
            missed = [h for h, ok in zip(hashes, found.held, strict=True) if not ok]
            await eventually(lambda: value(b, "mmcache_l2_up") == 1, timeout=10)
            assert (await cb.lookup(missed, lease=False)).held == [True] * len(missed)


async def test_an_idle_sidecar_sees_a_master_hang_and_locate_skips_it() -> None:
    """Masters are watched (PING each second): an idle sidecar's gauge shows a
    hung master, and a Locate, whose time is one L2 timeout, skips it at once."""
    with redis_cluster() as frozen:
        async with sidecars(frozen, 1, timeout_s=0.5) as [(b, cb)]:
            await eventually(lambda: value(b, "mmcache_l2_up") == 1)
            pid = frozen.procs[frozen.ports[0]].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                await eventually(lambda: value(b, "mmcache_l2_nodes_down") == 1, timeout=5)
                assert value(b, "mmcache_l2_up") == 0
                loop = asyncio.get_running_loop()
                started = loop.time()
                for n in range(5):
                    where = await cb.locate([f"where{n}-{i}" for i in range(6)], check_l2=True)
                    assert [w.tier for w in where] == [None] * 6
                assert loop.time() - started < 1.0  # one timeout each would be 2.5 s
            finally:
                os.kill(pid, signal.SIGCONT)
            await eventually(lambda: value(b, "mmcache_l2_up") == 1, timeout=10)


def test_a_bad_l2_url_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        L2Config("redis://nohost")
    with pytest.raises(ConfigError, match="redis://") as caught:
        L2Config("http://user:secret@h:1")
    assert "secret" not in str(caught.value)


async def test_a_sidecar_starts_and_serves_while_its_cluster_is_down() -> None:
    with redis_cluster() as gone:
        url = gone.url
    async with sidecars_at(url) as (server, client):
        assert (await client.lookup(["x"])).held == [False]
        await client.get_and_update([image_item(7)], ["x"])
        assert (await client.lookup(["x"])).held == [True]
        assert value(server, "mmcache_l2_errors_total", op="read") >= 1


@contextlib.asynccontextmanager
async def sidecars_at(url: str) -> AsyncIterator[tuple[MMCacheServer, MMCacheClient]]:
    async with (
        serving(l2=L2Config(url, timeout_s=0.2)) as server,
        connected(server) as client,
    ):
        yield server, client


async def health_of(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2
        )
        return reply.status


async def test_traffic_through_a_master_killed_mid_run_fails_no_request() -> None:
    """Two sidecars' frontends keep uploading, looking up and reading while a
    master dies under them: every call succeeds and every read is bit-exact."""
    with redis_cluster() as doomed:
        async with sidecars(doomed, 2, admit="first", timeout_s=0.5) as pairs:
            stop = asyncio.Event()
            done: list[int] = []

            async def frontend(index: int, client: MMCacheClient) -> None:
                n = 0
                while not stop.is_set():
                    h = f"t{index}-{n}"
                    other = f"t{1 - index}-{max(0, n - 3)}"  # the other node's, maybe via L2
                    item = image_item(n % 50)
                    await client.get_and_update([item], [h], lease=False)
                    found = await client.lookup([other], lease=False)
                    if found.held[0]:
                        (got,) = await client.fetch([other], release=False)
                        assert got == image_item(max(0, n - 3) % 50)
                    n += 1
                done.append(n)

            tasks = [asyncio.create_task(frontend(i, c)) for i, (_, c) in enumerate(pairs)]
            await asyncio.sleep(1.0)
            doomed.kill(doomed.ports[0])
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*tasks)  # any failed call would raise here
            # Calls that touch the dead master's slots each wait out its
            # timeouts, so a frontend may get few done: none may fail.
            assert len(done) == 2 and min(done) >= 1
            errors = sum(value(s, "mmcache_l2_errors_total", op=op) for s, _ in pairs
                         for op in ("read", "write", "claim", "check"))  # fmt: skip
            assert errors > 0  # the dead master was really in the way
            hits = sum(value(s, "mmcache_l2_hits_total") for s, _ in pairs)
            assert hits > 0


async def test_no_fetch_returns_another_items_bytes_while_the_master_stalls() -> None:
    """Issue 41: replies held back past the L2 timeout (a master stalling: a
    fork, a slow command), then let go at moments around it, while reads of
    other items are queued behind them. Whatever B answers held, its engine
    reads those very bytes; a late reply is a miss, never another item."""
    rng = random.Random(41)
    with redis_cluster(masters=1) as node:
        async with Proxy(node.ports[0]) as proxy:
            node.announce(node.ports[0], proxy.port)  # every connection through the proxy
            url = f"redis://127.0.0.1:{proxy.port}"
            async with (
                # The writer with the default timeout (a loaded machine's writes
                # all land); the reader gives up on a read after 0.1 s.
                serving(l2=L2Config(url, admit="first")) as a,
                serving(l2=L2Config(url, timeout_s=0.1)) as b,
                connected(a) as ca,
                connected(b) as cb,
            ):
                most, per_trial = 16, 6
                items = {
                    f"x{i}": image_item(i, numel=rng.choice([4_000, 40_000, 150_000]))
                    for i in range(most * per_trial)
                }
                await ca.get_and_update(list(items.values()), list(items))
                written = "mmcache_l2_writes_total"
                await eventually(lambda: value(a, written, result="written") == len(items), 120)
                keys = list(items)
                served = 0
                # At least 10 trials, and on until both a stall and a read that
                # got through were seen (a loaded machine stretches the timings).
                for trial in range(most):
                    stalled = value(b, "mmcache_l2_errors_total", op="read") > 0
                    if trial >= 10 and stalled and served:
                        break
                    await eventually(lambda: value(b, "mmcache_l2_up") == 1, timeout=30)
                    asked = keys[trial * per_trial : (trial + 1) * per_trial]
                    proxy.stall()
                    lookups = []
                    for key in asked:  # apart, so their deadlines fall apart
                        lookups.append(asyncio.ensure_future(cb.lookup([key], lease=False)))
                        await asyncio.sleep(rng.uniform(0, 0.015))
                    # Then let go: before, at or past the 0.1 s timeout.
                    await asyncio.sleep(rng.uniform(0.0, 0.06))
                    proxy.release()
                    await asyncio.gather(*lookups)
                    held = [key for key in asked if key in b.cache]
                    served += len(held)
                    for key, fetched in zip(held, await cb.fetch(held), strict=True):
                        assert fetched == items[key], f"{key} read back as another item"
                assert value(b, "mmcache_l2_errors_total", op="read") > 0  # stalls happened
                assert served > 0  # and reads got through between them
                # No reply reached another read (the key check would have caught it).
                for reason in ("key", "digest", "format"):
                    assert value(b, "mmcache_l2_bad_records_total", reason=reason) == 0


def test_the_local_recipe_runs_as_written(tmp_path: Path) -> None:
    """docs/l2.md's "Trying it on one machine", line by line, on free ports:
    the cluster forms, both sidecars use it, an item crosses from one to the
    other, and `down` leaves no master running."""
    text = (ROOT / "docs/l2.md").read_text()
    marker = "<!-- run by tests/test_l2.py::test_the_local_recipe_runs_as_written -->\n```sh\n"
    block = text[text.index(marker) + len(marker) :].split("```", 1)[0]
    ports = {str(p): str(free_port()) for p in (7000, 7001, 7002)}
    ports |= {str(p): str(free_port()) for p in (50061, 50062, 9481, 9482)}
    env = {
        **os.environ,
        "PATH": f"{Path(MMCACHE).parent}:{os.environ['PATH']}",
        "REDIS_CLUSTER_DIR": str(tmp_path),
    }
    lines = [re.sub(r"\b(\d{4,5})\b", lambda m: ports.get(m[1], m[1]), line.split("#")[0])
             for line in block.splitlines()]  # fmt: skip
    masters = f"{ports['7000']} {ports['7001']} {ports['7002']}"
    lines = [f"{line.rstrip()} {masters}" if "redis-cluster.sh" in line else line for line in lines]
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for line in lines:
            if line.rstrip().endswith("&"):
                servers.append(subprocess.Popen(line.rstrip(" &"), shell=True, env=env))
            elif "mmcache stats" in line:
                shown = ""
                for _ in range(100):
                    done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True)
                    shown = done.stdout
                    if "L2 tier    up" in shown:
                        break
                    time.sleep(0.1)
                assert "L2 tier    up" in shown, shown
                asyncio.run(_an_item_crosses(ports["50061"], ports["50062"]))
            else:
                done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True)
                assert done.returncode == 0, done.stdout + done.stderr
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(20)
        subprocess.run(f"scripts/redis-cluster.sh down {masters}", shell=True, env=env, cwd=ROOT)
    assert subprocess.run(["redis-cli", "-p", ports["7000"], "PING"], capture_output=True,
                          text=True).stdout.strip() != "PONG"  # fmt: skip


async def _an_item_crosses(one: str, other: str) -> None:
    async with (
        MMCacheClient(f"127.0.0.1:{one}") as first,
        MMCacheClient(f"127.0.0.1:{other}") as second,
    ):
        item = image_item(7)
        await first.get_and_update([item], ["recipe"])
        for _ in range(200):
            if (await second.locate(["recipe"], check_l2=True))[0].tier == "l2":
                break
            await asyncio.sleep(0.02)
        (fetched,) = await second.fetch(["recipe"])
        assert fetched == item
