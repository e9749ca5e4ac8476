"""The vLLM plugin's P0 measures and sharing rule (client/vllm/_costs.py),
which need no vLLM: how long a lookup waits for an upload in flight
elsewhere, and which items are uploaded (every one that can go). Their use
in a real P0: tests/vllm/test_caches.py and tests/vllm/test_no_regression.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache.client.vllm._costs import MOST_WAIT_S, ProcessingTime, Uploads


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


def test_every_item_goes_whatever_came_before() -> None:
    uploads = Uploads(most_in_flight=8)
    # A cold process shares: small items first, then large ones, all go.
    assert uploads.start([18_840, 18_840], capacity=0) == [True, True]
    uploads.ended()
    for _ in range(50):
        assert uploads.start([6_440_000, 12_660_000], capacity=1 << 30) == [True, True]
        uploads.ended()
    assert uploads.declined == 0


def test_only_what_cannot_go_is_declined_and_counted_exactly() -> None:
    uploads = Uploads(most_in_flight=2)
    assert uploads.start([10, 2_000], capacity=1_000) == [True, False]  # larger than the server
    assert uploads.start([10], capacity=1_000) == [True]
    assert uploads.start([10, 20], capacity=1_000) == [False, False]  # two in flight already
    assert uploads.declined == 3
    uploads.ended(failed=1)  # a failed upload's items were not shared either
    assert uploads.declined == 4
    assert uploads.start([10], capacity=1_000) == [True]  # room again: it goes
    uploads.ended()
    uploads.ended()
    uploads.close(deadline_s=0.1)
    assert uploads.start([10], capacity=0) == [False]  # closed
    assert uploads.declined == 5


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 20_000_000), min_size=1, max_size=6),
            st.booleans(),  # the upload failed
            st.booleans(),  # it ends before the next request
        ),
        max_size=60,
    )
)
def test_no_outcome_ever_refuses_an_item_that_fits_with_room(
    history: list[tuple[list[int], bool, bool]],
) -> None:
    """No decision feeds on its own outcome: whatever sizes, orders and
    failures came before, an item that fits goes whenever an upload has room."""
    uploads, capacity, open_ = Uploads(most_in_flight=3), 10_000_000, 0
    declined = 0
    for sizes, failed, ends in history:
        room = open_ < 3
        goes = uploads.start(sizes, capacity)
        assert goes == [room and size <= capacity for size in sizes]
        declined += goes.count(False)
        if any(goes):
            open_ += 1
            if ends:
                uploads.ended(failed=goes.count(True) if failed else 0)
                declined += goes.count(True) if failed else 0
                open_ -= 1
        assert uploads.declined == declined
