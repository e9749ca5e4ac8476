"""One mapping of errors to statuses, read both ways."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from mmcache import _errors as errors
from mmcache.client.wire import broken_write, error_from_status
from mmcache.server._status import failure_code, status_code_of


@pytest.mark.parametrize("cls", errors.ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_comes_back_as_its_own_class(cls: type[errors.MMCacheError]) -> None:
    code = status_code_of(cls("boom"))
    assert code.name == cls.code
    back = error_from_status(code, "boom")
    assert type(back) is cls


def test_a_cache_miss_travels_as_not_found_and_other_statuses_read_sensibly() -> None:
    assert status_code_of(errors.CacheMissError(["h"])) == grpc.StatusCode.NOT_FOUND
    assert type(error_from_status(grpc.StatusCode.OUT_OF_RANGE, "x")) is errors.InvalidArgumentError
    assert type(error_from_status(grpc.StatusCode.CANCELLED, "x")) is errors.UnavailableError
    unknown = error_from_status(grpc.StatusCode.UNKNOWN, "x")
    assert type(unknown) is errors.InternalError and str(unknown) == "UNKNOWN: x"


class _Context:
    """What failure_code asks of grpc's servicer context, for a call its client still waits on."""

    def cancelled(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return 5.0

    def code(self) -> grpc.StatusCode | None:
        return None


def test_a_per_request_stream_counts_a_failure_as_guard_answers_it() -> None:
    context: Any = _Context()
    assert failure_code(context, errors.CacheMissError(["h"])) == grpc.StatusCode.NOT_FOUND
    assert failure_code(context, asyncio.CancelledError()) == grpc.StatusCode.CANCELLED
    # A bug is INTERNAL (what guard answers), never UNKNOWN.
    assert failure_code(context, KeyError("x")) == grpc.StatusCode.INTERNAL


def test_a_write_grpc_core_failed_on_a_broken_link_counts_as_unavailable() -> None:
    # What grpc raises from `call.write` when the link breaks under it (seen in
    # CI): INTERNAL, though the call itself ends UNAVAILABLE. The client sends
    # such a batch again, as for UNAVAILABLE; any other INTERNAL stays one.
    metadata = grpc.aio.Metadata()
    broken = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        metadata,
        metadata,
        "Internal error from Core",
        'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation>,)',
    )
    other = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, metadata, metadata, "boom", "a server's own INTERNAL"
    )
    assert broken_write(broken) and not broken_write(other)
