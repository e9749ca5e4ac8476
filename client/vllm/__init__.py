"""mmcache inside vLLM: the processor-cache plugin and the EC connector.

The EC connector is `mmcache.client.vllm.connector.MMCacheECConnector`
(connector.py: a facade over a scheduler part and a worker part); it is not
imported here: the plugin's entry point, loaded in every vLLM process, needs
none of it.

The plugin is a `vllm.general_plugins` plugin. Installed with mmcache (entry
point `mmcache`, `register` here), it does nothing unless
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

Settings, from the environment (_settings.py reads them, for the EC connector too):

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
two models on one sidecar never share items (_keys.py).

The modules: runtime (public: the one bridge from vLLM's threads to the
client, SyncClient, one per process and target, and its bounded background
calls), _factories (vLLM's cache factories, replaced), _caches (P0's cache, an
adapter over _p0_lookup, _p0_sharing, _ledger, _updates and _p0_releases),
_receiver (P1's), convert (public: vLLM's items to mmcache's and back), _local
(the cache vLLM alone would keep, in each API process), _costs and _metrics
(the processor's time; the plugin's counters), _media (a hit skips the decode),
_naming (one model named alike wherever it is loaded from), _releases (the
vLLM releases tested); the EC connector's: connector, _ec_scheduler,
_ec_worker, _ec_metadata, _ec_metrics, _staging; dynamo (NVIDIA Dynamo's
transport, installed by `register`). _settings reads the settings of all,
_keys makes the keys of all.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ._keys import ec_scope_of, scope_of, scoped_key
from ._settings import ECSettings, Settings

if TYPE_CHECKING:
    from .runtime import SyncClient

__all__ = [
    "ECSettings",
    "Settings",
    "client_for",
    "ec_scope_of",
    "register",
    "scope_of",
    "scoped_key",
]

_LOGGER = logging.getLogger(__name__)


def client_for(settings: Settings | None = None) -> SyncClient:
    """This process's SyncClient of the sidecar (default: the environment's
    settings), one per process and target."""
    from .runtime import process_client

    return process_client(Settings.from_env() if settings is None else settings)


def register() -> None:
    """The `vllm.general_plugins` entry point: the EC connector's name
    registered with vLLM (it has settings of its own); the rest inert unless
    MMCACHE_TARGET is set."""
    from ._ec_name import register_ec_connector

    register_ec_connector()
    settings = Settings.from_env()
    if not settings.target:
        return
    import vllm
    from vllm.logger import init_logger

    from ._releases import PLUGIN_RELEASES, refusal

    why = refusal(
        "mmcache's vLLM plugin", str(vllm.__version__), PLUGIN_RELEASES, settings.untested
    )
    if why is not None:
        # Through vLLM's logger: its lines name the process.
        init_logger("vllm.mmcache").error("%s; it is off, vLLM runs with its own caches", why)
        return
    from ._digests import record_digests
    from ._factories import install_factories
    from ._media import CONNECTOR_NAME, register_connector
    from ._naming import name_models_by_content

    install_factories()
    if settings.metrics_port:  # a process with no /metrics of its own
        from ._metrics import serve_metrics

        serve_metrics(settings.metrics_port)
    # One model's items are named alike wherever it is loaded from (_naming.py).
    name_models_by_content()
    # Only what vLLM's hasher names is shared, never a client's uuid (_digests.py).
    record_digests()
    # A hit skips the image's decode (_media.py), unless another connector was chosen.
    if register_connector():
        os.environ.setdefault("VLLM_MEDIA_CONNECTOR", CONNECTOR_NAME)
    _LOGGER.info("mmcache: vLLM's multimodal cache is %s", settings.target)
    from .dynamo import install

    install()  # in NVIDIA Dynamo's frontend or worker: its multimodal transport
