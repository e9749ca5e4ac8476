"""Counts exact under concurrency (issue 43): a new item processed by two API
processes at once (both asked before either uploaded) is two misses for vLLM,
and two misses for the sidecar, whatever each upload found the other had
stored. Two frontend processes race on one item against a real server."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from mmcache.server import MMCacheServer

from .conftest import connected, scrape, serving
from .items import image_item


def racer(target: str, mm_hash: str, seed: int, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.racer_proc", target, mm_hash, str(seed), *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)).strip()


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


async def counts(server: MMCacheServer) -> tuple[float, float]:
    samples = await scrape(server.metrics_port)

    def total(metric: str) -> float:
        return sum(value for (name, _), value in samples.items() if name == metric)

    return total("mmcache_queries_total"), total("mmcache_hits_total")


@pytest.mark.parametrize("order", ["one after the other's feed", "at once"])
async def test_two_processes_racing_on_one_new_item_count_two_misses(order: str) -> None:
    async with serving() as server:
        target = f"127.0.0.1:{server.port}"
        after = ("--after-feed",) if order != "at once" else ()
        procs = [racer(target, "new", 1), racer(target, "new", 1, *after)]
        try:
            # Both asked before either uploaded: neither knew the item.
            assert [await line(p) for p in procs] == ["asked False", "asked False"]
            before = await counts(server)
            if after:
                go(procs[0])
                assert await line(procs[0]) == "uploaded False"  # stored: a miss
                go(procs[1])
                assert await line(procs[1]) == "uploaded False"  # its data sent: a miss
            else:
                go(procs[0])
                go(procs[1])
                assert sorted([await line(p) for p in procs]) == ["uploaded False"] * 2
            assert [await asyncio.to_thread(p.wait, 30) for p in procs] == [0, 0]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
        queries, hits = await counts(server)
        assert (queries - before[0], hits - before[1]) == (2, 0)  # as vLLM counts them


async def test_a_hash_sent_alone_and_held_is_the_only_hit() -> None:
    # The rule: data sent is a miss (its caller processed it), also over an
    # item stored meanwhile (REPLACED); a hash alone that is held is a hit.
    async with serving() as server, connected(server) as a, connected(server, follow=False) as b:
        await a.get_and_update([image_item(2)], ["x"], lease=False)  # STORED
        before = await counts(server)
        await b.get_and_update([image_item(2)], ["x"])  # its mirror did not know: REPLACED
        assert b.make_stats().hits == 0
        assert (await a.lookup(["x"])).held == [True]  # a hash alone, held: HIT
        queries, hits = await counts(server)
        assert (queries - before[0], hits - before[1]) == (2, 1)
