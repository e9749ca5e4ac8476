"""Encoder-cache bookkeeping: the budget rule and per-engine books of encoder tokens.

An engine's scheduler plans vision-encoder work against two budgets in encoder
tokens: how much it may encode per step (compute) and how much the encoder
outputs may occupy (cache). A book keeps the cache side for one engine, with
entries shared across requests by content hash (`mm_hash`): an entry lives
while any request references it, then waits, oldest first, to be evicted
when `can_allocate` needs its room. Evictions are reported once through
`get_freed_mm_hashes`, which the scheduler forwards to its workers.

Transport-free: the gRPC servicer and the metrics collector read these
objects; neither appears here. Not thread-safe: the asyncio server calls it
from its one event-loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from ._errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    MMCacheError,
    NotFoundError,
    ResourceExhaustedError,
)

__all__ = [
    "MAX_ENGINE_BOOKS",
    "AllocateOp",
    "BatchOutcome",
    "CanAllocateOp",
    "CheckAndUpdateCacheOp",
    "EncoderBooks",
    "EncoderCacheBook",
    "EncoderCacheStats",
    "EncoderOp",
    "FreeEncoderInputOp",
    "FreeOp",
    "GetCachedMmHashesOp",
    "GetFreedMmHashesOp",
    "OpResult",
    "ResetOp",
    "compute_encoder_budget",
]

# Engines with an encoder book at once: a fleet's worth (each book's memory
# is bounded by its cache_size, which the operator gives).
MAX_ENGINE_BOOKS = 1024


def _check_count(what: str, value: int) -> None:
    if value < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, got {value}")


def _check_id(what: str, value: str) -> None:
    if not value:
        raise InvalidArgumentError(f"{what} must not be empty")


def compute_encoder_budget(
    max_tokens_per_item_by_modality: Mapping[str, int],
    max_num_encoder_input_tokens: int,
    encoder_cache_size: int,
    max_num_batched_tokens: int,
    disable_chunked_mm_input: bool,
) -> tuple[int, int]:
    """Return `(compute_budget, cache_size)` in encoder tokens, as vLLM sizes them.

    Each is at least the largest item of any enabled modality, so one item
    always fits; `(0, 0)` when no modality has a nonzero per-item count. Usage::

        compute, size = compute_encoder_budget(
            {"image": 1225, "video": 0}, 8192, 8192, 8192, False
        )  # (8192, 8192)

    Raises InvalidArgumentError for negative inputs, and when chunked input is
    disabled and the largest item exceeds `max_num_batched_tokens`.
    """
    for modality, tokens in max_tokens_per_item_by_modality.items():
        _check_count(f"max tokens per {modality!r} item", tokens)
    _check_count("max_num_encoder_input_tokens", max_num_encoder_input_tokens)
    _check_count("encoder_cache_size", encoder_cache_size)
    _check_count("max_num_batched_tokens", max_num_batched_tokens)
    enabled = {m: t for m, t in max_tokens_per_item_by_modality.items() if t > 0}
    if not enabled:
        return 0, 0
    modality, largest = max(enabled.items(), key=lambda mt: mt[1])
    if disable_chunked_mm_input and largest > max_num_batched_tokens:
        raise InvalidArgumentError(
            f"chunked multimodal input is disabled, but a {modality!r} item takes up to "
            f"{largest} encoder tokens, more than max_num_batched_tokens "
            f"({max_num_batched_tokens}): raise max_num_batched_tokens to at least {largest} "
            "or enable chunked multimodal input"
        )
    return max(max_num_encoder_input_tokens, largest), max(encoder_cache_size, largest)


@dataclass(frozen=True, slots=True)
class EncoderCacheStats:
    """A snapshot of one book. Tokens: free + evictable + referenced == cache_size.

    The counters only grow over the book's life (`reset` keeps them); a book
    created anew under the same engine id starts them from zero.
    """

    cache_size: int
    free_tokens: int
    evictable_tokens: int  # unreferenced entries, still held until evicted
    referenced_tokens: int
    entries: int
    evictable_entries: int
    requests: int  # requests holding at least one reference
    allocations: int
    evictions: int
    hits: int  # check_and_update_cache calls that found the entry


class _Entry:
    __slots__ = ("refs", "size")

    def __init__(self, size: int, request_id: str) -> None:
        self.size = size
        self.refs = {request_id}


class EncoderCacheBook:
    """The encoder-cache book of one engine: entries shared by `mm_hash`.

    The scheduler's calls, per encoder input of a request::

        book = EncoderCacheBook(cache_size=8192)
        if not book.check_and_update_cache("req-1", h):  # shared hit: no work
            if book.can_allocate("req-1", h, 576, compute_budget, scheduled):
                book.allocate("req-1", h, 576)  # encode it this step
        ...
        book.free("req-1")  # request done: its entries become evictable
        workers_drop(book.get_freed_mm_hashes())

    Every operation is O(1) (plus O(1) per entry evicted or reference
    released); the eviction order lives in an `OrderedDict`.
    """

    __slots__ = (
        "_allocations",
        "_by_request",
        "_cache_size",
        "_entries",
        "_evictable",
        "_evictable_tokens",
        "_evictions",
        "_free",
        "_freed",
        "_hits",
    )

    def __init__(self, cache_size: int) -> None:
        _check_count("encoder cache size", cache_size)
        self._cache_size = cache_size
        self._free = cache_size
        self._evictable_tokens = 0
        self._entries: dict[str, _Entry] = {}
        # Unreferenced entries, oldest first: the eviction order.
        self._evictable: OrderedDict[str, int] = OrderedDict()
        # request -> its hashes, in the order it took them (dict as ordered set),
        # so `free` releases them, and they queue for eviction, deterministically.
        self._by_request: dict[str, dict[str, None]] = {}
        self._freed: list[str] = []
        self._allocations = 0
        self._evictions = 0
        self._hits = 0

    # ------------------------------------------------------------ numbers

    @property
    def cache_size(self) -> int:
        return self._cache_size

    @property
    def free_tokens(self) -> int:
        return self._free

    @property
    def evictable_tokens(self) -> int:
        return self._evictable_tokens

    @property
    def referenced_tokens(self) -> int:
        return self._cache_size - self._free - self._evictable_tokens

    @property
    def allocations(self) -> int:
        return self._allocations

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def hits(self) -> int:
        return self._hits

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def stats(self) -> EncoderCacheStats:
        """A consistent snapshot of the numbers the metrics export."""
        return EncoderCacheStats(
            cache_size=self._cache_size,
            free_tokens=self._free,
            evictable_tokens=self._evictable_tokens,
            referenced_tokens=self.referenced_tokens,
            entries=len(self._entries),
            evictable_entries=len(self._evictable),
            requests=len(self._by_request),
            allocations=self._allocations,
            evictions=self._evictions,
            hits=self._hits,
        )

    # ------------------------------------------------------------ operations

    def check_and_update_cache(self, request_id: str, mm_hash: str) -> bool:
        """True when `mm_hash` is held; the request then references it.

        An entry waiting for eviction is taken back, so it is not evicted.
        """
        _check_id("request_id", request_id)
        _check_id("mm_hash", mm_hash)
        entry = self._entries.get(mm_hash)
        if entry is None:
            return False
        if not entry.refs:
            self._evictable_tokens -= self._evictable.pop(mm_hash)
        entry.refs.add(request_id)
        self._by_request.setdefault(request_id, {})[mm_hash] = None
        self._hits += 1
        return True

    def can_allocate(
        self,
        request_id: str,
        mm_hash: str,
        num_tokens: int,
        compute_budget: int,
        tokens_already_scheduled: int = 0,
    ) -> bool:
        """Whether `num_tokens` more can be encoded this step and held; evicts to make room.

        `compute_budget` is what is left of this step's compute budget;
        `tokens_already_scheduled` are the encoder tokens scheduled this step
        but not yet allocated, so they count against the room needed. When
        free room is short, the oldest unreferenced entries are evicted (and
        reported by `get_freed_mm_hashes`) until it suffices; when even that
        would not suffice, nothing is evicted and the answer is False.
        """
        _check_id("request_id", request_id)
        _check_id("mm_hash", mm_hash)
        _check_count("num_tokens", num_tokens)
        _check_count("compute_budget", compute_budget)
        _check_count("tokens_already_scheduled", tokens_already_scheduled)
        if mm_hash in self._entries:
            # Evicting for a held hash could evict the hash itself.
            raise AlreadyExistsError(
                f"mm_hash {mm_hash!r} is already in the encoder cache: "
                "call check_and_update_cache to reference it instead"
            )
        if num_tokens > compute_budget:
            return False
        needed = num_tokens + tokens_already_scheduled
        if needed <= self._free:
            return True
        if needed > self._free + self._evictable_tokens:
            return False
        while needed > self._free:
            evicted, size = self._evictable.popitem(last=False)
            del self._entries[evicted]
            self._evictable_tokens -= size
            self._free += size
            self._freed.append(evicted)
            self._evictions += 1
        return True

    def allocate(self, request_id: str, mm_hash: str, num_tokens: int) -> None:
        """Hold `num_tokens` for `mm_hash`, referenced by the request.

        Never evicts: call `can_allocate` first. Raises AlreadyExistsError
        for a held hash and ResourceExhaustedError when free room is short.
        """
        _check_id("request_id", request_id)
        _check_id("mm_hash", mm_hash)
        _check_count("num_tokens", num_tokens)
        if mm_hash in self._entries:
            raise AlreadyExistsError(
                f"mm_hash {mm_hash!r} is already in the encoder cache "
                f"({self._entries[mm_hash].size} tokens): "
                "call check_and_update_cache to reference it instead"
            )
        if num_tokens > self._free:
            raise ResourceExhaustedError(
                f"allocating {num_tokens} encoder tokens for {mm_hash!r} needs {num_tokens} "
                f"free tokens, but {self._free} of {self._cache_size} are free "
                f"({self._evictable_tokens} evictable): call can_allocate first, "
                "which evicts to make room"
            )
        self._entries[mm_hash] = _Entry(num_tokens, request_id)
        self._by_request.setdefault(request_id, {})[mm_hash] = None
        self._free -= num_tokens
        self._allocations += 1

    def get_cached_mm_hashes(self, request_id: str) -> set[str]:
        """The hashes the request references (a copy)."""
        _check_id("request_id", request_id)
        return set(self._by_request.get(request_id, ()))

    def free_encoder_input(self, request_id: str, mm_hash: str) -> bool:
        """Drop the request's reference to `mm_hash`; False when it held none.

        The last reference going makes the entry evictable (newest in the
        eviction order); its tokens stay held until `can_allocate` evicts it.
        """
        _check_id("request_id", request_id)
        _check_id("mm_hash", mm_hash)
        hashes = self._by_request.get(request_id)
        if hashes is None or mm_hash not in hashes:
            return False
        del hashes[mm_hash]
        if not hashes:
            del self._by_request[request_id]
        self._release(request_id, mm_hash)
        return True

    def free(self, request_id: str) -> int:
        """Drop every reference of the request, oldest first; returns how many."""
        _check_id("request_id", request_id)
        hashes = self._by_request.pop(request_id, None)
        if hashes is None:
            return 0
        for mm_hash in hashes:
            self._release(request_id, mm_hash)
        return len(hashes)

    def get_freed_mm_hashes(self) -> list[str]:
        """The hashes evicted since the last call, in eviction order; clears them."""
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        """Forget every entry and reference, as when the model weights change.

        Nothing is reported as freed: the workers drop their whole encoder
        cache alongside. The counters are kept.
        """
        self._entries.clear()
        self._evictable.clear()
        self._by_request.clear()
        self._freed = []
        self._free = self._cache_size
        self._evictable_tokens = 0

    def apply_batch(self, ops: Iterable[EncoderOp]) -> BatchOutcome:
        """Apply `ops` in order, stopping at the first that raises an MMCacheError.

        Ops before the failing one keep their effect; the outcome holds their
        results and the failing index and error. Usage::

            outcome = book.apply_batch([CheckAndUpdateCacheOp("r", h), FreeOp("q")])
            if outcome.error is not None: ...
        """
        results: list[OpResult] = []
        for index, op in enumerate(ops):
            try:
                results.append(op.apply(self))
            except MMCacheError as exc:
                return BatchOutcome(results, index, exc)
        return BatchOutcome(results)

    def _release(self, request_id: str, mm_hash: str) -> None:
        entry = self._entries[mm_hash]
        entry.refs.discard(request_id)
        if not entry.refs:
            self._evictable[mm_hash] = entry.size
            self._evictable_tokens += entry.size


# ---------------------------------------------------------------- batch ops

OpResult: TypeAlias = bool | int | set[str] | list[str] | None


@dataclass(frozen=True, slots=True)
class CheckAndUpdateCacheOp:
    request_id: str
    mm_hash: str

    def apply(self, book: EncoderCacheBook) -> bool:
        return book.check_and_update_cache(self.request_id, self.mm_hash)


@dataclass(frozen=True, slots=True)
class CanAllocateOp:
    request_id: str
    mm_hash: str
    num_tokens: int
    compute_budget: int
    tokens_already_scheduled: int = 0

    def apply(self, book: EncoderCacheBook) -> bool:
        return book.can_allocate(
            self.request_id,
            self.mm_hash,
            self.num_tokens,
            self.compute_budget,
            self.tokens_already_scheduled,
        )


@dataclass(frozen=True, slots=True)
class AllocateOp:
    request_id: str
    mm_hash: str
    num_tokens: int

    def apply(self, book: EncoderCacheBook) -> None:
        book.allocate(self.request_id, self.mm_hash, self.num_tokens)


@dataclass(frozen=True, slots=True)
class GetCachedMmHashesOp:
    request_id: str

    def apply(self, book: EncoderCacheBook) -> set[str]:
        return book.get_cached_mm_hashes(self.request_id)


@dataclass(frozen=True, slots=True)
class FreeEncoderInputOp:
    request_id: str
    mm_hash: str

    def apply(self, book: EncoderCacheBook) -> bool:
        return book.free_encoder_input(self.request_id, self.mm_hash)


@dataclass(frozen=True, slots=True)
class FreeOp:
    request_id: str

    def apply(self, book: EncoderCacheBook) -> int:
        return book.free(self.request_id)


@dataclass(frozen=True, slots=True)
class GetFreedMmHashesOp:
    def apply(self, book: EncoderCacheBook) -> list[str]:
        return book.get_freed_mm_hashes()


@dataclass(frozen=True, slots=True)
class ResetOp:
    def apply(self, book: EncoderCacheBook) -> None:
        book.reset()


EncoderOp: TypeAlias = (
    CheckAndUpdateCacheOp
    | CanAllocateOp
    | AllocateOp
    | GetCachedMmHashesOp
    | FreeEncoderInputOp
    | FreeOp
    | GetFreedMmHashesOp
    | ResetOp
)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What `apply_batch` did: one result per op applied, and the failure if any."""

    results: list[OpResult]
    failed_index: int | None = None  # index of the op that raised; later ops not applied
    error: MMCacheError | None = None


