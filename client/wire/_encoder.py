"""`EncoderCache`: one engine's encoder-cache book on the server, as its scheduler calls it.

The operations are those of the core book (`mmcache._encoder`), each one
round trip; `run_batch` and `batch()` send a scheduler step's worth in one.
Every failure is a typed mmcache error (through `translate_errors`, the one
mapping); a failed batch op raises an `EncoderBatchError` that is also an
instance of the error the op alone would have raised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, cast

import grpc
from google.protobuf.message import Message

from mmcache._encoder import (
    AllocateOp,
    CanAllocateOp,
    CheckAndUpdateCacheOp,
    EncoderCacheStats,
    EncoderOp,
    FreeEncoderInputOp,
    FreeOp,
    GetCachedMmHashesOp,
    GetFreedMmHashesOp,
    OpResult,
    ResetOp,
)
from mmcache._errors import InternalError, InvalidArgumentError, MMCacheError
from mmcache.v1 import encoder_pb2 as epb

from ._status import error_from_status, translate_errors

__all__ = [
    "AllocateOp",
    "BatchResult",
    "CanAllocateOp",
    "CheckAndUpdateCacheOp",
    "EncoderBatch",
    "EncoderBatchError",
    "EncoderBooksAPI",
    "EncoderBudget",
    "EncoderBudgetInputs",
    "EncoderCache",
    "EncoderCacheStats",
    "EncoderOp",
    "FreeEncoderInputOp",
    "FreeOp",
    "GetCachedMmHashesOp",
    "GetFreedMmHashesOp",
    "OpResult",
    "ResetOp",
]

_SERVICE = "/" + epb.DESCRIPTOR.services_by_name["EncoderCache"].full_name
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}

T = TypeVar("T")


class EncoderBudget(NamedTuple):
    """Encoder-token budgets: per scheduler step (compute) and held (cache)."""

    compute_budget: int
    cache_size: int


@dataclass(frozen=True, slots=True)
class EncoderBudgetInputs:
    """A scheduler's configuration, from which the server sizes the budgets as vLLM does."""

    max_tokens_per_item_by_modality: Mapping[str, int]  # 0: the modality is disabled
    max_num_encoder_input_tokens: int
    encoder_cache_size: int
    max_num_batched_tokens: int
    disable_chunked_mm_input: bool = False

    def _message(self) -> epb.EncoderBudgetInputs:
        return epb.EncoderBudgetInputs(
            max_tokens_per_item_by_modality=dict(self.max_tokens_per_item_by_modality),
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
            encoder_cache_size=self.encoder_cache_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            disable_chunked_mm_input=self.disable_chunked_mm_input,
        )


class EncoderBatchError(MMCacheError):
    """An op of a batch failed: those before it kept their effect, later ones did not run.

    Raised as a subclass that is also the error the op alone would have
    raised, so `except ResourceExhaustedError` catches it either way::

        try:
            await book.run_batch(ops)
        except ResourceExhaustedError as exc:
            if isinstance(exc, EncoderBatchError):
                done = exc.results  # of ops[: exc.index]
    """

    def __init__(
        self, error: MMCacheError, index: int, op: EncoderOp, results: list[OpResult]
    ) -> None:
        super().__init__(f"op {index} of the batch ({type(op).__name__}) failed: {error}")
        self.error = error  # as the op alone would have raised it
        self.index = index
        self.op = op
        self.results = results  # of the ops before it, in order


_BATCH_ERROR_CLASSES: dict[type[MMCacheError], type[EncoderBatchError]] = {}


def _batch_error_class(cls: type[MMCacheError]) -> type[EncoderBatchError]:
    """`EncoderBatch<Name>`, a subclass of both (made once per error class)."""
    made = _BATCH_ERROR_CLASSES.get(cls)
    if made is None:
        made = cast(
            type[EncoderBatchError],
            type(f"EncoderBatch{cls.__name__}", (EncoderBatchError, cls), {}),
        )
        _BATCH_ERROR_CLASSES[cls] = made
    return made


