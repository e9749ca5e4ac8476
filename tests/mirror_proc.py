"""A following client in a process of its own, for the fleet tests.

    python -m tests.mirror_proc TARGET

Prints `live` once its mirror follows the feed; then, for each line `dump`
on its input, one JSON line: the mirror's keys (sorted) and feed number.
"""

from __future__ import annotations

import asyncio
import json
import sys

from mmcache.client import MMCacheClient


async def main(target: str) -> None:
    loop = asyncio.get_running_loop()
    async with MMCacheClient(target, timeout=20) as client:
        await client.wait_following()
        print("live", flush=True)
        while await loop.run_in_executor(None, sys.stdin.readline):
            mirror = client.mirror
            print(json.dumps({"keys": sorted(mirror.keys()), "seq": mirror.feed_seq}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
