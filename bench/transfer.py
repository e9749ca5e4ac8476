"""Put and fetch throughput of mmcache: shared memory beside memcpy, and the
gRPC path beside the raw gRPC ceiling.

    python -m bench.transfer [--sizes 1 8 64] [--rounds 12] [--burst 0.3] [--chunk-mib 1]
                             [--hot 6] [--hot-mib 64] [--hot-regions 256 512]

Put is measured in steady state: the cache (512 MiB) is filled first, so
every put also evicts. Servers run in their own processes (one core each
side on a 2-core machine), all on loopback. "put" is `get_and_update` of an
item the server lacks (a float32 tensor of the given size: encode, upload,
commit); "fetch" is the engine's read (download, rebuild the tensor) of an
item uploaded again, untimed, before each fetch burst (the puts of the burst
before evict it). The ceiling moves the same number of bytes through a bare
generic handler in raw chunks of the same size (a client stream), measured
in the same run; for put, also the same bytes as a protobuf `bytes` field
(built, serialised and parsed by protobuf: the path the chunk frames avoid);
for an item that fits one message, as one raw unary call (the best raw gRPC
does for it in a call of its own; mmcache streams such puts, see
docs/wire.md); and over one bidi stream kept open across puts (a count
message, the chunks, a reply: no call set-up per item, which is where small
items lose their time). All three processes call
`mmcache.keep_freed_memory()`. Prints a table.

A second client of the same server maps its shared-memory region (a client
on the server's host): its puts and fetches ("shm") move the bytes through
the region, beside a memory copy of the same bytes in this process (numpy's,
one thread; and torch's `copy_`, on its threads as mmcache's large copies
are: "of best" is against the faster of the two in each round) and the gRPC
client's figures, all in the same rounds; "view" is its zero-copy read
(`client.view`: tensors that view the region, no copy on the client). The
co-located client fetches an item of its own (uploaded through the region),
the gRPC client another (uploaded over gRPC, so kept as chunk frames).
"ms/call" is the time of one call (the item's bytes over its rate), beside
the raw call's.

The last table re-reads a hot set through the region ("co-located
re-reads"): `--hot` items of `--hot-mib` MiB (6 of 64 by default), uploaded
by a co-located client to a server of its own (2 GiB cache), each read in
turn with `fetch`, over and over: with the default 256 MiB region (the set
1.5x the region), and with a region that holds the whole set (every read
then makes no call), beside torch's `copy_` of as many distinct buffers into
one (a read's least work; "of copy_" is the median of per-round ratios).
"server copies" are the server's copies of items per read
(`mmcache_shm_item_copies_total`, docs/shm.md), over all the table's reads.

The machine's speed drifts by tens of percent over seconds (shared cores),
so the cells are not measured one after another: every round runs each of
them for one short burst, in turn, and the table gives medians over rounds;
"ratio" is the median of the per-round ratios, each taken from bursts a
fraction of a second apart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable

import grpc
import numpy
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


Op = Callable[[], Awaitable[object]]


async def burst(op: Op, nbytes: int, seconds: float) -> float:
    """GB/s of `op`, repeated for about `seconds` (at least twice)."""
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 2:
        await op()
        n += 1
    return n * nbytes / elapsed / 1e9


async def ceiling_ops(channel: grpc.aio.Channel, nbytes: int, chunk: int) -> dict[str, Op]:
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

    # One bidi stream opened now and reused by every put: no call set-up per
    # item, the floor a protocol that kept streams open could reach.
    session = channel.stream_stream("/bench.Raw/Session")()
    count = str(nbytes // chunk).encode()

    async def put_session() -> None:
        await session.write(count)
        for c in chunks:
            await session.write(c)
        await session.read()

    ops = {"raw put": put, "raw fetch": get, "proto put": put_proto, "session put": put_session}
    if nbytes <= chunk:
        # One message in a unary call: the best raw gRPC does for an item this
        # small (mmcache still streams it: docs/wire.md says why).
        one = channel.unary_unary("/bench.Raw/UploadOne")

        async def put_one() -> None:
            await one(chunks[0])

        ops["raw unary put"] = put_one
    return ops


def memcpy_ops(nbytes: int) -> dict[str, Op]:
    """A memory copy of `nbytes` between two buffers of this process: numpy's
    (one thread), and torch's `copy_` (on its intra-op threads, as mmcache's
    large copies through shared memory are)."""
    src = numpy.random.default_rng(0).integers(0, 255, nbytes, dtype=numpy.uint8)
    dst = numpy.empty_like(src)
    src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)

    async def copy() -> None:
        numpy.copyto(dst, src)

    async def copy_threads() -> None:
        dst_t.copy_(src_t)

    return {"memcpy": copy, "copy_": copy_threads}


async def mmcache_ops(
    client: MMCacheClient, nbytes: int, prefix: str = ""
) -> tuple[dict[str, Op], dict[str, Op]]:
    """The put and fetch ops (names after `prefix`), and what to run untimed
    before each burst of one."""
    item = {"pixel_values": torch.randn(nbytes // 4)}
    counter = iter(range(1 << 30))

    async def put() -> None:
        # Nobody reads these: no lease, or the full cache could not evict.
        (sent,) = await client.get_and_update(
            [item], [f"{prefix}put-{nbytes}-{next(counter)}"], lease=False
        )
        assert sent is item  # a miss each time: the bytes really move

    # Steady state, as in production: the cache is full and every put evicts.
    for _ in range(CAPACITY // nbytes + 1):
        await put()

    fetched = f"{prefix}fetched-{nbytes}"

    async def get() -> None:
        await client.fetch([fetched])

    async def upload_fetched() -> None:
        # The puts of the burst before evicted it: upload it again, untimed.
        # Always asked of the server: the mirror may not have seen that
        # eviction yet (a hit costs a hash; a miss the mirror did not
        # foresee is re-sent in the same call).
        await client.get_and_update([item], [fetched], lease=False)

    ops = {f"{prefix}put": put, f"{prefix}fetch": get}
    before = {f"{prefix}fetch": upload_fetched}
    if prefix:  # the co-located client: also its zero-copy view

        async def view() -> None:
            async with client.view([fetched]):
                pass

        ops[f"{prefix}view"] = view
        before[f"{prefix}view"] = upload_fetched
    return ops, before


async def measure(
    ops: dict[str, Op], before: dict[str, Op], nbytes: int, rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Per op, its GB/s in each round; the ops take turns within a round.

    `before[name]`, where given, runs untimed before each burst of that op.
    """
    for name, op in ops.items():
        if name in before:
            await before[name]()
        await op()  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            if name in before:
                await before[name]()
            rates[name].append(await burst(op, nbytes, seconds))
    return rates


