"""mmcache as vLLM's multimodal processor cache: a `vllm.general_plugins` plugin.

Installed with mmcache (entry point `mmcache`), it does nothing unless
`MMCACHE_TARGET` names a server, so it can sit in every environment:

    MMCACHE_TARGET=127.0.0.1:50051 vllm serve MODEL --api-server-count 2 ...

vLLM loads general plugins in every process that builds a cache: each API
server (P0) and the engine core (P1). There the plugin replaces the factories
that build vLLM's caches (`processor_cache_from_config` on P0,
`engine_receiver_cache_from_config` on P1), so every API process gets a P0
cache backed by the shared server and the engine reads through to it, also
where vLLM would have fallen back to "processor_only" (several API servers,
internal-LB data parallelism). vLLM's own switch still applies:
`--mm-processor-cache-gb 0` turns caching off. vLLM 0.32's
`mm_processor_cache_type` is a closed choice, hence the variable. Tested on
vLLM 0.31 (NVIDIA Dynamo 1.6's pin, whose P0 never ends a request with
`release_sender_touches`), 0.32 and 0.33; on another release the plugin stays
off with an ERROR that says so (_releases.py; `MMCACHE_VLLM_UNTESTED=1` tries it).

Settings, from the environment:

- `MMCACHE_TARGET`: the server, `host:port` (unset: the plugin is inert);
- `MMCACHE_DEADLINE_S` (default 1.0): the longest wait for the cache per call;
  past it P0 treats the items as misses and sends them inline;
- `MMCACHE_NAMESPACE` (default empty): the server namespace the model's items
  live in (and mixed into every key's scope); a token may be limited to it;
- `MMCACHE_TOKEN`, or `MMCACHE_TOKEN_FILE` (a mounted Secret): the token sent
  (the API servers need role write, the engine read; one token with both);
- `MMCACHE_TLS_CA` (and `MMCACHE_TLS_CERT`, `MMCACHE_TLS_KEY` for mTLS,
  `MMCACHE_TLS_SERVER_NAME` when the certificate names another host): TLS;
- `MMCACHE_SHM` (default on): `0` keeps the items off the sidecar's
  shared-memory region (docs/shm.md), over gRPC.

A server that refuses the token or the TLS settings fails vLLM's start with
the server's reason: a misconfigured cache is loud, an unreachable one fails
open.

Keys are vLLM's own `mm_hash` (content-derived; vLLM prefixes LoRA requests'
identifiers), scoped by a digest of the model and its processor settings, so
two models on one sidecar never share items.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["client_for", "connection_settings", "ec_scope_of", "register", "scope_of"]

from ._metrics import plugin_metrics
from ._naming import model_identity

_LOGGER = logging.getLogger(__name__)

_lock = threading.Lock()
_process_clients: dict[str, Any] = {}  # this process's SyncClient per target, made on first use


def scope_of(vllm_config: Any) -> str:
    """The key scope of a model: a digest of what shapes its processed items."""
    model = vllm_config.model_config
    multimodal = model.get_multimodal_config()
    tokenizer = getattr(model, "tokenizer", None) or model.model
    return _digest(
        {
            "model": model_identity(str(model.model)),
            "revision": str(getattr(model, "revision", None)),
            "tokenizer": model_identity(str(tokenizer)),
            "mm_processor_kwargs": getattr(multimodal, "mm_processor_kwargs", None),
            # The digest vLLM names items with (blake3, sha256, sha512): keys
            # made under one are never read under another.
            "mm_hasher_algorithm": str(getattr(multimodal, "mm_hasher_algorithm", "blake3")),
            "hf_overrides": getattr(model, "hf_overrides", None),
            "namespace": os.environ.get("MMCACHE_NAMESPACE", ""),
        }
    )


def ec_scope_of(vllm_config: Any) -> str:
    """The key scope of a model's encoder outputs: what shapes its items, plus
    the weights (revision, config, quantization), the dtype the encoder runs in
    and vLLM's version."""
    import vllm

    model = vllm_config.model_config
    hf_config = getattr(model, "hf_config", None)
    return _digest(
        {
            "kind": "encoder_output",
            "processed": scope_of(vllm_config),
            # Fine-tunes share processing files, not encoders: the path too.
            "model": str(model.model),
            "dtype": str(getattr(model, "dtype", None)),
            "quantization": str(getattr(model, "quantization", None)),
            "code_revision": str(getattr(model, "code_revision", None)),
            # Two checkpoints served from one path differ here at least.
            "hf_config": hf_config.to_json_string() if hf_config is not None else None,
            "vllm": vllm.__version__,  # encoders change between versions
        }
    )


