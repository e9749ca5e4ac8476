"""gRPC server metrics in the grpc-ecosystem naming (go-grpc-prometheus).

`grpc_server_started_total`, `grpc_server_handled_total` (with `grpc_code`)
and the `grpc_server_handling_seconds` histogram, labelled by service, method
and type, for every handler the server runs: ours, health and reflection.

A stream kept open to carry one request after another (UpdateSession) is
counted by its requests, not as one long call: its handler records each
(`requests`). The interceptor counts such a stream itself only when it ends
with a failure before carrying any (a refused token, namespace or header, a
cancel while it opened), as it would count a call that failed so.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["GrpcServerMetrics", "RequestMetrics"]

# The names go-grpc-prometheus gives codes (Go's `codes.Code.String()`).
_CODE_NAMES = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}

# The requests the stream running in this task has recorded so far (a
# per-request stream's wrapper sets it; RequestMetrics.start counts into it).
_CARRIED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "mmcache_grpc_carried", default=None
)

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """An aio server interceptor that counts and times every call."""

    def __init__(self, registry: CollectorRegistry, per_request: Collection[str] = ()) -> None:
        """`per_request`: full names of stream methods whose handlers record
        each request they carry (`requests`)."""
        self._per_request = frozenset(per_request)
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self._started = Counter(
            "grpc_server_started", "RPCs started on the server.", labels, registry=registry
        )
        self._handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, whatever their status.",
            [*labels, "grpc_code"],
            registry=registry,
        )
        self._seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its completion on the server.",
            labels,
            buckets=_BUCKETS,
            registry=registry,
        )
        # Handlers are the same objects call after call: wrap each once.
        self._wrapped: dict[str, tuple[object, grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._instrument(handler, handler_call_details.method)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def requests(self, full_method: str) -> RequestMetrics:
        """The series of the requests a bidi stream method carries one after
        another (one of `per_request`), for its handler to record."""
        service, _, method = full_method.lstrip("/").rpartition("/")
        return self._series(("bidi_stream", service, method))

    def _series(self, labels: tuple[str, str, str]) -> RequestMetrics:
        return RequestMetrics(
            self._started.labels(*labels),
            self._seconds.labels(*labels),
            lambda code: self._handled.labels(*labels, _CODE_NAMES.get(code, "Unknown")),
        )

    def _instrument(
        self, handler: grpc.RpcMethodHandler[Any, Any], full_method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        service, _, method = full_method.lstrip("/").rpartition("/")
        kind = {
            (False, False): "unary",
            (True, False): "client_stream",
            (False, True): "server_stream",
            (True, True): "bidi_stream",
        }[(handler.request_streaming, handler.response_streaming)]
        labels = (kind, service, method)
        factory, behavior = _behavior(handler)
        return factory(  # type: ignore[no-any-return]
            self._wrap(behavior, labels, per_request=full_method in self._per_request),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap(
        self, behavior: Callable[..., Any], labels: tuple[str, str, str], *, per_request: bool
    ) -> Any:
        # The wrap happens at a method's first call: its series start then.
        series = self._series(labels)

        def begin() -> list[int] | None:
            if not per_request:
                series.count_start()
                return None
            carried = [0]
            _CARRIED.set(carried)
            return carried

        def finish(
            context: grpc.aio.ServicerContext[Any, Any],
            t0: float,
            error: BaseException | None,
            carried: list[int] | None,
        ) -> None:
            code = context.code()  # None unless the handler set or aborted with one
            if code is None:
                code = _code_without_status(context, error)
            if carried is not None:  # a per-request stream: its requests counted themselves
                if carried[0] or code == grpc.StatusCode.OK:
                    return
                series.count_start()  # failed before its first request: counted as one
            series.end(t0, code)

        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                carried = begin()
                t0 = time.perf_counter()
                error: BaseException | None = None
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    finish(context, t0, error, carried)

            return stream

        async def call(request: Any, context: Any) -> Any:
            carried = begin()
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                finish(context, t0, error, carried)

        return call


class RequestMetrics:
    """Started, handled and timed: the series of one method's calls, or of the
    requests a per-request stream method carries."""

    def __init__(
        self, started: Any, seconds: Any, handled: Callable[[grpc.StatusCode], Any]
    ) -> None:
        self._started = started
        self._seconds = seconds
        self._handled_of = handled
        self._handled: dict[grpc.StatusCode, Any] = {}  # by code, made at its first use

    def start(self) -> float:
        """A request of a per-request stream began; the time to give `end`."""
        self.count_start()
        carried = _CARRIED.get()
        if carried is not None:
            carried[0] += 1
        return time.perf_counter()

    def count_start(self) -> None:
        self._started.inc()

    def end(self, t0: float, code: grpc.StatusCode) -> None:
        counter = self._handled.get(code)
        if counter is None:
            counter = self._handled[code] = self._handled_of(code)
        counter.inc()
        self._seconds.observe(time.perf_counter() - t0)


def _code_without_status(
    context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None
) -> grpc.StatusCode:
    """The status of a call whose handler set none: OK, UNKNOWN for a failure,
    and for a call its client left (grpc cancels the handler, or the reply has
    nowhere to go), DEADLINE_EXCEEDED past its deadline, else CANCELLED: a
    client leaving is no failure of the server's."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(error, asyncio.CancelledError) or context.cancelled():
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


def _behavior(
    handler: grpc.RpcMethodHandler[Any, Any],
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    # Exactly one behaviour of a handler is set; the factory rebuilds its kind.
    pairs: tuple[tuple[Callable[..., Any], Any], ...] = (
        (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    )
    return next((factory, fn) for factory, fn in pairs if fn is not None)
