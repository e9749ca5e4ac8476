"""Encoder-cache operations per second through the server: single calls against batched.

    python -m bench.encoder [--seconds 2] [--batches 8 32 128]

A scheduler's stream of operations is recorded against a local book (each
step: requests arrive with 1-3 images drawn from a skewed pool, each image is
checked, a miss is asked for with can_allocate and allocated, requests finish
after a few steps and are freed, and the freed hashes are drained), so every
op is valid and the server's results can be checked against the recording.
The stream is replayed against a server in its own process over loopback,
one call per op, then in batches of N ops (one round trip each). The "core"
row applies the same stream in-process: the ceiling without a network.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time

from mmcache._encoder import (
    AllocateOp,
    CanAllocateOp,
    CheckAndUpdateCacheOp,
    EncoderCacheBook,
    EncoderOp,
    FreeOp,
    GetFreedMmHashesOp,
    OpResult,
)
from mmcache.client import MMCacheClient
from mmcache.client.wire._encoder import EncoderCache

CACHE = 8192  # encoder tokens, as vLLM's default for many vision models
COMPUTE = 8192  # per step
SIZES = (256, 576, 1225)  # tokens of one image, by hash
POOL = 4000  # distinct images; popularity 1/rank, so some recur often


def record(num_ops: int, seed: int = 0) -> tuple[list[EncoderOp], list[OpResult]]:
    """A valid scheduler stream of about `num_ops` ops and the results a fresh book gives."""
    rng = random.Random(seed)
    hashes = [f"img-{i:05d}" for i in range(POOL)]
    weights = [1 / (i + 1) for i in range(POOL)]
    size = {h: rng.choice(SIZES) for h in hashes}
    book = EncoderCacheBook(CACHE)
    ops: list[EncoderOp] = []
    results: list[OpResult] = []
    running: list[tuple[str, int]] = []  # (request, step it finishes)
    step = started = 0

    def do(op: EncoderOp) -> OpResult:
        result = op.apply(book)
        ops.append(op)
        results.append(result)
        return result

    while len(ops) < num_ops:
        step += 1
        compute = COMPUTE
        for _ in range(2):  # arriving requests
            request = f"req-{started}"
            started += 1
            running.append((request, step + rng.randrange(1, 5)))
            for h in rng.choices(hashes, weights, k=rng.randrange(1, 4)):
                if do(CheckAndUpdateCacheOp(request, h)):
                    continue
                if do(CanAllocateOp(request, h, size[h], compute)):
                    do(AllocateOp(request, h, size[h]))
                    compute -= size[h]
        for request, _ in [r for r in running if r[1] <= step]:
            do(FreeOp(request))
        running = [r for r in running if r[1] > step]
        do(GetFreedMmHashesOp())
    return ops, results


async def single(book: EncoderCache, op: EncoderOp) -> OpResult:
    if isinstance(op, CheckAndUpdateCacheOp):
        return await book.check_and_update_cache(op.request_id, op.mm_hash)
    if isinstance(op, CanAllocateOp):
        return await book.can_allocate(op.request_id, op.mm_hash, op.num_tokens, op.compute_budget)
    if isinstance(op, AllocateOp):
        return await book.allocate(op.request_id, op.mm_hash, op.num_tokens)
    if isinstance(op, FreeOp):
        return await book.free(op.request_id)
    assert isinstance(op, GetFreedMmHashesOp)
    return await book.get_freed_mm_hashes()


async def replay(
    book: EncoderCache, ops: list[EncoderOp], expected: list[OpResult], batch: int, seconds: float
) -> tuple[float, float]:
    """(ops/s, round trips/s) replaying `ops` in batches of `batch` (1: single calls)."""
    done = trips = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        await book.create(cache_size=CACHE, replace=True)  # the stream starts from empty
        for i in range(0, len(ops), batch):
            chunk = ops[i : i + batch]
            if batch == 1:
                got = [await single(book, chunk[0])]
            else:
                got = await book.run_batch(chunk)
            assert got == expected[i : i + batch], "the server disagrees with the recording"
            done += len(chunk)
            trips += 1
            if trips % 64 == 0 and time.perf_counter() - start >= seconds:
                break
    return done / elapsed, trips / elapsed


def core_rate(ops: list[EncoderOp], seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        EncoderCacheBook(CACHE).apply_batch(ops)
        done += len(ops)
    return done / elapsed


def spawn_server() -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-m", "bench._cache_server"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def run(seconds: float, batches: list[int]) -> None:
    ops, expected = record(50_000)
    counts = {type(op).__name__: 0 for op in ops}
    for op in ops:
        counts[type(op).__name__] += 1
    print(f"stream: {len(ops)} ops: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    proc, port = spawn_server()
    try:
        async with MMCacheClient(f"127.0.0.1:{port}") as client:
            book = client.encoder_cache("bench")
            await replay(book, ops[:2000], expected[:2000], 32, 0.2)  # warm-up
            print(f"{seconds:g} s per row, one client, loopback, server in its own process")
            print(
                f"{'mode':>10} | {'ops/call':>8} | {'ops/s':>9} | {'calls/s':>7} | {'speed-up':>8}"
            )
            print("-" * 55)
            base = 0.0
            for batch in [1, *batches]:
                rate, trips = await replay(book, ops, expected, batch, seconds)
                base = base or rate
                mode = "single" if batch == 1 else "batched"
                row = f"{mode:>10} | {batch:>8} | {rate:>9,.0f} | {trips:>7,.0f}"
                print(f"{row} | {rate / base:>7.1f}x")
            rate = core_rate(ops, seconds)
            print(f"{'core':>10} | {'-':>8} | {rate:>9,.0f} | {'-':>7} | {rate / base:>7.1f}x")
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    args = parser.parse_args()
    asyncio.run(run(args.seconds, args.batches))


if __name__ == "__main__":
    main()