def ratio_of(rates: dict[str, list[float]], op: str, ceiling: str) -> float:
    """The median of the per-round ratios of `op` to `ceiling`."""
    return statistics.median(a / b for a, b in zip(rates[op], rates[ceiling], strict=True))


async def run(sizes: list[int], rounds: int, seconds: float, chunk: int) -> None:
    raw, raw_port = spawn([sys.executable, "-m", "bench._raw_server"])
    cache, cache_port = spawn([sys.executable, "-m", "bench._cache_server"])
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    target = f"127.0.0.1:{cache_port}"
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{raw_port}", options=options) as channel,
            MMCacheClient(target, chunk_bytes=chunk, shm=False) as client,
            MMCacheClient(target, chunk_bytes=chunk) as co_located,
        ):
            if co_located.region is None:
                print("no shared-memory region (is /dev/shm there?): gRPC rows only")
            print(
                f"chunk {chunk // MIB} MiB, {rounds} rounds of {seconds:g} s bursts, loopback, "
                "GB/s = 1e9 bytes/s, medians over rounds"
            )
            grpc_rows: list[str] = []
            shm_rows: list[str] = []
            for mib in sizes:
                nbytes = mib * MIB
                ours, before = await mmcache_ops(client, nbytes)
                ops = {**await ceiling_ops(channel, nbytes, chunk), **ours}
                if co_located.region is not None:
                    shm_ours, shm_before = await mmcache_ops(co_located, nbytes, "shm ")
                    ops.update(shm_ours, **memcpy_ops(nbytes))
                    before.update(shm_before)
                rates = await measure(ops, before, nbytes, rounds, seconds)
                med = {name: statistics.median(r) for name, r in rates.items()}
                grpc_rows += grpc_table_rows(mib, rates, med)
                if co_located.region is not None:
                    shm_rows += shm_table_rows(mib, rates, med)
            print("\nthe gRPC path beside the raw gRPC ceiling")
            print(
                f"{'item':>8} | {'op':>5} | {'mmcache':>8} | {'raw gRPC':>8} | {'ratio':>5} | "
                f"{'raw unary':>9} | {'ratio':>5} | {'open stream':>11} | {'ratio':>5} | "
                f"{'protobuf field':>14} | {'ms/call':>7} | {'raw ms':>6}"
            )
            print("-" * 127)
            print("\n".join(grpc_rows))
            if shm_rows:
                print("\nco-located: shared memory beside memcpy and the gRPC path")
                print(
                    f"{'item':>8} | {'op':>5} | {'shm':>6} | {'memcpy':>6} | {'copy_':>6} | "
                    f"{'of best':>7} | {'gRPC':>6} | {'shm/gRPC':>8} | {'ms/call':>7}"
                )
                print("-" * 87)
                print("\n".join(shm_rows))
    finally:
        for proc in (raw, cache):
            proc.terminate()
            proc.wait()