def _batch_error(
    failure: epb.BatchFailure, ops: Sequence[EncoderOp], results: list[OpResult]
) -> MMCacheError:
    if not len(results) == failure.index < len(ops):
        return InternalError(
            f"the server reported op {failure.index} of a batch of {len(ops)} as failed "
            f"after {len(results)} results"
        )
    code = _STATUS_CODES.get(failure.code, grpc.StatusCode.UNKNOWN)
    # The same mapping as a failed call's status: a failed op is one in all but transport.
    error = error_from_status(code, failure.message)
    return _batch_error_class(type(error))(error, failure.index, ops[failure.index], results)


class BatchResult(Generic[T]):
    """The result of one op queued on an `EncoderBatch`, once the batch has run."""

    __slots__ = ("_applied", "_value")

    def __init__(self) -> None:
        self._applied = False
        self._value: object = None

    @property
    def applied(self) -> bool:
        """The op ran (False before the batch runs, and for ops after a failed one)."""
        return self._applied

    @property
    def value(self) -> T:
        if not self._applied:
            raise RuntimeError("this op did not run: the batch has not run, or it stopped earlier")
        return cast(T, self._value)

    def _resolve(self, value: OpResult) -> None:
        self._applied, self._value = True, value


class _Reply(Protocol):
    @property
    def instance_id(self) -> str: ...


R = TypeVar("R", bound=_Reply)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class _Calls:
    """The service's unary calls on one channel; every failure a typed mmcache error."""

    def __init__(self, channel: grpc.aio.Channel, timeout: float) -> None:
        self._channel = channel
        self._timeout = timeout
        self._stubs: dict[str, grpc.aio.UnaryUnaryMultiCallable[Any, Any]] = {}
        self.instance_id = ""

    async def __call__(self, method: str, request: Message, parse: Callable[[bytes], R]) -> R:
        stub = self._stubs.get(method)
        if stub is None:
            stub = self._stubs[method] = self._channel.unary_unary(
                f"{_SERVICE}/{method}", request_serializer=_serialize, response_deserializer=parse
            )
        with translate_errors():
            reply: R = await stub(request, timeout=self._timeout, wait_for_ready=True)
        self.instance_id = reply.instance_id
        return reply


def _op_message(op: EncoderOp) -> epb.EncoderOp:
    """The op as a batch carries it (engine_id left empty: it is the batch's)."""
    if isinstance(op, CheckAndUpdateCacheOp):
        return epb.EncoderOp(
            check_and_update_cache=epb.CheckAndUpdateCacheRequest(
                request_id=op.request_id, mm_hash=op.mm_hash
            )
        )
    if isinstance(op, CanAllocateOp):
        return epb.EncoderOp(
            can_allocate=epb.CanAllocateRequest(
                request_id=op.request_id,
                mm_hash=op.mm_hash,
                num_tokens=op.num_tokens,
                compute_budget=op.compute_budget,
                tokens_already_scheduled=op.tokens_already_scheduled,
            )
        )
    if isinstance(op, AllocateOp):
        return epb.EncoderOp(
            allocate=epb.AllocateRequest(
                request_id=op.request_id, mm_hash=op.mm_hash, num_tokens=op.num_tokens
            )
        )
    if isinstance(op, GetCachedMmHashesOp):
        return epb.EncoderOp(
            get_cached_mm_hashes=epb.GetCachedMmHashesRequest(request_id=op.request_id)
        )
    if isinstance(op, FreeEncoderInputOp):
        return epb.EncoderOp(
            free_encoder_input=epb.FreeEncoderInputRequest(
                request_id=op.request_id, mm_hash=op.mm_hash
            )
        )
    if isinstance(op, FreeOp):
        return epb.EncoderOp(free=epb.FreeRequest(request_id=op.request_id))
    if isinstance(op, GetFreedMmHashesOp):
        return epb.EncoderOp(get_freed_mm_hashes=epb.GetFreedMmHashesRequest())
    if isinstance(op, ResetOp):
        return epb.EncoderOp(reset=epb.ResetRequest())
    raise InvalidArgumentError(f"not an encoder-cache op: {op!r}")


