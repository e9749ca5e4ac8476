"""Property-based tests (hypothesis) of the LRU, the server's store and the mirror.

Stateful tests: hypothesis runs random sequences of batches, touches, pins,
pops and clears, and after every step the cache must agree with a reference:

- `ByteLRU` in the mirror's mode against the oracle (vLLM's rule on
  cachetools' LRUCache), key for key, in LRU order, byte for byte;
- `ByteLRU` in the server's mode, with pins, against a model of the batch
  rule its docstring states (what must stay, what is UNCACHED, what may be
  evicted and in which order);
- the server's `ItemStore` and the client's `Mirror` together, a single
  client planning its uploads from its mirror, against the same oracle.

Where a batch needs more room than the cache has, vLLM's cache would evict
items of the batch itself while mmcache leaves the newcomers UNCACHED (its
documented departure): there the step checks mmcache's own guarantees and
the oracle starts again from the cache's state.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable

import cachetools
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mmcache._lru import BatchEntry, ByteLRU, Outcome
from mmcache.client._mirror import Mirror
from mmcache.server.cache._store import ItemStore, StoredItem, UploadEntry
from mmcache.v1 import cache_pb2 as pb

from .oracle import oracle_batch

# Few keys, so that batches hit, repeat and evict one another.
KEYS = [f"k{i}" for i in range(7)]
# A machine's bounds: by bytes (sizes 0 to above the capacity) or by count.
BOUNDS = {
    "counted": st.booleans(),
    "capacity": st.integers(0, 40),
    "max_items": st.integers(1, 4),
    "sizes": st.lists(st.integers(0, 45), min_size=len(KEYS), max_size=len(KEYS)),
}
BATCHES = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)
LOTS = 1 << 40  # a bound that never binds

# A few hundred short runs: the whole module stays within seconds, and no
# example database is written.
MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None, database=None)

Oracle = cachetools.LRUCache[str, int]


def lru_order(cache: Oracle) -> list[str]:
    """The oracle's keys from least to most recently used (read from a copy)."""
    clone = copy.copy(cache)
    return [clone.popitem()[0] for _ in range(len(clone))]


def new_oracle(maxsize: int, counted: bool, held: Iterable[tuple[str, int]] = ()) -> Oracle:
    """An LRUCache by bytes (each value its size) or by count, holding `held` in order."""
    cache: Oracle = (
        cachetools.LRUCache(maxsize) if counted else cachetools.LRUCache(maxsize, lambda v: v)
    )
    for key, size in held:
        cache[key] = size
    return cache


def binds(sizes: dict[str, int], keys: list[str], maxsize: int) -> bool:
    """Whether the batch's storable items need more room than the whole cache:
    then vLLM's rule evicts items of the batch itself and mmcache's does not."""
    return sum(sizes[k] for k in set(keys) if sizes[k] <= maxsize) > maxsize


def expected_in_batch(
    held: set[str], keys: list[str], outcomes: list[Outcome], pinned: frozenset[str] = frozenset()
) -> None:
    """The outcomes any batch must have, whatever room it found: a hash alone is a
    HIT exactly when held at its turn, data is STORED over nothing and REPLACED
    over an entry; UNCACHED data drops the entry it was meant to replace unless
    that is pinned."""
    present = set(held)
    for key, outcome in zip(keys, outcomes, strict=True):
        if outcome in (Outcome.HIT, Outcome.MISSING):
            assert outcome == (Outcome.HIT if key in present else Outcome.MISSING)
        elif outcome == Outcome.UNCACHED:
            if key not in pinned:
                present.discard(key)
        else:
            assert outcome == (Outcome.REPLACED if key in present else Outcome.STORED)
            present.add(key)


# -- the mirror's rule against the oracle -----------------------------------------


