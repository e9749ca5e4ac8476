"""The client's channels: their options, and what a client presents to a
server on them (TLS credentials, a token, a namespace).

The token and the namespace travel as metadata on every call of the
client's channel (an interceptor adds them), so the encoder client and any
caller of `MMCacheClient.channel` carry them too.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from mmcache._errors import InvalidArgumentError
from mmcache._frames import KEEPALIVE_MS, MAX_MESSAGE_BYTES
from mmcache._spec import NAMESPACE_KEY, check_namespace

__all__ = ["CHANNEL_OPTIONS", "Tls", "connect", "metadata_interceptors", "open_channel"]

_LOGGER = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"

Metadata = tuple[tuple[str, str], ...]

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # The feed is a stream that may carry nothing for minutes: pings find a
    # server host that vanished without closing the connection, so the mirror
    # stops trusting a dead feed within ~30 s (the server allows this rate).
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted sidecar is back within seconds: reconnect within 2 s, not
    # grpc's default of up to 120 s, which would keep a failing-open client
    # (whose calls do not wait for the channel) off its cache that long.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Tls:
    """How a client verifies its server, and proves itself when asked (mTLS).

        Tls(ca="/etc/mmcache/tls/ca.crt")  # verify the server against this CA
        Tls(ca="ca.crt", cert="client.crt", key="client.key")  # and present these
        Tls()  # the system's CAs
        Tls(credentials=grpc.ssl_channel_credentials(...))  # built by the caller

    `server_name` checks the server's certificate against that name instead of
    the target's host (a server reached by IP, or through a proxy). PEM files
    are read when the client is made: a missing one fails then.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None
    credentials: grpc.ChannelCredentials | None = None

    def __post_init__(self) -> None:
        if self.credentials is not None and (self.ca or self.cert or self.key):
            raise InvalidArgumentError("give Tls credentials= or the PEM file paths, not both")
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError("Tls cert and key go together (the client's mTLS pair)")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The channel's credentials: given ones, or read from the PEM files."""
        if self.credentials is not None:
            return self.credentials
        return grpc.ssl_channel_credentials(
            root_certificates=None if self.ca is None else _read(self.ca, "CA file (Tls ca)"),
            private_key=None if self.key is None else _read(self.key, "key file (Tls key)"),
            certificate_chain=None
            if self.cert is None
            else _read(self.cert, "certificate (Tls cert)"),
        )

    def channel_options(self) -> tuple[tuple[str, Any], ...]:
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)


def _with(details: grpc.aio.ClientCallDetails, extra: Metadata) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, extra: Metadata) -> None:
        self._extra = extra

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with(details, self._extra), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, extra: Metadata) -> None:
        self._extra = extra

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with(details, self._extra), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, extra: Metadata) -> None:
        self._extra = extra

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with(details, self._extra), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, extra: Metadata) -> None:
        self._extra = extra

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with(details, self._extra), requests)


def metadata_interceptors(token: str | None, namespace: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the token and namespace to every call; none when neither is set."""
    check_namespace(namespace)
    extra: list[tuple[str, str]] = []
    if token:
        if not token.isascii() or not token.isprintable() or token != token.strip():
            raise InvalidArgumentError("a token is printable ASCII without surrounding spaces")
        extra.append((AUTHORIZATION_KEY, f"Bearer {token}"))
    if namespace:
        extra.append((NAMESPACE_KEY, namespace))
    if not extra:
        return []  # no interceptor: no cost on the plain path
    fixed = tuple(extra)
    return [_UnaryUnary(fixed), _UnaryStream(fixed), _StreamUnary(fixed), _StreamStream(fixed)]


def _is_local(target: str) -> bool:
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 else target
    host = host.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if host in ("localhost", "") or target.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[grpc.aio.ClientInterceptor],
    token: str | None,
) -> grpc.aio.Channel:
    """A channel to `target`: TLS when there are credentials, else plaintext."""
    if credentials is None:
        if token and not _is_local(target):
            _LOGGER.warning(
                "mmcache client sends its token to %s without TLS: anyone on the network path "
                "can read it (give tls=Tls(ca=...))",
                target,
            )
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


def connect(
    target: str,
    *,
    tls: Tls | None = None,
    token: str | None = None,
    namespace: str = "",
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to `target` with the client's options (then `options`), `tls`'s
    credentials (plaintext without), and `token` and `namespace` on every call."""
    named = () if tls is None else tls.channel_options()
    return open_channel(
        target,
        None if tls is None else tls.channel_credentials(),
        (*CHANNEL_OPTIONS, *named, *options),
        metadata_interceptors(token, namespace),
        token,
    )
