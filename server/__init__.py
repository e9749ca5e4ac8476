"""The mmcache server: the P1 item cache (and encoder-budget books) over gRPC.

Run it with `mmcache serve` or `python -m mmcache.server`; embed it with
`async with MMCacheServer(ServerConfig(port=0)) as server: ...`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import EventsConfig, L2Config, ServerConfig, ShmConfig, TlsConfig

if TYPE_CHECKING:
    from ._app import MMCacheServer, serve

__all__ = [
    "EventsConfig",
    "L2Config",
    "MMCacheServer",
    "ServerConfig",
    "ShmConfig",
    "TlsConfig",
    "serve",
]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `mmcache serve` (server._cli) sets its
    # signal handlers before grpc and the rest load (a stop is never lost).
    if name in ("MMCacheServer", "serve"):
        from . import _app

        return getattr(_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
