"""The CPU one upload of a small item costs, the vLLM plugin's way.

    python -m bench.upload_cost [--uploads 1500] [--rounds 3] [--followers 4]

A sidecar (bench/_cache_server.py, its own process), and in this process the
plugin's client runtime (`SyncClient`: a thread of its own runs the calls)
uploading items one per call, as a request's background upload goes; and
`--followers` more clients, each in a process of its own, following the
sidecar's feed as the other API processes and the engine do (each upload
reaches each mirror). Per upload: the uploader's CPU (this process, every
thread), the sidecar's, and a follower's (the median of theirs; each
process's every thread, in clock ticks: 1500 uploads make a tick under
7 µs per upload). Over gRPC the item goes into the sidecar's heap;
"resident" sends it through a write slot of the shared-memory region
(`get_and_update(..., resident=True)`, what the plugin does for a small image
it shares): posted in the client's report ring with no call while it holds
spare slots of the item's size, by call when they are spent (the reply
brings more; docs/shm.md, "Uploads with no call"). The median of `--rounds`.

For scale: the processor's CPU on one 64x64 image (Qwen2-VL, 19 KiB
processed) is about 2.3 ms (`mmcache_vllm_processing_cpu_seconds_total`
over `mmcache_vllm_processed_items_total` on the family's icon trace), so
sharing an icon pays only where it saves more processings than its upload,
its feed and the sidecar's work cost: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid

import torch

from bench import cpu_seconds, stop_on_sigterm
from mmcache.client.vllm.runtime import SyncClient

KIB = 1 << 10
SIZES = (4 * KIB, 19 * KIB, 256 * KIB)


def follow(target: str) -> None:
    """A client following the feed until stdin closes (a follower's process)."""
    sync = SyncClient(target, deadline_s=2.0)
    sync.call(sync.client.wait_following())
    print("following", flush=True)
    sys.stdin.read()
    sync.close()


def item(nbytes: int) -> dict[str, torch.Tensor]:
    """An image item of about `nbytes`: pixel_values and its grid, as Qwen2-VL's."""
    return {
        "pixel_values": torch.rand(nbytes // (4 * 294), 294),
        "image_grid_thw": torch.tensor([1, 4, 4]),
    }


def one_round(
    uploader: SyncClient, server: int, followers: list[int], nbytes: int, resident: bool, n: int
) -> tuple[float, float, float]:
    """Microseconds per upload: the uploader's, the sidecar's, a follower's
    (the median of the processes `followers`)."""
    items = [item(nbytes) for _ in range(n)]
    keys = [uuid.uuid4().hex for _ in range(n)]
    client = uploader.client
    mine, theirs = time.process_time(), cpu_seconds(server)
    following = [cpu_seconds(pid) for pid in followers]
    for data, key in zip(items, keys, strict=True):
        uploader.call(
            client.get_and_update(
                [data], [key], lease=False, resident=resident, processed=True, metadata=[b"u" * 300]
            )
        )
    time.sleep(0.5)  # the last posted uploads are read (0.2 s), and reach the followers
    per = 1e6 / n
    spent = [cpu_seconds(pid) - before for pid, before in zip(followers, following, strict=True)]
    return (
        (time.process_time() - mine) * per,
        (cpu_seconds(server) - theirs) * per,
        (statistics.median(spent) if spent else 0.0) * per,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--uploads", type=int, default=1500, help="per row and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--followers", type=int, default=4)
    parser.add_argument("--follow", metavar="TARGET", help=argparse.SUPPRESS)  # (a follower)
    args = parser.parse_args()
    if args.follow:
        follow(args.follow)
        return
    stop_on_sigterm()
    cmd = [sys.executable, "-m", "bench._cache_server", "--capacity-mib", "2048"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    followers: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        target = f"127.0.0.1:{int(server.stdout.readline())}"
        follow_cmd = [sys.executable, "-m", "bench.upload_cost", "--follow", target]
        for _ in range(args.followers):
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
            followers.append(subprocess.Popen(follow_cmd, text=True, **pipes))
        for proc in followers:
            assert proc.stdout is not None
            proc.stdout.readline()  # following
        uploader = SyncClient(target, deadline_s=2.0)
        try:
            if uploader.client.region is None:
                sys.exit("no shared-memory region (is /dev/shm writable?): nothing to compare")
            table(uploader, server.pid, [proc.pid for proc in followers], args)
        finally:
            uploader.close()
    finally:
        for proc in (*followers, server):
            proc.terminate()
            proc.wait(30)


def table(
    uploader: SyncClient, server: int, followers: list[int], args: argparse.Namespace
) -> None:
    print(
        f"\nOne upload, the plugin's way ({args.uploads} uploads of one item per row and "
        f"round, median of {args.rounds} rounds; {args.followers} more clients follow "
        "the feed, each in a process of its own)"
    )
    print(
        "| item | path | uploader CPU µs/upload | sidecar CPU µs/upload "
        "| a follower's CPU µs/upload |"
    )
    print("|---|---|---|---|---|")
    for nbytes in SIZES:
        for resident in (False, True):
            rounds = [
                one_round(uploader, server, followers, nbytes, resident, args.uploads)
                for _ in range(args.rounds)
            ]
            up, side, each = (statistics.median(r[i] for r in rounds) for i in range(3))
            path = "resident (write slot, posted)" if resident else "gRPC (heap)"
            print(f"| {nbytes // KIB} KiB | {path} | {up:.0f} | {side:.0f} | {each:.0f} |")


if __name__ == "__main__":
    main()
