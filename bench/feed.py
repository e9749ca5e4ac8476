"""The mirror feed at scale: a million keys, a hundred subscribers.

    python -m bench.feed [--keys 1000000] [--subscribers 100] [--churn-s 10] [--rate 2000]

A server (its own process, its feed ring cut to 1 MiB) is filled with `keys`
items (64-character hashes, as sha256 hex; empty tensors, as only keys
matter to the feed), then `subscribers` feed subscribers connect, each on
a channel of its own, in 4 processes: two are full `MMCacheClient` mirrors,
the rest raw Subscribe streams that read every message and parse the small
ones (a raw subscriber stands for a client whose mirror costs its own
process, not the server's; it reads with a plain 64 KiB window, where
grpc's BDP probing would let a stopped reader's window grow to megabytes).
Then a writer uploads new items at `rate` per second for `churn_s` seconds
(each evicts one: two changes, plus the upload's pending and settled
marks), while every subscriber notes when it first sees
each of the writer's probe keys; halfway through, one subscriber process is
stopped (SIGSTOP) for 5 s, so its streams fall behind the feed's ring and
must be resynced. Prints:

- the fill, and the server's RSS once filled;
- how long until every subscriber holds the snapshot (1M keys each), and the
  server's RSS then;
- the server's CPU during churn, with the subscribers and, for comparison,
  for the same churn with none;
- feed latency (write acknowledged -> a subscriber sees it) p50 / p99 / max,
  over every probe and every subscriber that was not stopped;
- resyncs (`mmcache_feed_snapshots_total{reason="lag"}`) and the server's
  peak RSS (VmHWM) over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from bench import cpu_seconds

MIB = 1 << 20
PROCESSES = 4
STALL_S = 5.0
PROBE_EVERY = 20  # every 20th churn upload is a probe whose arrival subscribers time


def status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def key_of(n: int) -> str:
    return f"{n:064x}"


def probe_key(n: int) -> str:
    return "probe-" + f"{n:058x}"


# ---------------------------------------------------------------- subscriber processes


async def subscriber_process(target: str, streams: int, mirrors: int) -> None:
    """`streams` subscribers; the first `mirrors` are MMCacheClients. Prints one
    JSON line when all are live, then one with probe arrival times at 'end'."""
    import grpc

    from mmcache.client import MMCacheClient
    from mmcache.v1 import cache_pb2 as pb

    seen: dict[str, list[float]] = {}
    live = [asyncio.Event() for _ in range(streams)]
    clients: list[MMCacheClient] = []

    async def raw(index: int) -> None:
        async with grpc.aio.insecure_channel(
            # No BDP probing: a plain 64 KiB window, so a stopped subscriber
            # stalls the server's writes within a few hundred KiB.
            target,
            options=[("grpc.max_receive_message_length", 64 * MIB), ("grpc.http2.bdp_probe", 0)],
        ) as channel:
            call = channel.unary_stream("/mmcache.v1.MMCache/Subscribe")(
                pb.SubscribeRequest().SerializeToString()
            )
            async for message in call:
                if len(message) > 65536:
                    continue  # a snapshot part: not parsed (the client's cost, not the server's)
                parsed = pb.FeedMessage.FromString(message)
                body = parsed.WhichOneof("body")
                if body is None:
                    live[index].set()  # the head after a snapshot
                elif body == "changes":
                    now = time.monotonic()
                    changes = parsed.changes
                    for kind, mm_hash in zip(changes.kinds, changes.mm_hashes, strict=True):
                        if kind == pb.CHANGE_STORED and mm_hash.startswith("probe-"):
                            seen.setdefault(mm_hash, []).append(now)

    async def mirror(index: int) -> None:
        client = MMCacheClient(target, timeout=600)
        await client.connect()
        clients.append(client)
        await client.wait_following(timeout=600)
        live[index].set()

    tasks = [asyncio.create_task(mirror(i) if i < mirrors else raw(i)) for i in range(streams)]
    start = time.monotonic()
    await asyncio.gather(*(event.wait() for event in live))
    print(json.dumps({"live_s": time.monotonic() - start}), flush=True)

    async def watch_mirrors() -> None:
        # Mirror clients: when is_cached first turns True for each probe (in order).
        next_probe = [0] * len(clients)
        while True:
            for i, client in enumerate(clients):
                while client.is_cached([probe_key(next_probe[i])])[0]:
                    seen.setdefault(probe_key(next_probe[i]), []).append(time.monotonic())
                    next_probe[i] += 1
            await asyncio.sleep(0.0005)

    watcher = asyncio.create_task(watch_mirrors())
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "end"
    watcher.cancel()
    for task in tasks:
        task.cancel()
    for client in clients:
        await client.close()
    print(json.dumps({"seen": seen}), flush=True)


# ---------------------------------------------------------------- the driver


def start_server(keys: int) -> subprocess.Popen[str]:
    capacity_mib = max(64, keys * 64 // MIB)  # churn items carry 8 bytes
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "bench._cache_server", "--capacity-mib", str(capacity_mib)),
            *("--max-items", str(keys), "--metrics"),
            *("--feed-buffer-mib", "1"),  # small: the stalled subscribers fall out of it
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def start_subscribers(target: str, streams: int, mirrors: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "bench.feed", "--role", "subscriber", "--target", target),
            *("--streams", str(streams), "--mirrors", str(mirrors)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def scrape_lag_snapshots(metrics_port: int) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('mmcache_feed_snapshots_total{reason="lag"}'):
                return float(line.split()[-1])
    return 0.0


async def fill(target: str, keys: int) -> None:
    """`keys` items whose tensors are empty: headers alone, raw calls of 5000
    entries (the feed's cost is in keys, not bytes; this fills in seconds)."""
    import grpc

    from mmcache._frames import header_frame
    from mmcache.v1 import cache_pb2 as pb

    spec = pb.ItemSpec(form=pb.ItemSpec.FORM_MAPPING)
    spec.fields.add(key="x").data.tensor.CopyFrom(pb.TensorSpec(dtype="uint8", shape=[0]))
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/mmcache.v1.MMCache/GetAndUpdateOne")
        for start in range(0, keys, 5000):
            request = pb.UpdateRequest()
            for n in range(start, min(keys, start + 5000)):
                request.entries.add(mm_hash=key_of(n), modality="image", item=spec)
            await call(header_frame(request.SerializeToString()), timeout=600)


async def churn(client: object, seconds: float, rate: float, first: int) -> dict[str, float]:
    """New items at `rate`/s (in calls of what is due, at most 50 items each);
    returns when each probe's call was acknowledged."""
    import torch

    tiny = torch.zeros(8, dtype=torch.uint8)
    written: dict[str, float] = {}
    start = time.monotonic()
    n = 0
    while (now := time.monotonic()) - start < seconds:
        due = min(int((now - start) * rate), n + 50)
        if due > n:
            keys = [
                probe_key(i // PROBE_EVERY) if i % PROBE_EVERY == 0 else key_of(first + i)
                for i in range(n, due)
            ]
            await client.get_and_update([{"x": tiny}] * len(keys), keys, lease=False)  # type: ignore[attr-defined]
            acknowledged = time.monotonic()
            written.update((k, acknowledged) for k in keys if k.startswith("probe-"))
            n = due
        await asyncio.sleep(0.001)
    return written


async def run(args: argparse.Namespace) -> None:
    from mmcache.client import MMCacheClient

    server = start_server(args.keys)
    assert server.stdout is not None
    port, metrics_port = (int(x) for x in server.stdout.readline().split())
    target = f"127.0.0.1:{port}"
    subs: list[subprocess.Popen[str]] = []
    try:
        async with MMCacheClient(target, follow=False, timeout=600) as writer:
            started = time.monotonic()
            await fill(target, args.keys)
            print(
                f"filled {args.keys:,} keys in {time.monotonic() - started:.1f} s; "
                f"server RSS {status_bytes(server.pid, 'VmRSS') / MIB:.0f} MiB"
            )
            # The same churn with nobody subscribed: what the feed adds is the difference.
            cpu = cpu_seconds(server.pid)
            await churn(writer, args.churn_s / 2, args.rate, 10 * args.keys)
            alone = (cpu_seconds(server.pid) - cpu) / (args.churn_s / 2)

            per = args.subscribers // PROCESSES
            for i in range(PROCESSES):
                streams = per + (args.subscribers % PROCESSES if i == 0 else 0)
                subs.append(start_subscribers(target, streams, mirrors=2 if i == 0 else 0))
            started = time.monotonic()
            for sub in subs:
                assert sub.stdout is not None
                json.loads(await asyncio.to_thread(sub.stdout.readline))
            print(f"{args.subscribers} subscribers hold the snapshot ({args.keys:,} keys) "
                  f"{time.monotonic() - started:.1f} s after starting; "
                  f"server RSS {status_bytes(server.pid, 'VmRSS') / MIB:.0f} MiB")  # fmt: skip

            stalled = subs[-1]

            async def stall() -> None:
                await asyncio.sleep(args.churn_s / 2)
                stalled.send_signal(signal.SIGSTOP)
                await asyncio.sleep(STALL_S)
                stalled.send_signal(signal.SIGCONT)

            cpu = cpu_seconds(server.pid)
            stopper = asyncio.create_task(stall())
            written = await churn(writer, args.churn_s, args.rate, 20 * args.keys)
            await stopper
            busy = (cpu_seconds(server.pid) - cpu) / args.churn_s
            await asyncio.sleep(1.0)  # the last changes reach everyone
            latencies: list[float] = []
            for sub in subs:
                assert sub.stdin is not None and sub.stdout is not None
                sub.stdin.write("end\n")
                sub.stdin.flush()
                seen = json.loads(await asyncio.to_thread(sub.stdout.readline))["seen"]
                if sub is stalled:
                    continue
                for key, times in seen.items():
                    if key in written:
                        latencies.extend(t - written[key] for t in times)
        cuts = statistics.quantiles(latencies, n=100, method="inclusive")
        print(
            f"churn {args.rate:.0f} uploads/s: server CPU {busy:.0%} with {args.subscribers} "
            f"subscribers, {alone:.0%} with none"
        )
        print(
            f"feed latency, write acknowledged -> seen by a subscriber ({len(latencies):,} "
            f"arrivals): p50 {cuts[49] * 1e3:.1f} ms, p99 {cuts[98] * 1e3:.1f} ms, "
            f"max {max(latencies) * 1e3:.1f} ms"
        )
        print(
            f"subscribers of the stopped process resynced: "
            f"{scrape_lag_snapshots(metrics_port):.0f} lag snapshots; server peak RSS "
            f"{status_bytes(server.pid, 'VmHWM') / MIB:.0f} MiB"
        )
    finally:
        for sub in subs:
            sub.kill()
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["driver", "subscriber"], default="driver")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--churn-s", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="uploads per second")
    parser.add_argument("--target")
    parser.add_argument("--streams", type=int, default=0)
    parser.add_argument("--mirrors", type=int, default=0)
    args = parser.parse_args()
    if args.role == "subscriber":
        asyncio.run(subscriber_process(args.target, args.streams, args.mirrors))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