def _result_value(result: epb.EncoderOpResult) -> OpResult:
    field = result.WhichOneof("result")
    if field == "check_and_update_cache":
        return result.check_and_update_cache.cached
    if field == "can_allocate":
        return result.can_allocate.can_allocate
    if field == "get_cached_mm_hashes":
        return set(result.get_cached_mm_hashes.mm_hashes)
    if field == "free_encoder_input":
        return result.free_encoder_input.released
    if field == "free":
        return result.free.released
    if field == "get_freed_mm_hashes":
        return list(result.get_freed_mm_hashes.mm_hashes)
    return None  # allocate, reset


def _stats(message: epb.EncoderCacheStats) -> EncoderCacheStats:
    return EncoderCacheStats(
        **{f.name: getattr(message, f.name) for f in fields(EncoderCacheStats)}
    )


class EncoderCache:
    """The encoder-cache book of one engine, held by the server.

    Usage (from `MMCacheClient.encoder_cache`)::

        book = client.encoder_cache("engine-0")
        await book.create(cache_size=8192)
        if not await book.check_and_update_cache("req-1", h):
            if await book.can_allocate("req-1", h, 576, compute_budget=8192):
                await book.allocate("req-1", h, 576)
        await book.free("req-1")
        evicted = await book.get_freed_mm_hashes()

    `instance_id` is the server instance of the last reply: a new one means
    the server restarted and every book is gone.
    """

    def __init__(self, channel: grpc.aio.Channel, engine_id: str, *, timeout: float) -> None:
        self._engine_id = engine_id
        self._calls = _Calls(channel, timeout)

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def instance_id(self) -> str:
        return self._calls.instance_id

    # -- the book ----------------------------------------------------------

    async def create(
        self,
        cache_size: int | None = None,
        *,
        budget: EncoderBudgetInputs | None = None,
        replace: bool = False,
    ) -> EncoderBudget:
        """Create the engine's book, of `cache_size` tokens or sized from `budget`.

        Returns the budgets (compute_budget is 0 when `cache_size` was given).
        AlreadyExistsError if the engine has a book, unless `replace`.
        """
        if cache_size is not None and budget is not None:
            raise InvalidArgumentError("give cache_size or budget, not both")
        request = epb.CreateEncoderCacheRequest(engine_id=self._engine_id, replace=replace)
        if cache_size is not None:
            request.cache_size = cache_size
        elif budget is not None:
            request.budget.CopyFrom(budget._message())
        reply = await self._calls(
            "CreateEncoderCache", request, epb.CreateEncoderCacheReply.FromString
        )
        return EncoderBudget(reply.compute_budget, reply.cache_size)

    async def delete(self) -> None:
        """Discard the book; NotFoundError if the engine has none."""
        request = epb.DeleteEncoderCacheRequest(engine_id=self._engine_id)
        await self._calls("DeleteEncoderCache", request, epb.DeleteEncoderCacheReply.FromString)

    async def stats(self) -> EncoderCacheStats:
        """A snapshot of the book's numbers."""
        request = epb.GetEncoderCacheStatsRequest(engine_id=self._engine_id)
        reply = await self._calls(
            "GetEncoderCacheStats", request, epb.GetEncoderCacheStatsReply.FromString
        )
        return _stats(reply.books[0])

    # -- operations --------------------------------------------------------

    async def check_and_update_cache(self, request_id: str, mm_hash: str) -> bool:
        """True when the entry is held; the request then references it."""
        request = epb.CheckAndUpdateCacheRequest(
            engine_id=self._engine_id, request_id=request_id, mm_hash=mm_hash
        )
        reply = await self._calls(
            "CheckAndUpdateCache", request, epb.CheckAndUpdateCacheReply.FromString
        )
        return reply.cached

    async def can_allocate(
        self,
        request_id: str,
        mm_hash: str,
        num_tokens: int,
        compute_budget: int,
        tokens_already_scheduled: int = 0,
    ) -> bool:
        """Whether `num_tokens` can be encoded this step and held; may evict to make room."""
        request = epb.CanAllocateRequest(
            engine_id=self._engine_id,
            request_id=request_id,
            mm_hash=mm_hash,
            num_tokens=num_tokens,
            compute_budget=compute_budget,
            tokens_already_scheduled=tokens_already_scheduled,
        )
        reply = await self._calls("CanAllocate", request, epb.CanAllocateReply.FromString)
        return reply.can_allocate

    async def allocate(self, request_id: str, mm_hash: str, num_tokens: int) -> None:
        """Hold `num_tokens` for `mm_hash`; never evicts (ResourceExhaustedError if short)."""
        request = epb.AllocateRequest(
            engine_id=self._engine_id, request_id=request_id, mm_hash=mm_hash, num_tokens=num_tokens
        )
        await self._calls("Allocate", request, epb.AllocateReply.FromString)

    async def get_cached_mm_hashes(self, request_id: str) -> set[str]:
        """The hashes the request references."""
        request = epb.GetCachedMmHashesRequest(engine_id=self._engine_id, request_id=request_id)
        reply = await self._calls(
            "GetCachedMmHashes", request, epb.GetCachedMmHashesReply.FromString
        )
        return set(reply.mm_hashes)

    async def free_encoder_input(self, request_id: str, mm_hash: str) -> bool:
        """Drop the request's reference to `mm_hash`; False when it held none."""
        request = epb.FreeEncoderInputRequest(
            engine_id=self._engine_id, request_id=request_id, mm_hash=mm_hash
        )
        reply = await self._calls("FreeEncoderInput", request, epb.FreeEncoderInputReply.FromString)
        return reply.released

    async def free(self, request_id: str) -> int:
        """Drop every reference of the request; how many it held."""
        request = epb.FreeRequest(engine_id=self._engine_id, request_id=request_id)
        reply = await self._calls("Free", request, epb.FreeReply.FromString)
        return reply.released

    async def get_freed_mm_hashes(self) -> list[str]:
        """The hashes evicted since the last call, in eviction order (each reported once)."""
        request = epb.GetFreedMmHashesRequest(engine_id=self._engine_id)
        reply = await self._calls("GetFreedMmHashes", request, epb.GetFreedMmHashesReply.FromString)
        return list(reply.mm_hashes)

    async def reset(self) -> None:
        """Forget every entry and reference (the counters are kept)."""
        request = epb.ResetRequest(engine_id=self._engine_id)
        await self._calls("Reset", request, epb.ResetReply.FromString)

    # -- batches -----------------------------------------------------------

    async def run_batch(self, ops: Sequence[EncoderOp]) -> list[OpResult]:
        """Apply `ops` in one round trip, in order; their results, in order.

        The ops are the core's dataclasses (`mmcache._encoder`)::

            results = await book.run_batch([FreeOp("req-0"), GetFreedMmHashesOp()])

        A failing op stops the batch: EncoderBatchError (see there).
        """
        if not ops:
            return []
        request = epb.BatchRequest(engine_id=self._engine_id, ops=[_op_message(op) for op in ops])
        reply = await self._calls("Batch", request, epb.BatchReply.FromString)
        results = [_result_value(result) for result in reply.results]
        if reply.HasField("failure"):
            raise _batch_error(reply.failure, ops, results)
        return results

    def batch(self) -> EncoderBatch:
        """A builder whose ops run as one batch, with a typed result per op.

        Usage::

            async with book.batch() as step:
                hit = step.check_and_update_cache("req-1", h)
                freed = step.get_freed_mm_hashes()
            hit.value, freed.value  # bool, list[str]
        """
        return EncoderBatch(self)


