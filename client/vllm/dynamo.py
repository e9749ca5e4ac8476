"""mmcache as NVIDIA Dynamo's multimodal transport, frontend to vLLM worker.

Dynamo's vLLM-processor frontend (`python -m dynamo.frontend
--dyn-chat-processor vllm`) processes images and ships the tensors of every
item to the worker on every request, repeats included (a fresh shared-memory
segment, or NIXL). With `MMCACHE_TARGET` set in both processes, the vLLM
plugin (mmcache.client.vllm) loads in each as a vLLM general plugin
and installs this transport there (this module; `mmcache.client.dynamo` names it
too); no file of Dynamo's is edited:

- **Frontend.** vLLM's P0 cache there is the plugin's: an item the sidecar
  holds is a hit (not processed, leased for the worker) and every miss is
  uploaded in the background. `MMCacheSender` replaces Dynamo's sender: a
  hit travels as its sidecar key alone; a miss's tensors as Dynamo's own
  shared-memory sender sends them. The request's media (URLs or data URIs)
  always travel too, so a worker that cannot read an item processes the
  media itself and never answers without them. The leases end with the
  request (the sender's cleanup, after the stream).
- **Worker.** `try_receive_mm_kwargs` of Dynamo's request processor reads
  the transport's metadata (`extra_args["mm_kwargs_mmcache"]`): one `fetch`
  of the keys from this worker's sidecar, the inline items from their
  segments; then Dynamo's own `_receive_mm_kwargs` goes on (its checks, its
  hashes, `inject_into_mm_cache`). A fetched item is handed over as the
  vLLM item it is, not encoded and decoded again, and nothing is uploaded
  again from the worker. Any failure (an item evicted, the sidecar gone)
  returns None: Dynamo then processes the request's media, as it does when
  its own transfer fails.

What is hooked, for Dynamo 1.6.1 (the one release tested; another makes the
plugin say so with an ERROR and leave Dynamo's transfer as it is):
`dynamo.frontend.vllm_processor.VllmProcessor.__init__` (the sender) and
`._prepare_mm_routing` (the media always forwarded), and
`dynamo.vllm.multimodal_utils.request_processor`'s
`VllmMultimodalRequestProcessor.try_receive_mm_kwargs` and the module's
`decode_mm_kwargs_item`; and the frontend's media connector, registered as
`dynamo` in vLLM's registry, is the plugin's (vLLM's own, decoding lazily).
Keys are the frontend's: vLLM's full `mm_hash` in the plugin's scope (the
worker's 64-bit routing hashes never reach them). An image is named by its
encoded bytes, as `vllm serve` names it, so Dynamo frontends and `vllm
serve` API servers on one sidecar share items.
Misses travel by shared memory: with `DYNAMO_MM_TRANSFER=nixl` (workers on
other nodes) Dynamo's own transfer is left in place.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mmcache._errors import CacheMissError, DeadlineExceededError

if TYPE_CHECKING:
    from .runtime import SyncClient

__all__ = ["EXTRA_KEY", "TESTED_DYNAMO", "install"]

_LOGGER = logging.getLogger(__name__)

TESTED_DYNAMO = ("1.6.1",)
EXTRA_KEY = "mm_kwargs_mmcache"  # the request's extra_args entry of this transport
FRONTEND_MODULE = "dynamo.frontend.main"
WORKER_MODULE = "dynamo.vllm.main"
DYNAMO_CONNECTOR = "dynamo"  # the media connector name Dynamo's frontend sets


class MMCacheItem(BaseModel):  # type: ignore[misc]
    """One item of a request: its sidecar key (held there), or Dynamo's
    shared-memory segment of its serialised tensors (a miss)."""

    key: str | None = None
    shm_name: str | None = None
    shm_size: int = 0


class MMCacheTransferMetadata(BaseModel):  # type: ignore[misc]
    """`extra_args["mm_kwargs_mmcache"]`: the items in the request's order."""

    modality: str
    items: list[MMCacheItem]
    mm_hashes: list[str]  # the frontend's, as Dynamo's own metadata carries them


def install() -> None:
    """Hook the transport into this process's Dynamo frontend or worker (from
    the vLLM plugin's `register`); nothing where neither runs."""
    frontend, worker = FRONTEND_MODULE in sys.modules, WORKER_MODULE in sys.modules
    if not (frontend or worker):
        return
    try:
        version = importlib.metadata.version("ai-dynamo")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version not in TESTED_DYNAMO:
        _LOGGER.error(
            "mmcache: Dynamo %s is not a release mmcache's transport was tested with "
            "(tested: %s): Dynamo's own multimodal transfer is left in place",
            version,
            ", ".join(TESTED_DYNAMO),
        )
        return
    if frontend:
        _install_frontend()
    if worker:
        _install_worker()


# -- frontend ---------------------------------------------------------------


