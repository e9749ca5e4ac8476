"""An mmcache server for the benchmarks: prints its port once it serves.

python -m bench._cache_server [--capacity-mib 512] [--inflight-mib 1024] [--max-items N]
                              [--metrics] [--feed-buffer-mib 32]

With --metrics it prints its gRPC port and its /metrics port, on one line.
"""

from __future__ import annotations

import argparse
import asyncio

from mmcache._memory import keep_freed_memory
from mmcache.server import MMCacheServer, ServerConfig

MIB = 1 << 20


async def main(config: ServerConfig, metrics: bool) -> None:
    async with MMCacheServer(config) as server:
        print(server.port, *([server.metrics_port] if metrics else []), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    keep_freed_memory()  # as `mmcache serve` does; the same for both servers
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity-mib", type=int, default=512)
    parser.add_argument("--inflight-mib", type=int, default=1024)
    parser.add_argument("--max-items", type=int, default=None)
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--feed-buffer-mib", type=float, default=32)
    args = parser.parse_args()
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        capacity_bytes=args.capacity_mib * MIB,
        max_inflight_bytes=args.inflight_mib * MIB,
        max_items=args.max_items,
        feed_buffer_bytes=int(args.feed_buffer_mib * MIB),
        grace_s=0,
    )
    asyncio.run(main(config, args.metrics))
