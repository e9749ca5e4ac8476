"""The server process: gRPC (cache, health, reflection), /metrics, shutdown.

Lifecycle, as grpc's own aio examples do it: health turns SERVING once every
service is registered and the port is bound; on SIGTERM or SIGINT it turns
NOT_SERVING, feed subscriptions end, the server stops taking calls, calls in
flight get `grace_s` to finish, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import uuid
from collections.abc import Callable
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from mmcache import __version__
from mmcache._encoder import EncoderBooks
from mmcache._errors import MMCacheError
from mmcache._frames import KEEPALIVE_MS, MAX_MESSAGE_BYTES
from mmcache._memory import keep_freed_memory
from mmcache.metrics import (
    EncoderBookCollector,
    GrpcServerMetrics,
    MetricsEndpoint,
    StoreGauges,
    register_build_info,
)

from ._auth import AuthInterceptor, Metadata, TokenBook, check_call
from ._cache_config import cache_config
from ._config import ConfigError, EventsConfig, ServerConfig, TlsConfig, is_loopback
from ._encoder_servicer import ENCODER_SERVICE_NAME, EncoderServicer
from ._events import ItemEvents
from ._feed import Feed
from ._namespaces import Namespaces
from ._servicer import SERVICE_NAME, SESSION_METHOD, CacheServicer
from ._session_calls import SessionCalls
from ._sessions import Sessions
from ._standard import HEALTH_SERVICE_NAME, health_handler, reflection_handler
from .cache import CacheStats, ItemCache, open_cache

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
        self.cache = cache = open_cache(cache_config(config, self.instance_id), self.registry)
        self.namespaces = Namespaces(
            self.instance_id,
            cache.feed_state,
            lambda: cache.pending,
            max_namespaces=config.max_namespaces,
            ring_bytes=config.feed_buffer_bytes,
            on_snapshot=lambda reason: cache.metrics.feed_snapshots.labels(reason).inc(),
        )
        cache.changes.subscribe(self.namespaces.changed)
        self.sessions = Sessions(config.max_sessions)
        self.events = _item_events(config.events, self.instance_id)
        if self.events is not None:
            cache.changes.subscribe(self.events.changed)
        self._book: TokenBook | None = None  # made at start, when tokens are configured
        self._grpc_metrics = GrpcServerMetrics(self.registry, per_request=[SESSION_METHOD])
        session_calls = SessionCalls(
            self.sessions,
            self._grpc_metrics.requests(SESSION_METHOD),
            authorize=self._check_session_batch,
        )
        self._servicer = CacheServicer(
            cache,
            self.namespaces,
            self.instance_id,
            session_calls,
            may_upload=lambda metadata: self._check_session_batch(metadata) is None,
        )
        self.registry.register(_gauges(cache, self.namespaces, self.sessions))
        self.books = EncoderBooks()
        self.registry.register(EncoderBookCollector(self.books.stats))
        register_build_info(self.registry, __version__)
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._endpoint: MetricsEndpoint | None = None
        self._opened: contextlib.AsyncExitStack | None = None  # what `stop` closes
        self.port = 0
        self.metrics_port = 0
        self.health_port = 0

    @property
    def feed(self) -> Feed:
        """The default namespace's mirror feed."""
        return self.namespaces.default.feed

    @property
    def service_names(self) -> list[str]:
        return [SERVICE_NAME, ENCODER_SERVICE_NAME]

    async def start(self) -> None:
        """Bind every port and serve; OSError or ConfigError (with the fix) when it
        cannot, with what it had opened closed again."""
        config = self.config
        async with contextlib.AsyncExitStack() as opened:
            server, names = self._grpc_server()
            self._server = server
            opened.push_async_callback(self._stop_serving, 0.0)  # a no-op once stopped
            self.port = _bind(server, config.host, config.port, _server_credentials(config.tls))
            if config.health_port is not None:
                # Plaintext, health only: for probes that cannot speak TLS or send tokens.
                self._health_server = grpc.aio.server(options=GRPC_OPTIONS)
                self._health_server.add_generic_rpc_handlers(
                    [health_handler(self.health, self.instance_id)]
                )
                self.health_port = _bind(self._health_server, config.host, config.health_port, None)
            self._endpoint = _metrics_endpoint(self.registry, config)
            opened.callback(self._endpoint.close)
            self.metrics_port = self._endpoint.port
            if self.events is not None:  # stopped after the cache: the tier's writes are events
                self.events.start()
                opened.push_async_callback(self.events.stop)
            self.sessions.start()
            await opened.enter_async_context(self.cache)  # its region, L2 tier and timers
            opened.push_async_callback(self._servicer.aclose)  # posted uploads, before the cache
            self._warn_if_tenants_share_the_region()
            await server.start()
            if self._health_server is not None:
                await self._health_server.start()
            for name in ("", *names):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._opened = opened.pop_all()
        self._log_serving()

    def _grpc_server(self) -> tuple[grpc.aio.Server, list[str]]:
        """The main gRPC server with every handler (not bound), and the services' names."""
        config = self.config
        interceptors: list[grpc.aio.ServerInterceptor] = [self._grpc_metrics]
        if config.authenticates:
            self._book = TokenBook(config.tokens_file, config.tokens)
            interceptors.append(AuthInterceptor(self._book, self.instance_id))
        server = grpc.aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
        names = [*self.service_names, HEALTH_SERVICE_NAME]
        handlers = [
            self._servicer.handler(),
            EncoderServicer(self.books, self.instance_id).handler(),
            health_handler(self.health, self.instance_id),
        ]
        if config.reflection:
            handlers.append(reflection_handler([*names, reflection.SERVICE_NAME], self.instance_id))
        server.add_generic_rpc_handlers(handlers)
        return server, names

    def _warn_if_tenants_share_the_region(self) -> None:
        shm = self.cache.stats(drain=False).shm
        if shm is None or self._book is None or not self._book.limits_namespaces:
            return
        _LOGGER.warning(
            "tokens keep namespaces apart on gRPC, but the shared-memory region %s is "
            "one file: every process that can open it (its owner, and group with "
            "--shm-group) can read and overwrite the items in it, whatever its token. For "
            "tenants that must not see each other, give each its own sidecar or run "
            "with --no-shm.",
            shm.path,
        )

    def _log_serving(self) -> None:
        config = self.config
        risk = _exposure_risk(config)
        if risk:
            _LOGGER.warning("mmcache serves gRPC on %s:%d %s", config.host, self.port, risk)
        _LOGGER.info(
            "mmcache %s serving gRPC on %s:%d (%s), metrics on %s:%d/metrics; capacity %d "
            "bytes, at most %d items, leases of %gs; instance %s",
            __version__,
            config.host,
            self.port,
            _security_summary(config),
            config.metrics_host or config.host,
            self.metrics_port,
            config.capacity_bytes,
            config.item_bound,
            config.lease_s,
            self.instance_id,
        )

    def _check_session_batch(self, metadata: Metadata) -> MMCacheError | None:
        """Why an upload session's next batch may not proceed (its token, checked
        again: one revoked since the session opened stops working now)."""
        return None if self._book is None else check_call(self._book, SESSION_METHOD, metadata)

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, then stop taking calls and give those in flight `grace`
        seconds; then close what `start` opened, in the reverse order."""
        opened, self._opened = self._opened, None
        if opened is None:
            return
        await self.health.enter_graceful_shutdown()
        self.sessions.stop()  # those waiting for a batch end now, the others after theirs
        # Feed streams never end on their own: end them now, or every follower
        # would hold the stop for the whole grace and then be cancelled (which
        # grpc logs as an error).
        self.namespaces.close()
        await self._stop_serving(self.config.grace_s if grace is None else grace)
        await opened.aclose()

    async def _stop_serving(self, grace: float) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None

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


def _gauges(cache: ItemCache, namespaces: Namespaces, sessions: Sessions) -> StoreGauges:
    """The store's gauges, read from the cache's stats at each scrape."""

    def now() -> CacheStats:
        return cache.stats(drain=False)

    return StoreGauges(
        items=lambda: now().items,
        stored_bytes=lambda: now().used,
        capacity_bytes=lambda: now().capacity,
        max_items=lambda: now().max_items,
        inflight_bytes=lambda: now().inflight_bytes,
        leases=lambda: now().leases,
        leased_bytes=lambda: now().leased_bytes,
        feed_subscribers=lambda: namespaces.subscribers,
        namespaces=lambda: len(namespaces),
        upload_sessions=lambda: sessions.live,
        shm_leased_bytes=lambda: now().shm_leased_bytes,
        shm_resident_bytes=lambda: now().shm_resident_bytes,
        shm_transient_bytes=lambda: now().shm_transient_bytes,
        shm_reserve_bytes=lambda: now().shm_reserve_bytes,
    )


def _item_events(config: EventsConfig | None, instance_id: str) -> ItemEvents | None:
    """The item events for routers, when --events-endpoint names where."""
    if config is None:
        return None
    return ItemEvents(config.endpoint, config.replay_endpoint, config.topic, instance_id)


def _metrics_endpoint(registry: CollectorRegistry, config: ServerConfig) -> MetricsEndpoint:
    """/metrics served; OSError with the fix when its port is taken."""
    host = config.metrics_host or config.host
    try:
        return MetricsEndpoint(registry, host, config.metrics_port)
    except OSError as exc:
        taken = exc.errno == errno.EADDRINUSE
        raise OSError(
            f"port {config.metrics_port} on {host} (/metrics) is in use by another "
            "process: stop it, or choose another port (--metrics-port, or 0 for a free one)"
            if taken
            else f"cannot serve /metrics on {host}:{config.metrics_port}: {exc}"
        ) from None


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _server_credentials(config: TlsConfig | None) -> grpc.ServerCredentials | None:
    if config is None:
        return None
    chain = _read(config.cert, "TLS certificate (--tls-cert)")
    key = _read(config.key, "TLS key (--tls-key)")
    client_ca = None
    if config.client_ca is not None:
        client_ca = _read(config.client_ca, "client CA file (--tls-client-ca)")
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    address = f"{host}:{port}"
    _check_free(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot serve gRPC on {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot serve gRPC on {address}: the port is taken or unusable")
    return bound


def _check_free(host: str, port: int) -> None:
    """Say a taken port plainly, before gRPC tries it: gRPC binds with
    SO_REUSEPORT (so a second mmcache on the port would share its calls) and
    logs a raw C-core line when the bind fails."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(
            f"cannot serve gRPC on {host}:{port}: {host!r} does not resolve ({exc})"
        ) from None
    for family, kind, proto, _, where in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return  # gRPC says what else is wrong
                raise OSError(
                    f"port {port} on {host} is in use by another process: stop it, or "
                    f"choose another port (--port, or 0 for a free one)"
                ) from None


