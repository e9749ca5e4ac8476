"""`Tls` and the channel's metadata, at their former path: they live in the
wire layer (`mmcache.client.wire`); the vLLM plugin's settings import them here."""

from .wire._channel import Tls, metadata_interceptors, open_channel

__all__ = ["Tls", "metadata_interceptors", "open_channel"]
