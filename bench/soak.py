"""A bounded soak: many clients mix every kind of call against a small cache.

    python -m bench.soak [--minutes 2] [--clients 64] [--workers 4] [--capacity-mib 128]
                         [--inflight-mib 64] [--feed-buffer-mib 32] [--lease-s 5] [--shm-mib 64]
                         [--max-item-kib 4096] [--sample-s 5] [--seed 0]

The server runs in its own process (bench._cache_server, with its /metrics).
The clients run in `workers` processes of clients/workers asyncio clients
each: every client is an `MMCacheClient` of its own, on a connection of its
own, its mirror following the feed, as the frontends of a fleet are. Several
processes, so that no one event loop carries all 64 clients (and their 64
mirrors applying the feed) and serialises their calls: the summary gives
each worker's CPU and how late its event loop wakes a 50 ms sleep (on our 2
shared cores each worker used 20-30% of a core, its loop lag p50 2 ms and
p99 60-70 ms, against calls of 200-550 ms: the clients' calls do overlap on
the server).

Each client loops, one call at a time, over a random mix of:
- `upload`: get_and_update of 1-3 new items (leased); sizes log-uniform from
  1 KiB to `max-item-kib`, six dtypes, MMItems of three modalities and plain
  mappings with a scalar leaf;
- `repeat`: get_and_update of 1-4 hashes of a pool all clients share, sent as
  a hash alone where the mirror holds it (or sees it pending), else with data;
- `fetch`: the engine's read (release on read) of what a call reported held,
  0-1 s after it; the items must come back bit-exact. Of the held sets, 10%
  are released with `release()` instead, and 10% dropped (their leases expire);
- `lookup` (no lease), `touch` (is_cached and the mirror's touch, which rides
  with the next batch, or the Touch call itself);
- `... (cancelled)`: an upload, repeat or fetch cancelled 0-100 ms after it
  starts (asyncio's task.cancel());
- `... (deadline)`: the same through a client whose deadline is 1, 10, 50 or
  200 ms, so that many expire mid-upload or mid-read;
- `oversize`: an item larger than the whole cache (it must come back unheld).

Outcomes are counted by status code (the client's typed errors carry the
gRPC status they came from), with the calls' p50/p99 latency. The expected
ones: OK everywhere; NOT_FOUND for a `repeat` whose hash-only item was
evicted after the mirror saw it (CacheMissError: the caller processes it and
calls again), and for a read whose miss came back more than `lease-s` after
the call that leased it began (the lease may have ended); CANCELLED for
cancelled calls; DEADLINE_EXCEEDED for calls with a tiny deadline. Anything
else is unexpected: a leased item missing before its lease could have ended
(a broken promise), data that comes back different, an item larger than the
cache reported held, any other status (UNKNOWN, INTERNAL, ...) and any
exception that is not mmcache's (named by its class). The server's own count
of calls by status (`grpc_server_handled_total`) is judged the same way (OK,
Canceled, DeadlineExceeded, and NotFound for the reads, Fetch and ReadShm),
and any warning or error in its log is a failure too.

Every `sample-s` the server's RSS (VmRSS) is printed beside the bound of the
sizing rule (docs/deploy.md: 1.25 x capacity + max-inflight + 256 MiB; the
rule counts the default 32 MiB feed ring inside its 256 MiB). When the
clients have stopped, the soak waits for the leases nobody read to expire
(so the server runs with a short `--lease-s`) and then requires the lease
grants, leased bytes, uploads in flight (bytes, and pending hashes in a fresh
feed snapshot) and feed subscribers to be 0. Exit status 1 if anything
unexpected happened, the server died, RSS went over the bound, or something
was left at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from bench import cpu_seconds

if TYPE_CHECKING:  # the driver process needs no torch until its last check
    import torch

    from mmcache._items import Item
    from mmcache.client import MMCacheClient

KIB = 1 << 10
MIB = 1 << 20

FETCH_WITHIN_S = 1.0  # a held set is read 0-1 s after its call
CANCEL_WITHIN_S = 0.1  # a cancelled call is cancelled 0-100 ms after it starts
HASTY_TIMEOUTS_S = (0.001, 0.01, 0.05, 0.2)
POOL = 256  # hashes every client repeats
# Each client on a connection of its own, as a frontend process has (grpc
# otherwise shares one connection among the same process's channels).
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)
OFFSETS = 4096  # start offsets into the shared random data: distinct contents
# Op weights per loop turn (due fetches go first, whatever the draw).
OPS = {
    "upload": 25,
    "repeat": 25,
    "lookup": 4,
    "touch": 6,
    "cancel": 15,
    "deadline": 12,
    "oversize": 1,
}

# Per op: the outcomes that are no failure (see the module docstring).
EXPECTED: dict[str, set[str]] = {
    "upload": {"OK"},
    "repeat": {"OK", "NOT_FOUND"},
    "fetch": {"OK", "NOT_FOUND (lease over)"},
    "release": {"OK"},
    "lookup": {"OK"},
    "touch": {"OK"},
    "oversize": {"OK"},
    "upload (cancelled)": {"OK", "CANCELLED"},
    "repeat (cancelled)": {"OK", "CANCELLED", "NOT_FOUND"},
    "fetch (cancelled)": {"OK", "CANCELLED", "NOT_FOUND (lease over)"},
    "upload (deadline)": {"OK", "DEADLINE_EXCEEDED"},
    "repeat (deadline)": {"OK", "DEADLINE_EXCEEDED"},
    "fetch (deadline)": {"OK", "DEADLINE_EXCEEDED", "NOT_FOUND (lease over)"},
}
# The server's `grpc_code` labels that are no failure: NotFound only for reads.
SERVER_EXPECTED = {"OK", "Canceled", "DeadlineExceeded"}
SERVER_EXPECTED_FETCH = {*SERVER_EXPECTED, "NotFound"}
SERVER_READS = {"Fetch", "ReadShm"}  # a co-located fetch's read is ReadShm


def rule_bytes(capacity: int, inflight: int, feed_buffer: int, region: int = 0) -> int:
    """docs/deploy.md: 1.25 x capacity + max-inflight + shm region + 256 MiB (which holds the
    default 32 MiB feed ring; a larger ring adds what it has beyond that)."""
    fixed = 256 * MIB + max(0, feed_buffer - 32 * MIB)
    return int(1.25 * capacity) + inflight + region + fixed


# ---------------------------------------------------------------- items


DTYPES = ("f32", "f16", "bf16", "i64", "u8", "bool")
MODALITIES = ("image", "video", "audio")


class Contents:
    """Items whose hash names their content, so any client can check a read.

    A hash is `prefix.dtype.numel.offset.modality.form`: the item's tensor is
    `numel` elements of one shared random tensor per dtype, from `offset`.
    Every process draws the same random tensors (same seed).
    """

    def __init__(self, seed: int, max_bytes: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        n = max_bytes + OFFSETS  # enough for the largest item of 1-byte elements
        self.max_bytes = max_bytes
        self.base: dict[str, torch.Tensor] = {
            "f32": torch.randn(n // 4 + OFFSETS, generator=gen),
            "f16": torch.randn(n // 2 + OFFSETS, generator=gen).half(),
            "bf16": torch.randn(n // 2 + OFFSETS, generator=gen).bfloat16(),
            "i64": torch.randint(-(1 << 62), 1 << 62, (n // 8 + OFFSETS,), generator=gen),
            "u8": torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            "bool": torch.randint(0, 2, (n,), generator=gen).bool(),
        }
        # The hashes every client repeats: the same in every process.
        self.pool = [self.new_hash(random.Random(f"pool-{i}"), f"p{i}") for i in range(POOL)]

    def new_hash(self, rng: random.Random, prefix: str) -> str:
        dtype = rng.choice(DTYPES)
        nbytes = math.exp(rng.uniform(math.log(KIB), math.log(self.max_bytes)))
        numel = max(1, int(nbytes) // self.base[dtype].element_size())
        offset = rng.randrange(OFFSETS)
        form = "map" if rng.random() < 0.2 else "item"
        return f"{prefix}.{dtype}.{numel}.{offset}.{rng.choice(MODALITIES)}.{form}"

    def item(self, mm_hash: str) -> Item:
        from mmcache import BatchedField, FieldElem, FlatField, MMItem

        _, dtype, numel_s, offset_s, modality, form = mm_hash.split(".")
        numel, offset = int(numel_s), int(offset_s)
        data = self.base[dtype][offset : offset + numel]
        if form == "map":
            return {"data": data, "scale": offset / 7}  # a scalar leaf too
        import torch

        grid = torch.tensor([1, offset % 7 + 1, numel], dtype=torch.int64)
        return MMItem.from_elems(
            [
                FieldElem(modality, "pixel_values", data, FlatField([slice(0, numel)], dim=0)),
                FieldElem(modality, "image_grid_thw", grid, BatchedField()),
            ]
        )


def same_item(a: Item, b: Item) -> bool:
    from mmcache import FieldElem
    from mmcache._equal import nested_equal

    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, FieldElem) or isinstance(y, FieldElem):
            if x != y:  # FieldElem compares its data bit for bit
                return False
        elif not nested_equal(x, y):
            return False
    return True


# ---------------------------------------------------------------- worker processes


def code_of(exc: BaseException) -> str:
    """The status a call failed with: the gRPC one it came from, else its class's."""
    import grpc

    from mmcache.client import MMCacheError

    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(exc.__cause__, grpc.aio.AioRpcError):
        return str(exc.__cause__.code().name)
    if isinstance(exc, MMCacheError):  # raised by the client itself (CacheMissError)
        return type(exc).code
    return type(exc).__name__  # never expected


