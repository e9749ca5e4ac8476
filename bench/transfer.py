"""Put and fetch throughput of mmcache beside the raw gRPC ceiling.

    python -m bench.transfer [--sizes 1 8 64] [--seconds 3] [--chunk-mib 1]

Put is measured in steady state: the cache (512 MiB) is filled first, so
every put also evicts. Servers run in their own processes (one core each side on a 2-core machine),
all on loopback. "put" is `get_and_update` of an item the server lacks (a
float32 tensor of the given size: encode, upload, commit); "fetch" is the
engine's read (download, rebuild the tensor). The ceiling moves the same
number of bytes through a bare generic handler in raw chunks of the same
size, measured in the same run, and, for put, the same bytes as a protobuf
`bytes` field (built, serialised and parsed by protobuf): the path the chunk
frames avoid. All three processes call
`mmcache.keep_freed_memory()`. Prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from mmcache import keep_freed_memory
from mmcache._frames import MAX_MESSAGE_BYTES
from mmcache.client import MMCacheClient
from mmcache.v1 import cache_pb2 as pb

MIB = 1 << 20
CAPACITY = 512 * MIB  # of the benchmark's cache server (bench/_cache_server.py)


def spawn(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def rate(op: Callable[[], Awaitable[None]], nbytes: int, seconds: float) -> float:
    """GB/s of `op`, repeated for about `seconds` after one warm-up."""
    await op()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        await op()
        n += 1
    return n * nbytes / elapsed / 1e9


async def ceiling(port: int, nbytes: int, chunk: int, seconds: float) -> tuple[float, float, float]:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        up = channel.stream_unary("/bench.Raw/Upload")
        down = channel.unary_stream("/bench.Raw/Download")
        chunks = [b"\x5a" * chunk for _ in range(nbytes // chunk)]

        async def put() -> None:
            call = up()
            for c in chunks:
                await call.write(c)
            await call.done_writing()
            await call

        async def get() -> None:
            async for _ in down(f"{nbytes},{chunk}".encode()):
                pass

        proto_up = channel.stream_unary(
            "/bench.Raw/UploadProto", request_serializer=pb.UpdateFrame.SerializeToString
        )
        data = torch.randn(chunk // 4)

        async def put_proto() -> None:
            # What the tensor bytes would cost as a protobuf `bytes` field.
            view = data.numpy().tobytes()
            call = proto_up()
            for _ in range(nbytes // chunk):
                await call.write(pb.UpdateFrame(chunk=view))
            await call.done_writing()
            await call

        return (
            await rate(put, nbytes, seconds),
            await rate(get, nbytes, seconds),
            await rate(put_proto, nbytes, seconds),
        )


async def mmcache(port: int, nbytes: int, chunk: int, seconds: float) -> tuple[float, float]:
    async with MMCacheClient(f"127.0.0.1:{port}", chunk_bytes=chunk) as client:
        item = {"pixel_values": torch.randn(nbytes // 4)}
        counter = iter(range(1 << 30))

        async def put() -> None:
            (sent,) = await client.get_and_update([item], [f"put-{nbytes}-{next(counter)}"])
            assert sent is item  # a miss each time: the bytes really move

        # Steady state, as in production: the cache is full and every put evicts.
        for _ in range(CAPACITY // nbytes + 1):
            await put()
        put_rate = await rate(put, nbytes, seconds)

        await client.get_and_update([item], ["fetched"])

        async def get() -> None:
            await client.fetch(["fetched"])

        return put_rate, await rate(get, nbytes, seconds)


async def run(sizes: list[int], seconds: float, chunk: int) -> None:
    raw, raw_port = spawn([sys.executable, "-m", "bench._raw_server"])
    cache, cache_port = spawn([sys.executable, "-m", "bench._cache_server"])
    try:
        print(f"chunk {chunk // MIB} MiB, {seconds:g} s per cell, loopback, GB/s = 1e9 bytes/s")
        print(
            f"{'item':>8} | {'op':>5} | {'mmcache':>8} | {'raw gRPC':>8} | {'ratio':>5} | "
            f"{'protobuf field':>14}"
        )
        print("-" * 64)
        for mib in sizes:
            nbytes = mib * MIB
            raw_put, raw_get, proto_put = await ceiling(raw_port, nbytes, chunk, seconds)
            put, get = await mmcache(cache_port, nbytes, chunk, seconds)
            for op, ours, ceil, proto in (
                ("put", put, raw_put, f"{proto_put:14.2f}"),
                ("fetch", get, raw_get, f"{'':>14}"),
            ):
                row = f"{mib:>5} MiB | {op:>5} | {ours:8.2f} | {ceil:8.2f} | {ours / ceil:5.2f}"
                print(f"{row} | {proto}")
    finally:
        for proc in (raw, cache):
            proc.terminate()
            proc.wait()


def main() -> None:
    # Both servers and this client process (which runs the ceiling's client
    # and ours) reuse freed memory, as `mmcache serve` does by default.
    keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64], help="MiB")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--chunk-mib", type=int, default=1, choices=[1, 2, 3, 4])
    args = parser.parse_args()
    asyncio.run(run(args.sizes, args.seconds, args.chunk_mib * MIB))


if __name__ == "__main__":
    main()