class _Leased:
    """A request's hits: their leases end with it."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys


def _release(sync: SyncClient, keys: list[str]) -> None:
    """End a request's leases in the background: never awaited on the response's
    path (the release is bounded by the client's deadline, and a lease not
    given back ends by itself)."""
    if keys:
        sync.submit(sync.client.release(keys))


def _install_frontend() -> None:
    import dynamo.common.multimodal.media_connector  # noqa: F401  (Dynamo's "dynamo" registered now)
    from dynamo.frontend import vllm_processor
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    from ._caches import MMCacheProcessorCache
    from ._media import MMCacheMediaConnector

    # The frontend loads media through the connector it registers as "dynamo"
    # (it sets VLLM_MEDIA_CONNECTOR=dynamo), which hands vLLM decoded images:
    # vLLM then names an image by its pixels, where `vllm serve` names it by
    # its encoded bytes, and the two never share an item. Registered after
    # Dynamo's (imported above, so its own registration is done), that name
    # now gives vLLM's connector decoding lazily, as `vllm serve` with the plugin has.
    MEDIA_CONNECTOR_REGISTRY.register(DYNAMO_CONNECTOR)(MMCacheMediaConnector)
    _patch_frontend(vllm_processor.VllmProcessor, _sender_class(), MMCacheProcessorCache)


def _sender_class() -> type:
    """Dynamo's frontend sender, sending hits as their sidecar keys."""
    from dynamo.common.multimodal.mm_kwargs_transfer import (
        MmKwargsSender,
        MmKwargsShmSender,
        encode_mm_kwargs_item,
    )

    from ._caches import MMCacheProcessorCache

    class MMCacheSender(MmKwargsSender):  # type: ignore[misc]
        """Hits as their sidecar keys, misses as Dynamo's shm sender sends them."""

        _nvtx_label = "mm_frontend:mmcache_sender_prepare"

        def __init__(self, cache: MMCacheProcessorCache) -> None:
            self._cache = cache
            self._inline = MmKwargsShmSender()

        async def prepare(
            self, mm_features: list[Any], modality: str = "image"
        ) -> tuple[dict[str, Any] | None, list[Any]]:
            if not mm_features:
                return None, []
            items: list[MMCacheItem] = []
            cleanup: list[Any] = []
            leased: list[str] = []
            for index, feature in enumerate(mm_features):
                if feature.data is None:  # a hit: the sidecar holds it, leased
                    key = self._cache.key(feature.mm_hash)
                    items.append(MMCacheItem(key=key))
                    leased.append(key)
                    continue
                segment, handle = await self._inline._encode_item(
                    index, encode_mm_kwargs_item(feature.data)
                )
                items.append(MMCacheItem(shm_name=segment.name, shm_size=segment.size))
                cleanup.append(handle)
            if leased:
                cleanup.append(_Leased(leased))
            hashes = [f.mm_hash for f in mm_features if f.mm_hash]
            metadata = MMCacheTransferMetadata(modality=modality, items=items, mm_hashes=hashes)
            return {EXTRA_KEY: metadata.model_dump()}, cleanup

        async def _encode_item(self, idx: int, serialized: bytes) -> Any:
            return await self._inline._encode_item(idx, serialized)

        def _assemble_extra_args(
            self, modality: str, encoded_items: list[Any], mm_hashes: list[str]
        ) -> dict[str, Any]:
            raise NotImplementedError("MMCacheSender.prepare assembles its own")

        async def cleanup(self, items: list[Any]) -> None:
            """After the response: the segments go, and the hits' leases end
            (whether the worker read them or processed the media instead)."""
            await self._inline.cleanup([i for i in items if not isinstance(i, _Leased)])
            keys = [key for i in items if isinstance(i, _Leased) for key in i.keys]
            _release(self._cache.sync, keys)

    return MMCacheSender


def _patch_frontend(processor: Any, sender: type, cache_type: type[Any]) -> None:
    """Dynamo's frontend processor sends through `sender` when vLLM's cache is mmcache's."""
    original_init = processor.__init__
    original_prepare = processor._prepare_mm_routing

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        renderer = getattr(self.input_processor, "renderer", None)
        cache = getattr(renderer, "mm_processor_cache", None)
        if isinstance(cache, cache_type) and self.nixl_mm_enabled:
            if self.use_shm_transfer:
                cache.hits_as_keys()  # the worker reads them from its sidecar
                self._sender = sender(cache)
                _LOGGER.info("mmcache: Dynamo's multimodal transport is mmcache")
            else:
                _LOGGER.info("mmcache: DYNAMO_MM_TRANSFER is not shm: Dynamo's NIXL stays")

    async def _prepare_mm_routing(self: Any, *args: Any, **kwargs: Any) -> Any:
        info, cleanup, transferred = await original_prepare(self, *args, **kwargs)
        if isinstance(self._sender, sender):
            transferred = False  # the media go too: a worker-side miss processes them
        return info, cleanup, transferred

    processor.__init__ = __init__
    processor._prepare_mm_routing = _prepare_mm_routing


