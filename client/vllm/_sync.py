"""SyncClient's former path: client/vllm_plugin.py names it for typing.

The runtime is runtime.py (public); nothing else imports this module.
"""

from __future__ import annotations

from .runtime import SyncClient

__all__ = ["SyncClient"]
