"""Calls cut short by their clients (cancels, deadlines): typed on the client,
counted as what they are on the server (found by bench/soak.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from mmcache.client import DeadlineExceededError, FailOpen, MMCacheClient
from mmcache.server import MMCacheServer

from .conftest import MIB, connected, eventually, serving


def handled(server: MMCacheServer, method: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in server.registry.collect():
        for s in family.samples:
            if s.name == "grpc_server_handled_total" and s.labels["grpc_method"] == method:
                counts[s.labels["grpc_code"]] = s.value
    return counts


async def test_an_upload_past_its_deadline_is_deadline_exceeded_never_internal() -> None:
    data = torch.randn(1 << 20)  # 4 MiB: streamed in chunks, under flow control
    async with (
        serving(capacity_bytes=128 * MIB) as server,
        connected(server, timeout=0.02, follow=False) as client,
    ):
        outcomes = await asyncio.gather(
            *(client.get_and_update([{"x": data}], [f"h{i}"]) for i in range(48)),
            return_exceptions=True,
        )
    failures = {type(o).__name__ for o in outcomes if isinstance(o, BaseException)}
    assert failures <= {"DeadlineExceededError"}, failures
    assert any(isinstance(o, DeadlineExceededError) for o in outcomes)  # the case was met


async def test_a_failing_open_client_fails_open_on_a_deadline_mid_upload() -> None:
    data = torch.randn(1 << 20)
    async with (
        serving(capacity_bytes=128 * MIB) as server,
        connected(server, fail_open=FailOpen(0.03), follow=False) as client,
    ):
        results = await asyncio.gather(
            *(client.get_and_update([{"x": data}], [f"h{i}"]) for i in range(48))
        )
        assert len(results) == 48  # every request went on: none raised
        assert client.fail_opens > 0


async def test_cancelled_calls_are_counted_cancelled_not_unknown_or_invalid() -> None:
    data = torch.randn(1 << 20)
    rng = random.Random(0)
    async with (
        serving(capacity_bytes=128 * MIB) as server,
        connected(server, follow=False) as client,
    ):

        async def cancelled(i: int) -> None:
            task = asyncio.ensure_future(client.get_and_update([{"x": data}], [f"c{i}"]))
            await asyncio.sleep(rng.uniform(0, 0.02))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        for start in range(0, 120, 8):
            await asyncio.gather(*(cancelled(i) for i in range(start, start + 8)))
        async with connected(server) as follower:
            await follower.wait_following()  # a feed stream, closed below by its client
        # Counted once the server has seen each end.
        await eventually(lambda: handled(server, "Subscribe") == {"Canceled": 1})
        uploads = handled(server, "GetAndUpdate")
    assert uploads.get("Canceled", 0) > 0, uploads
    assert set(uploads) <= {"OK", "Canceled"}, uploads


@pytest.mark.parametrize("timeout", [0.001, 0.01])
async def test_a_fetch_past_its_deadline_is_deadline_exceeded(timeout: float) -> None:
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        async with MMCacheClient(target, follow=False) as writer:
            # 128 MiB: a co-located read copies at GB/s, and must outlast 10 ms.
            await writer.get_and_update([{"x": torch.randn(32 << 20)}], ["big"], lease=False)
        async with MMCacheClient(target, timeout=timeout, follow=False) as reader:

            async def read_often() -> None:
                for _ in range(20):
                    await reader.fetch(["big"])

            with pytest.raises(DeadlineExceededError):
                await read_often()
