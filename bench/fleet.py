"""A fleet replay: N frontend processes share one mmcache, an engine process reads.

    python -m bench.fleet [--frontends 1,2,4,8] [--conversations 40] [--pool 64]
                          [--capacity-mib 64] [--seed 0]

The trace: multi-turn chats whose every turn re-sends all earlier images of
the conversation (as OpenAI-style chat APIs do); each turn adds one image
drawn from a Zipf-like pool (weight 1/rank^1.1); image sizes log-uniform in
0.3-8 MiB, as vision processors produce; the cache smaller than the pool.
Conversations advance in round-robin; request i goes to frontend i mod N.

Each frontend, in a process of its own, does what vLLM's P0 does: asks its
mirror which images are cached, runs the "processor" (builds the tensors:
real CPU work) for the others, calls `get_and_update`, and hands the engine
the hashes the server holds for it (the rest travel inline). On a
CacheMissError (the mirror was wrong about an image it did not process) it
processes those and calls again, as vLLM's retry path does. The engine
process fetches every request's held items, two requests at a time (the rest
wait their turn, as requests wait for the scheduler), releasing their leases;
a read that finds an item gone is a read failure.

Modes, on the same trace in the same run:
- `mmcache`: mirrors follow the feed, calls lease, `is_cached(pending=True)`;
- `no feed`: each mirror knows only its own frontend's calls and replies,
  no leases (the mmcache of the first round);
- `no cache`: every request ships all its tensors (Dynamo's default): its
  processor runs and bytes are those of the trace, counted, not run.

Columns: processor runs / unique images, bytes uploaded to the server and
bytes shipped in all (uploaded + inline) / unique bytes, bytes the engine
read from the server / unique bytes, engine read failures, get_and_update
and fetch latency (p50/p99 ms; a fetch timed from when the engine starts
it), the server's hit
rate, and how often a frontend's `is_cached` agreed with the server for keys
that had not changed in the 50 ms before it asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

MIB = 1 << 20
AGREE_AFTER_S = 0.05
ENGINE_READS = 2  # requests the engine reads at once


# ---------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Trace:
    sizes: list[int]  # bytes of each pool image
    requests: list[list[int]]  # image ids of each request, in order

    @property
    def unique(self) -> list[int]:
        return sorted({i for request in self.requests for i in request})


def make_trace(seed: int, pool: int, conversations: int) -> Trace:
    rng = random.Random(seed)
    sizes = [
        int(math.exp(rng.uniform(math.log(0.3 * MIB), math.log(8 * MIB)))) for _ in range(pool)
    ]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(pool)]
    order = list(range(pool))
    rng.shuffle(order)  # popularity independent of size
    turns = [rng.randint(1, 5) for _ in range(conversations)]
    taken = [0] * conversations
    images: list[list[int]] = [[] for _ in range(conversations)]
    requests: list[list[int]] = []
    active = list(range(conversations))
    while active:
        for conv in list(active):
            new = order[rng.choices(range(pool), weights)[0]]
            if new not in images[conv]:
                images[conv].append(new)
            requests.append(list(images[conv]))  # every turn re-sends all earlier images
            taken[conv] += 1
            if taken[conv] == turns[conv]:
                active.remove(conv)
    return Trace(sizes, requests)


def image_hash(image: int) -> str:
    return f"img-{image:04d}"


def process(image: int, size: int) -> object:
    """The 'processor': builds the image's tensors (deterministic, real CPU work)."""
    import torch

    from mmcache import BatchedField, FieldElem, FlatField, MMItem

    numel = size // 4
    gen = torch.Generator().manual_seed(image)
    pixels = torch.randn(numel, generator=gen)
    grid = torch.tensor([1, 2, numel // 2], dtype=torch.int64)
    return MMItem.from_elems(
        [
            FieldElem("image", "pixel_values", pixels, FlatField([slice(0, numel)], dim=0)),
            FieldElem("image", "image_grid_thw", grid, BatchedField()),
        ]
    )


def trace_from(args: argparse.Namespace) -> Trace:
    return make_trace(args.seed, args.pool, args.conversations)


# ---------------------------------------------------------------- roles


def emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def frontend(args: argparse.Namespace) -> None:
    from mmcache.client import CacheMissError, MMCacheClient

    trace = trace_from(args)
    feed = args.mode == "mmcache"
    mine = [i for i in range(len(trace.requests)) if i % args.frontends == args.index]
    pool_hashes = [image_hash(i) for i in range(len(trace.sizes))]
    runs = 0
    latencies: list[float] = []
    async with MMCacheClient(args.target, follow=feed, timeout=120) as client:
        if feed:
            await client.wait_following()
        emit({"kind": "ready"})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        for index in mine:
            images = trace.requests[index]
            hashes = [image_hash(i) for i in images]
            cached = client.is_cached(hashes, pending=feed)
            items: list[object | None] = []
            for image, known in zip(images, cached, strict=True):
                items.append(None if known else process(image, trace.sizes[image]))
                runs += not known
            start = time.perf_counter()
            try:
                sent = await client.get_and_update(
                    items,  # type: ignore[arg-type]
                    hashes,
                    modality="image",
                    lease=feed,
                )
            except CacheMissError as exc:  # vLLM's retry: process what was missing
                missing = set(exc.missing_hashes)
                for n, (image, h) in enumerate(zip(images, hashes, strict=True)):
                    if h in missing:
                        items[n] = process(image, trace.sizes[image])
                        runs += 1
                sent = await client.get_and_update(
                    items,  # type: ignore[arg-type]
                    hashes,
                    modality="image",
                    lease=feed,
                )
            latencies.append(time.perf_counter() - start)
            inline = sum(
                trace.sizes[image]
                for image, held in zip(images, sent.held, strict=True)
                if not held
            )
            fetch = [h for h, held in zip(hashes, sent.held, strict=True) if held]
            emit({"kind": "request", "fetch": fetch, "inline": inline})
            probe = client.is_cached(pool_hashes)
            emit({"kind": "probe", "t": time.monotonic(), "cached": probe})
    emit({"kind": "done", "runs": runs, "latencies": latencies})


async def engine(args: argparse.Namespace) -> None:
    from mmcache.client import CacheMissError, MMCacheClient

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    failures = 0
    latencies: list[float] = []
    release = args.mode == "mmcache"
    async with MMCacheClient(args.target, follow=False, timeout=120) as client:
        # An engine reads a few requests at a time, as it schedules them; the
        # others wait their turn (and their items must still be there then).
        reading = asyncio.Semaphore(ENGINE_READS)

        async def read(hashes: list[str]) -> None:
            nonlocal failures
            async with reading:
                start = time.perf_counter()
                try:
                    await client.fetch(hashes, release=release)
                except CacheMissError:
                    failures += 1
                latencies.append(time.perf_counter() - start)

        tasks: list[asyncio.Task[None]] = []
        emit({"kind": "ready"})
        while line := await reader.readline():
            record = json.loads(line)
            if record["kind"] == "end":
                break
            if record["fetch"]:
                tasks.append(asyncio.create_task(read(record["fetch"])))
        await asyncio.gather(*tasks)
    emit({"kind": "done", "failures": failures, "latencies": latencies})


# ---------------------------------------------------------------- the driver


@dataclass
class Row:
    mode: str
    runs: int = 0
    uploaded: int = 0
    fetched: int = 0
    inline: int = 0
    failures: int = 0
    update_latencies: list[float] = field(default_factory=list)
    fetch_latencies: list[float] = field(default_factory=list)
    queries: float = 0
    hits: float = 0
    agree: int = 0
    compared: int = 0
    seconds: float = 0.0


async def spawn(role: str, args: argparse.Namespace, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.fleet",
        "--role",
        role,
        *("--seed", str(args.seed), "--pool", str(args.pool)),
        *("--conversations", str(args.conversations)),
        *extra,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def read_record(proc: asyncio.subprocess.Process) -> dict[str, object]:
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a benchmark process ended early (exit {await proc.wait()})")
    record: dict[str, object] = json.loads(line)
    return record


async def run_once(args: argparse.Namespace, trace: Trace, frontends: int, mode: str) -> Row:
    from mmcache.server import MMCacheServer, ServerConfig
    from mmcache.server.cache import Change, ItemChange

    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=args.capacity_mib * MIB,
        grace_s=0,
    )
    row = Row(mode)
    async with MMCacheServer(config) as server:
        # When each key last changed on the server, for the agreement check.
        changed: dict[str, float] = {}

        def record_change(change: ItemChange) -> None:
            if change.kind in (Change.STORED, Change.REMOVED) and not change.in_l2:
                changed[change.key] = time.monotonic()

        server.cache.changes.subscribe(record_change)
        target = f"127.0.0.1:{server.port}"
        common = ("--target", target, "--mode", mode)
        eng = await spawn("engine", args, *common)
        fronts = [
            await spawn("frontend", args, *common, "--frontends", str(frontends), "--index", str(i))
            for i in range(frontends)
        ]
        for proc in (eng, *fronts):
            assert (await read_record(proc))["kind"] == "ready"
        pool_hashes = [image_hash(i) for i in range(len(trace.sizes))]
        started = time.perf_counter()
        for proc in fronts:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()

        async def follow(proc: asyncio.subprocess.Process) -> None:
            assert eng.stdin is not None
            while True:
                record = await read_record(proc)
                if record["kind"] == "request":
                    row.inline += int(record["inline"])  # type: ignore[call-overload]
                    eng.stdin.write((json.dumps(record) + "\n").encode())
                elif record["kind"] == "probe":
                    asked = float(record["t"])  # type: ignore[arg-type]
                    for h, cached in zip(pool_hashes, record["cached"], strict=True):  # type: ignore[call-overload]
                        if changed.get(h, 0.0) <= asked - AGREE_AFTER_S:
                            row.compared += 1
                            row.agree += cached == (h in server.cache)
                else:
                    row.runs += int(record["runs"])  # type: ignore[call-overload]
                    row.update_latencies.extend(record["latencies"])  # type: ignore[arg-type]
                    return

        await asyncio.gather(*(follow(proc) for proc in fronts))
        assert eng.stdin is not None
        eng.stdin.write(b'{"kind": "end"}\n')
        await eng.stdin.drain()
        result = await read_record(eng)
        row.seconds = time.perf_counter() - started
        row.failures = int(result["failures"])  # type: ignore[call-overload]
        row.fetch_latencies = list(result["latencies"])  # type: ignore[call-overload]
        for proc in (eng, *fronts):
            await proc.wait()
        registry = server.registry
        row.uploaded = int(registry.get_sample_value("mmcache_received_bytes_total") or 0)
        row.fetched = int(registry.get_sample_value("mmcache_sent_bytes_total") or 0)
        row.queries = registry.get_sample_value("mmcache_queries_total", {"modality": "image"}) or 0
        row.hits = registry.get_sample_value("mmcache_hits_total", {"modality": "image"}) or 0
    return row


def no_cache_row(trace: Trace) -> Row:
    row = Row("no cache")
    row.runs = sum(len(r) for r in trace.requests)
    row.inline = sum(trace.sizes[i] for r in trace.requests for i in r)
    return row


def quantiles(values: Sequence[float]) -> str:
    if len(values) < 2:
        return "-"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"{cuts[49] * 1e3:.1f} / {cuts[98] * 1e3:.1f}"


def print_table(frontends: int, trace: Trace, rows: Sequence[Row]) -> None:
    unique = trace.unique
    unique_bytes = sum(trace.sizes[i] for i in unique)
    print(f"\nN = {frontends} frontends")
    print(
        "| mode | processor runs / unique | uploaded / unique bytes | shipped / unique bytes "
        "| fetched / unique bytes | read failures | get_and_update p50/p99 ms "
        "| fetch p50/p99 ms | hit rate "
        "| is_cached agrees | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        hit_rate = f"{row.hits / row.queries:.2f}" if row.queries else "-"
        agree = f"{row.agree / row.compared:.4f}" if row.compared else "-"
        print(
            f"| {row.mode} | {row.runs} / {len(unique)} = {row.runs / len(unique):.2f} "
            f"| {row.uploaded / unique_bytes:.2f} "
            f"| {(row.uploaded + row.inline) / unique_bytes:.2f} "
            f"| {row.fetched / unique_bytes:.2f} | {row.failures} "
            f"| {quantiles(row.update_latencies)} "
            f"| {quantiles(row.fetch_latencies)} | {hit_rate} | {agree} "
            f"| {row.seconds:.1f} |"
        )


async def drive(args: argparse.Namespace) -> None:
    trace = trace_from(args)
    unique_bytes = sum(trace.sizes[i] for i in trace.unique)
    refs = sum(len(r) for r in trace.requests)
    print(
        f"trace: {len(trace.requests)} requests, {refs} image references, "
        f"{len(trace.unique)} unique images ({unique_bytes / MIB:.0f} MiB); "
        f"cache {args.capacity_mib} MiB"
    )
    results: dict[int, list[Row]] = {}
    for n in args.frontends:
        rows = [await run_once(args, trace, n, mode) for mode in ("mmcache", "no feed")]
        rows.append(no_cache_row(trace))
        results[n] = rows
        print_table(n, trace, rows)
    if 1 in results and 4 in results:
        one, four = results[1][0], results[4][0]
        print(
            f"\nmmcache at N=4 against N=1 on the same trace: processor runs "
            f"{four.runs / max(one.runs, 1):.2f}x, bytes uploaded "
            f"{four.uploaded / max(one.uploaded, 1):.2f}x (target <= 1.1x), read failures "
            f"{four.failures} (target 0), is_cached agreement "
            f"{four.agree / max(four.compared, 1):.4f} (target >= 0.99)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["driver", "frontend", "engine"], default="driver")
    parser.add_argument(
        "--frontends",
        default="1,2,4,8",
        help="driver: the N to run, comma-separated; frontend: N",
    )
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--capacity-mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target")
    parser.add_argument("--mode", default="mmcache")
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args()
    if args.role == "driver":
        args.frontends = [int(n) for n in args.frontends.split(",")]
        asyncio.run(drive(args))
    else:
        args.frontends = int(args.frontends) if args.role == "frontend" else 0
        asyncio.run(frontend(args) if args.role == "frontend" else engine(args))


if __name__ == "__main__":
    main()