@dataclass
class Held:
    """What a call reported held (leased): the engine's read to come."""

    hashes: list[str]
    started: float  # when the call began: its leases end no sooner than lease_s after
    due: float


@dataclass
class Tally:
    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    broken: list[str] = field(default_factory=list)  # examples of broken promises
    examples: dict[str, str] = field(default_factory=dict)  # "op: code" -> a message
    unheld: int = 0  # items a call stored or found but could not hold (no room)
    abandoned: int = 0  # held sets never read nor released: their leases expire
    uploaded_bytes: int = 0
    fetched_bytes: int = 0


class Soaker:
    """One client's loop."""

    def __init__(
        self,
        name: str,
        client: MMCacheClient,
        hasty: Sequence[MMCacheClient],
        contents: Contents,
        oversize: Item,
        lease_s: float,
        tally: Tally,
        rng: random.Random,
    ) -> None:
        self.name = name
        self.client = client
        self.hasty = hasty
        self.contents = contents
        self.oversize = oversize
        self.lease_s = lease_s
        self.tally = tally
        self.rng = rng
        self.held: list[Held] = []
        self.made = 0
        self.pool = contents.pool
        self.loop = asyncio.get_running_loop()

    async def run(self, stop_at: float) -> None:
        while self.loop.time() < stop_at:
            await self.step()
        self.tally.abandoned += len(self.held)

    async def step(self) -> None:
        now = self.loop.time()
        for held in self.held:
            if held.due <= now:
                self.held.remove(held)
                await self.call("fetch", self.fetch(self.client, held), held)
                return
        op = self.rng.choices(list(OPS), list(OPS.values()))[0]
        if op in ("upload", "repeat"):
            await self.call(op, self.update(self.client, op == "repeat"))
        elif op == "lookup":
            await self.call(op, self.lookup())
        elif op == "touch":
            await self.call(op, self.touch())
        elif op == "oversize":
            await self.call(op, self.put_oversize())
        else:
            await self.disturbed(op)

    async def disturbed(self, how: str) -> None:
        """An upload, repeat or fetch, cancelled midway or under a tiny deadline."""
        kind = self.rng.choice(("upload", "repeat", "fetch") if self.held else ("upload", "repeat"))
        client = self.client if how == "cancel" else self.rng.choice(self.hasty)
        label = f"{kind} ({'cancelled' if how == 'cancel' else 'deadline'})"
        held = self.held.pop(self.rng.randrange(len(self.held))) if kind == "fetch" else None
        # Through a hasty client a repeat sends data: its mirror follows no feed.
        work = (
            self.fetch(client, held)
            if held is not None
            else self.update(client, kind == "repeat", hash_only=how == "cancel")
        )
        start = self.loop.time()
        task = asyncio.ensure_future(work)
        if how == "cancel":
            done, _ = await asyncio.wait({task}, timeout=self.rng.uniform(0, CANCEL_WITHIN_S))
            if not done:
                task.cancel()
        await self.call(label, task, held, start)

    async def call(
        self, op: str, work: Awaitable[str], held: Held | None = None, start: float | None = None
    ) -> None:
        start = self.loop.time() if start is None else start
        task = asyncio.ensure_future(work)
        await asyncio.wait({task})  # a cancelled task: no CancelledError here
        if task.cancelled():
            code = "CANCELLED"
        elif (exc := task.exception()) is not None:
            code = code_of(exc)
            self.tally.examples.setdefault(f"{op}: {code}", f"{type(exc).__name__}: {exc}")
            if code == "NOT_FOUND" and held is not None:
                # A read of leased items: a miss is a broken promise unless the
                # lease could have ended before the server looked.
                if self.loop.time() < held.started + self.lease_s:
                    code = "NOT_FOUND (leased)"
                    if len(self.tally.broken) < 5:
                        self.tally.broken.append(
                            f"{self.name} {op}: {exc} "
                            f"({self.loop.time() - held.started:.2f}s after the call)"
                        )
                else:
                    code = "NOT_FOUND (lease over)"
        else:
            code = task.result()
        self.tally.counts[op][code] += 1
        self.tally.seconds[f"{op}: {code}"].append(self.loop.time() - start)

    async def update(self, client: MMCacheClient, repeat: bool, *, hash_only: bool = True) -> str:
        rng = self.rng
        if repeat:
            hashes = rng.sample(self.pool, rng.randint(1, 4))
            cached = client.is_cached(hashes, pending=True) if hash_only else [False] * len(hashes)
        else:
            hashes = []
            for _ in range(rng.randint(1, 3)):
                hashes.append(self.contents.new_hash(rng, f"n-{self.name}-{self.made}"))
                self.made += 1
            cached = [False] * len(hashes)
        items = [None if c else self.contents.item(h) for h, c in zip(hashes, cached, strict=True)]
        started = self.loop.time()
        sent = await client.get_and_update(items, hashes)  # lease=True: every held item
        # What was not a hit went up (or, larger than the room, stays with the caller).
        self.tally.uploaded_bytes += sum(_payload(out) for out in sent if out is not None)
        kept = [h for h, held in zip(hashes, sent.held, strict=True) if held]
        self.tally.unheld += len(hashes) - len(kept)
        if kept:
            fate = rng.random()
            if fate < 0.1:
                self.tally.abandoned += 1  # a dropped request: its leases expire
            elif fate < 0.2:
                await self.call("release", self.release(kept))
            else:
                due = self.loop.time() + rng.uniform(0, FETCH_WITHIN_S)
                self.held.append(Held(kept, started, due))
        return "OK"

    async def fetch(self, client: MMCacheClient, held: Held) -> str:
        items = await client.fetch(held.hashes)
        for h, item in zip(held.hashes, items, strict=True):
            if not same_item(item, self.contents.item(h)):
                return "WRONG DATA"
            self.tally.fetched_bytes += _payload(item)
        return "OK"

    async def release(self, hashes: list[str]) -> str:
        await self.client.release(hashes)
        return "OK"

    async def lookup(self) -> str:
        await self.client.lookup(self.rng.sample(self.pool, 4), lease=False)
        return "OK"

    async def touch(self) -> str:
        hashes = self.rng.sample(self.pool, 8)
        cached = [h for h, c in zip(hashes, self.client.is_cached(hashes), strict=True) if c]
        if self.rng.random() < 0.5:
            for h in cached:
                self.client.touch(h)  # local: sent with this client's next batch
        else:
            await self.client.transport.touch(hashes)  # the Touch call itself
        return "OK"

    async def put_oversize(self) -> str:
        h = f"big-{self.name}-{self.made}"
        self.made += 1
        sent = await self.client.get_and_update([self.oversize], [h])
        return "HELD (larger than the cache)" if sent.held[0] or sent[0] is None else "OK"