class EncoderBatch:
    """Ops queued for one round trip; `run()` (or leaving `async with`) sends them."""

    def __init__(self, book: EncoderCache) -> None:
        self._book = book
        self._ops: list[EncoderOp] = []
        self._slots: list[BatchResult[Any]] = []

    def __len__(self) -> int:
        return len(self._ops)

    def _add(self, op: EncoderOp, slot: BatchResult[T]) -> BatchResult[T]:
        self._ops.append(op)
        self._slots.append(slot)
        return slot

    def check_and_update_cache(self, request_id: str, mm_hash: str) -> BatchResult[bool]:
        return self._add(CheckAndUpdateCacheOp(request_id, mm_hash), BatchResult[bool]())

    def can_allocate(
        self,
        request_id: str,
        mm_hash: str,
        num_tokens: int,
        compute_budget: int,
        tokens_already_scheduled: int = 0,
    ) -> BatchResult[bool]:
        op = CanAllocateOp(
            request_id, mm_hash, num_tokens, compute_budget, tokens_already_scheduled
        )
        return self._add(op, BatchResult[bool]())

    def allocate(self, request_id: str, mm_hash: str, num_tokens: int) -> BatchResult[None]:
        return self._add(AllocateOp(request_id, mm_hash, num_tokens), BatchResult[None]())

    def get_cached_mm_hashes(self, request_id: str) -> BatchResult[set[str]]:
        return self._add(GetCachedMmHashesOp(request_id), BatchResult[set[str]]())

    def free_encoder_input(self, request_id: str, mm_hash: str) -> BatchResult[bool]:
        return self._add(FreeEncoderInputOp(request_id, mm_hash), BatchResult[bool]())

    def free(self, request_id: str) -> BatchResult[int]:
        return self._add(FreeOp(request_id), BatchResult[int]())

    def get_freed_mm_hashes(self) -> BatchResult[list[str]]:
        return self._add(GetFreedMmHashesOp(), BatchResult[list[str]]())

    def reset(self) -> BatchResult[None]:
        return self._add(ResetOp(), BatchResult[None]())

    async def run(self) -> list[OpResult]:
        """Send the queued ops (the builder is empty again); their results, in order."""
        ops, slots = self._ops, self._slots
        self._ops, self._slots = [], []
        try:
            results = await self._book.run_batch(ops)
        except EncoderBatchError as exc:
            for slot, value in zip(slots, exc.results, strict=False):
                slot._resolve(value)
            raise
        for slot, value in zip(slots, results, strict=True):
            slot._resolve(value)
        return results

    async def __aenter__(self) -> EncoderBatch:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:  # an error in the block sends nothing
            await self.run()


