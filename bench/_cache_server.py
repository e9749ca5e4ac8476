"""An mmcache server for the benchmarks: prints its port once it serves."""

from __future__ import annotations

import asyncio

from mmcache._memory import keep_freed_memory
from mmcache.server import MMCacheServer, ServerConfig


async def main() -> None:
    config = ServerConfig(
        host="127.0.0.1", port=0, metrics_port=0, capacity_bytes=512 << 20, grace_s=0
    )
    async with MMCacheServer(config) as server:
        print(server.port, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    keep_freed_memory()  # as `mmcache serve` does; the same for both servers
    asyncio.run(main())