def _payload(item: Item) -> int:
    import torch

    from mmcache import FieldElem

    total = 0
    for value in item.values():
        data = value.data if isinstance(value, FieldElem) else value
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total


def emit(record: Mapping[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def loop_lag(stop_at: float, lags: list[float]) -> None:
    """How late this process's event loop wakes a 50 ms sleep: a loop that
    lags is a bottleneck of its own (its clients' calls wait for it)."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        before = loop.time()
        await asyncio.sleep(0.05)
        lags.append(loop.time() - before - 0.05)


async def worker(args: argparse.Namespace) -> dict[str, object]:
    import torch

    from mmcache import keep_freed_memory
    from mmcache.client import MMCacheClient

    keep_freed_memory()
    contents = Contents(args.seed, args.max_item_kib * KIB)
    # Larger than the cache: never stored, so its bytes are never read (or touched).
    oversize = {"data": torch.empty(args.capacity_mib * MIB + MIB, dtype=torch.uint8)}
    tally = Tally()
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                MMCacheClient(args.target, timeout=120, channel_options=OWN_CONNECTION)
            )
            for _ in range(args.clients)
        ]
        hasty = [
            await stack.enter_async_context(
                MMCacheClient(args.target, timeout=t, follow=False, channel_options=OWN_CONNECTION)
            )
            for t in HASTY_TIMEOUTS_S
        ]
        for client in clients:
            await client.wait_following(timeout=60)
        emit({"kind": "ready"})
        await loop.run_in_executor(None, sys.stdin.readline)  # "go"
        cpu_at_go = time.process_time()
        stop_at = loop.time() + args.seconds
        lags: list[float] = []
        lag_task = asyncio.create_task(loop_lag(stop_at, lags))
        soakers = [
            Soaker(
                f"w{args.index}c{i}",
                client,
                hasty,
                contents,
                oversize,
                args.lease_s,
                tally,
                random.Random(f"{args.seed}-{args.index}-{i}"),
            )
            for i, client in enumerate(clients)
        ]
        await asyncio.gather(*(s.run(stop_at) for s in soakers))
        await lag_task
    return {
        "counts": {op: dict(c) for op, c in tally.counts.items()},
        "seconds": tally.seconds,
        "broken": tally.broken,
        "examples": tally.examples,
        "unheld": tally.unheld,
        "abandoned": tally.abandoned,
        "uploaded_bytes": tally.uploaded_bytes,
        "fetched_bytes": tally.fetched_bytes,
        "cpu_s": time.process_time() - cpu_at_go,
        "lags": lags,
    }


# ---------------------------------------------------------------- the driver


def status_bytes(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * KIB
    raise KeyError(name)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    return sum(
        value
        for (n, have), value in samples.items()
        if n == name and set(labels.items()) <= set(have)
    )


@dataclass
class Row:
    t: float
    rss: int
    cpu: float  # the server's CPU seconds so far
    samples: Samples


async def pending_uploads(target: str) -> int:
    """Hashes a fresh subscriber's first snapshot says are being uploaded."""
    from mmcache.client import MMCacheClient

    async with MMCacheClient(target, follow=False) as client:
        feed = client.transport.subscribe()
        try:
            message = await anext(feed)
        finally:
            await feed.aclose()
    return len(message.snapshot.pending)


def quantiles(seconds: Sequence[float], sep: str = " | ") -> str:
    """p50 and p99 in ms."""
    if len(seconds) < 2:
        return sep.join([f"{seconds[0] * 1e3:.0f}" if seconds else "-"] * 2)
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return f"{cuts[49] * 1e3:.0f}{sep}{cuts[98] * 1e3:.0f}"


def print_rss(rows: Sequence[Row], bound: int) -> None:
    print("\nserver RSS over time")
    print(
        "| t s | RSS MiB | of bound | items | stored MiB | leases | leased MiB "
        "| in flight MiB | subscribers | calls/s | server CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    before: Row | None = None
    for row in rows:
        s = row.samples
        calls = total(s, "grpc_server_handled_total")
        rate = cpu = "-"
        if before is not None and row.t > before.t:
            done = calls - total(before.samples, "grpc_server_handled_total")
            rate = f"{done / (row.t - before.t):.0f}"
            cpu = f"{(row.cpu - before.cpu) / (row.t - before.t):.0%}"
        over = " OVER" if row.rss > bound else ""
        print(
            f"| {row.t:.0f} | {row.rss / MIB:.0f}{over} | {row.rss / bound:.2f} "
            f"| {total(s, 'mmcache_items'):.0f} | {total(s, 'mmcache_stored_bytes') / MIB:.0f} "
            f"| {total(s, 'mmcache_leases'):.0f} | {total(s, 'mmcache_leased_bytes') / MIB:.1f} "
            f"| {total(s, 'mmcache_inflight_bytes') / MIB:.1f} "
            f"| {total(s, 'mmcache_feed_subscribers'):.0f} | {rate} | {cpu} |"
        )
        before = row


def print_outcomes(run: Run) -> int:
    """The clients' outcomes by op and status; how many were unexpected."""
    counts, examples = run.counts, run.examples
    print("\nclient calls by outcome (ms: from the call until its outcome)")
    print("| call | outcome | count | p50 ms | p99 ms | |")
    print("|---|---|---|---|---|---|")
    unexpected = 0
    bad: list[str] = []
    for op in sorted(counts):
        for code, n in sorted(counts[op].items(), key=lambda kv: -kv[1]):
            ok = code in EXPECTED.get(op, set())
            unexpected += 0 if ok else n
            cuts = quantiles(run.seconds[f"{op}: {code}"])
            print(f"| {op} | {code} | {n} | {cuts} | {'expected' if ok else 'UNEXPECTED'} |")
            if not ok:
                bad.append(f"{op}: {code}")
    for key in bad:  # what the first of each unexpected outcome said
        print(f"  {key}: {examples.get(key, '')[:300]}")
    return unexpected


def print_server_codes(samples: Samples) -> int:
    """The server's calls by method and status; how many were unexpected."""
    print("\nserver calls by status (grpc_server_handled_total)")
    print("| method | grpc_code | count | |")
    print("|---|---|---|---|")
    unexpected = 0
    for (name, labels), value in sorted(samples.items()):
        have = dict(labels)
        if name != "grpc_server_handled_total" or not value:
            continue
        method, code = have["grpc_method"], have["grpc_code"]
        ok = code in (SERVER_EXPECTED_FETCH if method in SERVER_READS else SERVER_EXPECTED)
        unexpected += 0 if ok else int(value)
        print(f"| {method} | {code} | {value:.0f} | {'expected' if ok else 'UNEXPECTED'} |")
    return unexpected


def start_server(args: argparse.Namespace, log: IO[str]) -> tuple[subprocess.Popen[str], int, int]:
    command = [sys.executable, "-m", "bench._cache_server", "--metrics"]
    command += ["--capacity-mib", str(args.capacity_mib), "--inflight-mib", str(args.inflight_mib)]
    command += ["--feed-buffer-mib", str(args.feed_buffer_mib)]
    command += ["--lease-s", str(args.lease_s), "--log-level", "WARNING"]
    command += ["--shm-mib", str(args.shm_mib)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line:
        raise SystemExit(f"the server did not start (exit {server.wait()})")
    port, metrics_port = (int(x) for x in line.split())
    return server, port, metrics_port


def start_workers(
    args: argparse.Namespace, target: str, results: str
) -> list[subprocess.Popen[str]]:
    workers = []
    for i in range(args.workers):
        clients = args.clients // args.workers + (i < args.clients % args.workers)
        command = [sys.executable, "-m", "bench.soak", "--role", "worker", "--target", target]
        command += ["--result", os.path.join(results, f"{i}.json")]
        command += ["--index", str(i), "--clients", str(clients), "--seed", str(args.seed)]
        command += ["--seconds", str(args.minutes * 60), "--lease-s", str(args.lease_s)]
        command += ["--capacity-mib", str(args.capacity_mib)]
        command += ["--max-item-kib", str(args.max_item_kib)]
        workers.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    for w in workers:
        assert w.stdout is not None
        line = w.stdout.readline()
        if not line or json.loads(line)["kind"] != "ready":
            for other in workers:
                other.kill()
            raise SystemExit(f"a worker did not start (exit {w.wait()})")
    return workers


@dataclass
class Run:
    """What the driver saw: samples, the workers' tallies, the end state."""

    rows: list[Row] = field(default_factory=list)
    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    broken: list[str] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    worker_cpu: list[float] = field(default_factory=list)  # CPU seconds of each
    lags: list[float] = field(default_factory=list)  # the workers' event-loop lags
    extra: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    ran: float = 0.0  # seconds from "go" until every worker had finished
    drained: float = 0.0  # seconds after that until nothing was left
    final: Samples | None = None  # None: the server did not live to the end
    pending: int = 0
    peak: int = 0


# Gauges that must fall to 0 once the clients are gone and their leases expired.
LEFT = (
    "mmcache_leases",
    "mmcache_leased_bytes",
    "mmcache_inflight_bytes",
    "mmcache_feed_subscribers",
    "mmcache_shm_leased_bytes",
)


def soak(args: argparse.Namespace) -> Run:
    run = Run()
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryDirectory() as results:
        server, port, metrics_port = start_server(args, log)
        target = f"127.0.0.1:{port}"
        try:
            workers = start_workers(args, target, results)
            started = time.monotonic()

            def sample(keep: bool = True) -> Row:
                rss, cpu = status_bytes(server.pid, "VmRSS"), cpu_seconds(server.pid)
                row = Row(time.monotonic() - started, rss, cpu, scrape(metrics_port))
                if keep:
                    run.rows.append(row)
                return row

            sample()
            for w in workers:
                assert w.stdin is not None
                w.stdin.write("go\n")
                w.stdin.flush()
            give_up = started + args.minutes * 60 + 300
            next_sample = started + args.sample_s
            while any(w.poll() is None for w in workers) and server.poll() is None:
                if time.monotonic() > give_up:
                    run.failures.append("a worker was still running 5 minutes after the end")
                    break
                time.sleep(min(0.2, max(0.0, next_sample - time.monotonic())))
                if time.monotonic() >= next_sample:
                    sample()
                    next_sample += args.sample_s
            if server.poll() is not None:
                run.failures.append(f"the server died (exit {server.returncode})")
            collect(workers, results, run)
            run.ran = time.monotonic() - started
            if server.poll() is None:
                # Leases nobody read end lease_s after their grant; the server
                # expires them every lease_s/10 (at most 1 s). Polled twice a
                # second, kept in the table at its pace.
                last = sample()
                drain_until = time.monotonic() + args.lease_s + 10
                next_sample = time.monotonic() + args.sample_s
                while any(total(last.samples, g) for g in LEFT):
                    if time.monotonic() > drain_until:
                        break
                    time.sleep(0.5)
                    last = sample(keep=time.monotonic() >= next_sample)
                    if last is run.rows[-1]:
                        next_sample += args.sample_s
                if last is not run.rows[-1]:
                    run.rows.append(last)
                run.drained = last.t - run.ran
                run.final = last.samples
                run.peak = status_bytes(server.pid, "VmHWM")
                # After the last scrape: this subscriber is no client's.
                run.pending = asyncio.run(pending_uploads(target))
                if server.poll() is not None:
                    run.failures.append(f"the server died (exit {server.returncode})")
        finally:
            if server.poll() is None:
                server.terminate()
            server.wait()
        log.seek(0)
        run.log = [line.rstrip() for line in log if line.strip()]
    return run


def collect(workers: Sequence[subprocess.Popen[str]], results: str, run: Run) -> None:
    """Each worker's tally (killing any still running: the soak has failed then)."""
    for i, w in enumerate(workers):
        if w.poll() is None and run.failures:
            w.kill()
        w.communicate()
        if w.returncode != 0:
            run.failures.append(f"worker {i} exited {w.returncode}")
            continue
        with open(os.path.join(results, f"{i}.json")) as result:
            record = json.load(result)
        for op, by_code in record["counts"].items():
            run.counts[op].update(by_code)
        run.broken += record["broken"]
        for key, seconds in record["seconds"].items():
            run.seconds[key] += seconds
        for key, message in record["examples"].items():
            run.examples.setdefault(key, message)
        for key in ("unheld", "abandoned", "uploaded_bytes", "fetched_bytes"):
            run.extra[key] += record[key]
        run.worker_cpu.append(record["cpu_s"])
        run.lags += record["lags"]


def report(args: argparse.Namespace, run: Run, bound: int) -> int:
    """Print the tables; the exit status."""
    failures = run.failures
    print_rss(run.rows, bound)
    unexpected = print_outcomes(run)
    if unexpected:
        failures.append(f"{unexpected} unexpected client outcomes")
    for example in run.broken:
        print(f"  broken promise: {example}")
    if run.log:
        failures.append(f"{len(run.log)} lines of warnings or errors in the server's log")
        print("\nthe server's log (first 20 lines):")
        for line in run.log[:20]:
            print(f"  {line}")
    over = sum(row.rss > bound for row in run.rows)
    if over:
        failures.append(f"{over} RSS samples over the sizing rule")
    if run.peak > bound:
        failures.append(f"peak RSS (VmHWM) {run.peak / MIB:.0f} MiB over the sizing rule")
    final = run.final
    if final is not None:
        server_unexpected = print_server_codes(final)
        if server_unexpected:
            failures.append(f"{server_unexpected} unexpected statuses on the server")
        left = {
            "lease grants": total(final, "mmcache_leases"),
            "leased bytes": total(final, "mmcache_leased_bytes"),
            "in-flight bytes": total(final, "mmcache_inflight_bytes"),
            "pending uploads": float(run.pending),
            "feed subscribers": total(final, "mmcache_feed_subscribers"),
            "shared-memory slot bytes": total(final, "mmcache_shm_leased_bytes"),
        }
        for what, value in left.items():
            if value:
                failures.append(f"{value:.0f} {what} left at the end")
        calls = sum(sum(c.values()) for c in run.counts.values())
        queries = total(final, "mmcache_queries_total")
        print("\nsummary")
        print("| | |")
        print("|---|---|")
        print(f"| clients / processes | {args.clients} / {args.workers} |")
        print(f"| client calls | {calls} in {run.ran:.0f} s ({calls / run.ran:.0f}/s) |")
        server_cpu = (run.rows[-1].cpu - run.rows[0].cpu) / max(run.rows[-1].t, 1e-9)
        print(
            "| CPU, of one core: server / each client process | "
            f"{server_cpu:.0%} / {', '.join(f'{c / run.ran:.0%}' for c in run.worker_cpu)} |"
        )
        print(f"| client processes' event-loop lag, p50 / p99 ms | {quantiles(run.lags, ' / ')} |")
        print(f"| unexpected outcomes: client / server | {unexpected} / {server_unexpected} |")
        print(
            f"| MiB of misses sent / read back | {run.extra['uploaded_bytes'] / MIB:.0f} / "
            f"{run.extra['fetched_bytes'] / MIB:.0f} |"
        )
        print(
            "| server hit rate / evictions / items served uncached | "
            f"{total(final, 'mmcache_hits_total') / max(queries, 1):.2f} / "
            f"{total(final, 'mmcache_evictions_total'):.0f} / "
            f"{total(final, 'mmcache_uncached_total'):.0f} |"
        )
        print(
            "| entries that waited for another call's upload | "
            f"{total(final, 'mmcache_upload_waits_total'):.0f} |"
        )
        print(
            f"| held sets dropped / lease grants expired | {run.extra['abandoned']} / "
            f"{total(final, 'mmcache_lease_expiries_total'):.0f} |"
        )
        print(
            f"| server RSS MiB: peak sample / VmHWM / rule | "
            f"{max(r.rss for r in run.rows) / MIB:.0f} / {run.peak / MIB:.0f} / "
            f"{bound / MIB:.0f} ({run.peak / bound:.2f}) |"
        )
        print(
            f"| left {run.drained:.1f} s after the clients: {', '.join(left)} | "
            + " / ".join(f"{v:.0f}" for v in left.values())
            + " |"
        )
        print(f"| server log: warnings and errors | {len(run.log)} |")
    print(f"| verdict | {'FAIL' if failures else 'PASS'} |")
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


def drive(args: argparse.Namespace) -> int:
    bound = rule_bytes(
        args.capacity_mib * MIB,
        args.inflight_mib * MIB,
        int(args.feed_buffer_mib * MIB),
        args.shm_mib * MIB,
    )
    print(
        f"soak: {args.clients} clients in {args.workers} processes for {args.minutes:g} min; "
        f"cache {args.capacity_mib} MiB, {args.inflight_mib} MiB in flight, leases of "
        f"{args.lease_s:g} s, feed ring {args.feed_buffer_mib:g} MiB, shared-memory region "
        f"{args.shm_mib} MiB; items 1 KiB-"
        f"{args.max_item_kib} KiB; sizing rule "
        f"{bound / MIB:.0f} MiB",
        flush=True,
    )
    return report(args, soak(args), bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["driver", "worker"], default="driver")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4, help="client processes")
    parser.add_argument("--capacity-mib", type=int, default=128)
    parser.add_argument("--inflight-mib", type=int, default=64)
    parser.add_argument("--feed-buffer-mib", type=float, default=32)
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument(
        "--shm-mib", type=int, default=64, help="the server's shared-memory region; 0: gRPC only"
    )
    parser.add_argument("--max-item-kib", type=int, default=4096)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    # worker processes only
    parser.add_argument("--target")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--result", help="where a worker writes its tally (JSON)")
    args = parser.parse_args()
    if args.role == "worker":
        record = asyncio.run(worker(args))
        # To a file: a record this large would fill the pipe before the driver,
        # which reads once every worker has exited, gets to it.
        with open(args.result, "w") as out:
            json.dump(record, out)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
