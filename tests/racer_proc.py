"""A frontend in a process of its own that processed a new item, for the
counting race (tests/test_counts_race.py), as the vLLM plugin's P0 does it.

    python -m tests.racer_proc TARGET HASH SEED [--after-feed]

Asks its mirror (no call, as vLLM's `is_cached`), prints `asked HELD`, reads
one line from stdin (the go), then uploads the item unleased and `processed`
(the plugin's upload of what it processed) and prints `uploaded OUTCOME-IS-NONE`. With
--after-feed it first waits until its mirror knows another client stored the
item: the upload a mirror that drops the data would send as a hash alone.
"""

from __future__ import annotations

import asyncio
import sys

from mmcache.client import MMCacheClient

from .conftest import eventually
from .items import image_item


async def main(argv: list[str]) -> int:
    target, mm_hash, seed = argv[0], argv[1], int(argv[2])
    async with MMCacheClient(target, timeout=20) as client:
        await client.wait_following()
        print(f"asked {client.is_cached([mm_hash], pending=True)[0]}", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        if "--after-feed" in argv:
            await eventually(lambda: client.is_cached([mm_hash]) == [True], timeout=10)
        result = await client.get_and_update(
            [image_item(seed)], [mm_hash], lease=False, processed=True
        )
        print(f"uploaded {result[0] is None}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