def _security_summary(config: ServerConfig) -> str:
    transport = "plaintext" if config.tls is None else "mTLS" if config.verifies_clients else "TLS"
    return f"{transport}, {'tokens' if config.authenticates else 'no tokens'}"


def _exposure_risk(config: ServerConfig) -> str:
    """What an address beyond loopback exposes with these settings ("" when nothing)."""
    if is_loopback(config.host):
        return ""
    if config.tls is None and not config.authenticates:
        return (
            "with neither TLS nor tokens: any client that reaches this address can write "
            "items under any hash (deciding what engines see), clear the cache and read every "
            "item. Give --tokens-file and --tls-cert/--tls-key, or bind a sidecar to "
            "127.0.0.1 (--host)."
        )
    if config.tls is None:
        return (
            "without TLS: tokens and items cross the network unencrypted, so anyone on the "
            "path can read a token and use it. Give --tls-cert and --tls-key."
        )
    if not config.authenticates and not config.verifies_clients:
        return (
            "with TLS but neither tokens nor client certificates: any client that reaches "
            "this address may call every method. Give --tokens-file or --tls-client-ca."
        )
    return ""


async def serve(config: ServerConfig, stop_requested: Callable[[], bool] = lambda: False) -> int:
    """Run until SIGTERM or SIGINT; the process's exit status. The handlers are
    in place before the server starts, and a signal `stop_requested` says came
    even earlier stops it too: a stop is never lost, whenever it comes."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stop_requested():
        stop.set()
    keep_freed_memory()
    server = MMCacheServer(config)
    try:
        await server.start()
    except (OSError, ConfigError) as exc:
        _LOGGER.error("%s", exc)
        await server.stop(grace=0)
        return 2
    await stop.wait()
    _LOGGER.info("shutting down: NOT_SERVING, %.1fs for calls in flight", config.grace_s)
    await server.stop()
    _LOGGER.info("stopped")
    return 0