# -- worker -----------------------------------------------------------------


def _install_worker() -> None:
    from dynamo.vllm.multimodal_utils import request_processor

    _patch_worker(request_processor, _receiver_class())


def _receiver_class() -> type:
    """Dynamo's worker receiver, reading held items from this worker's sidecar."""
    from dynamo.common.multimodal.mm_kwargs_transfer import (
        MmKwargsReceiver,
        MmKwargsShmItem,
        MmKwargsShmReceiver,
        MmKwargsShmTransferMetadata,
    )

    from ._settings import Settings
    from .convert import to_vllm
    from .runtime import process_client

    settings = Settings.from_env()  # this worker's, read once: not per request

    class MMCacheReceiver(MmKwargsReceiver):  # type: ignore[misc]
        """The items: held ones fetched (`fetch`, before Dynamo's receive path,
        so that a miss falls back with one line and no traceback), inline ones
        from their segments; in the request's order."""

        _nvtx_label = "mm_backend:mmcache_receiver_read"

        def __init__(self, fetched: list[Any]) -> None:
            self._fetched = fetched

        @staticmethod
        async def fetch(metadata: MMCacheTransferMetadata) -> list[Any]:
            """The held items, in one fetch from this worker's sidecar; raises
            (CacheMissError, unavailable, timed out) when it cannot give them all."""
            keys = [item.key for item in metadata.items if item.key]
            if not keys:
                return []
            sync = process_client(settings)
            # No wait for a sidecar that is not there: the media are processed instead.
            fetched: list[Any] = await sync.wait(sync.client.fetch(keys, release=False, wait=False))
            return fetched

        async def _receive(self, metadata: Any) -> dict[str, Any]:
            assert isinstance(metadata, MMCacheTransferMetadata)
            fetched = self._fetched
            segments = [
                MmKwargsShmItem(name=item.shm_name, size=item.shm_size)
                for item in metadata.items
                if not item.key
            ]
            inline: list[Any] = []
            if segments:
                read = await MmKwargsShmReceiver().receive(
                    MmKwargsShmTransferMetadata(
                        modality=metadata.modality, items=segments, mm_hashes=[]
                    )
                )
                inline = list(read.get("__pickled_kwargs_item__", []))
            held, sent = iter(fetched), iter(inline)
            items = [to_vllm(next(held)) if item.key else next(sent) for item in metadata.items]
            return {"__pickled_kwargs_item__": items}

    return MMCacheReceiver


def _why(exc: BaseException) -> str:
    """A worker-side miss's reason, for its one log line."""
    if isinstance(exc, CacheMissError):
        return f"this worker's sidecar lacks {len(exc.missing_hashes)} of the request's items"
    if isinstance(exc, TimeoutError | DeadlineExceededError):
        return "this worker's sidecar did not answer within the deadline (MMCACHE_DEADLINE_S)"
    return f"the transfer could not be read ({type(exc).__name__}: {exc})"


def _patch_worker(request_processor: Any, receiver: type) -> None:
    """Dynamo's worker receives mmcache's transfers through `receiver`."""
    from vllm.multimodal.inputs import MultiModalKwargsItem

    from ._caches import already_shared

    processor = request_processor.VllmMultimodalRequestProcessor
    original_receive = processor.try_receive_mm_kwargs
    original_decode = request_processor.decode_mm_kwargs_item

    async def try_receive_mm_kwargs(self: Any, request: dict[str, Any]) -> Any:
        extra_args = request.get("extra_args") or {}
        raw = extra_args.get(EXTRA_KEY)
        if not raw:
            return await original_receive(self, request)
        try:
            metadata = MMCacheTransferMetadata.model_validate(raw)
            fetched = await receiver.fetch(metadata)  # type: ignore[attr-defined]
        except Exception as exc:  # expected (an evicted item, a sidecar down): one line
            log = _LOGGER.info if isinstance(exc, CacheMissError) else _LOGGER.warning
            log("mmcache: %s; the media are processed here, as Dynamo alone does", _why(exc))
            return None
        # Items the frontend uploaded or the sidecar gave: vLLM's cache
        # here takes them (inject_into_mm_cache) without uploading them again.
        with already_shared():
            return await self._receive_mm_kwargs(extra_args, "mmcache", receiver(fetched), metadata)

    def decode_mm_kwargs_item(payload: Any) -> Any:
        # A fetched item is a vLLM item already: not encoded and decoded again.
        return payload if isinstance(payload, MultiModalKwargsItem) else original_decode(payload)

    processor.try_receive_mm_kwargs = try_receive_mm_kwargs
    request_processor.decode_mm_kwargs_item = decode_mm_kwargs_item
