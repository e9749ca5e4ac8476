"""The gRPC face of the encoder-cache books (`mmcache.v1.EncoderCache`).

Each book operation is described once (`_Kind`: its request -> core op, its
result -> reply fields), and both its own RPC and `Batch` use that
description, so a single call and a batched one cannot disagree. Errors go
through `guard`, the one mapping to statuses; inside a batch, `status_code_of`
gives the code an op's failure carries.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from mmcache._encoder import (
    AllocateOp,
    CanAllocateOp,
    CheckAndUpdateCacheOp,
    EncoderBooks,
    EncoderCacheBook,
    EncoderCacheStats,
    EncoderOp,
    FreeEncoderInputOp,
    FreeOp,
    GetCachedMmHashesOp,
    GetFreedMmHashesOp,
    OpResult,
    ResetOp,
    compute_encoder_budget,
)
from mmcache._errors import InvalidArgumentError, MMCacheError
from mmcache._spec import check_count, check_name
from mmcache.v1 import encoder_pb2 as epb

from ._status import protobuf_method, status_code_of

__all__ = ["ENCODER_SERVICE_NAME", "EncoderServicer"]

_LOGGER = logging.getLogger(__name__)

ENCODER_SERVICE_NAME = epb.DESCRIPTOR.services_by_name["EncoderCache"].full_name

Context = grpc.aio.ServicerContext[Any, Any]
Handler = Callable[[Any, Context], Awaitable[Message]]


def _named(what: str, value: str) -> str:
    check_name(what, value)
    return value


def _request_id(request: Any) -> str:
    return _named("request_id", request.request_id)


def _mm_hash(request: Any) -> str:
    return _named("mm_hash", request.mm_hash)


@dataclass(frozen=True, slots=True)
class _Kind:
    """One book operation on the wire: its RPC, messages and conversions."""

    method: str  # the RPC; the op's field in EncoderOp/EncoderOpResult is `field`
    field: str
    request: type[Message]
    reply: type[Message]
    to_op: Callable[[Any], EncoderOp]  # the request's message -> the core op, names checked
    result_field: str | None  # the reply field the op's result goes to; None: no result


_KINDS = (
    _Kind(
        "CheckAndUpdateCache",
        "check_and_update_cache",
        epb.CheckAndUpdateCacheRequest,
        epb.CheckAndUpdateCacheReply,
        lambda r: CheckAndUpdateCacheOp(_request_id(r), _mm_hash(r)),
        "cached",
    ),
    _Kind(
        "CanAllocate",
        "can_allocate",
        epb.CanAllocateRequest,
        epb.CanAllocateReply,
        lambda r: CanAllocateOp(
            _request_id(r),
            _mm_hash(r),
            r.num_tokens,
            r.compute_budget,
            r.tokens_already_scheduled,
        ),
        "can_allocate",
    ),
    _Kind(
        "Allocate",
        "allocate",
        epb.AllocateRequest,
        epb.AllocateReply,
        lambda r: AllocateOp(_request_id(r), _mm_hash(r), r.num_tokens),
        None,
    ),
    _Kind(
        "GetCachedMmHashes",
        "get_cached_mm_hashes",
        epb.GetCachedMmHashesRequest,
        epb.GetCachedMmHashesReply,
        lambda r: GetCachedMmHashesOp(_request_id(r)),
        "mm_hashes",
    ),
    _Kind(
        "FreeEncoderInput",
        "free_encoder_input",
        epb.FreeEncoderInputRequest,
        epb.FreeEncoderInputReply,
        lambda r: FreeEncoderInputOp(_request_id(r), _mm_hash(r)),
        "released",
    ),
    _Kind(
        "Free",
        "free",
        epb.FreeRequest,
        epb.FreeReply,
        lambda r: FreeOp(_request_id(r)),
        "released",
    ),
    _Kind(
        "GetFreedMmHashes",
        "get_freed_mm_hashes",
        epb.GetFreedMmHashesRequest,
        epb.GetFreedMmHashesReply,
        lambda r: GetFreedMmHashesOp(),
        "mm_hashes",
    ),
    _Kind("Reset", "reset", epb.ResetRequest, epb.ResetReply, lambda r: ResetOp(), None),
)
_BY_FIELD = {kind.field: kind for kind in _KINDS}


def _fill(reply: Any, kind: _Kind, result: OpResult) -> None:
    if kind.result_field is None:
        return
    if isinstance(result, set):  # a request's hashes: no order, sorted to be stable
        reply.mm_hashes.extend(sorted(result))
    elif isinstance(result, list):  # freed hashes, in eviction order
        reply.mm_hashes.extend(result)
    else:
        setattr(reply, kind.result_field, result)


def _budget(inputs: epb.EncoderBudgetInputs) -> tuple[int, int]:
    for modality in inputs.max_tokens_per_item_by_modality:
        check_name("modality", modality)
    return compute_encoder_budget(
        inputs.max_tokens_per_item_by_modality,
        inputs.max_num_encoder_input_tokens,
        inputs.encoder_cache_size,
        inputs.max_num_batched_tokens,
        inputs.disable_chunked_mm_input,
    )


def _stats_message(engine_id: str, stats: EncoderCacheStats) -> epb.EncoderCacheStats:
    return epb.EncoderCacheStats(engine_id=engine_id, **asdict(stats))


class EncoderServicer:
    """Handlers of `mmcache.v1.EncoderCache` over the server's `EncoderBooks`."""

    def __init__(self, books: EncoderBooks, instance_id: str) -> None:
        self._books = books
        self._instance_id = instance_id

    def handler(self) -> grpc.GenericRpcHandler:
        own: tuple[tuple[str, Handler, type[Message], type[Message]], ...] = (
            (
                "ComputeEncoderBudget",
                self.compute_encoder_budget,
                epb.ComputeEncoderBudgetRequest,
                epb.ComputeEncoderBudgetReply,
            ),
            (
                "CreateEncoderCache",
                self.create,
                epb.CreateEncoderCacheRequest,
                epb.CreateEncoderCacheReply,
            ),
            (
                "DeleteEncoderCache",
                self.delete,
                epb.DeleteEncoderCacheRequest,
                epb.DeleteEncoderCacheReply,
            ),
            (
                "GetEncoderCacheStats",
                self.stats,
                epb.GetEncoderCacheStatsRequest,
                epb.GetEncoderCacheStatsReply,
            ),
            ("Batch", self.batch, epb.BatchRequest, epb.BatchReply),
        )
        ops = tuple((k.method, self._op_handler(k), k.request, k.reply) for k in _KINDS)
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            name: protobuf_method(handle, request, self._instance_id)
            for name, handle, request, _ in (*own, *ops)
        }
        return grpc.method_handlers_generic_handler(ENCODER_SERVICE_NAME, methods)

    def _book(self, engine_id: str) -> EncoderCacheBook:
        check_name("engine_id", engine_id)
        return self._books.get(engine_id)

    def _op_handler(self, kind: _Kind) -> Handler:
        async def handle(request: Any, context: Context) -> Message:
            book = self._book(request.engine_id)
            result = kind.to_op(request).apply(book)
            reply = kind.reply(instance_id=self._instance_id)
            _fill(reply, kind, result)
            return reply

        handle.__qualname__ = f"{type(self).__name__}.{kind.method}"  # for guard's log
        return handle

    async def compute_encoder_budget(
        self, request: epb.ComputeEncoderBudgetRequest, context: Context
    ) -> epb.ComputeEncoderBudgetReply:
        compute, size = _budget(request.inputs)
        return epb.ComputeEncoderBudgetReply(
            instance_id=self._instance_id, compute_budget=compute, cache_size=size
        )

    async def create(
        self, request: epb.CreateEncoderCacheRequest, context: Context
    ) -> epb.CreateEncoderCacheReply:
        check_name("engine_id", request.engine_id)
        which = request.WhichOneof("size")
        if which is None:
            raise InvalidArgumentError(
                f"creating the encoder cache of engine {request.engine_id!r} needs its size: "
                "give cache_size, or budget to size it as compute_encoder_budget does"
            )
        compute, size = _budget(request.budget) if which == "budget" else (0, request.cache_size)
        self._books.create(request.engine_id, size, replace=request.replace)
        _LOGGER.info("encoder cache of engine %r created: %d tokens", request.engine_id, size)
        return epb.CreateEncoderCacheReply(
            instance_id=self._instance_id, cache_size=size, compute_budget=compute
        )

    async def delete(
        self, request: epb.DeleteEncoderCacheRequest, context: Context
    ) -> epb.DeleteEncoderCacheReply:
        check_name("engine_id", request.engine_id)
        self._books.delete(request.engine_id)
        _LOGGER.info("encoder cache of engine %r deleted", request.engine_id)
        return epb.DeleteEncoderCacheReply(instance_id=self._instance_id)

    async def stats(
        self, request: epb.GetEncoderCacheStatsRequest, context: Context
    ) -> epb.GetEncoderCacheStatsReply:
        reply = epb.GetEncoderCacheStatsReply(instance_id=self._instance_id)
        if request.engine_id:
            book = self._book(request.engine_id)
            reply.books.append(_stats_message(request.engine_id, book.stats()))
        else:
            reply.books.extend(_stats_message(e, s) for e, s in self._books.stats().items())
        return reply

    async def batch(self, request: epb.BatchRequest, context: Context) -> epb.BatchReply:
        book = self._book(request.engine_id)
        check_count("ops", len(request.ops))
        kinds: list[_Kind] = []
        ops: list[EncoderOp] = []
        failure: tuple[int, MMCacheError] | None = None
        # An op that does not convert fails at its index, after those before it ran.
        for index, message in enumerate(request.ops):
            try:
                kind, op = self._batch_op(request.engine_id, index, message)
            except MMCacheError as exc:
                failure = (index, exc)
                break
            kinds.append(kind)
            ops.append(op)
        outcome = book.apply_batch(ops)
        if outcome.error is not None:
            assert outcome.failed_index is not None
            failure = (outcome.failed_index, outcome.error)
        reply = epb.BatchReply(instance_id=self._instance_id)
        for kind, result in zip(kinds[: len(outcome.results)], outcome.results, strict=True):
            target = getattr(reply.results.add(), kind.field)
            target.SetInParent()  # an empty reply (allocate, reset) still names its op
            _fill(target, kind, result)
        if failure is not None:
            failed_index, error = failure
            code: tuple[int, str] = status_code_of(error).value
            reply.failure.index = failed_index
            reply.failure.code = code[0]
            reply.failure.message = str(error)
        return reply

    @staticmethod
    def _batch_op(engine_id: str, index: int, message: epb.EncoderOp) -> tuple[_Kind, EncoderOp]:
        field = message.WhichOneof("op")
        if field is None:
            raise InvalidArgumentError(f"op {index} of the batch names no operation")
        kind = _BY_FIELD[field]
        request = getattr(message, field)
        if request.engine_id not in ("", engine_id):
            raise InvalidArgumentError(
                f"op {index} of the batch names engine {request.engine_id!r}, but the batch "
                f"is for engine {engine_id!r}: leave the op's engine_id empty"
            )
        return kind, kind.to_op(request)
