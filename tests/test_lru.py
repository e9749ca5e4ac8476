"""The byte-bounded LRU and the batch rule shared by server and mirror."""

from __future__ import annotations

import random

import cachetools
import pytest

from mmcache._lru import BatchEntry, ByteLRU, Outcome

from .oracle import oracle_batch


def test_put_evicts_least_recently_used_first() -> None:
    evicted: list[str] = []
    lru: ByteLRU[str] = ByteLRU(10, on_evict=lambda k, _v, _s: evicted.append(k))
    for key in "abc":
        lru.put(key, key, 3)
    lru.touch("a")
    lru.put("d", "d", 3)  # 12 > 10: evicts b, the least recently used
    assert evicted == ["b"]
    assert list(lru.keys()) == ["c", "a", "d"]
    assert lru.used == 9


def test_touch_of_missing_key_does_nothing() -> None:
    lru: ByteLRU[None] = ByteLRU(10)
    assert lru.touch("ghost") is False
    assert len(lru) == 0 and lru.used == 0
    lru.put("a", None, 10)  # still fills to the brim: no phantom entry takes room
    assert list(lru.keys()) == ["a"]


def test_peek_does_not_change_order() -> None:
    lru: ByteLRU[int] = ByteLRU(6)
    lru.put("a", 1, 3)
    lru.put("b", 2, 3)
    assert lru.peek("a") == 1
    lru.put("c", 3, 3)
    assert "a" not in lru and "b" in lru


def test_item_larger_than_capacity_is_uncached_and_cache_survives() -> None:
    lru: ByteLRU[None] = ByteLRU(10)
    lru.put("a", None, 4)
    assert lru.put("huge", None, 11) == Outcome.UNCACHED
    assert list(lru.keys()) == ["a"] and lru.used == 4


def test_sent_data_wins_and_counts_as_replaced() -> None:
    lru: ByteLRU[str] = ByteLRU(10)
    lru.put("a", "old", 4)
    outcomes = lru.apply_batch([BatchEntry("a", 5, "new")], replace_present=True)
    assert outcomes == [Outcome.REPLACED]
    assert lru.peek("a") == "new" and lru.used == 5


def test_replacement_that_cannot_fit_drops_the_stale_entry() -> None:
    lru: ByteLRU[str] = ByteLRU(10)
    lru.put("a", "old", 4)
    outcomes = lru.apply_batch([BatchEntry("a", 11, "new")], replace_present=True)
    assert outcomes == [Outcome.UNCACHED]
    assert "a" not in lru  # never keep serving old data under a hash that got new data


def test_mirror_mode_calls_a_held_key_a_hit() -> None:
    lru: ByteLRU[None] = ByteLRU(10)
    lru.put("a", None, 4)
    outcomes = lru.apply_batch(
        [BatchEntry("a", 4), BatchEntry("b", 3), BatchEntry("b", 3), BatchEntry("c")],
        replace_present=False,
    )
    assert outcomes == [Outcome.HIT, Outcome.STORED, Outcome.HIT, Outcome.MISSING]


def test_batch_never_evicts_an_item_it_refers_to() -> None:
    lru: ByteLRU[None] = ByteLRU(10)
    lru.put("old", None, 3)
    lru.put("a", None, 3)
    lru.put("b", None, 3)
    # a is the oldest batch reference; inserting c (4) may only evict "old".
    outcomes = lru.apply_batch(
        [BatchEntry("a"), BatchEntry("c", 4, None), BatchEntry("b")], replace_present=True
    )
    assert outcomes == [Outcome.HIT, Outcome.STORED, Outcome.HIT]
    assert set(lru.keys()) == {"a", "b", "c"}
    # d (5) would need room held by a, b or c, all in this batch: not stored.
    outcomes = lru.apply_batch(
        [BatchEntry("a"), BatchEntry("b"), BatchEntry("c"), BatchEntry("d", 5, None)],
        replace_present=True,
    )
    assert outcomes == [Outcome.HIT, Outcome.HIT, Outcome.HIT, Outcome.UNCACHED]
    assert set(lru.keys()) == {"a", "b", "c"}


def test_touch_first_protects_batch_items_from_its_inserts() -> None:
    lru: ByteLRU[None] = ByteLRU(9)
    for key in "abc":
        lru.put(key, None, 3)
    # "a" is least recently used, but the batch refers to it: d evicts b.
    outcomes = lru.apply_batch([BatchEntry("d", 3, None), BatchEntry("a")], replace_present=True)
    assert outcomes == [Outcome.STORED, Outcome.HIT]
    assert set(lru.keys()) == {"a", "c", "d"}


