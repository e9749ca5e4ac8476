"""A dead sidecar costs at most the deadline (issue 43, docs/faults.md): every
call a request makes returns within the client's fail-open deadline (plus a
margin for slow machines: the precise figure is a bench's) with the sidecar,
a real process, SIGKILLed, SIGSTOPped, or never there (a closed port); and
none waits for the client's own 60 s timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import torch

from mmcache._errors import DeadlineExceededError, UnavailableError
from mmcache.client import FailOpen, MMCacheClient

from .conftest import eventually
from .test_process import free_port
from .test_region_liveness import item, serve, settled

DEADLINE_S = 0.5
MARGIN_S = 0.5  # generous: CI machines are slow; the figure itself is a bench's


def small(seed: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((64,), float(seed))}


async def timed(call: Awaitable[Any]) -> tuple[float, Any]:
    """How long `call` took, and what it returned or raised."""
    began = time.monotonic()
    try:
        got: Any = await call
    except (UnavailableError, DeadlineExceededError) as exc:  # a read cannot fail open
        got = exc
    return time.monotonic() - began, got


def requests(client: MMCacheClient) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Every call a frontend's or an engine's request makes, by name."""
    return {
        "get_and_update": lambda: client.get_and_update([small(1)], ["new-small"]),
        "get_and_update (shm)": lambda: client.get_and_update([item(2)], ["new-big"]),
        "lookup": lambda: client.lookup(["held"], want_metadata=True),
        "fetch": lambda: client.fetch(["held"], release=True),
        "release": lambda: client.release(["held"]),
        "refresh": lambda: client.refresh(["held"]),
        "locate": lambda: client.locate(["held"]),
        "inject": lambda: client.inject_into_mm_cache(
            {"image": ["new-inj"]}, {"image": [small(3)]}
        ),
    }


async def all_bounded(client: MMCacheClient) -> dict[str, Any]:
    took: dict[str, float] = {}
    got: dict[str, Any] = {}
    for name, call in requests(client).items():
        took[name], got[name] = await timed(call())
        # Calls with no call at all stay instant too.
        assert client.lease_resident(["held"]).held == [False]
        assert client.fetch_resident(["held"]) is None
    slow = {name: t for name, t in took.items() if t > DEADLINE_S + MARGIN_S}
    assert not slow, f"past the {DEADLINE_S} s deadline: {slow}"
    return got


@contextmanager
def sidecar(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    proc = serve(tmp_path, port, free_port())
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.communicate()


@asynccontextmanager
async def frontend(port: int) -> AsyncIterator[MMCacheClient]:
    async with MMCacheClient(
        f"127.0.0.1:{port}", fail_open=FailOpen(timeout_s=DEADLINE_S)
    ) as client:
        yield client


async def leased_and_resident(client: MMCacheClient) -> None:
    """The client before the fault: an item held, resident, leased, ring open."""
    await client.get_and_update([item(9)], ["held"], lease=False)
    assert (await client.lookup(["held"])).held == [True]
    await eventually(lambda: client.report_ring is not None)


async def leases_are(client: MMCacheClient, wanted: int) -> bool:
    return (await client.transport.info()).leases == wanted


def check_failed_open(got: dict[str, Any]) -> None:
    assert list(got["get_and_update"]) != [None]  # handed back as a miss
    assert got["lookup"].held == [False]
    assert isinstance(got["fetch"], (UnavailableError, DeadlineExceededError))
    assert got["release"] == 0 and got["refresh"] == 0
    assert got["locate"][0].tier is None


async def test_a_sigkilled_sidecar_costs_at_most_the_deadline(tmp_path: Path) -> None:
    with sidecar(tmp_path) as (proc, port):
        async with frontend(port) as client:
            await leased_and_resident(client)
            proc.kill()
            proc.wait()
            await asyncio.sleep(2.5)  # past the heartbeat: its region is not trusted
            check_failed_open(await all_bounded(client))


async def test_a_stopped_sidecar_costs_at_most_the_deadline(tmp_path: Path) -> None:
    with sidecar(tmp_path) as (proc, port):
        async with frontend(port) as client:
            await leased_and_resident(client)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)
                check_failed_open(await all_bounded(client))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # Back: the calls answer again, the region is mapped once more, and
            # a read there gives its lease back (its report no longer dropped).
            deadline = time.monotonic() + 10
            while (await client.lookup(["held"], lease=False)).held != [True]:
                assert time.monotonic() < deadline, "not back after SIGCONT"
                await asyncio.sleep(0.1)
            await eventually(lambda: client.region is not None, timeout=5)
            leases = (await client.transport.info()).leases
            assert (await client.lookup(["held"])).held == [True]
            await client.fetch(["held"])  # out of the region, with no call
            await settled(lambda: leases_are(client, leases))


async def test_an_unreachable_sidecar_costs_at_most_the_deadline() -> None:
    began = time.monotonic()
    async with frontend(free_port()) as client:  # nothing listens there
        assert time.monotonic() - began < DEADLINE_S + MARGIN_S
        check_failed_open(await all_bounded(client))