@MACHINE_SETTINGS
class MirrorRuleAgainstOracle(RuleBasedStateMachine):
    """`ByteLRU.apply_batch(replace_present=False)`, bounded by bytes or by count."""

    def __init__(self) -> None:
        super().__init__()
        self.lru: ByteLRU[None] = ByteLRU(0)
        self.oracle = new_oracle(0, counted=False)
        self.sizes: dict[str, int] = {}
        self.counted = False
        self.maxsize = 0

    @initialize(**BOUNDS)
    def start(self, counted: bool, capacity: int, max_items: int, sizes: list[int]) -> None:
        self.counted = counted
        if counted:  # bytes to spare: only the count binds
            self.maxsize = max_items
            self.lru = ByteLRU(LOTS, max_items=max_items)
            self.sizes = dict.fromkeys(KEYS, 1)
        else:  # sizes from 0 to above the capacity
            self.maxsize = capacity
            self.lru = ByteLRU(capacity)
            self.sizes = dict(zip(KEYS, sizes, strict=True))
        self.oracle = new_oracle(self.maxsize, counted)

    @rule(keys=BATCHES)
    def batch(self, keys: list[str]) -> None:
        held = set(self.lru.keys())
        entries: list[BatchEntry[None]] = [BatchEntry(k, self.sizes[k]) for k in keys]
        outcomes = self.lru.apply_batch(entries, replace_present=False)
        expected_in_batch(held, keys, outcomes)
        assert Outcome.REPLACED not in outcomes  # the mirror's mode: held data is a hit
        if not binds(self.sizes, keys, self.maxsize):
            hits = oracle_batch(self.oracle, [(k, self.sizes[k]) for k in keys])
            assert [o == Outcome.HIT for o in outcomes] == hits
            assert list(self.lru.keys()) == lru_order(self.oracle)
            assert self.lru.used == self.oracle.currsize  # bytes, or (all sizes 1) entries
            return
        # mmcache's departure: the batch keeps every item it refers to.
        assert held & set(keys) <= set(self.lru.keys())
        self.oracle = new_oracle(self.maxsize, self.counted, zip(*self.lru.sizes(), strict=True))

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: str) -> None:
        assert self.lru.touch(key) == (key in self.oracle)
        if key in self.oracle:
            self.oracle[key]  # a read is cachetools' touch
        assert list(self.lru.keys()) == lru_order(self.oracle)

    @invariant()
    def within_bounds(self) -> None:
        keys, sizes = self.lru.sizes()
        assert self.lru.used == sum(sizes) and len(keys) == len(self.lru) == len(set(keys))
        assert self.lru.used <= self.lru.capacity
        assert len(self.lru) <= (self.lru.max_items or LOTS)
        assert all(sizes[i] == self.sizes[k] for i, k in enumerate(keys))


TestMirrorRuleAgainstOracle = MirrorRuleAgainstOracle.TestCase


# -- the server's rule, with pins, against a model of it --------------------------

SIZES = st.integers(0, 8) | st.integers(0, 35)  # mostly small, now and then too large


