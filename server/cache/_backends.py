"""Which L2 backend a URL names: Redis Cluster (redis:// or rediss://), or
the in-memory one of this process (memory://NAME). redis-py is loaded only
when a Redis URL is given."""

from __future__ import annotations

from ._l2 import L2Backend
from ._l2_memory import is_memory_url, shared_memory_l2

__all__ = ["check_l2_url", "open_backend"]


def check_l2_url(url: str) -> None:
    """ValueError, saying what is wrong, unless `url` names an L2 backend."""
    if is_memory_url(url):
        shared_memory_l2(url)
        return
    from ._l2_redis import parse_l2_url

    parse_l2_url(url)


def open_backend(url: str, prefix: str, timeout_s: float) -> L2Backend:
    """The backend `url` names (checked by `check_l2_url`); it connects on first use."""
    if is_memory_url(url):
        return shared_memory_l2(url)
    from ._l2_redis import RedisClusterL2

    return RedisClusterL2(url, prefix=prefix, timeout_s=timeout_s)
