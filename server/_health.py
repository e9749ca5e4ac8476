"""`mmcache health TARGET`: the probe a container's HEALTHCHECK runs."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2

from mmcache._errors import MMCacheError

from ._inspect import Connection

__all__ = ["check"]

_CHECK = "/grpc.health.v1.Health/Check"


async def check(connection: Connection, service: str = "") -> int:
    """0 when the server answers SERVING for `service`, 1 otherwise (with a reason on stderr).

    With the connection's `tls_ca` (and `tls_cert`/`tls_key` for a server
    that asks for a client certificate) it speaks TLS: the exec probe of a TLS
    server. It sends no token: health is for probes.
    """
    target = connection.target
    try:
        channel = connection.channel()
    except (OSError, MMCacheError) as exc:  # a PEM file it cannot read
        print(f"mmcache health {target}: {exc}", file=sys.stderr)
        return 1
    async with channel:
        call = channel.unary_unary(
            _CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = await call(request, timeout=connection.timeout)
        except grpc.aio.AioRpcError as exc:
            print(f"mmcache health {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"mmcache health {target}: {status}", file=sys.stderr)
        return 1
    print(f"mmcache health {target}: {status}")
    return 0
