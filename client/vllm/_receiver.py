"""vLLM's P1 multimodal cache (the engine core's), reading through to the sidecar.

`MMCacheReceiverCache`: features that came with data
are used as they are (P0 uploaded them); those without are copied out of the
sidecar's shared memory on the engine's thread, with no call, where all are
resident there, or else read through in one `fetch` per request; either
releases their leases. Hashes the server does not
hold raise vLLM's `MultiModalCacheMissError` naming each, in request order,
so vLLM's own retry path has P0 invalidate them and the client re-send.

Where vLLM alone's engine keeps an LRU of items (its `lru` cache type: one
API server, no internal data parallelism), this engine keeps the very same
one (`own`: vLLM's class, of `--mm-processor-cache-gb`) in front of the
sidecar: what came with data and what it read is kept there, so a hit it
holds costs the engine no read, as vLLM alone's P1 hit costs none (a
1920x1080 image's item is 12.7 MB to copy, a 2560x1440 one's 87 MB), and
its lease is given back with no call. The engine's memory is then vLLM
alone's (as vLLM counts it, by tensor bytes); where vLLM
alone's engine keeps nothing (several API servers), nor does this one.
Keys sent without data are the sidecar's hits, named by their content
(never a client's uuid: those always travel with their data), so a kept
item is never another item's.
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
    def __init__(
        self, sync: SyncClient, scope: str, own: BaseMultiModalReceiverCache | None = None
    ) -> None:
        super().__init__()
        self.sync = sync  # the process's client, which every read goes through
        self._scope = scope
        self._own = own  # vLLM alone's engine LRU, where it keeps one

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

    def _held(self, mm_hash: str) -> MultiModalKwargsItem | None:
        """The item `own` keeps (None: none kept, or no `own`)."""
        if self._own is None:
            return None
        try:
            item: MultiModalKwargsItem = self._own.get_and_update_item(None, mm_hash)
        except MultiModalCacheMissError:
            return None
        return item

    def _kept(self, item: MultiModalKwargsItem, mm_hash: str) -> MultiModalKwargsItem:
        """`item`, kept in `own` as vLLM alone's engine keeps what it is sent."""
        if self._own is None:
            return item
        kept: MultiModalKwargsItem = self._own.get_and_update_item(item, mm_hash)
        return kept

    def _give_back(self, hashes: list[str]) -> None:
        """The leases P0 took for reads `own` made needless end now, as a read
        would have ended them: in the report ring with no call, else by a call
        no one waits for."""
        keys = [scoped_key(self._scope, h) for h in hashes]
        client = self.sync.client
        try:
            if not client.release_posted(keys):
                self.sync.submit(client.release(keys))
        except MMCacheError as exc:  # a hash no server takes: it leased nothing
            _LOGGER.debug("mmcache release failed: %s", exc)

    @override
    def get_and_update_features(
        self, mm_features: list[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        keys = [f.mm_hash or f.identifier for f in mm_features]
        if self._own is not None:  # this request's items first, as vLLM's cache does
            for key in keys:
                self._own.touch_receiver_cache_item(key)
        need: list[tuple[MultiModalFeatureSpec, str]] = []
        held: list[str] = []
        for feature, key in zip(mm_features, keys, strict=True):
            if feature.data is not None:
                feature.data = self._kept(feature.data, key)
            elif (kept := self._held(key)) is not None:
                feature.data = kept
                held.append(key)
            else:
                need.append((feature, key))
        if held:
            self._give_back(held)
        if need:
            items = self._read([key for _, key in need])
            for (feature, key), item in zip(need, items, strict=True):
                feature.data = self._kept(item, key)
        return mm_features

    @override
    def get_and_update_item(
        self, mm_item: MultiModalKwargsItem | None, mm_hash: str
    ) -> MultiModalKwargsItem:
        if mm_item is not None:
            return self._kept(mm_item, mm_hash)
        if (kept := self._held(mm_hash)) is not None:
            self._give_back([mm_hash])
            return kept
        return self._kept(self._read([mm_hash])[0], mm_hash)

    @override
    def touch_receiver_cache_item(
        self, mm_hash: str, mm_item: MultiModalKwargsItem | None = None
    ) -> None:
        if self._own is not None:  # the sidecar orders by its own calls
            self._own.touch_receiver_cache_item(mm_hash)

    @override
    def clear_cache(self) -> None:
        if self._own is not None:  # (vLLM's reset_mm_cache); the sidecar's is its own
            self._own.clear_cache()
