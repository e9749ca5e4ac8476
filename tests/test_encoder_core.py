"""The encoder budget rule, the per-engine encoder-cache books and their registry."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mmcache import (
    AlreadyExistsError,
    InvalidArgumentError,
    MMCacheError,
    NotFoundError,
    ResourceExhaustedError,
)
from mmcache._encoder import (
    AllocateOp,
    CanAllocateOp,
    CheckAndUpdateCacheOp,
    EncoderBooks,
    EncoderCacheBook,
    EncoderCacheStats,
    EncoderOp,
    FreeEncoderInputOp,
    FreeOp,
    GetCachedMmHashesOp,
    GetFreedMmHashesOp,
    OpResult,
    ResetOp,
    compute_encoder_budget,
)

# ---------------------------------------------------------------- compute_encoder_budget


def test_budget_is_the_configured_one_when_items_are_smaller() -> None:
    assert compute_encoder_budget({"image": 1225, "video": 4000}, 8192, 6000, 8192, False) == (
        8192,
        6000,
    )


def test_budget_grows_to_the_largest_enabled_item() -> None:
    # The disabled modality (0) is ignored; the largest enabled item (1225) wins.
    assert compute_encoder_budget({"image": 1225, "audio": 0}, 100, 200, 8192, False) == (
        1225,
        1225,
    )


@pytest.mark.parametrize("per_item", [{}, {"image": 0, "video": 0}])
def test_budget_is_zero_without_an_enabled_modality(per_item: dict[str, int]) -> None:
    assert compute_encoder_budget(per_item, 8192, 8192, 8192, True) == (0, 0)


def test_unchunked_item_larger_than_a_batch_is_rejected_with_the_numbers() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'video'.*4000.*max_num_batched_tokens.*2048"):
        compute_encoder_budget({"image": 1000, "video": 4000}, 8192, 8192, 2048, True)


def test_chunked_input_allows_items_larger_than_a_batch() -> None:
    assert compute_encoder_budget({"video": 4000}, 100, 100, 2048, False) == (4000, 4000)


def test_unchunked_item_exactly_a_batch_is_accepted() -> None:
    assert compute_encoder_budget({"image": 2048}, 100, 100, 2048, True) == (2048, 2048)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (({"image": -1}, 1, 1, 1, False), "'image'"),
        (({"image": 1}, -2, 1, 1, False), "max_num_encoder_input_tokens"),
        (({"image": 1}, 1, -3, 1, False), "encoder_cache_size"),
        (({"image": 1}, 1, 1, -4, False), "max_num_batched_tokens"),
    ],
)
def test_budget_rejects_negative_inputs(
    args: tuple[dict[str, int], int, int, int, bool], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"{named}.*>= 0, got -\d"):
        compute_encoder_budget(*args)


# ---------------------------------------------------------------- book: sharing


def tokens(book: EncoderCacheBook) -> tuple[int, int, int]:
    return book.free_tokens, book.evictable_tokens, book.referenced_tokens


def test_allocated_entry_is_shared_by_a_second_request() -> None:
    book = EncoderCacheBook(100)
    assert book.check_and_update_cache("r1", "h") is False
    book.allocate("r1", "h", 30)
    assert book.check_and_update_cache("r2", "h") is True
    assert book.get_cached_mm_hashes("r1") == {"h"}
    assert book.get_cached_mm_hashes("r2") == {"h"}
    assert tokens(book) == (70, 0, 30)  # charged once, not per request
    assert (book.hits, book.allocations) == (1, 1)


def test_last_reference_going_makes_the_entry_evictable_not_free() -> None:
    book = EncoderCacheBook(100)
    book.allocate("r1", "h", 30)
    book.check_and_update_cache("r2", "h")
    assert book.free_encoder_input("r1", "h") is True
    assert tokens(book) == (70, 0, 30)  # r2 still holds it
    assert book.free_encoder_input("r2", "h") is True
    assert tokens(book) == (70, 30, 0)
    assert "h" in book
    assert book.get_freed_mm_hashes() == []  # not evicted yet


def test_check_takes_an_evictable_entry_back() -> None:
    book = EncoderCacheBook(40)
    book.allocate("r1", "a", 30)
    book.free("r1")
    assert book.check_and_update_cache("r2", "a") is True
    assert tokens(book) == (10, 0, 30)
    # Taken back, it is no longer a candidate: 20 more cannot be made room for.
    assert book.can_allocate("r3", "b", 20, 100) is False
    assert "a" in book
    assert book.get_freed_mm_hashes() == []


def test_freeing_a_reference_twice_counts_it_once() -> None:
    book = EncoderCacheBook(100)
    book.allocate("r1", "h", 30)
    assert book.check_and_update_cache("r1", "h") is True  # same request again: one reference
    assert book.free_encoder_input("r1", "h") is True
    assert book.free_encoder_input("r1", "h") is False
    assert book.free_encoder_input("stranger", "h") is False
    assert tokens(book) == (70, 30, 0)
    assert book.stats().evictable_entries == 1


def test_free_releases_every_reference_of_the_request_in_the_order_taken() -> None:
    book = EncoderCacheBook(30)
    for h in ("c", "a", "b"):
        book.allocate("r1", h, 10)
    book.allocate("r2", "keep", 0)
    assert book.free("r1") == 3
    assert book.free("r1") == 0
    assert book.get_cached_mm_hashes("r1") == set()
    assert tokens(book) == (0, 30, 0)
    # Evictable in the order r1 took them: c first.
    assert book.can_allocate("r3", "new", 15, 100) is True
    assert book.get_freed_mm_hashes() == ["c", "a"]
    assert book.get_cached_mm_hashes("r2") == {"keep"}


def test_cached_hashes_are_a_copy() -> None:
    book = EncoderCacheBook(10)
    book.allocate("r", "h", 1)
    book.get_cached_mm_hashes("r").clear()
    assert book.get_cached_mm_hashes("r") == {"h"}


def test_zero_token_entry_is_held_and_shared() -> None:
    book = EncoderCacheBook(0)
    assert book.can_allocate("r1", "h", 0, 0) is True
    book.allocate("r1", "h", 0)
    assert book.check_and_update_cache("r2", "h") is True
    assert len(book) == 1
    assert tokens(book) == (0, 0, 0)


# ---------------------------------------------------------------- book: can_allocate


def test_item_beyond_the_compute_budget_is_refused_even_with_room() -> None:
    book = EncoderCacheBook(100)
    assert book.can_allocate("r", "h", 11, 10) is False
    assert book.can_allocate("r", "h", 10, 10) is True


def test_tokens_already_scheduled_count_against_the_room_not_the_compute_budget() -> None:
    book = EncoderCacheBook(10)
    assert book.can_allocate("r", "h", 6, 6, 5) is False  # 6 + 5 > 10 free
    assert book.can_allocate("r", "h", 6, 6, 4) is True  # 6 + 4 fits; 6 <= compute 6


def test_can_allocate_evicts_the_oldest_unreferenced_entries_just_enough() -> None:
    book = EncoderCacheBook(100)
    for h, n in (("a", 20), ("b", 20), ("c", 20), ("live", 20)):
        book.allocate("r-" + h, h, n)
    for h in ("b", "a", "c"):  # evictable order: b, a, c
        book.free("r-" + h)
    assert tokens(book) == (20, 60, 20)
    assert book.can_allocate("r", "new", 50, 100) is True  # needs 30 more: b then a
    assert book.get_freed_mm_hashes() == ["b", "a"]
    assert book.get_freed_mm_hashes() == []  # reported once
    assert "c" in book
    assert "live" in book
    assert "a" not in book
    assert tokens(book) == (60, 20, 20)
    assert book.evictions == 2
    book.allocate("r", "new", 50)
    assert tokens(book) == (10, 20, 70)


def test_can_allocate_that_cannot_fit_evicts_nothing() -> None:
    book = EncoderCacheBook(100)
    book.allocate("r1", "live", 60)
    book.allocate("r2", "old", 30)
    book.free("r2")
    assert book.can_allocate("r3", "new", 41, 100) is False  # 10 free + 30 evictable < 41
    assert "old" in book
    assert book.get_freed_mm_hashes() == []
    assert tokens(book) == (10, 30, 60)
    assert book.evictions == 0


def test_referenced_entries_are_never_evicted() -> None:
    book = EncoderCacheBook(50)
    book.allocate("r1", "a", 25)
    book.allocate("r2", "b", 25)
    book.free("r2")
    book.check_and_update_cache("r3", "b")  # b referenced again
    assert book.can_allocate("r4", "c", 1, 100) is False
    assert book.get_freed_mm_hashes() == []
    assert book.get_cached_mm_hashes("r1") == {"a"}
    assert book.get_cached_mm_hashes("r3") == {"b"}


def test_can_allocate_for_a_held_hash_points_to_check_and_update_cache() -> None:
    book = EncoderCacheBook(10)
    book.allocate("r1", "h", 5)
    book.free("r1")
    with pytest.raises(AlreadyExistsError, match="check_and_update_cache"):
        book.can_allocate("r2", "h", 5, 10)
    assert tokens(book) == (5, 5, 0)  # not evicted, not taken back


# ---------------------------------------------------------------- book: errors


def test_allocate_without_room_is_resource_exhausted_with_the_numbers() -> None:
    book = EncoderCacheBook(100)
    book.allocate("r1", "a", 70)
    book.free("r1")
    book.allocate("r2", "b", 20)
    with pytest.raises(
        ResourceExhaustedError, match=r"15 .*'c'.*10 of 100 are free \(70 evictable"
    ):
        book.allocate("r3", "c", 15)  # allocate never evicts
    assert "c" not in book
    assert tokens(book) == (10, 70, 20)
    assert book.get_cached_mm_hashes("r3") == set()
    assert book.allocations == 2


@pytest.mark.parametrize("release", [False, True])
def test_allocating_a_held_hash_is_already_exists(release: bool) -> None:
    book = EncoderCacheBook(100)
    book.allocate("r1", "h", 10)
    if release:
        book.free("r1")
    with pytest.raises(AlreadyExistsError, match=r"'h'.*10 tokens.*check_and_update_cache"):
        book.allocate("r2", "h", 10)
    assert book.get_cached_mm_hashes("r2") == set()
    assert book.allocations == 1


BOOK_CALLS: dict[str, Callable[[EncoderCacheBook], object]] = {
    "check/request": lambda b: b.check_and_update_cache("", "h"),
    "check/hash": lambda b: b.check_and_update_cache("r", ""),
    "can_allocate/request": lambda b: b.can_allocate("", "h", 1, 1),
    "can_allocate/hash": lambda b: b.can_allocate("r", "", 1, 1),
    "can_allocate/tokens": lambda b: b.can_allocate("r", "h", -1, 1),
    "can_allocate/budget": lambda b: b.can_allocate("r", "h", 1, -1),
    "can_allocate/scheduled": lambda b: b.can_allocate("r", "h", 1, 1, -1),
    "allocate/request": lambda b: b.allocate("", "h", 1),
    "allocate/hash": lambda b: b.allocate("r", "", 1),
    "allocate/tokens": lambda b: b.allocate("r", "h", -1),
    "cached/request": lambda b: b.get_cached_mm_hashes(""),
    "free_input/request": lambda b: b.free_encoder_input("", "h"),
    "free_input/hash": lambda b: b.free_encoder_input("r", ""),
    "free/request": lambda b: b.free(""),
}


@pytest.mark.parametrize("call", BOOK_CALLS.values(), ids=BOOK_CALLS.keys())
def test_empty_ids_and_negative_sizes_are_invalid_and_change_nothing(
    call: Callable[[EncoderCacheBook], object],
) -> None:
    book = EncoderCacheBook(10)
    book.allocate("r", "held", 4)
    before = book.stats()
    with pytest.raises(InvalidArgumentError, match=r"must not be empty|>= 0, got -1"):
        call(book)
    assert book.stats() == before


def test_negative_cache_size_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="-5"):
        EncoderCacheBook(-5)


# ---------------------------------------------------------------- book: reset and stats


def test_reset_forgets_entries_and_pending_frees_but_keeps_counters() -> None:
    book = EncoderCacheBook(10)
    book.allocate("r1", "a", 6)
    book.free("r1")
    book.check_and_update_cache("r2", "a")
    book.free("r2")
    assert book.can_allocate("r3", "b", 10, 10) is True  # evicts a
    book.allocate("r3", "b", 10)
    book.reset()
    assert len(book) == 0
    assert tokens(book) == (10, 0, 0)
    assert book.get_cached_mm_hashes("r3") == set()
    assert book.get_freed_mm_hashes() == []
    assert (book.allocations, book.evictions, book.hits) == (2, 1, 1)
    assert book.check_and_update_cache("r3", "b") is False


def test_stats_snapshot() -> None:
    book = EncoderCacheBook(100)
    book.allocate("r1", "a", 10)
    book.allocate("r1", "b", 20)
    book.allocate("r2", "c", 30)
    book.check_and_update_cache("r2", "a")
    book.check_and_update_cache("r2", "zzz")
    book.free("r1")
    assert book.stats() == EncoderCacheStats(
        cache_size=100,
        free_tokens=40,
        evictable_tokens=20,
        referenced_tokens=40,
        entries=3,
        evictable_entries=1,
        requests=1,
        allocations=3,
        evictions=0,
        hits=1,
    )


# ---------------------------------------------------------------- batch


def test_batch_applies_in_order_and_returns_each_result() -> None:
    book = EncoderCacheBook(10)
    outcome = book.apply_batch(
        [
            CheckAndUpdateCacheOp("r1", "a"),
            CanAllocateOp("r1", "a", 6, 10),
            AllocateOp("r1", "a", 6),
            CheckAndUpdateCacheOp("r2", "a"),
            GetCachedMmHashesOp("r2"),
            FreeEncoderInputOp("r2", "a"),
            FreeOp("r1"),
            CanAllocateOp("r3", "b", 8, 10),
            GetFreedMmHashesOp(),
            ResetOp(),
        ]
    )
    assert outcome.failed_index is None
    assert outcome.error is None
    assert outcome.results == [False, True, None, True, {"a"}, True, 1, True, ["a"], None]
    assert len(book) == 0
    assert book.evictions == 1


def test_batch_stops_at_the_first_failure_and_keeps_what_came_before() -> None:
    book = EncoderCacheBook(10)
    outcome = book.apply_batch(
        [
            AllocateOp("r1", "a", 4),
            AllocateOp("r1", "b", 7),  # 7 > 6 free
            AllocateOp("r1", "c", 1),  # not applied
        ]
    )
    assert outcome.results == [None]
    assert outcome.failed_index == 1
    assert isinstance(outcome.error, ResourceExhaustedError)
    assert "a" in book
    assert "b" not in book
    assert "c" not in book


def test_batch_reports_invalid_ops_as_failures() -> None:
    book = EncoderCacheBook(10)
    outcome = book.apply_batch([FreeOp("r"), CheckAndUpdateCacheOp("", "h")])
    assert outcome.results == [0]
    assert outcome.failed_index == 1
    assert isinstance(outcome.error, InvalidArgumentError)


# ---------------------------------------------------------------- registry


def test_books_are_created_found_listed_and_deleted() -> None:
    books = EncoderBooks()
    a = books.create("engine-b", 100)
    b = books.create("engine-a", 50)
    assert books.get("engine-b") is a
    assert books.get("engine-a") is b
    assert books.list() == ["engine-a", "engine-b"]
    assert list(books.stats()) == ["engine-a", "engine-b"]
    assert books.stats()["engine-a"].cache_size == 50
    books.delete("engine-b")
    assert books.list() == ["engine-a"]
    assert "engine-b" not in books
    assert len(books) == 1


def test_books_are_independent() -> None:
    books = EncoderBooks()
    books.create("e1", 10).allocate("r", "h", 10)
    books.create("e2", 10)
    assert books.get("e2").check_and_update_cache("r", "h") is False
    assert books.get("e2").free_tokens == 10
    assert books.get("e1").free_tokens == 0


def test_creating_an_existing_book_needs_replace() -> None:
    books = EncoderBooks()
    old = books.create("e", 10)
    old.allocate("r", "h", 3)
    with pytest.raises(AlreadyExistsError, match=r"'e'.*10 tokens.*replace"):
        books.create("e", 20)
    assert books.get("e") is old
    new = books.create("e", 20, replace=True)
    assert books.get("e") is new
    assert new.cache_size == 20
    assert "h" not in new


def test_invalid_replacement_keeps_the_old_book() -> None:
    books = EncoderBooks()
    old = books.create("e", 10)
    with pytest.raises(InvalidArgumentError, match="-1"):
        books.create("e", -1, replace=True)
    assert books.get("e") is old


def test_unknown_engine_is_not_found_with_advice() -> None:
    books = EncoderBooks()
    with pytest.raises(NotFoundError, match="unknown engine 'x'; create"):
        books.get("x")
    with pytest.raises(NotFoundError, match="unknown engine 'x'"):
        books.delete("x")


def test_empty_engine_id_is_invalid() -> None:
    books = EncoderBooks()
    with pytest.raises(InvalidArgumentError, match="engine_id"):
        books.create("", 10)
    with pytest.raises(InvalidArgumentError, match="engine_id"):
        books.get("")
    assert len(books) == 0


# ---------------------------------------------------------------- random schedules


class Model:
    """A deliberately plain book: lists and linear scans, sums instead of counters."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.tokens: dict[str, int] = {}  # held entries
        self.refs: dict[str, list[str]] = {}  # request -> hashes, in the order taken
        self.queue: list[str] = []  # unreferenced entries, oldest first
        self.pending: list[str] = []  # evicted, not yet reported
        self.reported: list[str] = []  # every eviction that must be reported
        self.allocations = self.evictions = self.hits = 0

    def holders(self, mm_hash: str) -> list[str]:
        return [r for r, hs in self.refs.items() if mm_hash in hs]

    def free_tokens(self) -> int:
        return self.size - sum(self.tokens.values())

    def queued_tokens(self) -> int:
        return sum(self.tokens[h] for h in self.queue)

    def apply(self, op: EncoderOp) -> OpResult:
        if isinstance(op, CheckAndUpdateCacheOp):
            if op.mm_hash not in self.tokens:
                return False
            if op.mm_hash in self.queue:
                self.queue.remove(op.mm_hash)
            taken = self.refs.setdefault(op.request_id, [])
            if op.mm_hash not in taken:
                taken.append(op.mm_hash)
            self.hits += 1
            return True
        if isinstance(op, CanAllocateOp):
            if op.mm_hash in self.tokens:
                raise AlreadyExistsError
            if op.num_tokens > op.compute_budget:
                return False
            need = op.num_tokens + op.tokens_already_scheduled
            if need > self.free_tokens() + self.queued_tokens():
                return False
            while need > self.free_tokens():
                victim = self.queue.pop(0)
                assert not self.holders(victim)
                del self.tokens[victim]
                self.pending.append(victim)
                self.evictions += 1
            return True
        if isinstance(op, AllocateOp):
            if op.mm_hash in self.tokens:
                raise AlreadyExistsError
            if op.num_tokens > self.free_tokens():
                raise ResourceExhaustedError
            self.tokens[op.mm_hash] = op.num_tokens
            self.refs.setdefault(op.request_id, []).append(op.mm_hash)
            self.allocations += 1
            return None
        if isinstance(op, GetCachedMmHashesOp):
            return set(self.refs.get(op.request_id, []))
        if isinstance(op, FreeEncoderInputOp):
            if op.mm_hash not in self.refs.get(op.request_id, []):
                return False
            self.release(op.request_id, op.mm_hash)
            return True
        if isinstance(op, FreeOp):
            taken = list(self.refs.get(op.request_id, []))
            for mm_hash in taken:
                self.release(op.request_id, mm_hash)
            return len(taken)
        if isinstance(op, GetFreedMmHashesOp):
            out, self.pending = self.pending, []
            self.reported += out
            return out
        assert isinstance(op, ResetOp)
        self.tokens.clear()
        self.refs.clear()
        self.queue.clear()
        self.pending.clear()  # dropped with the workers' caches, never reported
        return None

    def release(self, request_id: str, mm_hash: str) -> None:
        self.refs[request_id].remove(mm_hash)
        if not self.refs[request_id]:
            del self.refs[request_id]
        if not self.holders(mm_hash):
            self.queue.append(mm_hash)