@MACHINE_SETTINGS
class ServerRuleWithPins(RuleBasedStateMachine):
    """`ByteLRU.apply_batch(replace_present=True)` and `put`, `pin`, `unpin`, `pop`,
    `clear`, under both bounds at once.

    The model holds every entry's value and size, the set of pinned keys and the
    LRU order of the unpinned ones; each step predicts what must happen and the
    evictions reported must be the least recently used entries it may evict.
    """

    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[str] = []
        self.lru: ByteLRU[int] = ByteLRU(0)
        self.capacity = 0
        self.max_items: int | None = None
        self.entries: dict[str, tuple[int, int]] = {}  # key -> (value, size)
        self.pinned: set[str] = set()
        self.order: list[str] = []  # unpinned keys, least recently used first
        self.values = itertools.count()

    @initialize(
        capacity=st.integers(0, 30) | st.integers(15, 30), max_items=st.none() | st.integers(1, 5)
    )
    def start(self, capacity: int, max_items: int | None) -> None:
        self.capacity, self.max_items = capacity, max_items
        self.lru = ByteLRU(capacity, lambda k, _v, _s: self.evicted.append(k), max_items=max_items)

    def apply(self, entries: list[tuple[str, int | None, int]], outcomes: list[Outcome]) -> None:
        """Check one batch's outcomes and evictions against the rule; update the model."""
        batch = {k for k, _, _ in entries}
        evictable = [k for k in self.order if k not in batch]
        # The evictions are the least recently used entries outside the batch.
        assert self.evicted == evictable[: len(self.evicted)]
        for key in self.evicted:
            del self.entries[key]
        recent = [k for k in self.order if k in batch]  # touched first, in some order
        for (key, size, value), outcome in zip(entries, outcomes, strict=True):
            held = self.entries.get(key)
            if size is None:
                assert outcome == (Outcome.MISSING if held is None else Outcome.HIT)
                if held is not None and key in recent:
                    recent.remove(key)
                    recent.append(key)
                continue
            # What must stay: the batch's entries held now and every pinned one.
            stay = [k for k in self.entries if (k in batch or k in self.pinned) and k != key]
            room = self.capacity - sum(self.entries[k][1] for k in stay)
            full = self.max_items is not None and len(stay) >= self.max_items
            if full or size > room:
                assert outcome == Outcome.UNCACHED
                if held is not None and key not in self.pinned:
                    del self.entries[key]  # never left serving old data
                    recent.remove(key)
                continue
            assert outcome == (Outcome.STORED if held is None else Outcome.REPLACED)
            self.entries[key] = (value, size)
            if key in recent:
                recent.remove(key)
            if key not in self.pinned:  # a leased entry stays leased
                recent.append(key)
        self.order = evictable[len(self.evicted) :] + recent
        self.evicted = []

    @rule(
        entries=st.lists(
            st.tuples(st.sampled_from(KEYS), st.one_of(st.none(), SIZES, SIZES)),
            min_size=1,
            max_size=4,
        )
    )
    def batch(self, entries: list[tuple[str, int | None]]) -> None:
        sent = [(k, s, next(self.values)) for k, s in entries]
        outcomes = self.lru.apply_batch(
            [BatchEntry(k, s, None if s is None else v) for k, s, v in sent],
            replace_present=True,
        )
        before = dict(self.entries)
        expected_in_batch(set(before), [k for k, _ in entries], outcomes, frozenset(self.pinned))
        self.apply(sent, outcomes)
        # Data sent and stored is the data held; unchanged entries keep their value.
        for key, (value, size) in self.entries.items():
            if key not in {k for k, s in entries if s is not None}:
                assert (value, size) == before[key]

    @rule(key=st.sampled_from(KEYS), size=SIZES)
    def put(self, key: str, size: int) -> None:
        """`put` is the batch rule for a batch of one."""
        value = next(self.values)
        outcome = self.lru.put(key, value, size)
        self.apply([(key, size, value)], [outcome])

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.entries) or KEYS) | st.sampled_from(KEYS))
        assert self.lru.pin(key) == (key in self.entries)
        if key in self.entries:
            self.pinned.add(key)
            if key in self.order:
                self.order.remove(key)

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pinned)))
        self.lru.unpin(key)
        self.pinned.discard(key)
        self.order.append(key)  # back in the order, as the most recently used

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: str) -> None:
        assert self.lru.touch(key) == (key in self.entries)
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)

    @rule(key=st.sampled_from(KEYS))
    def pop(self, key: str) -> None:
        held = self.entries.pop(key, None)
        assert self.lru.pop(key) == (None if held is None else held[0])
        self.pinned.discard(key)
        if key in self.order:
            self.order.remove(key)

    @precondition(lambda self: len(self.entries) >= 4)  # not so often that all stays empty
    @rule(keep_pinned=st.booleans())
    def clear(self, keep_pinned: bool) -> None:
        removed = self.lru.clear(keep_pinned=keep_pinned)
        kept = self.pinned if keep_pinned else set()
        assert sorted(removed) == sorted(set(self.entries) - kept)
        self.entries = {k: v for k, v in self.entries.items() if k in kept}
        self.pinned &= kept
        self.order = []
        assert not self.evicted  # removed, not evicted

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert {k: (v, s) for k, v, s in self.lru.items()} == self.entries
        keys = list(self.lru.keys())  # the unpinned ones in LRU order, then the pinned ones
        assert [k for k in keys if not self.lru.is_pinned(k)] == self.order
        assert {k for k in keys if self.lru.is_pinned(k)} == self.pinned
        assert self.lru.pinned_count == len(self.pinned)
        assert self.lru.pinned_bytes == sum(self.entries[k][1] for k in self.pinned)

    @invariant()
    def within_bounds(self) -> None:
        assert self.lru.used == sum(size for _, _, size in self.lru.items())
        assert self.lru.used <= self.capacity
        assert len(self.lru) <= (self.max_items or LOTS)


TestServerRuleWithPins = ServerRuleWithPins.TestCase


