"""L2's state, as `mmcache serve` processes show it: a wrong --l2 (a Redis
without cluster mode, nothing at the address) is an ERROR at start with the
fix, and L1 serves; and the tier heals as it failed in a fleet: four sidecars
under traffic and an idle fifth on one Redis Cluster, a master SIGKILLed and
started again (empty) with the traffic running; then every sidecar, the idle
one included, reads and writes L2 again on every master within 15 s of the
cluster being whole, and `Locate` agrees with what Redis holds."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmcache.client import MMCacheClient

from .conftest import connected, parse_samples, sample, scrape_text
from .items import image_item
from .redis_cluster import RedisCluster, needs_redis, redis_cluster
from .test_process import MMCACHE, free_port, wait_serving

SIDECARS = 5  # four with traffic, the last idle
HEAL_S = 15.0


@dataclass
class Sidecar:
    port: int
    metrics_port: int
    log: Path
    proc: subprocess.Popen[bytes]

    def gauge(self, name: str) -> float | None:
        return sample(parse_samples(scrape_text(self.metrics_port)), name)


@contextlib.contextmanager
def sidecars(l2: str, count: int, logs: Path) -> Iterator[list[Sidecar]]:
    """`mmcache serve` processes on `l2`, their logs in files (a pipe nobody
    reads could block them)."""
    running: list[Sidecar] = []
    try:
        for index in range(count):
            port, metrics_port, log = free_port(), free_port(), logs / f"sidecar{index}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [
                        MMCACHE,
                        "serve",
                        "--host=127.0.0.1",
                        f"--port={port}",
                        f"--metrics-port={metrics_port}",
                        "--capacity-gb=0.25",
                        "--no-shm",
                        f"--l2={l2}",
                        "--l2-timeout-ms=500",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            running.append(Sidecar(port, metrics_port, log, proc))
            wait_serving(port, proc)  # type: ignore[arg-type]
        yield running
    finally:
        for sidecar in running:
            sidecar.proc.terminate()
        for sidecar in running:
            sidecar.proc.wait(timeout=20)


async def traffic(port: int, index: int, stop: asyncio.Event) -> int:
    """Frontends of one sidecar, several at once (L2 operations overlap, as in
    a fleet): each stores new images, repeats them (hits: written behind) and
    looks up images the other sidecars stored (read through L2). Fails no call."""
    async with MMCacheClient(f"127.0.0.1:{port}", follow=False) as client:
        done = await asyncio.gather(*(frontend(client, index, lane, stop) for lane in range(4)))
    return min(done)


async def frontend(client: MMCacheClient, index: int, lane: int, stop: asyncio.Event) -> int:
    calls = 0
    n = 0
    while not stop.is_set():
        mine = f"busy{index}-{lane}-{n}"
        others = [
            f"busy{(index + k) % 4}-{(lane + k) % 4}-{max(0, n - j)}"
            for k in (1, 2, 3)
            for j in (2, 5)
        ]
        if index == 3:  # a router's sidecar: asks only where items are
            await client.locate(
                [*others, *(f"cold{lane}-{n}-{j}" for j in range(16))], check_l2=True
            )
            n += 1
            calls += 1
            continue
        cold = [f"cold{index}-{lane}-{n}-{j}" for j in range(4)]  # asked for, never stored
        found = await client.lookup([mine, *others, *cold], lease=False)
        if not found.held[0]:
            await client.get_and_update([image_item(n)], [mine], resend=[True], lease=False)
        await client.lookup([mine], lease=False)  # a second sighting: written behind
        n += 1
        calls += 1
    return calls


def l2_holds(cluster: RedisCluster, key: str) -> bool:
    from mmcache.server.cache._l2_redis import redis_key

    name = redis_key("mmcache:", key)
    for port in cluster.procs:
        reply = cluster.cli(port, "HEXISTS", name, "m").strip()
        if reply == "1":
            return True
    return False


@needs_redis
async def test_a_wrong_l2_is_an_error_and_every_sidecar_heals_within_15s_of_a_master_restart(
    tmp_path: Path, plain_redis: int
) -> None:
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    with sidecars(f"redis://127.0.0.1:{plain_redis}", 1, wrong) as (sidecar,):
        await served_from_l1(sidecar)
        log = sidecar.log.read_text()
        assert "ERROR" in log and "cluster support disabled" in log, log
        assert "cluster-enabled yes" in log, log  # the fix

    with redis_cluster() as cluster, sidecars(cluster.url, SIDECARS, tmp_path) as fleet:
        ports = [(s.port, s.metrics_port) for s in fleet]
        assert [s.gauge("mmcache_l2_up") for s in fleet] == [1.0] * SIDECARS
        stop = asyncio.Event()
        busy = [asyncio.create_task(traffic(p, i, stop)) for i, (p, _) in enumerate(ports[:4])]
        await asyncio.sleep(2.0)
        victim = cluster.ports[1]
        cluster.kill(victim)
        await asyncio.sleep(3.0)
        # L2's state is visible: the busy sidecars found the master gone.
        for sidecar in fleet[:4]:
            assert sidecar.gauge("mmcache_l2_up") == 0.0
            assert sidecar.gauge("mmcache_l2_nodes_down") == 1.0
        cluster.restart(victim)  # empty; waits for cluster_state:ok
        whole = time.monotonic()
        await asyncio.sleep(1.0)  # traffic goes on over the healed cluster
        stop.set()
        assert min(await asyncio.gather(*busy)) > 0  # no call failed

        # Records on every master, written by a sidecar under traffic.
        async with MMCacheClient(f"127.0.0.1:{ports[0][0]}", follow=False) as writer:
            seeded = [f"seed-{i}" for i in range(24)]
            for _ in range(2):  # stored, then a second sighting: written behind
                await writer.get_and_update(
                    [image_item(100 + i) for i in range(24)], seeded, lease=False
                )
        while not all(l2_holds(cluster, h) for h in seeded):
            assert time.monotonic() - whole < HEAL_S, "sidecar 0 does not write L2 again"
            await asyncio.sleep(0.2)

        for index, (port, _) in enumerate(ports):
            async with MMCacheClient(f"127.0.0.1:{port}", follow=False) as client:
                # Locate agrees with Redis for every master's slots.
                while True:
                    where = await client.locate(seeded, check_l2=True)
                    tiers = [w.tier for w in where]
                    if all(t in ("l1", "l2") for t in tiers):
                        break
                    assert time.monotonic() - whole < HEAL_S, (
                        f"sidecar {index} still locates {tiers.count(None)} of 24 nowhere"
                    )
                    await asyncio.sleep(0.2)
                if index > 0:  # reads through on every master: all 24 held
                    found = await client.lookup(seeded, lease=False)
                    assert found.held == [True] * 24, f"sidecar {index}"
                    (got, *_) = await client.fetch(seeded[:1], release=False)
                    assert got == image_item(100)
                # Writes: its own items reach L2 (a second sighting each).
                own = [f"own{index}-{i}" for i in range(12)]
                for _ in range(2):
                    await client.get_and_update(
                        [image_item(200 + i) for i in range(12)], own, lease=False
                    )
                while not all(l2_holds(cluster, h) for h in own):
                    assert time.monotonic() - whole < HEAL_S, f"sidecar {index} writes no L2"
                    await asyncio.sleep(0.2)
        for index, sidecar in enumerate(fleet):
            assert sidecar.gauge("mmcache_l2_up") == 1.0, f"sidecar {index}"
            assert sidecar.gauge("mmcache_l2_nodes_down") == 0.0, f"sidecar {index}"
        # One WARNING when the master went, one INFO when it came back, with the
        # reason: per outage, never per call (a loaded machine may time out a
        # watch PING and see a second, short one).
        for sidecar in fleet[:4]:
            log = sidecar.log.read_text()
            down = log.count(
                f"WARNING mmcache.server.cache._redis_nodes: L2 node 127.0.0.1:{victim} is down ("
            )
            back = log.count(f"L2 node 127.0.0.1:{victim} is back after")
            assert 1 <= down == back <= 2, log
            assert " ERROR " not in log, log


@pytest.fixture
def plain_redis(tmp_path: Path) -> Iterator[int]:
    """A Redis without cluster mode, as a wrong --l2 may name."""
    port = free_port()
    plain = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    try:
        RedisCluster(tmp_path, 0).wait_pong(port)
        yield port
    finally:
        plain.terminate()
        plain.wait(timeout=10)


async def test_an_unreachable_l2_is_an_error_at_start_and_l1_serves(tmp_path: Path) -> None:
    """No redis-server: nothing answers at the address (a cluster that is down)."""
    with sidecars(f"redis://127.0.0.1:{free_port()}", 1, tmp_path) as (sidecar,):
        await served_from_l1(sidecar)
        log = sidecar.log.read_text()
        assert "ERROR" in log and "is unusable" in log and "Connect" in log, log
        errors = parse_samples(scrape_text(sidecar.metrics_port))
        assert (sample(errors, "mmcache_l2_errors_total", op="read") or 0) >= 1


async def served_from_l1(sidecar: Sidecar) -> None:
    async with connected(sidecar, follow=False) as client:
        assert (await client.lookup(["x"])).held == [False]
        await client.get_and_update([image_item(7)], ["x"])
        assert (await client.lookup(["x"])).held == [True]
        assert (await client.fetch(["x"])) == [image_item(7)]
    assert sidecar.gauge("mmcache_l2_up") == 0.0
