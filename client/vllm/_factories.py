"""vLLM's cache factories, replaced: P0's and P1's caches on the sidecar.

`register` (the package's entry point) installs these in place of
`processor_cache_from_config` (P0: each API server) and
`engine_receiver_cache_from_config` (P1: the engine core), also in the
modules that imported them by name, so every API process gets a cache backed
by the shared sidecar, where vLLM would have built its own or fallen back to
"processor_only".
"""

from __future__ import annotations

from typing import Any

from ._keys import scope_of
from ._settings import Settings
from .runtime import process_client

__all__ = [
    "engine_receiver_cache_from_config",
    "install_factories",
    "processor_cache_from_config",
]

# With single flight, P0 asks the sidecar about every image its own cache
# lacks, whatever its mirror says, leases resident ones in the shared memory
# by their hash, and claims the rest: a mirror up to this far behind loses
# no hit (at most a re-send), while every feed message would wake this API
# process (docs/vllm.md).
SINGLE_FLIGHT_FEED_GAP_S = 0.25


def install_factories() -> None:
    """vLLM builds its multimodal caches with the factories below."""
    import vllm.multimodal.cache as cache_package
    import vllm.multimodal.cache.factories as factories
    import vllm.renderers.base as renderers
    import vllm.v1.engine.core as engine_core

    # The factories, and the modules that imported them by name.
    for module in (factories, cache_package, renderers):
        module.processor_cache_from_config = processor_cache_from_config
    for module in (factories, cache_package, engine_core):
        module.engine_receiver_cache_from_config = engine_receiver_cache_from_config


def _caching_enabled(vllm_config: Any) -> bool:
    model = vllm_config.model_config
    return bool(
        model.supports_multimodal_inputs and model.get_multimodal_config().mm_processor_cache_gb > 0
    )


def processor_cache_from_config(vllm_config: Any) -> Any:
    """P0's cache: mmcache's, wherever vLLM would build one or fall back."""
    if not _caching_enabled(vllm_config):
        return None
    from ._caches import MMCacheProcessorCache
    from ._digests import input_shape, is_digest
    from ._small import no_shape

    settings = Settings.from_env()
    model = str(getattr(getattr(vllm_config, "model_config", None), "model", "") or "")
    scope = scope_of(vllm_config, settings.namespace)
    _said_active("the multimodal processor cache is the sidecar", settings, scope)
    # Beside the sidecar, the cache vLLM alone would keep, of the same memory (_local.py).
    multimodal = vllm_config.model_config.get_multimodal_config()
    algorithm = str(getattr(multimodal, "mm_hasher_algorithm", "blake3"))
    single_flight = settings.single_flight
    if single_flight is None:  # on where several API processes share the sidecar
        parallel = getattr(vllm_config, "parallel_config", None)
        single_flight = int(getattr(parallel, "_api_process_count", 1) or 1) > 1
    return MMCacheProcessorCache(
        process_client(settings, feed_gap_s=SINGLE_FLIGHT_FEED_GAP_S if single_flight else 0.0),
        scope,
        model,
        multimodal.mm_processor_cache_gb,
        shareable=lambda mm_hash: is_digest(mm_hash, algorithm),  # not a client's uuid
        single_flight=single_flight,
        shape_of=no_shape if settings.share_small else input_shape,
        share_kept=settings.share_small is not False,  # off: kept ones not uploaded
    )


def engine_receiver_cache_from_config(vllm_config: Any) -> Any:
    """P1's cache: reads through to mmcache."""
    if not _caching_enabled(vllm_config):
        return None
    from ._receiver import MMCacheReceiverCache

    settings = Settings.from_env()
    scope = scope_of(vllm_config, settings.namespace)
    _said_active("the engine reads its multimodal items from the sidecar", settings, scope)
    # It reads (the region, or `fetch`) and never asks the mirror: no feed.
    return MMCacheReceiverCache(
        process_client(settings, follow=False), scope, _engine_lru(vllm_config)
    )


def _engine_lru(vllm_config: Any) -> Any:
    """vLLM alone's engine LRU where vLLM alone's engine keeps one (its `lru`
    cache type: one API server, no internal data parallelism), by vLLM's own
    rule; else None (_receiver.py)."""
    from vllm.multimodal.cache import factories
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

    cache_type = getattr(factories, "_get_cache_type", lambda config: None)
    if cache_type(vllm_config) != "lru":
        return None
    return LruKeyReplicatedReceiverCache(vllm_config.model_config)


def _said_active(what: str, settings: Settings, scope: str) -> None:
    """One INFO line per process and cache, through vLLM's logger (its lines
    name the process): what is mmcache's, where, and under which key scope."""
    from vllm.logger import init_logger

    init_logger("vllm.mmcache").info(
        "mmcache: %s at %s, key scope %s", what, settings.target, scope
    )
