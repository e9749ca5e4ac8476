"""Server memory under churn, against the deployment's sizing rule.

    python -m bench.memory [--capacity-gb 1] [--inflight-gb 0.25] [--churn 1.5] [--only NAME]

An item's size (what the LRU charges) counts only its data, as vLLM counts
it; the server also keeps a hash, a spec and an LRU entry per item, and the
allocator keeps what churn fragments. The sizing rule of docs/deploy.md
(memory = 1.25 x capacity + max-inflight + shm region + 256 MiB) must cover
all of it, for
any mix of item sizes: for small items that takes the item bound
(`--max-items`, by default 65536 + one per 8 KiB of capacity).

Each workload runs against a fresh server process with the given capacity:
clients upload new items (every upload evicts once the cache is full) until
`churn` times the items that fill the cache (by bytes, or by the item bound)
have gone up. The table gives what the server holds at the end, the memory
it holds beyond the data (RSS - RSS at start - bytes held: bookkeeping,
fragmentation, buffers) in all and per item, its peak RSS (VmHWM), and that
peak as a fraction of the rule's memory for the configuration. The last row
turns the item bound off, to show what it prevents. The client maps the
server's shared-memory region (as an engine beside it does): larger uploads
go through it, and the region, reserved at start, counts in the peak whole.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
from dataclasses import dataclass

import torch

from mmcache import keep_freed_memory
from mmcache.client import MMCacheClient

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Workload:
    name: str
    low: int  # item sizes, bytes, drawn uniformly
    high: int
    per_call: int  # items per get_and_update
    tasks: int  # concurrent calls
    bounded: bool = True  # the server's default item bound (else none)


WORKLOADS = (
    Workload("images 0.3-6 MiB", 300 * KIB, 6 * MIB, 1, 4),
    Workload("video 8-64 MiB", 8 * MIB, 64 * MIB, 1, 2),
    Workload("small 16-64 KiB", 16 * KIB, 64 * KIB, 32, 4),
    Workload("tiny 1-3 KiB", 1 * KIB, 3 * KIB, 256, 2),
    Workload("tiny 1-3 KiB, no item bound", 1 * KIB, 3 * KIB, 256, 2, bounded=False),
)


def rule_bytes(capacity: int, inflight: int, region: int) -> int:
    """docs/deploy.md: 1.25 x capacity + max-inflight + shm region + 256 MiB."""
    return int(1.25 * capacity) + inflight + region + 256 * MIB


def status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    raise KeyError(field)


@dataclass(frozen=True)
class Result:
    items: int
    held: int
    beyond: int  # RSS beyond the data held and the server's RSS at start
    peak: int  # peak RSS plus the shared-memory region
    region: int


def start_server(w: Workload, capacity: int, inflight: int) -> tuple[subprocess.Popen[str], int]:
    args = [sys.executable, "-m", "bench._cache_server"]
    args += ["--capacity-mib", str(capacity // MIB), "--inflight-mib", str(inflight // MIB)]
    if not w.bounded:
        args += ["--max-items", str(1 << 40)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    return server, int(server.stdout.readline())


async def run_workload(w: Workload, capacity: int, inflight: int, churn: float) -> Result:
    server, port = start_server(w, capacity, inflight)
    try:
        start_rss = status_bytes(server.pid, "VmRSS")
        rng = random.Random(0)
        # Tensors are shared between items: the client's own memory stays small.
        step = max(4, (w.high - w.low) // 64)
        tensors = [torch.rand(n // 4) for n in range(w.low, w.high + 1, step)]
        made = 0
        async with MMCacheClient(f"127.0.0.1:{port}") as client:
            bound = (await client.transport.info()).max_items or capacity
            # Items that fill the cache, by bytes or by count, times the churn.
            target = churn * min(capacity // ((w.low + w.high) // 2), bound)

            async def upload() -> None:
                nonlocal made
                while made < target:
                    batch = [{"pixel_values": rng.choice(tensors)} for _ in range(w.per_call)]
                    keys = [f"{made + i:064x}" for i in range(w.per_call)]
                    made += w.per_call
                    await client.get_and_update(batch, keys, lease=False)  # churn: no reader

            await asyncio.gather(*(upload() for _ in range(w.tasks)))
            info = await client.transport.info()
            assert client.region is not None or not info.HasField("shm")
        rss = status_bytes(server.pid, "VmRSS")
        beyond = rss - start_rss - info.used_bytes
        # The region's pages are reserved at start and charged to the server
        # whether touched or not: added whole (those it touched, which RSS
        # also counts, twice: an upper bound).
        region = info.shm.size_bytes
        peak = status_bytes(server.pid, "VmHWM") + region
        return Result(info.items, info.used_bytes, beyond, peak, region)
    finally:
        server.terminate()
        server.wait()


async def run(capacity: int, inflight: int, churn: float, only: str) -> None:
    print(
        f"capacity {capacity / GIB:g} GiB, max-inflight {inflight / GIB:g} GiB, churn {churn:g}x; "
        "peak = peak RSS + the shared-memory region; the rule counts the region too"
    )
    print(
        f"{'workload':>28} | {'items held':>10} | {'MiB held':>8} | {'MiB beyond':>10} | "
        f"{'per item':>8} | {'region':>6} | {'peak MiB':>8} | {'rule MiB':>8} | {'of rule':>7}"
    )
    print("-" * 128)
    for w in WORKLOADS:
        if only not in w.name:
            continue
        r = await run_workload(w, capacity, inflight, churn)
        rule = rule_bytes(capacity, inflight, r.region)
        print(
            f"{w.name:>28} | {r.items:>10} | {r.held / MIB:8.0f} | {r.beyond / MIB:10.0f} | "
            f"{r.beyond / max(r.items, 1):6.0f} B | {r.region / MIB:6.0f} | {r.peak / MIB:8.0f} | "
            f"{rule / MIB:8.0f} | {r.peak / rule:7.2f}",
            flush=True,
        )


def main() -> None:
    keep_freed_memory()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity-gb", type=float, default=1)
    parser.add_argument("--inflight-gb", type=float, default=0.25)
    parser.add_argument("--churn", type=float, default=1.5)
    parser.add_argument("--only", default="", help="run the workloads whose name has this")
    args = parser.parse_args()
    capacity = int(args.capacity_gb * GIB)
    asyncio.run(run(capacity, int(args.inflight_gb * GIB), args.churn, args.only))


if __name__ == "__main__":
    main()