CACHE = 120
REQUESTS = [f"req-{i}" for i in range(6)]
HASHES = [f"mm-{i}" for i in range(30)]


def random_op(rng: random.Random, sizes: dict[str, int]) -> EncoderOp:
    r, h = rng.choice(REQUESTS), rng.choice(HASHES)
    kind = rng.choices(range(8), weights=[20, 20, 14, 4, 16, 8, 8, 0.3])[0]
    if kind == 0:
        return CheckAndUpdateCacheOp(r, h)
    if kind == 1:
        scheduled = rng.choice([0, 0, 0, rng.randrange(CACHE // 2)])
        budget = rng.choice([CACHE, sizes[h], max(sizes[h] - 1, 0)])
        return CanAllocateOp(r, h, sizes[h], budget, scheduled)
    if kind == 2:
        return AllocateOp(r, h, sizes[h])
    if kind == 3:
        return GetCachedMmHashesOp(r)
    if kind == 4:
        return FreeEncoderInputOp(r, h)
    if kind == 5:
        return FreeOp(r)
    if kind == 6:
        return GetFreedMmHashesOp()
    return ResetOp()


def apply_both(book: EncoderCacheBook, model: Model, op: EncoderOp) -> OpResult:
    """Apply `op` to both: they must agree on the result, or raise the same class."""
    try:
        expected = model.apply(op)
    except MMCacheError as exc:
        with pytest.raises(type(exc)):
            op.apply(book)
        raise
    assert op.apply(book) == expected, op
    return expected


def check_agreement(book: EncoderCacheBook, model: Model) -> None:
    st = book.stats()
    assert st.free_tokens + st.evictable_tokens + st.referenced_tokens == st.cache_size == CACHE
    assert st.free_tokens == model.free_tokens()
    assert st.evictable_tokens == model.queued_tokens()
    referenced = sum(n for h, n in model.tokens.items() if model.holders(h))
    assert st.referenced_tokens == referenced
    assert (st.entries, st.evictable_entries, st.requests) == (
        len(model.tokens),
        len(model.queue),
        len(model.refs),
    )
    assert (st.allocations, st.evictions, st.hits) == (
        model.allocations,
        model.evictions,
        model.hits,
    )
    for r in REQUESTS:
        held = book.get_cached_mm_hashes(r)
        assert held == set(model.refs.get(r, []))
        # No entry a live request references is ever gone.
        assert all(h in book for h in held)
    assert [h for h in HASHES if h in book] == [h for h in HASHES if h in model.tokens]


def schedule_input(book: EncoderCacheBook, model: Model, r: str, h: str, size: int) -> None:
    """The scheduler's own sequence for one encoder input of a request."""
    if apply_both(book, model, CheckAndUpdateCacheOp(r, h)):
        return
    check_agreement(book, model)
    if apply_both(book, model, CanAllocateOp(r, h, size, CACHE)):
        check_agreement(book, model)
        apply_both(book, model, AllocateOp(r, h, size))  # can_allocate made the room


def freed_in(ops: list[EncoderOp], results: list[OpResult]) -> list[str]:
    return [
        h
        for op, result in zip(ops, results, strict=True)
        if isinstance(op, GetFreedMmHashesOp) and isinstance(result, list)
        for h in result
    ]


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("seed", range(4))
def test_random_schedule_agrees_with_the_model(seed: int, batched: bool) -> None:
    rng = random.Random(seed)
    # One size per hash (content fixes it); the last hash never fits at all.
    sizes = {h: rng.randrange(0, CACHE // 4) for h in HASHES}
    sizes[HASHES[-1]] = CACHE + 1
    book, model = EncoderCacheBook(CACHE), Model(CACHE)
    reported: list[str] = []
    errors: set[type[MMCacheError]] = set()
    ops = 0
    while ops < 3000:
        if batched:
            chunk = [random_op(rng, sizes) for _ in range(rng.randrange(1, 12))]
            outcome = book.apply_batch(chunk)
            expected: list[OpResult] = []
            failure: tuple[int, type[MMCacheError]] | None = None
            for index, op in enumerate(chunk):
                try:
                    expected.append(model.apply(op))
                except MMCacheError as exc:
                    failure = (index, type(exc))
                    break
            if failure is None:
                assert outcome.failed_index is None
                assert outcome.error is None
            else:
                errors.add(failure[1])
                assert outcome.failed_index == failure[0]
                assert type(outcome.error) is failure[1]
            assert outcome.results == expected
            reported += freed_in(chunk[: len(expected)], expected)
            ops += len(chunk)
        elif rng.random() < 0.4:
            schedule_input(book, model, rng.choice(REQUESTS), h := rng.choice(HASHES), sizes[h])
            ops += 1
        else:
            op = random_op(rng, sizes)
            try:
                result = apply_both(book, model, op)
            except MMCacheError as exc:
                errors.add(type(exc))
            else:
                reported += freed_in([op], [result])
            ops += 1
        check_agreement(book, model)
    reported += book.get_freed_mm_hashes()
    model.apply(GetFreedMmHashesOp())
    # Every eviction reported exactly once, in eviction order.
    assert reported == model.reported
    # The schedule exercised what it is meant to check.
    assert model.evictions > 50
    assert model.hits > 50
    assert {AlreadyExistsError, ResourceExhaustedError} <= errors
