"""The vLLM plugin's P0 estimates (client/vllm/_costs.py), which need no
vLLM: how long a lookup waits for an upload in flight elsewhere, and which
uploads are worth their cost. Their use in a real P0: tests/vllm/test_caches.py."""

from __future__ import annotations

from mmcache.client.vllm._costs import MOST_WAIT_S, Admission, ProcessingTime, UploadCost


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


def test_uploads_go_while_images_repeat_and_one_in_ten_when_they_do_not() -> None:
    admission = Admission(explore=10)
    assert admission.admit(6_440_000, 0.027)  # nothing measured yet: it goes
    admission.uploaded(0.010, 6_440_000)  # 10 ms to upload, 27 ms to process
    for _ in range(10):
        admission.queried(hits=4, total=5)  # a chat's images come back
    assert admission.reuse > 0.6
    assert all(admission.admit(6_440_000, 0.027) for _ in range(20))
    for _ in range(60):
        admission.queried(hits=0, total=2)  # every image new
    assert admission.reuse < 0.2
    sent = sum(admission.admit(6_440_000, 0.027) for _ in range(100))
    assert sent == 10  # exploring: the estimate follows the traffic back
    # An upload dearer than processing does not pay even when images repeat.
    for _ in range(60):
        admission.queried(hits=5, total=5)
    assert not any(admission.admit(6_440_000, 0.004) for _ in range(9))


def test_an_uploads_cost_is_a_fixed_part_and_a_part_per_byte() -> None:
    cost = UploadCost()
    assert cost.of(6_440_000) == 0.0  # nothing measured: uploads go
    for _ in range(5):
        cost.observe(0.0025, 1_200_000)  # a call's fixed cost dominates small items
        cost.observe(0.0030, 6_440_000)
    # Not 5.4x the small upload's cost, as a cost per byte would say.
    assert 0.0028 < cost.of(6_440_000) < 0.0032
    assert 0.0030 < cost.of(12_660_000) < 0.0040
    for _ in range(40):  # only one size seen lately: proportional to it
        cost.observe(0.004, 6_440_000)
    assert abs(cost.of(6_440_000) - 0.004) < 0.0002


def test_a_cold_process_shares_its_first_images_and_stops_once_none_come_back() -> None:
    admission = Admission()
    admission.uploaded(0.003, 6_440_000)  # 3 ms to upload, 8 ms to process
    for _ in range(20):
        admission.queried(hits=0, total=1)  # new images so far...
    assert admission.admit(6_440_000, 0.008)  # ...but the prior is that images come back
    for _ in range(40):
        admission.queried(hits=0, total=1)
    assert admission.reuse < 0.2
    assert not admission.admit(6_440_000, 0.008)