def _ms(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3


def grpc_table_rows(mib: int, rates: dict[str, list[float]], med: dict[str, float]) -> list[str]:
    rows = []
    nbytes = mib * MIB
    for op, ceil, proto in (
        ("put", "raw put", f"{med['proto put']:14.2f}"),
        ("fetch", "raw fetch", f"{'':>14}"),
    ):
        row = (
            f"{mib:>5} MiB | {op:>5} | {med[op]:8.2f} | {med[ceil]:8.2f} | "
            f"{ratio_of(rates, op, ceil):5.2f}"
        )
        unary = f"{'':>9} | {'':>5}"
        # The raw call an item's transfer is held to: a unary put where it
        # fits one message, the raw stream otherwise.
        raw_call = ceil
        if op == "put" and "raw unary put" in med:
            raw_call = "raw unary put"
            unary = f"{med['raw unary put']:9.2f} | {ratio_of(rates, op, 'raw unary put'):5.2f}"
        session = f"{'':>11} | {'':>5}"
        if op == "put":
            session = f"{med['session put']:11.2f} | {ratio_of(rates, op, 'session put'):5.2f}"
        latency = f"{_ms(nbytes, med[op]):7.2f} | {_ms(nbytes, med[raw_call]):6.2f}"
        rows.append(f"{row} | {unary} | {session} | {proto} | {latency}")
    return rows


def shm_table_rows(mib: int, rates: dict[str, list[float]], med: dict[str, float]) -> list[str]:
    rows = []
    # "view": the zero-copy read (client.view), against the gRPC fetch.
    for op, grpc_op in (("put", "put"), ("fetch", "fetch"), ("view", "fetch")):
        shm = f"shm {op}"
        # Against the faster copy of each round: one thread or torch's threads.
        of_best = statistics.median(
            a / max(b, c)
            for a, b, c in zip(rates[shm], rates["memcpy"], rates["copy_"], strict=True)
        )
        rows.append(
            f"{mib:>5} MiB | {op:>5} | {med[shm]:6.2f} | {med['memcpy']:6.2f} | "
            f"{med['copy_']:6.2f} | {of_best:7.0%} | {med[grpc_op]:6.2f} | "
            f"{ratio_of(rates, shm, grpc_op):8.2f} | {_ms(mib * MIB, med[shm]):7.2f}"
        )
    return rows


async def hot_set(items: int, mib: int, regions: list[int], rounds: int, seconds: float) -> None:
    """The re-read table: the same hot set read over and over from servers with
    regions of `regions` MiB, the servers' bursts taking turns."""
    nbytes = items * mib * MIB
    ops: dict[str, Op] = {}
    servers: list[tuple[int, subprocess.Popen[str], int]] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            for region in regions:
                proc, port, metrics_port = spawn_metered(
                    ["--capacity-mib", "2048", "--shm-mib", str(region)]
                )
                servers.append((region, proc, metrics_port))
                client = await stack.enter_async_context(MMCacheClient(f"127.0.0.1:{port}"))
                if client.region is None:
                    print("no shared-memory region (is /dev/shm there?): no re-read table")
                    return
                ops[f"{region} MiB"] = await reread_op(client, items, mib)
            ops["copy_"] = set_copy_op(items, mib * MIB)
            copies_before = {r: server_copies(m) for r, _, m in servers}
            reads = {name: 0 for name in ops}
            counted = {name: counting(op, reads, name) for name, op in ops.items()}
            rates = await measure(counted, {}, nbytes, rounds, seconds)
            med = {name: statistics.median(r) for name, r in rates.items()}
            print(f"\nco-located re-reads: {items} items of {mib} MiB, each fetched in turn")
            print(
                f"{'region':>8} | {'set/region':>10} | {'GB/s':>6} | {'min-max':>11} | "
                f"{'ms/item':>7} | {'copy_':>6} | {'of copy_':>8} | {'server copies':>13}"
            )
            print("-" * 90)
            for region, _, metrics_port in servers:
                name = f"{region} MiB"
                copies = server_copies(metrics_port) - copies_before[region]
                print(
                    f"{name:>8} | {items * mib / region:10.2f} | {med[name]:6.2f} | "
                    f"{min(rates[name]):5.2f}-{max(rates[name]):<5.2f} | "
                    f"{_ms(mib * MIB, med[name]):7.2f} | {med['copy_']:6.2f} | "
                    f"{ratio_of(rates, name, 'copy_'):8.0%} | "
                    f"{copies / (reads[name] * items):13.2f}"
                )
    finally:
        for _, proc, _ in servers:
            proc.terminate()
            proc.wait()


def spawn_metered(args: list[str]) -> tuple[subprocess.Popen[str], int, int]:
    """A cache server with `args`: the process, its port and its /metrics port."""
    cmd = [sys.executable, "-m", "bench._cache_server", "--metrics", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port, metrics_port = map(int, proc.stdout.readline().split())
    return proc, port, metrics_port


async def reread_op(client: MMCacheClient, items: int, mib: int) -> Op:
    """One read of each item of a hot set, in turn (uploaded now, through the region)."""
    hashes = [f"hot-{mib}-{i}" for i in range(items)]
    for mm_hash in hashes:
        await client.get_and_update([{"pixel_values": torch.randn(mib * MIB // 4)}], [mm_hash])

    async def reread() -> None:
        for mm_hash in hashes:
            await client.fetch([mm_hash], release=False)

    return reread


def set_copy_op(items: int, nbytes: int) -> Op:
    """torch's `copy_` of `items` distinct buffers of `nbytes` in turn into one
    (a read's least work: one copy, into reused memory, of bytes not in cache)."""
    sources = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8) for _ in range(items)]
    dst = torch.empty(nbytes, dtype=torch.uint8)

    async def copy() -> None:
        for src in sources:
            dst.copy_(src)

    return copy


def counting(op: Op, counts: dict[str, int], name: str) -> Op:
    async def counted() -> None:
        await op()
        counts[name] += 1

    return counted


def server_copies(metrics_port: int) -> float:
    """The server's copies of items into and out of its region, so far."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mmcache_shm_item_copies_total{")
    )


def main() -> None:
    # Both servers and this client process (which runs the ceiling's client
    # and ours) reuse freed memory, as `mmcache serve` does by default.
    keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 8, 64], help="MiB")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--burst", type=float, default=0.3, help="seconds per op per round")
    parser.add_argument("--chunk-mib", type=int, default=1, choices=[1, 2, 3, 4])
    parser.add_argument("--hot", type=int, default=6, help="items of the re-read set (0: none)")
    parser.add_argument("--hot-mib", type=int, default=64)
    parser.add_argument(
        "--hot-regions", type=int, nargs="+", default=[256, 512], help="region sizes, MiB"
    )
    args = parser.parse_args()
    if args.sizes:
        asyncio.run(run(args.sizes, args.rounds, args.burst, args.chunk_mib * MIB))
    if args.hot:
        asyncio.run(hot_set(args.hot, args.hot_mib, args.hot_regions, args.rounds, args.burst))


if __name__ == "__main__":
    main()
