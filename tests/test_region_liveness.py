"""A region is trusted only while its server is alive now, and a restart is a
clean break (issue 43): real server processes, SIGKILLed and started again on
the same port and shared-memory directory; clients used as the vLLM plugin
uses them (the frontends' `lease_resident` and `lookup`, their uploads
unleased; the engine's `fetch_resident`, then `fetch`)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import torch

from mmcache._errors import DeadlineExceededError, UnavailableError
from mmcache._shm_layout import BEAT_S, STALE_S
from mmcache.client import MMCacheClient

from .conftest import eventually, sample, scrape
from .test_process import MMCACHE, free_port, start, wait_serving
from .test_shm import tensor

ITEM_BYTES = 4 << 18  # float32 x 2^18: 1 MiB, large enough to be resident


def item(seed: int) -> dict[str, torch.Tensor]:
    return {"x": tensor(torch.float32, 1 << 18, seed)}


def serve(shm_dir: Path, port: int, metrics_port: int) -> subprocess.Popen[str]:
    proc = start(
        [
            MMCACHE,
            "serve",
            *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)),
            *("--shm-dir", str(shm_dir), "--shm-mb", "64", "--capacity-gb", "0.25"),
            *("--grace-s", "0"),
        ]
    )
    wait_serving(port, proc)
    return proc


class Sidecar:
    """A server process on one port and shared-memory directory, killed and
    started again there."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = shm_dir
        self.port, self.metrics_port = free_port(), free_port()
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        self.procs.append(serve(self.shm_dir, self.port, self.metrics_port))

    def kill(self) -> None:
        self.procs[-1].send_signal(signal.SIGKILL)
        self.procs[-1].wait()

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@asynccontextmanager
async def running(shm_dir: Path, n: int) -> AsyncIterator[tuple[Sidecar, list[MMCacheClient]]]:
    """A sidecar, and `n` clients of it, each with its report ring."""
    sidecar = Sidecar(shm_dir)
    try:
        sidecar.start()
        async with AsyncExitStack() as stack:
            made = [
                await stack.enter_async_context(
                    MMCacheClient(f"127.0.0.1:{sidecar.port}", fail_open=True, timeout=5.0)
                )
                for _ in range(n)
            ]
            await eventually(lambda: all(c.report_ring is not None for c in made))
            yield sidecar, made
    finally:
        sidecar.stop_all()


async def test_a_killed_servers_region_is_neither_leased_nor_read_after_an_idle_spell(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, 3) as (sidecar, (api, engine, watcher)):
        await api.get_and_update([item(1)], ["a"], lease=False)
        assert api.lease_resident(["a"]).held == [True]
        assert engine.fetch_resident(["a"]) is not None
        region = api.region
        assert region is not None
        # Idle while the server lives: its heartbeat moves meanwhile, which
        # a count of beats would take for life at the first look after the kill.
        await asyncio.sleep(1.5)
        sidecar.kill()
        killed = time.monotonic()
        watched = watcher.region
        assert watched is not None
        # Looked at all along: the bound.
        await eventually(lambda: not watched.serving(), timeout=STALE_S + 2)
        abandoned = time.monotonic() - killed
        assert abandoned <= STALE_S + BEAT_S + 0.5, abandoned
        await asyncio.sleep(STALE_S + 0.5 - abandoned)  # the idle clients' first look
        assert not region.serving()
        assert api.lease_resident(["a"]).held == [False]
        assert engine.fetch_resident(["a"]) is None
        with_ring = region.open()
        began = time.monotonic()
        found = await api.lookup(["a"])  # fails open: a miss, nothing leased
        assert found.held == [False]
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            await engine.fetch(["a"], wait=False)  # by call, to nobody: not the region
        assert time.monotonic() - began < 2 * 1.0 + 0.5  # within the fail-open bounds
        # The stale region is dropped, not just skipped: unmapped from the client.
        assert with_ring and engine.region is None and not region.open()


async def test_a_restart_is_a_clean_break_no_lease_left_every_read_counted(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, 3) as (sidecar, (uploader, asker, engine)):

        async def round_of_hits(seed: int) -> int:
            """One round: the first frontend processes and uploads (unleased),
            the second hits (leased for the engine), the engine reads."""
            await eventually(lambda: uploader.following and asker.following, timeout=15)
            hashes = [f"{seed}-{i}" for i in range(4)]  # new items each round
            items = [item(seed + i) for i in range(len(hashes))]
            await uploader.get_and_update(items, hashes, lease=False)
            leased = asker.lease_resident(hashes)
            rest = [h for h, held in zip(hashes, leased.held, strict=True) if not held]
            if rest:
                assert (await asker.lookup(rest)).held == [True] * len(rest)
            got = engine.fetch_resident(hashes)
            if got is None:
                got = await engine.fetch(hashes, release=True)
            for read, sent in zip(got, items, strict=True):
                assert torch.equal(read["x"], sent["x"])
            return len(hashes) * ITEM_BYTES

        async def counted(read: int) -> bool:
            """No lease left, and every byte the engine read counted as sent."""
            leases = (await engine.transport.info()).leases
            samples = await scrape(sidecar.metrics_port)
            sent = sample(samples, "mmcache_sent_bytes_total") or 0.0
            return leases == 0 and sent == read

        read = await round_of_hits(10)
        await settled(lambda: counted(read))
        old = engine.region
        assert old is not None

        sidecar.kill()
        sidecar.start()
        # Round two on the new server at once: no client leases, reads or
        # reports through the old region (the new server closed it).
        assert not old.open()
        read = await round_of_hits(20)
        await settled(lambda: counted(read))
        # Back to full speed: each client maps the new region.
        await eventually(
            lambda: all(
                c.region is not None and c.region.instance_id == c.instance_id
                for c in (uploader, asker, engine)
            ),
            timeout=10,
        )
        read += await round_of_hits(30)
        await settled(lambda: counted(read))


async def settled(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """`eventually`, for a check that makes calls."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("not within the time")
        await asyncio.sleep(0.05)
