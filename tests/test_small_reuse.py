"""The server's judgement of small items' reuse (server/cache/_reuse.py), on its own."""

from __future__ import annotations

from mmcache.server.cache._reuse import PAUSE_HITS_PER, SMALL_BYTES, STORES, SmallReuse


def test_too_few_stores_judge_nothing_and_large_items_never_count() -> None:
    reuse = SmallReuse()
    reuse.hit(4096)  # before any store: of nothing in the span
    for _ in range(STORES - 1):
        reuse.stored(4096)
    for _ in range(100):
        reuse.stored(SMALL_BYTES)  # not small
        reuse.hit(SMALL_BYTES)
    assert not reuse.paused and reuse.hits_per_store == 0  # 31 stores: too few to judge
    reuse.stored(4096)
    assert reuse.paused


def test_the_pause_follows_the_hits_in_the_span_of_the_last_stores() -> None:
    reuse = SmallReuse()
    for _ in range(STORES):
        reuse.stored(4096)
    assert reuse.paused
    # Reuse comes back (paused, only a sample is stored): one hit per store.
    needed = -(-STORES // PAUSE_HITS_PER)  # 4 hits in the span of 32 stores
    for _ in range(needed):
        assert reuse.paused
        reuse.stored(4096)
        reuse.hit(4096)
    assert not reuse.paused and reuse.hits_per_store == needed / STORES
    # Stores alone push those hits out of the span: paused again, exactly then.
    for _ in range(STORES - needed):
        reuse.stored(4096)
    assert not reuse.paused  # the first of those hits still in the span
    reuse.stored(4096)
    assert reuse.paused
