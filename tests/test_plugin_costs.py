"""The vLLM plugin's P0 estimates (client/vllm_plugin/_costs.py), which need no
vLLM: how long a lookup waits for an upload in flight elsewhere, and which
uploads are worth their cost. Their use in a real P0: tests/vllm/test_caches.py."""

from __future__ import annotations

from mmcache.client.vllm_plugin._costs import MOST_WAIT_S, Admission, ProcessingTime


def test_a_lookup_waits_about_the_processing_it_would_save() -> None:
    timing = ProcessingTime()
    for _ in range(40):
        timing.observe(0.06, 2)  # 30 ms an item
    assert abs(timing.wait_for(1) - 0.03) < 0.002
    assert abs(timing.wait_for(3) - 0.09) < 0.005  # three in flight: as long as three here
    assert timing.wait_for(100) == MOST_WAIT_S
    timing.observe(1.0, 0)  # no item processed: nothing learned
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
