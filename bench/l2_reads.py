"""Reads of an L2 record by each parser the tier could use, on one local
redis-server: the tier's own (`BulkReader`, server/cache/_resp_reads.py),
redis-py's asyncio RESP2 parser, and hiredis's where it is importable.

    python -m bench.l2_reads [--reps 40] [--sizes 1,6.44,12.66]
    PYTHONPATH=/path/to/hiredis python -m bench.l2_reads   # adds hiredis's row

A record is what a sidecar writes for an item: a Redis hash of a manifest and
4 MiB chunk frames. Each row reads it `--reps` times with HGETALL (the
parsers take turns, one read each), and the `+ digest` row is BulkReader's
read and the record's XXH3-128 check, the whole of what an L2 hit now costs
to read. Columns: wall ms median, CPU ms per read (the process's), and the
wall time against BulkReader's. Every parser must give each read its own
reply after a caller gives up (tests/test_resp_reads.py for ours; redis-py
closes a connection whose command was cancelled); this table is the cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable

from redis._parsers import _AsyncRESP2Parser
from redis.asyncio import ConnectionPool, Redis

from mmcache._frames import MAX_CHUNK_BYTES
from mmcache.server.cache._l2 import payload_digest
from mmcache.server.cache._resp_reads import BulkReader
from tests.redis_cluster import free_port

Read = Callable[[], Awaitable[object]]


def redis_server(port: int, directory: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
            *("--appendonly", "no", "--dir", directory),
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(500):
        done = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True)
        if done.stdout.strip() == b"PONG":
            return proc
        time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def hiredis_client(port: int) -> Redis | None:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return None
    from redis._parsers import _AsyncHiredisParser

    return _with_parser(port, _AsyncHiredisParser)


def _with_parser(port: int, parser: type) -> Redis:
    return Redis(connection_pool=ConnectionPool(port=port, parser_class=parser))


async def timed(read: Read, reps: int) -> tuple[float, float]:
    """Median wall ms and mean CPU ms of `reps` reads."""
    walls, cpu = [], 0.0
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        assert await read()
        walls.append(time.perf_counter() - w0)
        cpu += time.process_time() - c0
    return statistics.median(walls) * 1e3, cpu / reps * 1e3


async def row(port: int, size: int, reps: int) -> None:
    payload = os.urandom(size)
    frames = [payload[i : i + MAX_CHUNK_BYTES] for i in range(0, size, MAX_CHUNK_BYTES)]
    fields: dict[str, bytes] = {"m": b"manifest" * 20}
    fields.update({f"c{i}": frame for i, frame in enumerate(frames)})
    key = f"record-{size}"
    python = _with_parser(port, _AsyncRESP2Parser)
    hiredis = hiredis_client(port)
    ours = BulkReader("127.0.0.1", port)
    await python.hset(key, mapping=fields)  # type: ignore[misc]

    async def ours_digest() -> object:
        reply = await ours.command(b"HGETALL", key)
        assert isinstance(reply, list)
        return payload_digest(v for v in reply[3::2] if isinstance(v, bytes))

    readers: dict[str, Read] = {
        "BulkReader (the tier's)": lambda: ours.command(b"HGETALL", key),
        "BulkReader + digest": ours_digest,
        "redis-py, RESP2 parser": lambda: python.hgetall(key),  # type: ignore[return-value]
    }
    if hiredis is not None:
        readers["redis-py, hiredis"] = lambda: hiredis.hgetall(key)  # type: ignore[return-value]
    for read in readers.values():  # connect and warm
        await read()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
    for _ in range(reps // 5):  # in turns, so that a noisy spell hits them all
        for name, read in readers.items():
            results[name].append(await timed(read, 5))
    base = statistics.median(w for w, _ in results["BulkReader (the tier's)"])
    for name, runs in results.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.mean(c for _, c in runs)
        print(f"| {size / 1e6:.2f} MB | {name} | {wall:.2f} | {cpu:.2f} | {wall / base:.2f}x |")
    await ours.close()
    await python.aclose()
    if hiredis is not None:
        await hiredis.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--sizes", default="1.05,6.44,12.66", help="MB, comma-separated")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        proc = redis_server(port, directory)
        try:
            print("| record | reader | wall ms, median | CPU ms per read | wall / BulkReader |")
            print("|---|---|---|---|---|")
            for mb in args.sizes.split(","):
                await row(port, int(float(mb) * 1e6), args.reps)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(main())
