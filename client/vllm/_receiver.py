"""vLLM's P1 multimodal cache (the engine core's), reading through to the sidecar.

`MMCacheReceiverCache`: features that came with data
are used as they are (P0 uploaded them); those without are copied out of the
sidecar's shared memory on the engine's thread, with no call, where all are
resident there, or else read through in one `fetch` per request; either
releases their leases. Hashes the server does not
hold raise vLLM's `MultiModalCacheMissError` naming each, in request order,
so vLLM's own retry path has P0 invalidate them and the client re-send.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from typing_extensions import override
from vllm.multimodal.cache import BaseMultiModalReceiverCache, MultiModalCacheMissError
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem

from mmcache._errors import CacheMissError, MMCacheError

from ._keys import scoped_key
from .convert import to_vllm
from .runtime import SyncClient

__all__ = ["MMCacheReceiverCache"]

_LOGGER = logging.getLogger(__name__)


class MMCacheReceiverCache(BaseMultiModalReceiverCache):  # type: ignore[misc]
    def __init__(self, sync: SyncClient, scope: str) -> None:
        super().__init__()
        self.sync = sync  # the process's client, which every read goes through
        self._scope = scope

    def _read(self, hashes: Sequence[str]) -> list[MultiModalKwargsItem]:
        keys = [scoped_key(self._scope, h) for h in hashes]
        try:
            # Resident in the sidecar's shared memory: read on this thread, with no call.
            items = self.sync.client.fetch_resident(keys)
            if items is None:
                items = self.sync.call(self.sync.client.fetch(keys, release=True))
        except CacheMissError as exc:
            missing = set(exc.missing_hashes)
            raise MultiModalCacheMissError(
                [h for h, k in zip(hashes, keys, strict=True) if k in missing]
            ) from None
        except MMCacheError as exc:  # the server did not answer: vLLM's retry path
            _LOGGER.warning("mmcache read failed: %s", exc)
            raise MultiModalCacheMissError(list(hashes)) from None
        return [to_vllm(item) for item in items]

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        need = [f for f in mm_features if f.data is None]
        if need:
            hashes = [f.mm_hash or f.identifier for f in need]
            items = self._read(hashes)
            for feature, item in zip(need, items, strict=True):
                feature.data = item
        return mm_features

    @override
    def get_and_update_item(
        self, mm_item: MultiModalKwargsItem | None, mm_hash: str
    ) -> MultiModalKwargsItem:
        if mm_item is not None:
            return mm_item
        return self._read([mm_hash])[0]

    @override
    def touch_receiver_cache_item(
        self, mm_hash: str, mm_item: MultiModalKwargsItem | None = None
    ) -> None:
        return None  # the server orders by its own calls

    @override
    def clear_cache(self) -> None:
        return None
