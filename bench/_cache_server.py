"""An mmcache server for the benchmarks: prints its port once it serves.

python -m bench._cache_server [--capacity-mib 512] [--inflight-mib 1024] [--max-items N]
                              [--metrics] [--feed-buffer-mib 32] [--lease-s 30]
                              [--log-level LEVEL]

With --metrics it prints its gRPC port and its /metrics port, on one line.
With --log-level the server's log goes to stderr, each line led by its level
(without it, only Python's last-resort handler prints warnings and errors).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from mmcache._memory import keep_freed_memory
from mmcache.server import MMCacheServer, ServerConfig, ShmConfig

MIB = 1 << 20


async def main(config: ServerConfig, metrics: bool) -> None:
    async with MMCacheServer(config) as server:
        print(server.port, *([server.metrics_port] if metrics else []), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    keep_freed_memory()  # as `mmcache serve` does; the same for both servers
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity-mib", type=int, default=512)
    parser.add_argument("--inflight-mib", type=int, default=ServerConfig.max_inflight_bytes // MIB)
    parser.add_argument("--max-items", type=int, default=None)
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument(
        "--feed-buffer-mib", type=float, default=ServerConfig.feed_buffer_bytes / MIB
    )
    parser.add_argument("--lease-s", type=float, default=ServerConfig.lease_s)
    parser.add_argument("--log-level", default=None)
    parser.add_argument("--shm-mib", type=int, default=ShmConfig.bytes // MIB, help="0: no region")
    parser.add_argument("--shm-dir", default=ShmConfig.dir)
    args = parser.parse_args()
    if args.log_level is not None:
        logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=args.capacity_mib * MIB,
        max_inflight_bytes=args.inflight_mib * MIB,
        max_items=args.max_items,
        feed_buffer_bytes=int(args.feed_buffer_mib * MIB),
        lease_s=args.lease_s,
        grace_s=0,
        shm=ShmConfig(enabled=args.shm_mib > 0, dir=args.shm_dir, bytes=max(args.shm_mib, 1) * MIB),
    )
    asyncio.run(main(config, args.metrics))
