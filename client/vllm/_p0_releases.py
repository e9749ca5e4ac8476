"""Where P0's behaviour differs by vLLM release (tested: 0.31, 0.32, 0.33).

- 0.32 and later end each request with `release_sender_touches`: the
  request's uploads leave then, in one call. 0.31 (NVIDIA Dynamo 1.6's pin)
  has no such method and never says a request ended: there each processed
  item leaves as vLLM takes it, and a thread's next `is_cached` ends the
  request that thread ran before (`RequestEnds`).
- 0.33 asks `is_cached_item` on its output loop (before it `invalidate`s
  what the engine found missing), `validate_input_item` of items a client
  sent processed, and `close` at shutdown; earlier releases never call them.
- 0.31's LRU raises for an item over the whole cache, where later releases
  skip it: `LocalCache.get_and_update_item` (_local.py) serves it uncached.
"""

from __future__ import annotations

from vllm.multimodal.cache import BaseMultiModalProcessorCache

from ._ledger import Ledger

__all__ = ["ENDS_REQUESTS", "RequestEnds"]

# Whether this vLLM calls release_sender_touches at each request's end.
ENDS_REQUESTS = hasattr(BaseMultiModalProcessorCache, "release_sender_touches")


class RequestEnds:
    """When a request's uploads leave, on this vLLM (read once: at the cache's making)."""

    def __init__(self) -> None:
        self.said = ENDS_REQUESTS

    def ended_unsaid(self, ledger: Ledger) -> bool:
        """vLLM 0.31: the thread's last request ended, its items taken, though
        nothing said so: the next is_cached on the thread says it."""
        return not self.said and ledger.merged

    def per_item(self) -> bool:
        """vLLM 0.31: items leave as vLLM takes them, nothing ending the request."""
        return not self.said
