"""Real Prometheus scrapes a real `mmcache serve`: the counters the traffic implies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmcache.client import MMCacheClient
from tests.conftest import MMCACHE
from tests.deploy.prometheus_harness import (
    fetch_text,
    free_port,
    promtool_check_metrics,
    running_prometheus,
)
from tests.items import image_item


@pytest.fixture
def mmcache_process() -> Iterator[tuple[int, int]]:
    port, metrics_port = free_port(), free_port()
    env = {
        **os.environ,
        "MMCACHE_HOST": "127.0.0.1",
        "MMCACHE_PORT": str(port),
        "MMCACHE_METRICS_PORT": str(metrics_port),
        "MMCACHE_CAPACITY_GB": "0.125",
    }
    proc = subprocess.Popen([MMCACHE, "serve"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(
            [MMCACHE, "health", f"127.0.0.1:{port}", "--timeout", "1"],
            capture_output=True,
            check=False,
        ).returncode:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "mmcache did not become SERVING"
            time.sleep(0.1)
        yield port, metrics_port
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


async def drive(port: int) -> None:
    """6 image queries (3 hits) and 1 video query (0 hits), and one engine book."""
    images = [image_item(i) for i in range(3)]
    hashes = [f"img-{i}" for i in range(3)]
    async with MMCacheClient(f"127.0.0.1:{port}") as client:
        await client.get_and_update(images, hashes)
        await client.inject_into_mm_cache({"image": hashes}, {"image": list(images)})
        await client.get_and_update([image_item(9, modality="video")], ["vid-0"])
        book = client.encoder_cache("engine-0")
        await book.create(cache_size=1000)
        assert await book.can_allocate("req-1", "img-0", 100, 500, 0)
        await book.allocate("req-1", "img-0", 100)


def test_prometheus_reads_back_the_counts_the_traffic_implies(
    mmcache_process: tuple[int, int], tmp_path: Path
) -> None:
    port, metrics_port = mmcache_process
    with running_prometheus({"mmcache": [f"127.0.0.1:{metrics_port}"]}, tmp_path) as prom:
        prom.wait_for_up("mmcache")
        asyncio.run(drive(port))
        job = 'job="mmcache"'
        assert prom.wait_for(f"sum(mmcache_queries_total{{{job}}})", lambda v: v == 7) == 7
        assert prom.wait_for(f"sum(mmcache_hits_total{{{job}}})", lambda v: v == 3) == 3
        by_modality = {
            labels["modality"]: value
            for labels, value in prom.query(f"mmcache_queries_total{{{job}}}")
        }
        assert by_modality == {"image": 6, "video": 1, "audio": 0}  # audio: at 0 from the start
        assert prom.query_value(f'mmcache_hits_total{{{job},modality="video"}}') == 0
        assert prom.query_value(f"mmcache_items{{{job}}}") == 4
        referenced = f'mmcache_encoder_referenced_tokens{{{job},engine="engine-0"}}'
        assert prom.wait_for(referenced, lambda v: v == 100) == 100
        handled = (
            # Batches go over upload sessions (UpdateSession), counted one by one.
            f'sum(grpc_server_handled_total{{{job},grpc_method=~"GetAndUpdate(One)?|UpdateSession",'
            'grpc_code="OK"})'
        )
        assert prom.wait_for(handled, lambda v: v == 3) == 3


def test_promtool_accepts_the_exposition(mmcache_process: tuple[int, int]) -> None:
    port, metrics_port = mmcache_process
    asyncio.run(drive(port))
    result = promtool_check_metrics(fetch_text(f"http://127.0.0.1:{metrics_port}/metrics"))
    assert result.returncode == 0, result.stdout + result.stderr
