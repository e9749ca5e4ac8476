"""`mmcache health TARGET`: the probe a container's HEALTHCHECK runs."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2

__all__ = ["check"]

_CHECK = "/grpc.health.v1.Health/Check"


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


async def check(
    target: str,
    service: str = "",
    timeout: float = 3.0,
    *,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_server_name: str | None = None,
) -> int:
    """0 when `target` answers SERVING for `service`, 1 otherwise (with a reason on stderr).

    With `tls_ca` (and `tls_cert`/`tls_key` for a server that asks for a
    client certificate) it speaks TLS: the exec probe of a TLS server.
    """
    if tls_ca is None and tls_cert is None:
        channel = grpc.aio.insecure_channel(target)
    else:
        try:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=None if tls_ca is None else _read(tls_ca),
                private_key=None if tls_key is None else _read(tls_key),
                certificate_chain=None if tls_cert is None else _read(tls_cert),
            )
        except OSError as exc:
            print(f"mmcache health {target}: {exc}", file=sys.stderr)
            return 1
        options = (
            [] if tls_server_name is None else [("grpc.ssl_target_name_override", tls_server_name)]
        )
        channel = grpc.aio.secure_channel(target, credentials, options=options)
    async with channel:
        call = channel.unary_unary(
            _CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = await call(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            print(f"mmcache health {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"mmcache health {target}: {status}", file=sys.stderr)
        return 1
    print(f"mmcache health {target}: {status}")
    return 0
