"""A clean stop with feed followers: SIGTERM to a real `mmcache serve`."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from contextlib import AsyncExitStack

from mmcache.client import MMCacheClient

from .conftest import MMCACHE, eventually
from .items import image_item
from .test_process import free_port, start, wait_serving

GRACE_S = 10


def serve(port: int, metrics_port: int) -> subprocess.Popen[str]:
    return start(
        [MMCACHE, "serve"],
        env={
            "MMCACHE_HOST": "127.0.0.1",
            "MMCACHE_PORT": str(port),
            "MMCACHE_METRICS_PORT": str(metrics_port),
            "MMCACHE_CAPACITY_GB": "0.25",
            "MMCACHE_GRACE_S": str(GRACE_S),
        },
    )


async def test_sigterm_with_followers_exits_at_once_and_they_follow_the_restart() -> None:
    port, metrics_port = free_port(), free_port()
    procs = [serve(port, metrics_port)]
    try:
        await asyncio.to_thread(wait_serving, port, procs[0])
        async with AsyncExitStack() as stack:
            followers = [
                await stack.enter_async_context(MMCacheClient(f"127.0.0.1:{port}"))
                for _ in range(3)
            ]
            for follower in followers:
                await follower.wait_following()
            old = followers[0].instance_id
            await followers[0].get_and_update([image_item(0)], ["held"])
            await eventually(lambda: all(f.is_cached(["held"]) == [True] for f in followers))

            # No call in flight but the three feeds: nothing to wait the grace for.
            began = time.monotonic()
            procs[0].send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(procs[0].wait, GRACE_S + 5)
            took = time.monotonic() - began
            _, err = procs[0].communicate()
            assert code == 0
            assert took < 3, f"{took:.1f}s to stop with {GRACE_S}s of grace: {err}"
            assert "ERROR" not in err, err

            # Its ports are free at once, and each follower resets its mirror
            # to the new instance (which holds nothing) and follows it.
            procs.append(serve(port, metrics_port))
            await asyncio.to_thread(wait_serving, port, procs[1])
            await eventually(
                lambda: all(f.instance_id != old and f.following for f in followers), timeout=15
            )
            assert [f.is_cached(["held"]) for f in followers] == [[False]] * 3
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
