"""Nodes sharing an L2 tier: N sidecar processes, each with its own frontend,
on one Redis Cluster (three masters on loopback).

    python -m bench.nodes [--nodes 1,2,4] [--conversations 40] [--pool 64]
                          [--capacity-mib 64] [--seed 0] [--reps 30]

The trace is bench/fleet.py's: multi-turn chats re-sending their earlier
images, from a Zipf-like pool of 0.3-8 MiB images, request i sent to node
i mod N (a router that knows nothing of images: the worst case for sharing).
Each node is a `mmcache serve` process and a frontend process that does what
the vLLM plugin's P0 does, then its engine's read: asks its mirror, asks its
sidecar (`lookup`: read-through to L2, waiting for an image another node is
processing) for the rest, runs the "processor" for what is still missing,
uploads it, and fetches the request's held items.

Modes on the same trace: `L2` (`--l2` on every sidecar, admission on a second
sighting) and `no L2` (each node an island). Columns: processor runs / unique
images across all nodes, and that against one node's; bytes through L2
(read + written) / unique bytes; L2 hits and single-flight waits.

A second table times a lookup that L2 answers (the item read from L2 into
the sidecar, then answered held) beside one L1 answers, for 1 and 8 MiB items,
`--reps` times each: p50/p99 ms from the frontend, and the mean of the
server's own L2 reads (the Redis HGETALL, checks included).

A third times lookups (4 held items, 4 cold) with every master up and with
one master stopped (SIGSTOP), `--reps` x 4 each (`--only-hung`: this table
alone). A fourth replays chats whose users think 30-120 s between turns
(`--only-think`), and a fifth counts the L2 operations that fail around a
master killed and restarted under load (`--only-heal`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from bench.fleet import Trace, emit, image_hash, make_trace, process, read_record

if TYPE_CHECKING:
    from tests.redis_cluster import RedisCluster

MIB = 1 << 20


# ---------------------------------------------------------------- a node's frontend


def paced_trace(args: argparse.Namespace) -> tuple[Trace, list[float]]:
    """Chats whose users think between turns: each turn adds an image (the
    same Zipf-like pool) and re-sends the chat's earlier ones, 30-120 s after
    the last; chats start over the first 120 s. Times scaled by `--think`
    (1/40: 0.75-3 s between turns). Requests in time order, with their times."""
    pool = make_trace(args.seed, args.pool, 0).sizes
    rng = random.Random(args.seed + 1)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(pool))]
    order = list(range(len(pool)))
    rng.shuffle(order)
    timed: list[tuple[float, list[int]]] = []
    for _ in range(args.conversations):
        at, images = rng.uniform(0, 120), []
        for _ in range(rng.randint(2, 5)):
            new = order[rng.choices(range(len(pool)), weights)[0]]
            if new not in images:
                images.append(new)
            timed.append((at * args.think, list(images)))
            at += rng.uniform(30, 120)
    timed.sort(key=lambda pair: pair[0])
    return Trace(pool, [images for _, images in timed]), [at for at, _ in timed]


async def frontend(args: argparse.Namespace) -> None:
    from mmcache.client import CacheMissError, MMCacheClient

    if args.think:
        trace, times = paced_trace(args)
    else:
        trace, times = make_trace(args.seed, args.pool, args.conversations), []
    mine = [i for i in range(len(trace.requests)) if i % args.nodes == args.index]
    runs = 0
    failures = 0
    async with MMCacheClient(args.target, follow=True, timeout=120) as client:
        await client.wait_following()
        emit({"kind": "ready"})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        started = time.monotonic()

        async def request(index: int) -> None:
            nonlocal runs, failures
            if times:  # at its time, beside the chats in flight
                await asyncio.sleep(max(0.0, started + times[index] - time.monotonic()))
            images = trace.requests[index]
            hashes = [image_hash(i) for i in images]
            cached = client.is_cached(hashes, pending=True)
            asked = [h for h, known in zip(hashes, cached, strict=True) if not known]
            found = await client.lookup(asked, modality="image") if asked else None
            held_now = (
                set()
                if found is None
                else {h for h, ok in zip(asked, found.held, strict=False) if ok}
            )
            items: list[object | None] = []
            resend: list[bool] = []
            for image, h, known in zip(images, hashes, cached, strict=True):
                if known or h in held_now:
                    items.append(None)
                    resend.append(False)
                else:
                    items.append(process(image, trace.sizes[image]))
                    resend.append(h in asked)
                    runs += 1
            lease: bool | str = "hits" if found is not None else True
            send = partial(client.get_and_update, mm_hashes=hashes, modality="image", lease=lease)
            try:
                sent = await send(items, resend=resend)  # type: ignore[arg-type]
            except CacheMissError as exc:  # gone since the mirror said cached: as vLLM's P0
                for position, h in enumerate(hashes):
                    if h in exc.missing_hashes:
                        items[position] = process(images[position], trace.sizes[images[position]])
                        resend[position] = True
                        runs += 1
                sent = await send(items, resend=resend)  # type: ignore[arg-type]
            fetch = [h for h, held in zip(hashes, sent.held, strict=True) if held]
            if fetch:
                try:
                    await client.fetch(fetch)  # its engine's read
                except Exception:
                    failures += 1

        if times:
            await asyncio.gather(*(request(index) for index in mine))
        else:
            for index in mine:
                await request(index)
    emit({"kind": "done", "runs": runs, "failures": failures})


# ---------------------------------------------------------------- the driver


@dataclass
class Row:
    mode: str
    nodes: int
    runs: int = 0
    failures: int = 0
    l2_bytes: float = 0.0
    l2_hits: float = 0.0
    waits: float = 0.0
    timeouts: float = 0.0
    seconds: float = 0.0


def free_port() -> int:
    from tests.redis_cluster import free_port as pick

    return pick()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from tests.conftest import parse_samples

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse_samples(response.read().decode())


def sidecar(
    port: int, metrics_port: int, capacity_mib: int, l2: str | None, *extra: str
) -> subprocess.Popen[str]:
    from tests.conftest import MMCACHE

    argv = [
        MMCACHE,
        "serve",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--metrics-port={metrics_port}",
        f"--capacity-gb={capacity_mib / 1024}",
        "--no-shm",  # nodes share nothing but L2
        "--log-level=WARNING",
    ]
    if l2 is not None:
        argv.append(f"--l2={l2}")
    proc = subprocess.Popen([*argv, *extra], text=True)
    from tests.test_process import wait_serving

    wait_serving(port, proc)  # type: ignore[arg-type]
    return proc


async def spawn_frontend(
    args: argparse.Namespace, target: str, nodes: int, index: int
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.nodes",
        "--role=frontend",
        f"--seed={args.seed}",
        f"--pool={args.pool}",
        f"--conversations={args.conversations}",
        f"--think={args.think}",
        f"--target={target}",
        f"--nodes={nodes}",
        f"--index={index}",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def run_once(args: argparse.Namespace, nodes: int, l2: str | None) -> Row:
    row = Row("L2" if l2 else "no L2", nodes)
    ports = [(free_port(), free_port()) for _ in range(nodes)]
    # Think times scaled: the claim's window (10 s) too, so the two keep their ratio.
    extra = [f"--l2-window-s={10 * args.think:g}"] if args.think else []
    procs = [sidecar(p, m, args.capacity_mib, l2, *extra) for p, m in ports]
    try:
        fronts = [
            await spawn_frontend(args, f"127.0.0.1:{p}", nodes, i) for i, (p, _) in enumerate(ports)
        ]
        for proc in fronts:
            assert (await read_record(proc))["kind"] == "ready"
        started = time.perf_counter()
        for proc in fronts:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        for proc in fronts:
            done = await read_record(proc)
            row.runs += int(done["runs"])  # type: ignore[call-overload]
            row.failures += int(done["failures"])  # type: ignore[call-overload]
            await proc.wait()
        row.seconds = time.perf_counter() - started
        for _, metrics_port in ports:
            samples = scrape(metrics_port)
            for name in ("mmcache_l2_read_bytes_total", "mmcache_l2_written_bytes_total"):
                row.l2_bytes += samples.get((name, ()), 0.0)
            row.l2_hits += samples.get(("mmcache_l2_hits_total", ()), 0.0)
            waits = "mmcache_l2_flight_waits_total"
            row.waits += samples.get((waits, (("result", "arrived"),)), 0.0)
            row.timeouts += samples.get((waits, (("result", "timeout"),)), 0.0)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
    return row


def print_rows(trace: Trace, rows: Sequence[Row]) -> None:
    unique = trace.unique
    unique_bytes = sum(trace.sizes[i] for i in unique)
    one = {r.mode: r.runs for r in rows if r.nodes == 1}  # each mode against its one node
    print(
        "\n| nodes | mode | processor runs / unique | runs vs one node | L2 bytes / unique "
        "| L2 hits | single-flight waits (in vain) | engine read failures | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        versus = f"{row.runs / one[row.mode]:.2f}x" if one.get(row.mode) else "-"
        print(
            f"| {row.nodes} | {row.mode} | {row.runs} / {len(unique)} = "
            f"{row.runs / len(unique):.2f} | {versus} | {row.l2_bytes / unique_bytes:.2f} "
            f"| {row.l2_hits:.0f} | {row.waits:.0f} ({row.timeouts:.0f}) | {row.failures} "
            f"| {row.seconds:.1f} |"
        )


# Qwen2-VL's uint8 pixel_values at its real pixel limits (vLLM 0.32): a
# 1024x1024 image is 74x74 patches of 1176 bytes, a 1920x1080 one 78x138.
CACHE_MIB = 128  # each sidecar's, in the latency table
ITEM_SIZES = {"1 MiB": MIB, "1024x1024": 74 * 74 * 1176, "1920x1080": 78 * 138 * 1176}


async def latency(args: argparse.Namespace, l2: str) -> None:
    """Lookups answered through L2 beside lookups L1 answers, per item size,
    and a bare redis-py read (HGETALL, the parser redis-py picks: hiredis
    where installed) of the same record from the same cluster."""
    from redis.asyncio.cluster import RedisCluster as BareCluster

    from mmcache.client import MMCacheClient
    from mmcache.server.cache._l2_redis import redis_key

    ports = [(free_port(), free_port()) for _ in range(2)]
    # A cache that fills and evicts within the run, as in service: what a read
    # from L2 keeps lands in memory freed by evictions, not in fresh pages.
    procs = [sidecar(p, m, CACHE_MIB, l2) for p, m in ports]
    bare = BareCluster.from_url(l2)
    print(
        "\n| item | lookup, L2 hit p50 / p99 ms | lookup, L1 hit p50 / p99 ms | L2 read ms "
        "| bare redis-py read p50 ms | L2 hit / bare read, throughput |"
    )
    print("|---|---|---|---|---|---|")
    try:
        async with (
            MMCacheClient(f"127.0.0.1:{ports[0][0]}", timeout=60) as writer,
            MMCacheClient(f"127.0.0.1:{ports[1][0]}", timeout=60) as reader,
        ):
            # The reader's cache full before the first read, as in service: each
            # read from L2 then lands in memory that evictions freed. (Without,
            # the 1024x1024 row's reads went mostly into fresh pages, which the
            # kernel zeroes first: 4.5-5 ms against 2.6 for the bare read.)
            for i in range(CACHE_MIB // 8 + 4):
                filler = process(100_000 + i, 8 * MIB)
                await reader.get_and_update(
                    [filler], [f"fill-{i}-{time.monotonic_ns()}"], lease=False
                )
            read = ("mmcache_l2_latency_seconds_sum", (("op", "read"),))
            reads = ("mmcache_l2_latency_seconds_count", (("op", "read"),))
            for label, size in ITEM_SIZES.items():
                before = scrape(ports[1][1])
                l2_times: list[float] = []
                l1_times: list[float] = []
                bare_times: list[float] = []
                for rep in range(args.reps):
                    h = f"lat-{label}-{rep}-{time.monotonic_ns()}"
                    await writer.get_and_update([process(rep, size)], [h], lease=False)
                    await writer.lookup([h], lease=False)  # a second sighting: to L2
                    for _ in range(500):
                        where = await reader.locate([h], check_l2=True)
                        if where[0].tier == "l2":
                            break
                        await asyncio.sleep(0.005)
                    start = time.perf_counter()
                    assert (await reader.lookup([h], lease=False)).held == [True]
                    l2_times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    assert (await reader.lookup([h], lease=False)).held == [True]
                    l1_times.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    assert await bare.hgetall(redis_key("mmcache:", h))  # type: ignore[misc]
                    bare_times.append(time.perf_counter() - start)
                after = scrape(ports[1][1])
                seconds = after.get(read, 0.0) - before.get(read, 0.0)
                count = after.get(reads, 0.0) - before.get(reads, 0.0)
                mean = f"{seconds / count * 1e3:.1f}" if count else "-"
                ratio = statistics.median(bare_times) / statistics.median(l2_times)
                print(
                    f"| {label} ({size / 1e6:.2f} MB) | {_ms(l2_times)} | {_ms(l1_times)} "
                    f"| {mean} | {statistics.median(bare_times) * 1e3:.1f} | {ratio:.2f}x |"
                )
    finally:
        await bare.aclose()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)


async def hung(args: argparse.Namespace, cluster: RedisCluster) -> None:
    """Lookups while a master hangs (SIGSTOP): each names 4 images the sidecar
    holds and 4 cold ones (read from L2, then claimed), a third of them on the
    stopped master's slots. Without a breaker per master every such lookup
    waits the L2 timeout (1 s); with one, only those in the first second do."""
    from mmcache.client import MMCacheClient

    port, metrics_port = free_port(), free_port()
    proc = sidecar(port, metrics_port, 1024, cluster.url)
    print("\n| masters | lookups | lookup p50 / p99 ms | slowest ms | L2 errors |")
    print("|---|---|---|---|---|")
    try:
        async with MMCacheClient(f"127.0.0.1:{port}", timeout=60) as client:
            held = [f"held-{i}" for i in range(4)]
            await client.get_and_update([process(i, 64 << 10) for i in range(4)], held)
            for state in ("all up", "one stopped"):
                pid = cluster.procs[cluster.ports[1]].pid
                if state == "one stopped":
                    os.kill(pid, signal.SIGSTOP)
                try:
                    before = scrape(metrics_port)
                    times: list[float] = []
                    for rep in range(args.reps * 4):
                        cold = [f"cold-{state}-{rep}-{i}" for i in range(4)]
                        start = time.perf_counter()
                        await client.lookup([*held, *cold], lease=False)
                        times.append(time.perf_counter() - start)
                    after = scrape(metrics_port)
                finally:
                    if state == "one stopped":
                        os.kill(pid, signal.SIGCONT)
                errors = sum(
                    after.get(key, 0.0) - before.get(key, 0.0)
                    for key in after
                    if key[0] == "mmcache_l2_errors_total"
                )
                print(
                    f"| {state} | {len(times)} | {_ms(times)} | {max(times) * 1e3:.0f} "
                    f"| {errors:.0f} |"
                )
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def heal(args: argparse.Namespace, cluster: RedisCluster) -> None:
    """One sidecar's L2 backend under 32 operations at once (2 reads to 1
    write of 200 KB records), a master SIGKILLed and restarted empty 3 s
    later: how many operations fail, before, during and after, by the time
    since the cluster was whole again."""
    from mmcache.server.cache._l2 import L2Record
    from mmcache.server.cache._l2_redis import RedisClusterL2

    backend = RedisClusterL2(cluster.url, timeout_s=1.0)
    record = L2Record(b"m" * 16, (b"x" * 200_000,))
    for i in range(60):
        await backend.write(f"heal{i}", record, 0)
    marks: list[tuple[float, bool]] = []
    stop = False

    async def worker(lane: int) -> None:
        n = 0
        while not stop:
            try:
                if n % 3 == 0:
                    await backend.write(f"w{lane}-{n}", record, 0)
                else:
                    await backend.read(f"heal{(n * 7 + lane) % 60}")
                marks.append((time.monotonic(), True))
            except Exception:
                marks.append((time.monotonic(), False))
            n += 1

    workers = [asyncio.create_task(worker(lane)) for lane in range(32)]
    await asyncio.sleep(2.0)
    killed = time.monotonic()
    cluster.kill(cluster.ports[1])
    await asyncio.sleep(3.0)
    await asyncio.to_thread(cluster.restart, cluster.ports[1])
    whole = time.monotonic()
    await asyncio.sleep(20.0)
    stop = True
    await asyncio.gather(*workers)
    await backend.close()
    phases = [
        ("before the kill", 0.0, killed),
        ("master down", killed, whole),
        ("0-1 s after whole", whole, whole + 1),
        ("1-5 s after whole", whole + 1, whole + 5),
        ("5-20 s after whole", whole + 5, whole + 20),
    ]
    print("\n| phase | operations | failed |")
    print("|---|---|---|")
    for name, start, end in phases:
        inside = [ok for at, ok in marks if start <= at < end]
        failed = inside.count(False)
        share = f"{failed / len(inside):.0%}" if inside else "-"
        print(f"| {name} | {len(inside)} | {failed} ({share}) |")


def _ms(values: Sequence[float]) -> str:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"{cuts[49] * 1e3:.1f} / {cuts[98] * 1e3:.1f}"


async def drive(args: argparse.Namespace) -> None:
    from tests.redis_cluster import redis_cluster

    trace = make_trace(args.seed, args.pool, args.conversations)
    unique_bytes = sum(trace.sizes[i] for i in trace.unique)
    refs = sum(len(r) for r in trace.requests)
    print(
        f"trace: {len(trace.requests)} requests, {refs} image references, "
        f"{len(trace.unique)} unique images ({unique_bytes / MIB:.0f} MiB); "
        f"{args.capacity_mib} MiB cache per node; Redis Cluster of 3 masters"
    )
    rows: list[Row] = []
    with redis_cluster(maxmemory_mb=256) as cluster:
        if args.only_hung:
            await hung(args, cluster)
            return
        if args.only_think:
            await thinking(args, cluster)
            return
        if args.only_heal:
            await heal(args, cluster)
            return
        if args.only_latency:
            await latency(args, cluster.url)
            return
        for nodes in args.nodes:
            for l2 in (cluster.url, None):
                cluster.flushall()
                rows.append(await run_once(args, nodes, l2))
        print_rows(trace, rows)
        cluster.flushall()
        await latency(args, cluster.url)
        cluster.flushall()
        await hung(args, cluster)
        await thinking(args, cluster)
        await heal(args, cluster)


async def thinking(args: argparse.Namespace, cluster: RedisCluster) -> None:
    """The chats of `paced_trace`: users who think 30-120 s between turns,
    far past the claim's 10 s window, each turn on the next node."""
    paced = argparse.Namespace(**{**vars(args), "think": args.think_scale})
    trace, times = paced_trace(paced)
    print(
        f"\nthink times of 30-120 s between turns (scaled by {args.think_scale:g}: the "
        f"--l2-window-s too): {len(trace.requests)} requests over "
        f"{times[-1] / args.think_scale:.0f} s, {len(trace.unique)} unique images"
    )
    rows = []
    for nodes in sorted({1, *args.nodes}):
        cluster.flushall()
        rows.append(await run_once(paced, nodes, cluster.url))
    print_rows(trace, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["driver", "frontend"], default="driver")
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--capacity-mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--only-hung", action="store_true", help="only the hung-master table")
    parser.add_argument("--only-think", action="store_true", help="only the think-time table")
    parser.add_argument("--only-heal", action="store_true", help="only the master-restart table")
    parser.add_argument("--only-latency", action="store_true", help="only the L2-hit table")
    parser.add_argument("--think-scale", type=float, default=1 / 40)
    parser.add_argument("--think", type=float, default=0.0)  # a frontend's: its trace paced
    parser.add_argument("--target")
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args()
    if args.role == "driver":
        args.nodes = [int(n) for n in args.nodes.split(",")]
        asyncio.run(drive(args))
    else:
        args.nodes = int(args.nodes)
        asyncio.run(frontend(args))


if __name__ == "__main__":
    main()
