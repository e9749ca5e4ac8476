"""What the vLLM plugin's own code costs per small image, by path and thread.

    .venv-vllm/bin/python -m bench.p0_path [--icons 300] [--rounds 3]

The family's icon rows (bench/vllm_family.py) put sharing at its worst: a
64x64 image costs the processor about 2.3 ms of CPU, about what sharing it
costs, and their requests/s moves more between runs of the same code than
the plugin's whole cost. This bench measures that cost apart, with no model
and no processor: two API processes' P0 caches (`MMCacheProcessorCache`,
single flight on, each with the plugin's client runtime: a thread of its
own), one engine's P1 cache (`MMCacheReceiverCache`), in this process with
vLLM imported, and one sidecar in its own process. Per icon (a 19 KiB item,
as the family's Qwen2-VL makes of a 64x64 image), in vLLM's call order:

- A: a miss, processed (not here: its data is given) and shared through the
  sidecar's shared memory; then A's own hit of it;
- B: a hit of A's icon in the region (leased with no call, read into B's
  own cache), once B's mirror has heard of it; then B's own hit;
- the engine: its read of B's hit from the region.

CPU per icon, each thread's own (`thread_time`, the threads' schedstat): on
the request's thread for each path; on A's and B's client threads (the
upload, the feed, timers) and gRPC's threads; and the sidecar's process.
Between icons the processes wait for the feed, so each path runs with its
caches cold, as it does between a vLLM process's other work. The median of
`--rounds` rounds, each with a sidecar and icons of its own.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench import cpu_seconds, stop_on_sigterm, thread_cpu_ns
from mmcache.client.vllm._receiver import MMCacheReceiverCache
from mmcache.client.vllm.runtime import SyncClient
from tests.vllm.conftest import Sidecar
from tests.vllm.test_caches import (
    SCOPE,
    digest_of,
    eventually,
    feature,
    icon_processes,
    item,
    request,
)

ICON_FLOATS = 4800  # pixel_values of a 64x64 image on the family's Qwen2-VL: 19 KiB
PROCESSING_MS = 2.3  # the processor's CPU on one such image (bench/upload_cost.py)

MISSED = "B's requests that were no region hit (count, all rounds)"
PATHS = ("A: miss, shared", "A: own hit", "B: region hit", "B: own hit", "engine: region read")


def used_ns(before: dict[int, tuple[str, int]], pid: int | str = "self") -> dict[int, int]:
    """Each thread's CPU nanoseconds since `before` (thread_cpu_ns of `pid`)."""
    return {
        tid: ns - before.get(tid, (name, 0))[1] for tid, (name, ns) in thread_cpu_ns(pid).items()
    }


async def _native_id() -> int:
    return threading.get_native_id()


@contextmanager
def spent(totals: dict[str, float], path: str) -> Iterator[None]:
    started = time.thread_time()
    yield
    totals[path] = totals.get(path, 0.0) + time.thread_time() - started


def one_round(sidecar: Sidecar, icons: int, round_: int) -> dict[str, float]:
    """Microseconds per icon: each path's on the request's thread, and each
    thread's and the sidecar's over the whole round."""
    made: list[SyncClient] = []

    def clients(follow: bool = True) -> SyncClient:
        sync = SyncClient(sidecar.target, deadline_s=1.0, follow=follow)
        if follow:
            sync.call(sync.client.wait_following())
        made.append(sync)
        return sync

    try:
        a, b = icon_processes(clients)
        engine = MMCacheReceiverCache(clients(follow=False), SCOPE)  # as vLLM's engine's
        eventually(lambda: engine.sync.client.region is not None)
        loops = {"A's client thread": a.sync, "B's client thread": b.sync}
        hashes = [digest_of((64, 64), f"#{round_:02x}{n:04x}") for n in range(icons)]
        items = [item(n, numel=ICON_FLOATS) for n in range(icons)]
        assert sidecar.proc is not None
        before, server = thread_cpu_ns(), cpu_seconds(sidecar.proc.pid)
        sidecar_before = thread_cpu_ns(sidecar.proc.pid)
        wall = time.monotonic()
        totals: dict[str, float] = {}
        missed = 0
        for mm_hash, data in zip(hashes, items, strict=True):
            key = b.key(mm_hash)
            with spent(totals, PATHS[0]):
                request(a, [(mm_hash, data)])
            with spent(totals, PATHS[1]):
                request(a, [(mm_hash, data)])
            eventually(lambda key=key: b.sync.client.is_cached([key]) == [True])
            with spent(totals, PATHS[2]):
                (hit,) = request(b, [(mm_hash, data)])
            missed += hit[0] is not None  # not a region hit: its data came back
            with spent(totals, PATHS[3]):
                request(b, [(mm_hash, data)])
            with spent(totals, PATHS[4]):
                engine.get_and_update_features([feature(mm_hash, None)])
        server = cpu_seconds(sidecar.proc.pid) - server
        here, wall = used_ns(before), time.monotonic() - wall
        there = used_ns(sidecar_before, sidecar.proc.pid)
        # The sidecar idle for a quarter of that time (still reading the
        # report rings every 5 ms, as uploads were posted): its timers' share.
        idle = cpu_seconds(sidecar.proc.pid)
        time.sleep(wall / 4)
        idle = (cpu_seconds(sidecar.proc.pid) - idle) * 4
        out = {path: seconds / icons * 1e6 for path, seconds in totals.items()}
        idents = {sync.call(_native_id()): name for name, sync in loops.items()}
        idents[engine.sync.call(_native_id())] = "the engine's client thread"
        for tid, name in idents.items():
            out[name] = here.pop(tid) / icons / 1e3
        here.pop(threading.get_native_id())  # the requests' own thread: the paths above
        out["gRPC's threads (the three clients')"] = sum(here.values()) / icons / 1e3
        out["the sidecar (its process)"] = server / icons * 1e6
        loop = there.pop(sidecar.proc.pid)
        out["  its event loop"] = loop / icons / 1e3
        out["  gRPC's and its other threads"] = sum(there.values()) / icons / 1e3
        out[MISSED] = missed
        out["  idle as long again (its timers)"] = idle / icons * 1e6
        out["wall time per icon, µs (waiting for the feed)"] = wall / icons * 1e6
        return out
    finally:
        for sync in made:
            sync.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--icons", type=int, default=300, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    stop_on_sigterm()
    rounds = []
    for n in range(args.rounds):  # a fresh sidecar each: its processes learn icons anew
        sidecar = Sidecar(capacity_gb=1, env={"MMCACHE_SHM_MB": "512"})
        sidecar.start()
        try:
            rounds.append(one_round(sidecar, args.icons, n))
        finally:
            sidecar.stop()

    def median(name: str) -> float:
        return statistics.median(r.get(name, 0.0) for r in rounds)

    print("| where | µs of CPU per icon (median of rounds) |")
    print("|---|---|")
    for name in rounds[0]:
        value = sum(r[name] for r in rounds) if name == MISSED else median(name)
        print(f"| {name} | {value:.0f} |")
    share = median(PATHS[0]) + median("A's client thread") + median("the sidecar (its process)")
    follower = median("B's client thread")
    hit = median(PATHS[2]) + median(PATHS[4])
    print(
        f"\nSharing an icon: {share / 1e3:.2f} ms (its process and the sidecar) "
        f"+ {follower / 1e3:.2f} ms in each other process on the feed; a hit "
        f"of it in another process: {hit / 1e3:.2f} ms (that process and the "
        f"engine), against about {PROCESSING_MS} ms to process it (gRPC's "
        "threads apart)."
    )


if __name__ == "__main__":
    main()
