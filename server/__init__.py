"""The mmcache server: the P1 item cache (and encoder-budget books) over gRPC.

Run it with `mmcache serve` or `python -m mmcache.server`; embed it with
`async with MMCacheServer(ServerConfig(port=0)) as server: ...`.
"""

from ._app import MMCacheServer, serve
from ._config import ServerConfig

__all__ = ["MMCacheServer", "ServerConfig", "serve"]
