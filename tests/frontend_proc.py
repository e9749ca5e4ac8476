"""A frontend in a process of its own, for the fleet tests.

    python -m tests.frontend_proc TARGET SEED [SEED ...] [--hold]

Uploads one test image per seed (hash `img-SEED`) in one get_and_update with
leases, prints one line `uploaded HITS KNOWN` (HITS: items the server
already held; KNOWN: items its mirror knew were cached before the call), then
exits, or with --hold sleeps until killed (a frontend that dies
before its engine reads).
"""

from __future__ import annotations

import asyncio
import sys

from mmcache.client import MMCacheClient

from .items import image_item


async def main(argv: list[str]) -> int:
    hold = "--hold" in argv
    args = [a for a in argv if a != "--hold"]
    target, seeds = args[0], [int(s) for s in args[1:]]
    async with MMCacheClient(target, timeout=20) as client:
        await client.wait_following()
        items = [image_item(seed, numel=2000) for seed in seeds]
        hashes = [f"img-{seed}" for seed in seeds]
        held_before = sum(client.is_cached(hashes))
        result = await client.get_and_update(items, hashes)
        print(f"uploaded {sum(r is None for r in result)} {held_before}", flush=True)
        if hold:
            await asyncio.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
