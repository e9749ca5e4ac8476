"""The vLLM plugin's P0 measures and sharing rule (client/vllm/_costs.py), and
the bound on its uploads in flight (client/vllm/runtime.py's BackgroundCalls),
which need no vLLM: how long a lookup waits for an upload in flight
elsewhere, and which items are uploaded (every one that can go). Their use
in a real P0: tests/vllm/test_caches.py and tests/vllm/test_no_regression.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcache.client.vllm._costs import MOST_WAIT_S, ProcessingTime, fits
from mmcache.client.vllm.runtime import BackgroundCalls, SyncClient


def test_a_lookup_waits_about_the_processing_it_would_save() -> None:
    timing = ProcessingTime()
    for _ in range(40):
        timing.observe(0.06, 0.05, 2)  # 30 ms an item, 25 of them CPU
    assert abs(timing.wait_for(1) - 0.03) < 0.002
    assert abs(timing.wait_for(3) - 0.09) < 0.005  # three in flight: as long as three here
    assert timing.wait_for(100) == MOST_WAIT_S
    assert abs(timing.cpu_per_item - 0.025) < 0.002
    timing.observe(1.0, 1.0, 0)  # no item processed: nothing learned
    assert abs(timing.wait_for(1) - 0.03) < 0.002


@pytest.fixture(scope="module")
def sync() -> Iterator[SyncClient]:
    """A runtime whose sidecar is not there (it fails open): the calls run
    here are the tests' own coroutines, on its loop."""
    runtime = SyncClient("127.0.0.1:1", deadline_s=0.2)
    yield runtime
    runtime.close()


class Calls:
    """Background calls that end when the test says, and what ended."""

    def __init__(self, sync: SyncClient, most: int) -> None:
        self.sync = sync
        self.calls = BackgroundCalls(sync, most)
        self.gates: list[asyncio.Event] = []
        self.ended: list[bool] = []  # per ended call: whether it failed

    def start(self, *, fail: bool = False) -> bool:
        gate = asyncio.Event()

        async def call() -> None:
            await gate.wait()
            if fail:
                raise ConnectionError("the sidecar went away")

        def done(future: Future[None]) -> None:
            self.ended.append(future.exception() is not None)

        went = self.calls.start(call, done)
        if went:
            self.gates.append(gate)
        return went

    def end_first(self) -> None:
        """The oldest call in flight ends; returns once it is counted."""
        in_flight = self.calls.in_flight
        gate = self.gates.pop(0)

        async def open_gate() -> None:
            gate.set()

        self.sync.call(open_gate())
        until = time.monotonic() + 5
        while self.calls.in_flight != in_flight - 1 and time.monotonic() < until:
            time.sleep(0.001)
        assert self.calls.in_flight == in_flight - 1


def test_every_item_goes_whatever_came_before(sync: SyncClient) -> None:
    uploads = Calls(sync, 8)
    # A cold process shares: small items first, then large ones, all go.
    assert fits([18_840, 18_840], 0) == [True, True]
    assert uploads.start()
    uploads.end_first()
    for _ in range(50):
        assert fits([6_440_000, 12_660_000], 1 << 30) == [True, True]
        assert uploads.start(fail=True)
        uploads.end_first()
    assert uploads.ended == [False] + [True] * 50  # failures change nothing


def test_only_what_cannot_go_is_declined(sync: SyncClient) -> None:
    assert fits([10, 2_000], 1_000) == [True, False]  # larger than the server
    uploads = Calls(sync, 2)
    assert uploads.start() and uploads.start()
    assert not uploads.start()  # two in flight already
    uploads.end_first()
    assert uploads.start()  # room again: it goes
    uploads.end_first()
    uploads.end_first()
    uploads.calls.close(0.1)
    assert not uploads.start()  # closed
    assert uploads.calls.in_flight == 0


def test_close_waits_for_the_calls_in_flight(sync: SyncClient) -> None:
    uploads = Calls(sync, 2)
    assert uploads.start()
    began = time.monotonic()
    uploads.calls.close(0.2)  # the call never ends: close gives up at its wait
    assert 0.15 < time.monotonic() - began < 1.0
    uploads.end_first()


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 20_000_000), min_size=1, max_size=6),
            st.booleans(),  # the upload fails
            st.booleans(),  # it ends before the next request
        ),
        max_size=30,
    )
)
def test_no_outcome_ever_refuses_an_item_that_fits_with_room(
    sync: SyncClient, history: list[tuple[list[int], bool, bool]]
) -> None:
    """No decision feeds on its own outcome: whatever sizes, orders and
    failures came before, an item that fits goes whenever an upload has room."""
    uploads, capacity = Calls(sync, 3), 10_000_000
    for sizes, failed, ends in history:
        room = uploads.calls.in_flight < 3
        going = fits(sizes, capacity)
        assert going == [size <= capacity for size in sizes]
        went = any(going) and uploads.start(fail=failed)
        assert went == (room and any(going))
        if went and ends:
            uploads.end_first()
    while uploads.gates:
        uploads.end_first()