class EncoderBooksAPI:
    """`MMCacheClient`'s calls to the server's encoder-cache books
    (docs/encoder.md): its channel, with its deadline for each call."""

    @property
    def channel(self) -> grpc.aio.Channel:
        raise NotImplementedError  # the client's

    @property
    def _books_timeout(self) -> float:
        raise NotImplementedError  # the client's deadline of each call, in seconds

    def encoder_cache(self, engine_id: str) -> EncoderCache:
        """The server's encoder-cache book of one engine (see `EncoderCache`)."""
        return EncoderCache(self.channel, engine_id, timeout=self._books_timeout)

    async def compute_encoder_budget(
        self,
        max_tokens_per_item_by_modality: Mapping[str, int],
        *,
        max_num_encoder_input_tokens: int,
        encoder_cache_size: int,
        max_num_batched_tokens: int,
        disable_chunked_mm_input: bool = False,
    ) -> EncoderBudget:
        """(compute budget, cache size) in encoder tokens, computed by the server."""
        inputs = EncoderBudgetInputs(
            max_tokens_per_item_by_modality,
            max_num_encoder_input_tokens,
            encoder_cache_size,
            max_num_batched_tokens,
            disable_chunked_mm_input,
        )
        request = epb.ComputeEncoderBudgetRequest(inputs=inputs._message())
        reply = await _Calls(self.channel, self._books_timeout)(
            "ComputeEncoderBudget", request, epb.ComputeEncoderBudgetReply.FromString
        )
        return EncoderBudget(reply.compute_budget, reply.cache_size)

    async def encoder_cache_stats(self) -> dict[str, EncoderCacheStats]:
        """Every engine's book on the server, by engine id (sorted)."""
        reply = await _Calls(self.channel, self._books_timeout)(
            "GetEncoderCacheStats",
            epb.GetEncoderCacheStatsRequest(),
            epb.GetEncoderCacheStatsReply.FromString,
        )
        return {book.engine_id: _stats(book) for book in reply.books}
