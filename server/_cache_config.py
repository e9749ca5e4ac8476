"""The data plane's configuration (mmcache.server.cache's `CacheConfig`)
made from the server's: its parts' values, and the wire's formats of what
the data plane keeps opaque (an L2 record's manifest, a ring's record)."""

from __future__ import annotations

from dataclasses import fields

from ._config import L2Config, ServerConfig
from ._records import WIRE_MANIFESTS
from ._reports import parse_report
from .cache import CacheConfig, L2Settings, L2Target, RegionConfig

__all__ = ["cache_config"]


def cache_config(config: ServerConfig, node: str) -> CacheConfig:
    """What `open_cache` builds the sidecar's data plane from; `node`: its id."""
    shm = config.shm
    return CacheConfig(
        capacity_bytes=config.capacity_bytes,
        max_items=config.item_bound,
        lease_s=config.lease_s,
        inflight_bytes=config.max_inflight_bytes,
        manifests=WIRE_MANIFESTS,
        parse_report=parse_report,
        region=RegionConfig(shm.dir, shm.bytes, shm.group) if shm.enabled else None,
        l2=None if config.l2 is None else _l2_target(config.l2),
        node=node,
    )


def _l2_target(config: L2Config) -> L2Target:
    # The tier's settings that are flags (L2Config's fields of the same names).
    flags = {f.name for f in fields(config)} & {f.name for f in fields(L2Settings)}
    settings = L2Settings(**{name: getattr(config, name) for name in flags})
    return L2Target(config.url, config.prefix, settings)