def test_resize_evicts_to_fit() -> None:
    lru: ByteLRU[None] = ByteLRU(10)
    for key in "abc":
        lru.put(key, None, 3)
    lru.resize(5)
    assert list(lru.keys()) == ["c"] and lru.used == 3


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ByteLRU(-1)
    with pytest.raises(ValueError, match="max_items must be >= 1"):
        ByteLRU(10, max_items=0)


def test_max_items_evicts_the_least_recently_used_beyond_the_count() -> None:
    evicted: list[str] = []
    lru: ByteLRU[None] = ByteLRU(100, on_evict=lambda k, _v, _s: evicted.append(k), max_items=2)
    for key in "abc":
        lru.put(key, None, 1)  # bytes to spare: the count alone evicts
    assert evicted == ["a"] and list(lru.keys()) == ["b", "c"] and lru.used == 2
    assert lru.put("c", None, 5) == Outcome.REPLACED  # a replacement takes no new slot
    assert evicted == ["a"] and list(lru.keys()) == ["b", "c"]


def test_max_items_never_evicts_an_item_the_batch_refers_to() -> None:
    lru: ByteLRU[None] = ByteLRU(100, max_items=2)
    # More new items than slots: the batch keeps its first two.
    outcomes = lru.apply_batch(
        [BatchEntry("x", 1, None), BatchEntry("y", 1, None), BatchEntry("z", 1, None)],
        replace_present=True,
    )
    assert outcomes == [Outcome.STORED, Outcome.STORED, Outcome.UNCACHED]
    assert set(lru.keys()) == {"x", "y"}
    # x is referred to, so a new item may take only y's slot...
    outcomes = lru.apply_batch([BatchEntry("x"), BatchEntry("n", 1, None)], replace_present=True)
    assert outcomes == [Outcome.HIT, Outcome.STORED] and set(lru.keys()) == {"x", "n"}
    # ...and none when both held items are in the batch.
    outcomes = lru.apply_batch(
        [BatchEntry("x"), BatchEntry("n"), BatchEntry("m", 1, None)], replace_present=True
    )
    assert outcomes == [Outcome.HIT, Outcome.HIT, Outcome.UNCACHED]
    assert set(lru.keys()) == {"x", "n"}


def test_resize_to_fewer_items_evicts_the_oldest() -> None:
    lru: ByteLRU[None] = ByteLRU(100)
    for key in "abcd":
        lru.put(key, None, 1)
    lru.resize(100, max_items=2)
    assert list(lru.keys()) == ["c", "d"] and lru.max_items == 2
    lru.resize(100)  # None: bounded by bytes alone again
    for key in "efg":
        lru.put(key, None, 1)
    assert len(lru) == 5


@pytest.mark.parametrize("seed", range(3))
def test_count_bound_agrees_with_cachetools_over_long_random_sequences(seed: int) -> None:
    # Bytes to spare, so only the count bounds it: cachetools' LRUCache of
    # maxsize 5 with its default size of 1 per entry is the oracle.
    rng = random.Random(seed)
    oracle: cachetools.LRUCache[str, int] = cachetools.LRUCache(5)
    lru: ByteLRU[None] = ByteLRU(1 << 30, max_items=5)
    keys = [f"h{i}" for i in range(14)]
    for _ in range(2000):
        batch = rng.choices(keys, k=rng.randint(1, 4))  # fewer than 5: pinning never binds
        expected = oracle_batch(oracle, [(k, 1) for k in batch])
        got = lru.apply_batch([BatchEntry(k, 1) for k in batch], replace_present=False)
        assert [o == Outcome.HIT for o in got] == expected
        assert set(lru.keys()) == set(oracle.keys())


@pytest.mark.parametrize("seed", range(5))
def test_mirror_rule_agrees_with_cachetools_over_long_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    capacity = 1000
    oracle: cachetools.LRUCache[str, int] = cachetools.LRUCache(capacity, getsizeof=lambda v: v)
    lru: ByteLRU[None] = ByteLRU(capacity)
    sizes = {f"h{i}": rng.randint(1, 120) for i in range(60)}
    sizes["too-big"] = capacity + 1
    for _ in range(3000):
        keys = rng.choices(list(sizes), k=rng.randint(1, 4))
        batch = [(k, sizes[k]) for k in keys]
        expected = oracle_batch(oracle, batch)
        got = lru.apply_batch([BatchEntry(k, s) for k, s in batch], replace_present=False)
        assert [o == Outcome.HIT for o in got] == expected
        assert set(lru.keys()) == set(oracle.keys())
        assert lru.used == oracle.currsize


