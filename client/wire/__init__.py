"""The client's wire: the only part of the client that speaks gRPC and the
generated messages (proto/), and needs no torch.

The rest of the client, and the ops CLI (`mmcache stats`), call the services
through it in the client's own values (`_types`): a channel (`connect`, with
TLS, a token and a namespace), the cache's calls (`CacheTransport`), items'
specs (`Spec`, `describe`), the encoder-cache books (`EncoderCache`), and
gRPC's errors as mmcache's typed ones.

    async with connect("127.0.0.1:50051", token=token) as channel:
        info = await CacheTransport(channel, timeout=5.0).info()
"""

from . import _types
from ._channel import CHANNEL_OPTIONS, Tls, connect, metadata_interceptors, open_channel
from ._messages import parse_fetched, report_bytes, update_header
from ._sessions import MAX_SESSIONS
from ._spec import Leaf, Spec, TensorLeaf, describe, parse_spec
from ._status import broken_write, error_from_rpc, error_from_status, translate_errors
from ._transport import CacheTransport
from ._types import *  # noqa: F403 (the client's values: every name in _types.__all__)

__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_SESSIONS",
    "CacheTransport",
    "Leaf",
    "Spec",
    "TensorLeaf",
    "Tls",
    "broken_write",
    "connect",
    "describe",
    "error_from_rpc",
    "error_from_status",
    "metadata_interceptors",
    "open_channel",
    "parse_fetched",
    "parse_spec",
    "report_bytes",
    "translate_errors",
    "update_header",
    *_types.__all__,
]