# ---------------------------------------------------------------- registry


class EncoderBooks:
    """The books of every engine that shares this service, by engine id.

    Usage::

        books = EncoderBooks()
        books.create("engine-0", cache_size=8192)
        book = books.get("engine-0")  # NotFoundError for an engine without one
        books.delete("engine-0")
    """

    __slots__ = ("_books",)

    def __init__(self) -> None:
        self._books: dict[str, EncoderCacheBook] = {}

    def create(self, engine_id: str, cache_size: int, *, replace: bool = False) -> EncoderCacheBook:
        """A new empty book; with `replace`, one that exists is discarded first.

        Raises AlreadyExistsError when the engine has a book and not `replace`.
        """
        _check_id("engine_id", engine_id)
        book = EncoderCacheBook(cache_size)
        old = self._books.get(engine_id)
        if old is None and len(self._books) >= MAX_ENGINE_BOOKS:
            raise ResourceExhaustedError(
                f"{len(self._books)} engines already have an encoder cache, the limit: delete "
                "the books of engines that are gone"
            )
        if old is not None and not replace:
            raise AlreadyExistsError(
                f"engine {engine_id!r} already has an encoder cache "
                f"({old.cache_size} tokens): pass replace to start it afresh"
            )
        self._books[engine_id] = book
        return book

    def get(self, engine_id: str) -> EncoderCacheBook:
        """The engine's book; NotFoundError when it has none."""
        _check_id("engine_id", engine_id)
        book = self._books.get(engine_id)
        if book is None:
            raise NotFoundError(
                f"unknown engine {engine_id!r}; create its encoder cache first "
                f"({len(self._books)} engines have one)"
            )
        return book

    def delete(self, engine_id: str) -> None:
        """Discard the engine's book; NotFoundError when it has none."""
        self.get(engine_id)
        del self._books[engine_id]

    def list(self) -> list[str]:
        """The engine ids with a book, sorted."""
        return sorted(self._books)

    def stats(self) -> dict[str, EncoderCacheStats]:
        """A snapshot of every book, by engine id in sorted order (for the metrics)."""
        # One step (a list of the items) so that a scrape on another thread
        # never trips over a book the event loop deletes meanwhile.
        books = list(self._books.items())
        return {engine_id: book.stats() for engine_id, book in sorted(books)}

    def __len__(self) -> int:
        return len(self._books)

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._books
