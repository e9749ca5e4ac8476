"""Sidecars as separate `mmcache serve` processes ("nodes") sharing one Redis
Cluster as L2: a cold image asked for by every node at once is processed once,
and what one node stored is held by the others."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import pytest

from mmcache.client import MMCacheClient

from .conftest import MMCACHE, parse_samples, sample, scrape_text
from .items import image_item
from .redis_cluster import RedisCluster, redis_available, redis_cluster
from .test_process import free_port, start, wait_serving

pytestmark = pytest.mark.skipif(
    not redis_available(), reason="redis-server is missing: scripts/install-system-deps.sh"
)

NODES = 4


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[RedisCluster, list[tuple[int, int]]]]:
    """Four sidecar processes on one cluster: (gRPC port, metrics port) each."""
    with redis_cluster() as cluster:
        procs: list[subprocess.Popen[str]] = []
        ports: list[tuple[int, int]] = []
        try:
            for _ in range(NODES):
                # Each picked just before its start: a running sidecar's Redis
                # connections take ephemeral ports, which a port picked early may be.
                port, metrics_port = free_port(), free_port()
                ports.append((port, metrics_port))
                proc = start(
                    [
                        MMCACHE,
                        "serve",
                        "--host=127.0.0.1",
                        f"--port={port}",
                        f"--metrics-port={metrics_port}",
                        "--capacity-gb=0.25",
                        "--no-shm",
                        f"--l2={cluster.url}",
                        "--l2-wait-ms=3000",
                    ]
                )
                procs.append(proc)
                wait_serving(port, proc)
            yield cluster, ports
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.communicate(timeout=20)


def total(ports: list[tuple[int, int]], name: str, **labels: str) -> float:
    return sum(sample(parse_samples(scrape_text(m)), name, **labels) or 0.0 for _, m in ports)


async def frontend(port: int, mm_hash: str, seed: int) -> int:
    """A frontend's request with one image: 1 when it had to run the processor."""
    async with MMCacheClient(f"127.0.0.1:{port}") as client:
        found = await client.lookup([mm_hash], modality="image")
        if found.held[0]:
            (got,) = await client.fetch([mm_hash])  # its engine's read
            assert got == image_item(seed)
            return 0
        await asyncio.sleep(0.05)  # the processor
        await client.get_and_update([image_item(seed)], [mm_hash], resend=[True])
        (got,) = await client.fetch([mm_hash])
        assert got == image_item(seed)
        return 1


async def test_a_cold_image_asked_for_by_four_nodes_at_once_is_processed_once(
    nodes: tuple[RedisCluster, list[tuple[int, int]]],
) -> None:
    _, ports = nodes
    runs = await asyncio.gather(*(frontend(port, "cold-everywhere", 1) for port, _ in ports))
    assert sum(runs) == 1
    assert total(ports, "mmcache_l2_hits_total") == NODES - 1
    # Those that asked before it reached L2 waited for it; a later one read it.
    assert 1 <= total(ports, "mmcache_l2_flight_waits_total", result="arrived") <= NODES - 1
    assert total(ports, "mmcache_l2_flight_waits_total", result="timeout") == 0


async def test_an_image_seen_twice_on_one_node_is_read_by_the_others(
    nodes: tuple[RedisCluster, list[tuple[int, int]]],
) -> None:
    _, ports = nodes
    first, *others = [port for port, _ in ports]
    assert await frontend(first, "multi-turn", 2) == 1  # turn 1: processed
    assert await frontend(first, "multi-turn", 2) == 0  # turn 2: a hit, and admitted to L2
    written = total(ports, "mmcache_l2_writes_total", result="written")
    for _ in range(100):
        if written >= 2:  # this test's item and the one before's
            break
        await asyncio.sleep(0.05)
        written = total(ports, "mmcache_l2_writes_total", result="written")
    runs = await asyncio.gather(*(frontend(port, "multi-turn", 2) for port in others))
    assert sum(runs) == 0