def test_a_pinned_entry_is_never_evicted_and_counts_in_both_bounds() -> None:
    evicted: list[str] = []
    lru: ByteLRU[str] = ByteLRU(9, lambda k, _v, _s: evicted.append(k), max_items=3)
    for key in "abc":
        lru.put(key, key, 3)
    assert lru.pin("a") and not lru.pin("ghost")
    assert lru.pinned_bytes == 3 and lru.pinned_count == 1 and lru.used == 9
    lru.put("d", "d", 3)  # a is the oldest, but pinned: b goes
    assert evicted == ["b"] and "a" in lru and lru.peek("a") == "a"
    # Room beside the pinned entry and the batch: 9 - 3 = 6 at most.
    assert lru.apply_batch([BatchEntry("e", 7, "e")], replace_present=True) == [Outcome.UNCACHED]
    lru.unpin("a")  # back in the order, as the most recently used
    assert list(lru.keys()) == ["c", "d", "a"] and lru.pinned_bytes == 0
    lru.put("f", "f", 3)
    assert evicted == ["b", "c"]


def test_every_entry_pinned_leaves_no_room_and_loses_nothing() -> None:
    lru: ByteLRU[None] = ByteLRU(6, max_items=2)
    lru.put("a", None, 3)
    lru.put("b", None, 3)
    lru.pin("a")
    lru.pin("b")
    assert lru.apply_batch([BatchEntry("c", 1)], replace_present=True) == [Outcome.UNCACHED]
    assert sorted(lru.keys()) == ["a", "b"] and lru.used == 6


def test_sent_data_replaces_a_pinned_entry_which_stays_pinned() -> None:
    lru: ByteLRU[str] = ByteLRU(10)
    lru.put("a", "old", 3)
    lru.pin("a")
    assert lru.put("a", "new", 4) == Outcome.REPLACED
    assert lru.peek("a") == "new" and lru.pinned_bytes == 4 and lru.used == 4


def test_a_pinned_entry_whose_new_data_cannot_fit_is_kept() -> None:
    lru: ByteLRU[str] = ByteLRU(10)
    lru.put("a", "old", 4)
    lru.put("b", "b", 4)
    lru.pin("a")
    lru.pin("b")
    # No room for 8 bytes beside b: UNCACHED, and a (promised) stays as it was.
    assert lru.put("a", "new", 8) == Outcome.UNCACHED
    assert lru.apply_batch([BatchEntry("a", 8, "new")], replace_present=True) == [Outcome.UNCACHED]
    assert lru.peek("a") == "old" and lru.used == 8
    lru.unpin("a")  # unpinned, the same call drops the stale entry
    assert lru.put("a", "new", 8) == Outcome.UNCACHED and "a" not in lru


def test_clear_can_keep_pinned_entries() -> None:
    lru: ByteLRU[None] = ByteLRU(10)
    for key in "abc":
        lru.put(key, None, 2)
    lru.pin("b")
    assert sorted(lru.clear(keep_pinned=True)) == ["a", "c"]
    assert list(lru.keys()) == ["b"] and lru.used == 2
    assert lru.clear() == ["b"] and lru.used == 0 and lru.pinned_bytes == 0


@pytest.mark.parametrize("seed", range(3))
def test_pins_keep_the_bounds_and_never_lose_a_pinned_entry(seed: int) -> None:
    rng = random.Random(seed)
    lru: ByteLRU[None] = ByteLRU(30, max_items=6)  # 3 pinned of up to 12 can fill it
    pinned: set[str] = set()
    for _ in range(3000):
        key = f"k{rng.randrange(20)}"
        action = rng.random()
        if action < 0.5:
            lru.apply_batch([BatchEntry(key, rng.randint(1, 12))], replace_present=True)
        elif action < 0.7 and key in lru and len(pinned) < 3:
            lru.pin(key)
            pinned.add(key)
        elif action < 0.9 and pinned:
            unpinned = rng.choice(sorted(pinned))
            lru.unpin(unpinned)
            pinned.discard(unpinned)
        else:
            lru.touch(key)
        assert lru.used <= 30 and len(lru) <= 6
        assert pinned <= set(lru.keys())  # never lost, whatever is put over it
        assert lru.pinned_bytes == sum(lru.size_of(k) or 0 for k in pinned)


@pytest.mark.parametrize("seed", range(3))
def test_put_is_the_batch_rule_for_one_entry(seed: int) -> None:
    rng = random.Random(seed)
    fast: ByteLRU[int] = ByteLRU(30, max_items=5)
    batch: ByteLRU[int] = ByteLRU(30, max_items=5)
    for step in range(3000):
        key = f"k{rng.randrange(12)}"
        if rng.random() < 0.15 and key in fast:
            assert fast.pin(key) == batch.pin(key)
        elif rng.random() < 0.15:
            fast.unpin(key)
            batch.unpin(key)
        else:
            size = rng.randint(0, 14)
            outcome = fast.put(key, step, size)
            assert [outcome] == batch.apply_batch(
                [BatchEntry(key, size, step)], replace_present=True
            )
        assert list(fast.keys()) == list(batch.keys())
        assert (fast.used, fast.pinned_bytes) == (batch.used, batch.pinned_bytes)