def _digest(described: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def client_for(target: str, deadline_s: float) -> Any:
    """This process's SyncClient of `target` (one per process and target)."""
    with _lock:
        client = _process_clients.get(target)
        if client is None:
            from ._sync import SyncClient

            client = _process_clients[target] = SyncClient(
                target,
                deadline_s=deadline_s,
                on_fail_open=plugin_metrics().fail_opens.inc,
                **connection_settings(os.environ),
            )
        return client


def _client() -> Any:
    return client_for(
        os.environ["MMCACHE_TARGET"], float(os.environ.get("MMCACHE_DEADLINE_S", "1.0"))
    )


def connection_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """MMCacheClient's namespace, token and TLS arguments, from the environment."""
    token = env.get("MMCACHE_TOKEN") or None
    token_file = env.get("MMCACHE_TOKEN_FILE")
    if token is None and token_file:
        with open(token_file, encoding="utf-8") as file:
            token = file.read().strip()
    return {
        "namespace": env.get("MMCACHE_NAMESPACE", ""),
        "token": token,
        "tls_ca": env.get("MMCACHE_TLS_CA") or None,
        "tls_cert": env.get("MMCACHE_TLS_CERT") or None,
        "tls_key": env.get("MMCACHE_TLS_KEY") or None,
        "tls_server_name": env.get("MMCACHE_TLS_SERVER_NAME") or None,
        "shm": env.get("MMCACHE_SHM", "on").strip().lower() not in ("0", "off", "false", "no"),
    }


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

    model = str(getattr(getattr(vllm_config, "model_config", None), "model", "") or "")
    scope = scope_of(vllm_config)
    _said_active("multimodal processor cache", scope)
    return MMCacheProcessorCache(_client(), scope, model)


def engine_receiver_cache_from_config(vllm_config: Any) -> Any:
    """P1's cache: reads through to mmcache."""
    if not _caching_enabled(vllm_config):
        return None
    from ._caches import MMCacheReceiverCache

    scope = scope_of(vllm_config)
    _said_active("engine's multimodal reads", scope)
    return MMCacheReceiverCache(_client(), scope)


def _said_active(what: str, scope: str) -> None:
    """One INFO line per process and cache, through vLLM's logger (its lines
    name the process): what is mmcache's, where, and under which key scope."""
    from vllm.logger import init_logger

    init_logger("vllm.mmcache").info(
        "mmcache: the %s is the sidecar at %s, key scope %s",
        what,
        os.environ["MMCACHE_TARGET"],
        scope,
    )


def register() -> None:
    """The `vllm.general_plugins` entry point: inert unless MMCACHE_TARGET is set."""
    if not os.environ.get("MMCACHE_TARGET"):
        return
    import vllm
    from vllm.logger import init_logger

    from ._releases import PLUGIN_RELEASES, refusal

    why = refusal("mmcache's vLLM plugin", str(vllm.__version__), PLUGIN_RELEASES, os.environ)
    if why is not None:
        # Through vLLM's logger: its lines name the process.
        init_logger("vllm.mmcache").error("%s; it is off, vLLM runs with its own caches", why)
        return
    import vllm.multimodal.cache as cache_package
    import vllm.multimodal.cache.factories as factories
    import vllm.renderers.base as renderers
    import vllm.v1.engine.core as engine_core

    # The factories, and the modules that imported them by name.
    for module in (factories, cache_package, renderers):
        module.processor_cache_from_config = processor_cache_from_config
    for module in (factories, cache_package, engine_core):
        module.engine_receiver_cache_from_config = engine_receiver_cache_from_config
    from ._media import CONNECTOR_NAME, register_connector
    from ._naming import name_models_by_content

    # One model's items are named alike wherever it is loaded from (_naming.py).
    name_models_by_content()
    # A hit skips the image's decode (_media.py), unless another connector was chosen.
    if register_connector():
        os.environ.setdefault("VLLM_MEDIA_CONNECTOR", CONNECTOR_NAME)
    _LOGGER.info("mmcache: vLLM's multimodal cache is %s", os.environ["MMCACHE_TARGET"])
    from ..dynamo import install

    install()  # in NVIDIA Dynamo's frontend or worker: its multimodal transport
