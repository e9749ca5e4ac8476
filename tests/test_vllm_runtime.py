"""The vLLM side's runtime (client/vllm/runtime.py), with no vLLM: every
call from vLLM's threads, or from another event loop (Dynamo's), ends by
the deadline, and a call nobody waits for never raises into its caller."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from mmcache.client import DeadlineExceededError, UnavailableError
from mmcache.client.vllm.runtime import SyncClient

DEADLINE_S = 0.2


@pytest.fixture(scope="module")
def sync() -> Iterator[SyncClient]:
    runtime = SyncClient("127.0.0.1:1", deadline_s=DEADLINE_S)  # nothing there: fails open
    yield runtime
    runtime.close()


async def _never() -> None:
    await asyncio.Event().wait()


async def _fails() -> None:
    raise ConnectionError("the sidecar went away")


def test_a_call_ends_by_its_deadline(sync: SyncClient) -> None:
    began = time.monotonic()
    with pytest.raises(DeadlineExceededError, match=r"did not answer within 0\.4s"):
        sync.call(_never())  # default: twice the deadline
    assert time.monotonic() - began < 2 * DEADLINE_S + 0.5


def test_a_wait_from_another_loop_ends_by_the_deadline(sync: SyncClient) -> None:
    async def caller() -> float:
        began = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await sync.wait(_never())
        return time.monotonic() - began

    assert asyncio.run(caller()) < DEADLINE_S + 0.5

    async def answered() -> int:
        async def seven() -> int:
            return 7

        return await sync.wait(seven())

    assert asyncio.run(answered()) == 7


def test_a_call_nobody_waits_for_fails_quietly(
    sync: SyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="mmcache.client.vllm.runtime"):
        future = sync.submit(_fails())
        assert isinstance(future.exception(timeout=5), ConnectionError)
        until = time.monotonic() + 5
        while "the sidecar went away" not in caplog.text and time.monotonic() < until:
            time.sleep(0.01)
    assert "a call in the background failed: the sidecar went away" in caplog.text


def test_background_calls_past_their_bound_are_not_made(sync: SyncClient) -> None:
    calls = sync.background(1)
    made: list[str] = []

    def make(name: str) -> Coroutine[Any, Any, None]:
        made.append(name)
        return _never()

    assert calls.start(lambda: make("first"), lambda done: None)
    assert not calls.start(lambda: make("second"), lambda done: None)
    assert made == ["first"]  # the refused call's data was never prepared
    began = time.monotonic()
    calls.close(DEADLINE_S)  # the first never ends: close waits its time, no more
    assert DEADLINE_S - 0.05 < time.monotonic() - began < DEADLINE_S + 0.5
    assert calls.in_flight == 1


def test_closing_the_runtime_cancels_the_calls_still_running() -> None:
    runtime = SyncClient("127.0.0.1:1", deadline_s=DEADLINE_S)
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = runtime.submit(forever())
    runtime.close()
    assert cancelled.is_set() and future.cancelled()  # ended, not left pending with the loop


def test_a_call_the_closing_runtime_cancels_fails_open() -> None:
    """A vLLM thread waiting in `call` when the runtime closes gets an
    MMCacheError (the plugin's fail-open catches those), not a CancelledError."""
    runtime = SyncClient("127.0.0.1:1", deadline_s=5.0)
    errors: list[Exception] = []

    def caller() -> None:
        try:
            runtime.call(_never(), timeout=10)
        except Exception as exc:
            errors.append(exc)

    waiting = threading.Thread(target=caller)
    waiting.start()
    time.sleep(0.2)
    runtime.close()
    waiting.join(5)
    assert [type(e) for e in errors] == [UnavailableError]
