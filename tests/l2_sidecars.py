"""Sidecars in this process sharing one L2 (a Redis Cluster, or `memory://NAME`),
each with a client: the fleet tests' nodes (tests/test_l2_fleet.py on
`memory://`, tests/test_l2.py on Redis)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from mmcache.client import MMCacheClient
from mmcache.server import EventsConfig, L2Config, MMCacheServer

from .conftest import serving

__all__ = ["L2", "sidecars", "value"]


class L2(Protocol):
    """What the sidecars are pointed at: a `RedisCluster`, or a memory:// fleet."""

    @property
    def url(self) -> str: ...


def value(server: MMCacheServer, name: str, **labels: str) -> float:
    found = server.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


@contextlib.asynccontextmanager
async def sidecars(
    l2: L2,
    count: int,
    *,
    capacity_bytes: int | None = None,
    events: EventsConfig | None = None,
    **settings: Any,
) -> AsyncIterator[list[tuple[MMCacheServer, MMCacheClient]]]:
    """`count` sidecars sharing `l2` (`settings`: the rest of its L2Config),
    each with a client."""
    overrides: dict[str, Any] = {"events": events, "l2": L2Config(l2.url, **settings)}
    if capacity_bytes is not None:
        overrides["capacity_bytes"] = capacity_bytes
    async with contextlib.AsyncExitStack() as stack:
        pairs = []
        for _ in range(count):
            server = await stack.enter_async_context(serving(**overrides))
            client = await stack.enter_async_context(MMCacheClient(f"127.0.0.1:{server.port}"))
            pairs.append((server, client))
        yield pairs
