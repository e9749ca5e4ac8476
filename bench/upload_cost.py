"""The CPU one upload of a small item costs, the vLLM plugin's way.

    python -m bench.upload_cost [--uploads 600] [--rounds 3] [--followers 4]

A sidecar (bench/_cache_server.py, its own process) and, in this process,
the plugin's client runtime (`SyncClient`: a thread of its own runs the
calls) uploading items one per call, as a request's background upload goes;
`--followers` more clients follow the sidecar's feed as the other API
processes and the engine do (each upload reaches each mirror). Per upload:
the uploader's CPU (this process, the followers' client threads taken out;
gRPC's own threads, which every client in the process shares, stay in it),
the sidecar's (its process, every thread), and each follower's client thread.
Over gRPC the item goes into the sidecar's heap; "resident" sends it through a
write slot of the shared-memory region (`get_and_update(..., resident=True)`,
what the plugin does for a small image it shares). The median of `--rounds`.

For scale: the processor's CPU on one 64x64 image (Qwen2-VL, 19 KiB
processed) is about 2.3 ms (`mmcache_vllm_processing_cpu_seconds_total`
over `mmcache_vllm_processed_items_total` on the family's icon trace), so
sharing an icon pays only where it saves more processings than its upload,
its feed and the sidecar's work cost: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

import torch

from bench import stop_on_sigterm
from mmcache.client.vllm.runtime import SyncClient

KIB = 1 << 10
SIZES = (4 * KIB, 19 * KIB, 256 * KIB)


def process_cpu(pid: int) -> float:
    """CPU seconds of every thread of `pid` so far (Linux)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def item(nbytes: int) -> dict[str, torch.Tensor]:
    """An image item of about `nbytes`: pixel_values and its grid, as Qwen2-VL's."""
    return {
        "pixel_values": torch.rand(nbytes // (4 * 294), 294),
        "image_grid_thw": torch.tensor([1, 4, 4]),
    }


def one_round(
    uploader: SyncClient,
    followers: list[SyncClient],
    server: int,
    nbytes: int,
    resident: bool,
    n: int,
) -> tuple[float, float, float]:
    """Microseconds per upload: the uploader's, the sidecar's, each follower's."""
    items = [item(nbytes) for _ in range(n)]
    keys = [uuid.uuid4().hex for _ in range(n)]
    client = uploader.client
    followed = [f.loop_cpu() for f in followers]
    mine, theirs = time.process_time(), process_cpu(server)
    for data, key in zip(items, keys, strict=True):
        uploader.call(
            client.get_and_update(
                [data], [key], lease=False, resident=resident, processed=True, metadata=[b"u" * 300]
            )
        )
    time.sleep(0.2)  # the feed's last changes reach the followers
    follow = sum(f.loop_cpu() - b for f, b in zip(followers, followed, strict=True))
    spent = time.process_time() - mine - follow
    per = 1e6 / n
    each = follow / len(followers) if followers else 0.0
    return spent * per, (process_cpu(server) - theirs) * per, each * per


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--uploads", type=int, default=600, help="per row and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--followers", type=int, default=4)
    args = parser.parse_args()
    stop_on_sigterm()
    cmd = [sys.executable, "-m", "bench._cache_server", "--capacity-mib", "2048"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        target = f"127.0.0.1:{int(server.stdout.readline())}"
        uploader = SyncClient(target, deadline_s=2.0)
        followers = [SyncClient(target, deadline_s=2.0) for _ in range(args.followers)]
        try:
            if uploader.client.region is None:
                sys.exit("no shared-memory region (is /dev/shm writable?): nothing to compare")
            print(
                f"\nOne upload, the plugin's way ({args.uploads} uploads of one item per row and "
                f"round, median of {args.rounds} rounds; {args.followers} more clients follow "
                "the feed)"
            )
            print(
                "| item | path | uploader CPU µs/upload | sidecar CPU µs/upload "
                "| each follower's client thread µs/upload |"
            )
            print("|---|---|---|---|---|")
            for nbytes in SIZES:
                for resident in (False, True):
                    rounds = [
                        one_round(uploader, followers, server.pid, nbytes, resident, args.uploads)
                        for _ in range(args.rounds)
                    ]
                    up, side, each = (statistics.median(r[i] for r in rounds) for i in range(3))
                    path = "resident (write slot)" if resident else "gRPC (heap)"
                    print(f"| {nbytes // KIB} KiB | {path} | {up:.0f} | {side:.0f} | {each:.0f} |")
        finally:
            for sync in (*followers, uploader):
                sync.close()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
