"""`mmcache health TARGET`: the probe a container's HEALTHCHECK runs."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2

__all__ = ["check"]

_CHECK = "/grpc.health.v1.Health/Check"


async def check(target: str, service: str = "", timeout: float = 3.0) -> int:
    """0 when `target` answers SERVING for `service`, 1 otherwise (with a reason on stderr)."""
    async with grpc.aio.insecure_channel(target) as channel:
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
