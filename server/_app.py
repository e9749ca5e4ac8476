"""The server process: gRPC (cache, health, reflection), /metrics, shutdown.

Lifecycle, as grpc's own aio examples do it: health turns SERVING once every
service is registered and the port is bound; on SIGTERM or SIGINT it turns
NOT_SERVING, the server stops taking calls, calls in flight get `grace_s` to
finish, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import uuid
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from mmcache import __version__
from mmcache._encoder import EncoderBooks
from mmcache._frames import KEEPALIVE_MS, MAX_MESSAGE_BYTES
from mmcache._memory import keep_freed_memory
from mmcache.metrics import (
    CacheMetrics,
    EncoderBookCollector,
    GrpcServerMetrics,
    MetricsEndpoint,
    StoreGauges,
    register_build_info,
)

from ._config import ServerConfig
from ._encoder_servicer import ENCODER_SERVICE_NAME, EncoderServicer
from ._feed import Feed
from ._inflight import InflightBudget
from ._servicer import SERVICE_NAME, CacheServicer
from ._store import ItemStore

__all__ = ["MMCacheServer", "serve"]

_LOGGER = logging.getLogger(__name__)

GRPC_OPTIONS = (
    # A second server on the same port must fail to bind, not share it.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Clients keep their feed streams alive with pings (mmcache._frames).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
)


class MMCacheServer:
    """An mmcache server; `async with MMCacheServer(config) as server:` runs one.

    Ports given as 0 are chosen free; `port` and `metrics_port` tell which.
    """

    def __init__(self, config: ServerConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.instance_id = uuid.uuid4().hex
        self.registry = CollectorRegistry() if registry is None else registry
        self.metrics = CacheMetrics(self.registry)
        self.feed = Feed(
            self.instance_id,
            lambda: self.store.state(self._cache.pending),
            ring_bytes=config.feed_buffer_bytes,
            on_snapshot=lambda reason: self.metrics.feed_snapshots.labels(reason).inc(),
        )
        self.store = ItemStore(
            config.capacity_bytes,
            max_items=config.item_bound,
            lease_s=config.lease_s,
            on_evict=self.metrics.evicted,
            on_change=self.feed.emit,
            on_expire=self.metrics.lease_expiries.inc,
        )
        self.inflight = InflightBudget(config.max_inflight_bytes)
        self._cache = CacheServicer(
            self.store, self.inflight, self.metrics, self.feed, self.instance_id, __version__
        )
        self.registry.register(
            StoreGauges(
                items=lambda: len(self.store),
                stored_bytes=lambda: self.store.used,
                capacity_bytes=lambda: self.store.capacity,
                max_items=lambda: self.store.max_items,
                inflight_bytes=lambda: self.inflight.used,
                leases=lambda: self.store.leases,
                leased_bytes=lambda: self.store.leased_bytes,
                feed_subscribers=lambda: self.feed.subscribers,
            )
        )
        self.books = EncoderBooks()
        self.registry.register(EncoderBookCollector(self.books.stats))
        register_build_info(self.registry, __version__)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._endpoint: MetricsEndpoint | None = None
        self.port = 0
        self.metrics_port = 0

    @property
    def service_names(self) -> list[str]:
        return [SERVICE_NAME, ENCODER_SERVICE_NAME]

    async def start(self) -> None:
        server = grpc.aio.server(
            interceptors=[GrpcServerMetrics(self.registry)], options=GRPC_OPTIONS
        )
        encoder = EncoderServicer(self.books, self.instance_id)
        server.add_generic_rpc_handlers((self._cache.handler(), encoder.handler()))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        if self.config.reflection:
            reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
        address = f"{self.config.host}:{self.config.port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot serve gRPC on {address}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot serve gRPC on {address}: the port is taken or unusable")
        metrics_host = self.config.metrics_host or self.config.host
        try:
            self._endpoint = MetricsEndpoint(self.registry, metrics_host, self.config.metrics_port)
        except OSError as exc:
            raise OSError(
                f"cannot serve /metrics on {metrics_host}:{self.config.metrics_port}: {exc}"
            ) from None
        self.metrics_port = self._endpoint.port
        await server.start()
        self._server = server
        self._expiry = asyncio.create_task(self._expire_leases())
        for name in ("", *names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if not _is_loopback(self.config.host):
            _LOGGER.warning(
                "mmcache serves gRPC on %s:%d with neither TLS nor client authentication: any "
                "client that reaches this address can write items under any hash, clear the "
                "cache and read every item. For a sidecar, bind to 127.0.0.1 (--host); "
                "otherwise let only the engine's own clients reach the port (e.g. a "
                "Kubernetes NetworkPolicy).",
                self.config.host,
                self.port,
            )
        _LOGGER.info(
            "mmcache %s serving gRPC on %s:%d, metrics on %s:%d/metrics; capacity %d bytes, "
            "at most %d items, leases of %gs; instance %s",
            __version__,
            self.config.host,
            self.port,
            metrics_host,
            self.metrics_port,
            self.store.capacity,
            self.store.max_items,
            self.config.lease_s,
            self.instance_id,
        )

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, then stop taking calls and give those in flight `grace` seconds."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._server is not None:
            await self.health.enter_graceful_shutdown()
            await self._server.stop(self.config.grace_s if grace is None else grace)
            self._server = None
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    async def _expire_leases(self) -> None:
        # Calls expire leases as they come; this covers a server with none.
        interval = min(1.0, self.config.lease_s / 10)
        while True:
            await asyncio.sleep(interval)
            self.store.expire()

    async def __aenter__(self) -> MMCacheServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(grace=0)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; the process's exit status."""
    keep_freed_memory()
    server = MMCacheServer(config)
    try:
        await server.start()
    except OSError as exc:
        _LOGGER.error("%s", exc)
        await server.stop(grace=0)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    _LOGGER.info("shutting down: NOT_SERVING, %.1fs for calls in flight", config.grace_s)
    await server.stop()
    _LOGGER.info("stopped")
    return 0