# -- a single client: its mirror and the server's store, against the oracle -------


@MACHINE_SETTINGS
class MirrorAndStoreAgainstOracle(RuleBasedStateMachine):
    """The client plans each batch from its mirror (data only for what it does not
    hold), the store applies it, the mirror applies the reply: the three agree."""

    def __init__(self) -> None:
        super().__init__()
        self.store = ItemStore(LOTS, max_items=1, lease_s=30.0)
        self.mirror = Mirror("i")
        self.oracle = new_oracle(0, counted=False)
        self.sizes: dict[str, int] = {}
        self.counted = False
        self.maxsize = 0
        self.changes: list[tuple[int, str, int]] = []
        self.held_by_feed: dict[str, int] = {}
        self.seq = 0
        self.touched = False  # touches the store has yet to get

    @initialize(**BOUNDS)
    def start(self, counted: bool, capacity: int, max_items: int, sizes: list[int]) -> None:
        self.counted = counted
        self.maxsize = max_items if counted else capacity
        self.sizes = dict.fromkeys(KEYS, 1) if counted else dict(zip(KEYS, sizes, strict=True))
        self.store = ItemStore(
            LOTS if counted else capacity,
            max_items=max_items if counted else 1 << 30,
            lease_s=30.0,
        )
        self.store.changes.subscribe(lambda c: self.changes.append((c.kind, c.key, c.size)))
        self.mirror = Mirror("i", self.store.capacity, self.store.max_items)
        self.oracle = new_oracle(self.maxsize, counted)

    @rule(keys=BATCHES)
    def batch(self, keys: list[str]) -> None:
        send = self.mirror.plan(keys, [True] * len(keys))
        entries = [
            UploadEntry(k, StoredItem(b"", (), 0, self.sizes[k])) if data else UploadEntry(k)
            for k, data in zip(keys, send, strict=True)
        ]
        held = set(self.store.keys())
        result = self.store.update(self.mirror.take_touches(), entries)
        self.touched = False
        expected_in_batch(held, keys, result.outcomes)
        assert Outcome.REPLACED not in result.outcomes  # held data is never sent again
        assert held & set(keys) <= set(self.store.keys())  # the batch keeps what it refers to
        self.seq += 1
        call = self.mirror.call_started()
        self.mirror.apply_reply(
            "i",
            self.store.capacity,
            self.store.max_items,
            self.seq,
            keys,
            result.outcomes,
            result.sizes,
            result.evicted,
        )
        self.mirror.call_ended(call)
        if not binds(self.sizes, keys, self.maxsize):
            hits = oracle_batch(self.oracle, [(k, self.sizes[k]) for k in keys])
            assert [o == Outcome.HIT for o in result.outcomes] == hits
            assert self.store.keys() == lru_order(self.oracle)
        else:
            now = self.store.keys()
            self.oracle = new_oracle(self.maxsize, self.counted, [(k, self.sizes[k]) for k in now])

    @rule(keys=BATCHES)
    def touch(self, keys: list[str]) -> None:
        """Touched locally now; the store gets the touches with the next batch."""
        for key in keys:
            self.mirror.touch(key)
            if key in self.oracle:
                self.oracle[key]
                self.touched = True
        assert self.mirror.keys() == lru_order(self.oracle)

    @invariant()
    def mirror_is_the_store(self) -> None:
        if not self.touched:
            assert self.mirror.keys() == self.store.keys()  # in LRU order too
        held = self.mirror.keys()
        assert sorted(held) == sorted(self.store.keys())
        assert all(self.mirror.size_of(k) == self.sizes[k] for k in held)
        assert self.mirror.used == self.store.used <= self.store.capacity
        assert len(self.store) <= self.store.max_items

    @invariant()
    def the_change_feed_tells_the_same(self) -> None:
        # What a subscriber would hold, from the store's changes alone.
        for kind, key, size in self.changes:
            if kind == pb.CHANGE_STORED:
                self.held_by_feed[key] = size
            elif kind == pb.CHANGE_REMOVED:
                self.held_by_feed.pop(key, None)
        self.changes.clear()
        held = self.store.keys()
        assert self.held_by_feed == {k: self.sizes[k] for k in held}


TestMirrorAndStoreAgainstOracle = MirrorAndStoreAgainstOracle.TestCase
