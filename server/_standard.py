"""gRPC's standard services (health, reflection), with requests parsed by us.

grpc answers a request its own deserializer cannot parse with UNKNOWN. The
servicers are grpc's own (`grpc_health`, `grpc_reflection`); only their
requests are parsed here, inside `guard`, so that garbage gets
INVALID_ARGUMENT naming the message expected, as on mmcache's own services.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from mmcache._errors import InvalidArgumentError

from ._status import guard, protobuf_method, write

__all__ = ["HEALTH_SERVICE_NAME", "health_handler", "reflection_handler"]

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

Context = grpc.aio.ServicerContext[Any, Any]


def _parse(raw: bytes, request_type: type[Message]) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(
            f"the request does not parse as a {request_type.DESCRIPTOR.full_name}: {exc}"
        ) from None


def health_handler(servicer: health.aio.HealthServicer, instance_id: str) -> grpc.GenericRpcHandler:
    """`grpc.health.v1.Health`, answered by `servicer`."""

    async def watch(raw: bytes, context: Context) -> None:
        # Watch writes its replies through the context (serialised by grpc).
        await servicer.Watch(_parse(raw, health_pb2.HealthCheckRequest), context)

    methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Check": protobuf_method(servicer.Check, health_pb2.HealthCheckRequest, instance_id),
        "Watch": grpc.unary_stream_rpc_method_handler(
            guard(instance_id)(watch),
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(HEALTH_SERVICE_NAME, methods)


def reflection_handler(service_names: list[str], instance_id: str) -> grpc.GenericRpcHandler:
    """`grpc.reflection.v1alpha.ServerReflection` over `service_names`."""
    servicer = reflection.aio.ReflectionServicer(service_names)

    async def info(raw_requests: AsyncIterator[bytes], context: Context) -> None:
        async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            async for raw in raw_requests:
                yield _parse(raw, reflection_pb2.ServerReflectionRequest)

        # An async generator (the stubs call it a coroutine).
        replies: AsyncIterator[Any] = servicer.ServerReflectionInfo(requests(), context)  # type: ignore[assignment]
        async for reply in replies:
            await write(context, reply)

    methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            guard(instance_id)(info),
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    return grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, methods)
