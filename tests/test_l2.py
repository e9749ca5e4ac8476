"""The L2 tier on a real Redis Cluster (three masters on loopback): what only
Redis shows. Items it evicts (maxmemory, allkeys-lru) are clean misses; a
master that hangs or dies costs a call at most a timeout and fails none; a
master that stalls never gets an item another's bytes (issue 41); docs/l2.md's
local recipe runs as written. The fleet protocol itself (claims, holds, wants,
take-overs, admission, bad records) runs on in-memory nodes:
tests/test_l2_fleet.py."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmcache.client import MMCacheClient
from mmcache.server import L2Config

from .conftest import MIB, MMCACHE, ROOT, connected, eventually, serving
from .items import image_item
from .l2_sidecars import sidecars, value
from .proxy import Proxy
from .redis_cluster import free_port, needs_redis, redis_cluster

pytestmark = needs_redis


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


async def test_a_master_that_hangs_or_dies_costs_a_call_a_timeout_and_fails_none() -> None:
    """One cluster, one master SIGSTOPped then another SIGKILLed. A writer (A,
    the default timeout: a loaded machine fails no write) and readers with
    short timeouts: B (0.5 s) and D (1 s) read A's items, C stays idle, T1 and
    T2 run traffic while the master dies. A hung master costs B's first call
    one timeout (a breaker per master: later calls skip it), idle C sees it
    (a PING each second) and its Locate skips it, and both find it again once
    it answers; a dead master's share misses, no call fails, health stays
    SERVING, every read is bit-exact."""
    loop = asyncio.get_running_loop()
    with redis_cluster() as cluster:
        url = cluster.url
        async with (
            serving(l2=L2Config(url, admit="first")) as a,
            connected(a) as ca,
            serving(l2=L2Config(url, timeout_s=0.5)) as b,
            connected(b) as cb,
            serving(l2=L2Config(url, timeout_s=0.5)) as c,
            connected(c) as cc,
            serving(l2=L2Config(url, timeout_s=1.0)) as d,
            connected(d) as cd,
            sidecars(cluster, 2, admit="first", timeout_s=0.5) as pairs,
        ):
            everyone = [a, b, c, d, *(s for s, _ in pairs)]
            # -- a master that hangs --
            hashes = [f"s{i}" for i in range(12)]
            await ca.get_and_update([image_item(i) for i in range(12)], hashes)
            await eventually(lambda: value(a, "mmcache_l2_writes_total", result="written") == 12)
            await cb.lookup(["warm"], lease=False)  # B is connected: its timeout is the reads'
            await eventually(lambda: value(c, "mmcache_l2_up") == 1)
            pid = cluster.procs[cluster.ports[0]].pid
            os.kill(pid, signal.SIGSTOP)
            # Masters are watched: idle C's gauge shows the hung one in 5 s.
            idle_sees = asyncio.ensure_future(
                eventually(lambda: value(c, "mmcache_l2_nodes_down") == 1, timeout=5)
            )
            try:
                started = loop.time()
                found = await cb.lookup(hashes, lease=False)  # the one timeout
                elapsed = loop.time() - started
                assert 0 < sum(found.held) < 12
                # The reads run at once, then the claims of what they missed: two
                # timeouts of 0.5 s, not one per item (12 would be 6 s, or 12).
                assert elapsed < 3.5
                assert value(b, "mmcache_l2_nodes_down") == 1
                assert value(b, "mmcache_l2_up") == 0
                started = loop.time()
                for n in range(10):  # 4 cold hashes each: all but surely one on it
                    await cb.lookup([f"cold{n}-{i}" for i in range(4)], lease=False)
                # One timeout each would be 5 s at least.
                assert loop.time() - started < 1.5
                await idle_sees
                assert value(c, "mmcache_l2_up") == 0
                started = loop.time()
                for n in range(5):  # a Locate's time is one L2 timeout: C skips it
                    where = await cc.locate([f"where{n}-{i}" for i in range(6)], check_l2=True)
                    assert [w.tier for w in where] == [None] * 6
                assert loop.time() - started < 1.0  # one timeout each would be 2.5 s
            finally:
                idle_sees.cancel()
                os.kill(pid, signal.SIGCONT)
            missed = [h for h, ok in zip(hashes, found.held, strict=True) if not ok]
            await eventually(lambda: value(b, "mmcache_l2_up") == 1, timeout=10)
            assert (await cb.lookup(missed, lease=False)).held == [True] * len(missed)
            await eventually(lambda: value(c, "mmcache_l2_up") == 1, timeout=10)

            # -- a master that dies, under traffic --
            await eventually(lambda: all(value(s, "mmcache_l2_up") == 1 for s in everyone), 10)
            written = value(a, "mmcache_l2_writes_total", result="written")
            hashes = [f"k{i}" for i in range(30)]
            await ca.get_and_update([image_item(i) for i in range(30)], hashes)
            await eventually(
                lambda: value(a, "mmcache_l2_writes_total", result="written") == written + 30
            )
            await cd.lookup(["warm"], lease=False)  # D is connected: its timeout is the reads'
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

            tasks = [asyncio.create_task(frontend(i, t)) for i, (_, t) in enumerate(pairs)]
            await asyncio.sleep(1.0)
            cluster.kill(cluster.ports[1])
            killed = loop.time()
            found = await cd.lookup(hashes, lease=False)
            elapsed = loop.time() - killed
            assert 0 < sum(found.held) < 30  # the dead master's share misses
            assert elapsed < 5
            assert value(d, "mmcache_l2_errors_total", op="read") > 0
            await asyncio.sleep(max(0.0, 1.5 - (loop.time() - killed)))
            stop.set()
            await asyncio.gather(*tasks)  # any failed call would raise here
            # Calls that touch the dead master's slots each wait out its
            # timeouts, so a frontend may get few done: none may fail.
            assert len(done) == 2 and min(done) >= 1
            errors = sum(value(s, "mmcache_l2_errors_total", op=op) for s, _ in pairs
                         for op in ("read", "write", "claim", "check"))  # fmt: skip
            assert errors > 0  # the dead master was really in the way
            assert sum(value(s, "mmcache_l2_hits_total") for s, _ in pairs) > 0
            # D's own uploads go on; A still serves from L1.
            await cd.get_and_update([image_item(99)], ["after"])
            assert (await ca.lookup(hashes)).held == [True] * 30
            assert await health_of(d.port) == health_pb2.HealthCheckResponse.SERVING


async def health_of(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2
        )
        return reply.status


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
                # exec: the shell becomes the sidecar, so terminate() stops it (not only sh)
                servers.append(subprocess.Popen(f"exec {line.rstrip(' &')}", shell=True, env=env))
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
