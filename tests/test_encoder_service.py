"""The encoder-cache service through a real server: the client, the wire and /metrics."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

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
    EncoderCacheStats,
    EncoderOp,
    FreeEncoderInputOp,
    FreeOp,
    GetCachedMmHashesOp,
    GetFreedMmHashesOp,
    OpResult,
    ResetOp,
)
from mmcache.client import MMCacheClient
from mmcache.client.wire._encoder import (
    EncoderBatchError,
    EncoderBudget,
    EncoderBudgetInputs,
    EncoderCache,
)
from mmcache.server import MMCacheServer
from mmcache.server._status import INSTANCE_ID_KEY
from mmcache.v1 import encoder_pb2 as epb

from .conftest import sample, scrape

SERVICE = "/mmcache.v1.EncoderCache"


@pytest.fixture
async def book(client: MMCacheClient) -> EncoderCache:
    created = client.encoder_cache("engine-0")
    await created.create(cache_size=100)
    return created


@pytest.fixture
async def channel(server: MMCacheServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


async def tokens(book: EncoderCache) -> tuple[int, int, int]:
    st = await book.stats()
    return st.free_tokens, st.evictable_tokens, st.referenced_tokens


# ---------------------------------------------------------------- budget


async def test_budget_is_the_configured_one_when_items_are_smaller(client: MMCacheClient) -> None:
    budget = await client.compute_encoder_budget(
        {"image": 1225, "video": 4000},
        max_num_encoder_input_tokens=8192,
        encoder_cache_size=6000,
        max_num_batched_tokens=8192,
    )
    assert budget == (8192, 6000)
    assert isinstance(budget, EncoderBudget)
    assert (budget.compute_budget, budget.cache_size) == (8192, 6000)


async def test_budget_grows_to_the_largest_enabled_item(client: MMCacheClient) -> None:
    budget = await client.compute_encoder_budget(
        {"image": 1225, "audio": 0},
        max_num_encoder_input_tokens=100,
        encoder_cache_size=200,
        max_num_batched_tokens=8192,
        disable_chunked_mm_input=True,
    )
    assert budget == (1225, 1225)


@pytest.mark.parametrize("per_item", [{}, {"image": 0, "video": 0}])
async def test_budget_is_zero_without_an_enabled_modality(
    client: MMCacheClient, per_item: dict[str, int]
) -> None:
    budget = await client.compute_encoder_budget(
        per_item,
        max_num_encoder_input_tokens=8192,
        encoder_cache_size=8192,
        max_num_batched_tokens=8192,
        disable_chunked_mm_input=True,
    )
    assert budget == (0, 0)


async def test_unchunked_item_larger_than_a_batch_is_invalid_with_the_numbers(
    client: MMCacheClient,
) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"'video'.*4000 encoder tokens.*max_num_batched_tokens \(2048\)"
    ):
        await client.compute_encoder_budget(
            {"image": 1000, "video": 4000},
            max_num_encoder_input_tokens=8192,
            encoder_cache_size=8192,
            max_num_batched_tokens=2048,
            disable_chunked_mm_input=True,
        )


async def test_negative_budget_input_is_invalid(client: MMCacheClient) -> None:
    with pytest.raises(InvalidArgumentError, match=r"encoder_cache_size must be >= 0, got -3"):
        await client.compute_encoder_budget(
            {"image": 10},
            max_num_encoder_input_tokens=1,
            encoder_cache_size=-3,
            max_num_batched_tokens=1,
        )


# ---------------------------------------------------------------- books


async def test_book_is_created_from_a_size_or_from_a_budget(client: MMCacheClient) -> None:
    sized = client.encoder_cache("sized")
    assert await sized.create(cache_size=100) == EncoderBudget(compute_budget=0, cache_size=100)
    budgeted = client.encoder_cache("budgeted")
    inputs = EncoderBudgetInputs({"image": 1225}, 8192, 4096, 8192)
    assert await budgeted.create(budget=inputs) == EncoderBudget(8192, 4096)
    assert (await sized.stats()).cache_size == 100
    assert await budgeted.stats() == EncoderCacheStats(4096, 4096, 0, 0, 0, 0, 0, 0, 0, 0)


async def test_creating_needs_exactly_one_size(client: MMCacheClient) -> None:
    book = client.encoder_cache("e")
    with pytest.raises(InvalidArgumentError, match=r"'e' needs its size: give cache_size"):
        await book.create()
    with pytest.raises(InvalidArgumentError, match="not both"):
        await book.create(100, budget=EncoderBudgetInputs({"image": 1}, 1, 1, 1))
    with pytest.raises(NotFoundError):
        await book.stats()


async def test_invalid_budget_or_negative_size_creates_nothing(client: MMCacheClient) -> None:
    book = client.encoder_cache("e")
    with pytest.raises(InvalidArgumentError, match=r"'image'.*300.*max_num_batched_tokens"):
        await book.create(budget=EncoderBudgetInputs({"image": 300}, 1, 1, 200, True))
    with pytest.raises(InvalidArgumentError, match="encoder cache size must be >= 0, got -5"):
        await book.create(cache_size=-5)
    with pytest.raises(NotFoundError):
        await book.stats()


async def test_creating_an_existing_book_needs_replace(book: EncoderCache) -> None:
    await book.allocate("r", "h", 30)
    with pytest.raises(AlreadyExistsError, match=r"'engine-0'.*100 tokens.*replace"):
        await book.create(cache_size=50)
    assert (await book.stats()).allocations == 1  # the old book is untouched
    assert await book.create(cache_size=50, replace=True) == (0, 50)
    assert await book.stats() == EncoderCacheStats(50, 50, 0, 0, 0, 0, 0, 0, 0, 0)
    assert await book.check_and_update_cache("r", "h") is False


async def test_deleted_book_is_gone_and_can_be_created_again(book: EncoderCache) -> None:
    await book.allocate("r", "h", 30)
    await book.delete()
    with pytest.raises(NotFoundError, match="unknown engine 'engine-0'"):
        await book.check_and_update_cache("r", "h")
    with pytest.raises(NotFoundError, match="unknown engine 'engine-0'"):
        await book.delete()
    await book.create(cache_size=10)
    assert await book.check_and_update_cache("r", "h") is False


CALLS: dict[str, Callable[[EncoderCache], Awaitable[object]]] = {
    "stats": lambda b: b.stats(),
    "delete": lambda b: b.delete(),
    "check": lambda b: b.check_and_update_cache("r", "h"),
    "can_allocate": lambda b: b.can_allocate("r", "h", 1, 1),
    "allocate": lambda b: b.allocate("r", "h", 1),
    "cached": lambda b: b.get_cached_mm_hashes("r"),
    "free_input": lambda b: b.free_encoder_input("r", "h"),
    "free": lambda b: b.free("r"),
    "freed": lambda b: b.get_freed_mm_hashes(),
    "reset": lambda b: b.reset(),
    "batch": lambda b: b.run_batch([FreeOp("r")]),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_unknown_engine_is_not_found_with_advice(
    client: MMCacheClient, call: Callable[[EncoderCache], Awaitable[object]]
) -> None:
    await client.encoder_cache("engine-0").create(cache_size=10)
    with pytest.raises(
        NotFoundError, match="unknown engine 'nobody'; create its encoder cache"
    ) as info:
        await call(client.encoder_cache("nobody"))
    assert not isinstance(info.value, EncoderBatchError)  # the whole call failed


@pytest.mark.parametrize(
    ("engine_id", "message"),
    [("", "engine_id must not be empty"), ("e" * 257, "257 characters long; the limit is 256")],
)
async def test_bad_engine_ids_are_invalid(
    client: MMCacheClient, engine_id: str, message: str
) -> None:
    book = client.encoder_cache(engine_id)
    with pytest.raises(InvalidArgumentError, match=message):
        await book.create(cache_size=10)
    with pytest.raises(InvalidArgumentError, match=message):
        await book.check_and_update_cache("r", "h")
    with pytest.raises(InvalidArgumentError, match=message):
        await book.run_batch([FreeOp("r")])


async def test_engines_are_independent(client: MMCacheClient) -> None:
    e0, e1 = client.encoder_cache("e0"), client.encoder_cache("e1")
    await e0.create(cache_size=100)
    await e1.create(cache_size=50)
    await e0.allocate("r", "h", 100)
    assert await e1.check_and_update_cache("r", "h") is False
    await e1.allocate("r", "h", 50)  # its own room, untouched by e0's
    await e1.free("r")
    assert await tokens(e0) == (0, 0, 100)
    assert await tokens(e1) == (0, 50, 0)
    every = await client.encoder_cache_stats()
    assert list(every) == ["e0", "e1"]
    assert every["e0"] == await e0.stats()
    await e0.delete()
    assert list(await client.encoder_cache_stats()) == ["e1"]
    assert await e1.check_and_update_cache("r2", "h") is True


# ---------------------------------------------------------------- operations


async def test_an_entry_is_shared_by_hash_and_charged_once(book: EncoderCache) -> None:
    assert await book.check_and_update_cache("r1", "h") is False
    assert await book.can_allocate("r1", "h", 30, compute_budget=100) is True
    await book.allocate("r1", "h", 30)
    assert await book.check_and_update_cache("r2", "h") is True
    assert await book.get_cached_mm_hashes("r1") == {"h"}
    assert await book.get_cached_mm_hashes("r2") == {"h"}
    assert await tokens(book) == (70, 0, 30)
    st = await book.stats()
    assert (st.entries, st.requests, st.hits, st.allocations) == (1, 2, 1, 1)


async def test_last_reference_going_makes_the_entry_evictable_not_free(book: EncoderCache) -> None:
    await book.allocate("r1", "h", 30)
    await book.check_and_update_cache("r2", "h")
    assert await book.free_encoder_input("r1", "h") is True
    assert await book.free_encoder_input("r1", "h") is False  # held none any more
    assert await tokens(book) == (70, 0, 30)  # r2 still holds it
    assert await book.free_encoder_input("r2", "h") is True
    assert await tokens(book) == (70, 30, 0)
    assert await book.get_freed_mm_hashes() == []  # held until evicted
    assert await book.check_and_update_cache("r3", "h") is True  # taken back
    assert await tokens(book) == (70, 0, 30)


async def test_free_releases_every_reference_and_says_how_many(book: EncoderCache) -> None:
    for h in ("c", "a", "b"):
        await book.allocate("r1", h, 10)
    assert await book.free("r1") == 3
    assert await book.free("r1") == 0
    assert await book.get_cached_mm_hashes("r1") == set()
    assert await tokens(book) == (70, 30, 0)


async def test_can_allocate_evicts_oldest_unreferenced_and_reports_each_once(
    book: EncoderCache,
) -> None:
    for h in ("a", "b", "c", "live"):
        await book.allocate("r-" + h, h, 20)
    for h in ("b", "a", "c"):  # evictable in this order
        await book.free("r-" + h)
    assert await book.can_allocate("r", "new", 50, 100) is True  # needs 30 more: b, a
    assert await book.get_freed_mm_hashes() == ["b", "a"]
    assert await book.get_freed_mm_hashes() == []  # reported once
    assert await book.check_and_update_cache("r-live", "live") is True  # referenced: kept
    assert await tokens(book) == (60, 20, 20)
    assert (await book.stats()).evictions == 2


async def test_can_allocate_that_cannot_fit_evicts_nothing(book: EncoderCache) -> None:
    await book.allocate("r1", "live", 60)
    await book.allocate("r2", "old", 30)
    await book.free("r2")
    assert await book.can_allocate("r3", "new", 41, 100) is False  # 10 free + 30 evictable
    assert await book.get_freed_mm_hashes() == []
    assert await tokens(book) == (10, 30, 60)


async def test_can_allocate_counts_compute_budget_and_tokens_already_scheduled(
    book: EncoderCache,
) -> None:
    assert await book.can_allocate("r", "h", 11, compute_budget=10) is False
    assert await book.can_allocate("r", "h", 10, compute_budget=10) is True
    assert await book.can_allocate("r", "h", 10, 10, tokens_already_scheduled=91) is False
    assert await book.can_allocate("r", "h", 10, 10, tokens_already_scheduled=90) is True


async def test_reset_forgets_entries_and_pending_frees_but_keeps_counters(
    book: EncoderCache,
) -> None:
    await book.allocate("r1", "a", 60)
    await book.free("r1")
    await book.check_and_update_cache("r2", "a")
    await book.free("r2")
    assert await book.can_allocate("r3", "b", 100, 100) is True  # evicts a
    await book.allocate("r3", "b", 100)
    await book.reset()
    assert await book.get_freed_mm_hashes() == []
    assert await book.get_cached_mm_hashes("r3") == set()
    assert await book.stats() == EncoderCacheStats(100, 100, 0, 0, 0, 0, 0, 2, 1, 1)


async def test_allocating_without_space_is_resource_exhausted_with_the_numbers(
    book: EncoderCache,
) -> None:
    await book.allocate("r1", "a", 70)
    await book.free("r1")
    await book.allocate("r2", "b", 20)
    before = await book.stats()
    with pytest.raises(
        ResourceExhaustedError, match=r"15 .*'c'.*10 of 100 are free \(70 evictable.*can_allocate"
    ):
        await book.allocate("r3", "c", 15)  # allocate never evicts
    assert await book.stats() == before
    assert await book.get_cached_mm_hashes("r3") == set()


async def test_a_held_hash_is_already_exists_pointing_to_check(book: EncoderCache) -> None:
    await book.allocate("r1", "h", 10)
    with pytest.raises(AlreadyExistsError, match=r"'h'.*10 tokens.*check_and_update_cache"):
        await book.allocate("r2", "h", 10)
    with pytest.raises(AlreadyExistsError, match="check_and_update_cache"):
        await book.can_allocate("r2", "h", 10, 100)
    assert await book.get_cached_mm_hashes("r2") == set()


BAD_CALLS: dict[str, tuple[Callable[[EncoderCache], Awaitable[object]], str]] = {
    "can_allocate/tokens": (lambda b: b.can_allocate("r", "h", -1, 1), "num_tokens"),
    "can_allocate/budget": (lambda b: b.can_allocate("r", "h", 1, -1), "compute_budget"),
    "can_allocate/scheduled": (
        lambda b: b.can_allocate("r", "h", 1, 1, -1),
        "tokens_already_scheduled",
    ),
    "allocate/tokens": (lambda b: b.allocate("r", "h", -1), "num_tokens"),
    "check/request": (lambda b: b.check_and_update_cache("", "h"), "request_id"),
    "allocate/hash": (lambda b: b.allocate("r", "", 1), "mm_hash"),
    "free_input/hash": (lambda b: b.free_encoder_input("r", "h" * 257), "mm_hash"),
    "free/request": (lambda b: b.free("r" * 300), "request_id"),
    "cached/request": (lambda b: b.get_cached_mm_hashes(""), "request_id"),
}


@pytest.mark.parametrize(("call", "named"), BAD_CALLS.values(), ids=BAD_CALLS.keys())
async def test_negative_sizes_and_bad_ids_are_invalid_and_change_nothing(
    book: EncoderCache, call: Callable[[EncoderCache], Awaitable[object]], named: str
) -> None:
    await book.allocate("r", "held", 4)
    before = await book.stats()
    with pytest.raises(
        InvalidArgumentError, match=rf"{named} (must be >= 0, got -1|must not be empty|is \d+ char)"
    ):
        await call(book)
    assert await book.stats() == before


# ---------------------------------------------------------------- statuses on the wire


async def call_raw(
    channel: grpc.aio.Channel, method: str, request: Message, reply: type[Message]
) -> Any:
    """One call of the service with hand-built messages, past the client."""
    stub: grpc.aio.UnaryUnaryMultiCallable[Message, Message] = channel.unary_unary(
        f"{SERVICE}/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=reply.FromString,
    )
    return await stub(request, timeout=5)


@pytest.mark.parametrize(
    ("method", "request_", "reply", "code", "message"),
    [
        (
            "Allocate",
            epb.AllocateRequest(engine_id="nobody", request_id="r", mm_hash="h", num_tokens=1),
            epb.AllocateReply,
            grpc.StatusCode.NOT_FOUND,
            "unknown engine 'nobody'",
        ),
        (
            "Allocate",
            epb.AllocateRequest(engine_id="e", request_id="r", mm_hash="h", num_tokens=11),
            epb.AllocateReply,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "10 of 10 are free",
        ),
        (
            "CanAllocate",
            epb.CanAllocateRequest(engine_id="e", request_id="r", mm_hash="h", num_tokens=-2),
            epb.CanAllocateReply,
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_tokens must be >= 0, got -2",
        ),
        (
            "CreateEncoderCache",
            epb.CreateEncoderCacheRequest(engine_id="e2"),
            epb.CreateEncoderCacheReply,
            grpc.StatusCode.INVALID_ARGUMENT,
            "needs its size",
        ),
        (
            "CreateEncoderCache",
            epb.CreateEncoderCacheRequest(engine_id="e", cache_size=5),
            epb.CreateEncoderCacheReply,
            grpc.StatusCode.ALREADY_EXISTS,
            "already has an encoder cache",
        ),
    ],
    ids=["unknown-engine", "no-room", "negative", "no-size", "exists"],
)
async def test_errors_are_statuses_with_message_and_instance_id(
    server: MMCacheServer,
    channel: grpc.aio.Channel,
    method: str,
    request_: Message,
    reply: type[Message],
    code: grpc.StatusCode,
    message: str,
) -> None:
    server.books.create("e", 10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_raw(channel, method, request_, reply)
    assert info.value.code() == code
    assert message in (info.value.details() or "")
    assert dict(info.value.trailing_metadata() or ())[INSTANCE_ID_KEY] == server.instance_id


async def test_every_reply_carries_the_instance_id(
    server: MMCacheServer, channel: grpc.aio.Channel, book: EncoderCache
) -> None:
    assert book.instance_id == server.instance_id
    e0 = {"engine_id": "engine-0", "request_id": "r"}
    requests: dict[str, dict[str, Any]] = {
        "ComputeEncoderBudget": {},
        "CreateEncoderCache": {"engine_id": "fresh", "cache_size": 1},
        "GetEncoderCacheStats": {},
        "CheckAndUpdateCache": {**e0, "mm_hash": "a"},
        "CanAllocate": {**e0, "mm_hash": "b", "num_tokens": 1, "compute_budget": 1},
        "Allocate": {**e0, "mm_hash": "b", "num_tokens": 1},
        "GetCachedMmHashes": e0,
        "FreeEncoderInput": {**e0, "mm_hash": "b"},
        "Free": e0,
        "GetFreedMmHashes": {"engine_id": "engine-0"},
        "Reset": {"engine_id": "engine-0"},
        "Batch": {"engine_id": "engine-0"},
        "DeleteEncoderCache": {"engine_id": "fresh"},
    }
    methods = epb.DESCRIPTOR.services_by_name["EncoderCache"].methods
    assert set(requests) == {m.name for m in methods}
    for method in methods:
        request = getattr(epb, method.input_type.name)(**requests[method.name])
        reply = await call_raw(channel, method.name, request, getattr(epb, method.output_type.name))
        assert reply.instance_id == server.instance_id, method.name


# ---------------------------------------------------------------- batch


async def test_batch_applies_in_order_and_returns_typed_results(book: EncoderCache) -> None:
    results = await book.run_batch(
        [
            CheckAndUpdateCacheOp("r1", "a"),
            CanAllocateOp("r1", "a", 60, 100),
            AllocateOp("r1", "a", 60),
            CheckAndUpdateCacheOp("r2", "a"),
            GetCachedMmHashesOp("r2"),
            FreeEncoderInputOp("r2", "a"),
            FreeOp("r1"),
            CanAllocateOp("r3", "b", 80, 100),
            GetFreedMmHashesOp(),
            ResetOp(),
        ]
    )
    assert results == [False, True, None, True, {"a"}, True, 1, True, ["a"], None]
    assert await book.stats() == EncoderCacheStats(100, 100, 0, 0, 0, 0, 0, 1, 1, 1)


async def test_batch_stops_at_the_first_failure_and_keeps_what_came_before(
    book: EncoderCache,
) -> None:
    ops: list[EncoderOp] = [
        AllocateOp("r1", "a", 40),
        CheckAndUpdateCacheOp("r2", "a"),
        AllocateOp("r1", "b", 70),  # 70 > 60 free
        AllocateOp("r1", "c", 1),  # not applied
    ]
    with pytest.raises(ResourceExhaustedError, match=r"op 2 of the batch \(AllocateOp\)") as info:
        await book.run_batch(ops)
    error = info.value
    assert isinstance(error, EncoderBatchError)
    assert (error.index, error.op, error.results) == (2, ops[2], [None, True])
    assert isinstance(error.error, ResourceExhaustedError)
    assert "60 of 100 are free" in str(error.error)
    st = await book.stats()
    assert (st.entries, st.allocations, st.hits, st.referenced_tokens) == (1, 1, 1, 40)
    assert await book.get_cached_mm_hashes("r1") == {"a"}


async def test_batch_op_with_bad_input_fails_at_its_index(book: EncoderCache) -> None:
    with pytest.raises(InvalidArgumentError, match=r"op 2 .*request_id must not be empty") as info:
        await book.run_batch(
            [AllocateOp("r", "a", 5), FreeOp("r"), CheckAndUpdateCacheOp("", "a"), ResetOp()]
        )
    assert isinstance(info.value, EncoderBatchError)
    assert (info.value.index, info.value.results) == (2, [None, 1])
    assert await tokens(book) == (95, 5, 0)  # the free ran; the reset did not


async def test_batch_builder_gives_a_typed_result_per_op(book: EncoderCache) -> None:
    async with book.batch() as step:
        miss = step.check_and_update_cache("r1", "a")
        room = step.can_allocate("r1", "a", 30, 100)
        step.allocate("r1", "a", 30)
        hit = step.check_and_update_cache("r2", "a")
        held = step.get_cached_mm_hashes("r2")
        released = step.free("r2")
        assert not miss.applied
        with pytest.raises(RuntimeError, match="has not run"):
            _ = miss.value
    assert (miss.value, room.value, hit.value, held.value, released.value) == (
        False,
        True,
        True,
        {"a"},
        1,
    )
    assert len(step) == 0  # sent and emptied


async def test_batch_builder_after_a_failure_resolves_only_the_ops_that_ran(
    book: EncoderCache,
) -> None:
    step = book.batch()
    freed = step.free("r")
    bad = step.allocate("r", "big", 101)
    after = step.get_freed_mm_hashes()
    with pytest.raises(ResourceExhaustedError):
        await step.run()
    assert freed.value == 0
    assert not bad.applied
    assert not after.applied
    with pytest.raises(RuntimeError):
        _ = after.value


async def test_an_error_inside_the_batch_block_sends_nothing(book: EncoderCache) -> None:
    async def failing_step() -> None:
        async with book.batch() as step:
            step.allocate("r", "a", 10)
            raise KeyError("scheduler bug")

    with pytest.raises(KeyError):
        await failing_step()
    assert (await book.stats()).entries == 0


async def test_batch_op_naming_another_engine_or_nothing_fails_that_op(
    server: MMCacheServer, channel: grpc.aio.Channel, book: EncoderCache
) -> None:
    request = epb.BatchRequest(
        engine_id="engine-0",
        ops=[
            epb.EncoderOp(
                allocate=epb.AllocateRequest(
                    engine_id="engine-0", request_id="r", mm_hash="a", num_tokens=5
                )
            ),
            epb.EncoderOp(reset=epb.ResetRequest()),
            epb.EncoderOp(free=epb.FreeRequest(engine_id="engine-1", request_id="r")),
        ],
    )
    reply = await call_raw(channel, "Batch", request, epb.BatchReply)
    assert isinstance(reply, epb.BatchReply)
    assert reply.instance_id == server.instance_id
    assert [r.WhichOneof("result") for r in reply.results] == ["allocate", "reset"]
    assert all(not getattr(r, r.WhichOneof("result") or "").instance_id for r in reply.results)
    assert reply.failure.index == 2
    assert reply.failure.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (
        "names engine 'engine-1', but the batch is for engine 'engine-0'" in reply.failure.message
    )
    empty = epb.BatchRequest(engine_id="engine-0", ops=[epb.EncoderOp()])
    reply = await call_raw(channel, "Batch", empty, epb.BatchReply)
    assert isinstance(reply, epb.BatchReply)
    assert (reply.failure.index, reply.failure.message) == (
        0,
        "op 0 of the batch names no operation",
    )
    assert (await book.stats()).allocations == 1


# ---------------------------------------------------------------- random schedules

CACHE = 100
LIVE_REQUESTS = 4
HASHES = [f"mm-{i}" for i in range(40)]
POPULARITY = [1 / (i + 1) for i in range(len(HASHES))]  # a few hashes recur often


class Observed:
    """What the replies tell, checked as they arrive; no model of eviction."""

    def __init__(self) -> None:
        self.refs: dict[str, set[str]] = {}  # request -> hashes it references
        self.live: Counter[str] = Counter()  # allocated and not yet reported freed
        self.reported: list[str] = []
        self.hits = self.allocations = 0

    def referenced(self) -> set[str]:
        return set().union(*self.refs.values())

    def apply(self, op: EncoderOp, result: OpResult) -> None:
        if isinstance(op, CheckAndUpdateCacheOp):
            # An entry some live request references is never gone.
            assert result or op.mm_hash not in self.referenced(), op
            if result:
                self.refs.setdefault(op.request_id, set()).add(op.mm_hash)
                self.hits += 1
        elif isinstance(op, AllocateOp):
            self.refs.setdefault(op.request_id, set()).add(op.mm_hash)
            self.live[op.mm_hash] += 1
            self.allocations += 1
        elif isinstance(op, GetCachedMmHashesOp):
            assert result == self.refs.get(op.request_id, set())
        elif isinstance(op, FreeEncoderInputOp):
            held = self.refs.get(op.request_id, set())
            assert result == (op.mm_hash in held)
            held.discard(op.mm_hash)
        elif isinstance(op, FreeOp):
            assert result == len(self.refs.pop(op.request_id, set()))
        elif isinstance(op, GetFreedMmHashesOp):
            assert isinstance(result, list)
            for h in result:
                self.live[h] -= 1
                assert self.live[h] >= 0, f"{h} reported freed more often than allocated"
            self.reported += result
        elif isinstance(op, ResetOp):  # only ever right after a drain: nothing pending
            self.refs.clear()
            self.live.clear()


async def single(book: EncoderCache, op: EncoderOp) -> OpResult:
    if isinstance(op, CheckAndUpdateCacheOp):
        return await book.check_and_update_cache(op.request_id, op.mm_hash)
    if isinstance(op, CanAllocateOp):
        return await book.can_allocate(
            op.request_id, op.mm_hash, op.num_tokens, op.compute_budget, op.tokens_already_scheduled
        )
    if isinstance(op, AllocateOp):
        return await book.allocate(op.request_id, op.mm_hash, op.num_tokens)
    if isinstance(op, GetCachedMmHashesOp):
        return await book.get_cached_mm_hashes(op.request_id)
    if isinstance(op, FreeEncoderInputOp):
        return await book.free_encoder_input(op.request_id, op.mm_hash)
    if isinstance(op, FreeOp):
        return await book.free(op.request_id)
    if isinstance(op, GetFreedMmHashesOp):
        return await book.get_freed_mm_hashes()
    return await book.reset()


class Schedule:
    """Random scheduler steps against one book, single calls or batched at random."""

    def __init__(self, book: EncoderCache, seed: int) -> None:
        self.book = book
        self.rng = random.Random(seed)
        # One size per hash (content fixes it); the last hash never fits at all.
        self.sizes = {h: self.rng.randrange(1, CACHE // 6) for h in HASHES}
        self.sizes[HASHES[-1]] = CACHE + 1
        self.requests = [f"req-{i}" for i in range(LIVE_REQUESTS)]  # oldest first
        self.started = LIVE_REQUESTS
        self.observed = Observed()
        self.errors: set[type[MMCacheError]] = set()
        self.ops = 0

    async def run(
        self, ops: list[EncoderOp], *, batched: bool, count: bool = True
    ) -> list[OpResult]:
        """Apply `ops` (a batch stops at a failure), observing each applied one.

        The results in op order; None for an op that failed or did not run.
        """
        self.ops += len(ops) if count else 0
        results: list[OpResult] = []
        if batched:
            try:
                results = await self.book.run_batch(ops)
            except EncoderBatchError as exc:
                self.errors.add(type(exc.error))
                results = exc.results
            applied = list(zip(ops, results, strict=False))
        else:
            applied = []
            for op in ops:
                try:
                    result = await single(self.book, op)
                except MMCacheError as exc:
                    self.errors.add(type(exc))
                    result = None  # a failed op changes nothing
                else:
                    applied.append((op, result))
                results.append(result)
        for op, result in applied:
            self.observed.apply(op, result)
        return results

    async def step(self) -> None:
        """One step as the scheduler takes it: check, can_allocate, allocate, free, drain."""
        rng, sizes = self.rng, self.sizes
        batched = rng.random() < 0.5
        if rng.random() < 0.01:
            await self.run([GetFreedMmHashesOp(), ResetOp()], batched=batched)
            return
        picks = rng.choices(HASHES, POPULARITY, k=rng.randrange(1, 5))
        inputs = [(rng.choice(self.requests), h) for h in picks]
        hits = await self.run([CheckAndUpdateCacheOp(r, h) for r, h in inputs], batched=batched)
        misses = [(r, h) for (r, h), hit in zip(inputs, hits, strict=False) if hit is False]
        budget, scheduled, asks = rng.choice([CACHE, CACHE // 2]), 0, []
        for r, h in misses:
            asks.append(CanAllocateOp(r, h, sizes[h], budget, scheduled))
            budget, scheduled = max(budget - sizes[h], 0), scheduled + sizes[h]
        granted = await self.run(asks, batched=batched)
        rest: list[EncoderOp] = [
            AllocateOp(op.request_id, op.mm_hash, op.num_tokens)
            for op, ok in zip(asks, granted, strict=False)
            if ok is True
        ]
        if rng.random() < 0.3:  # allocate without asking: may not fit, may be held
            h = rng.choice(HASHES)
            rest.append(AllocateOp(rng.choice(self.requests), h, sizes[h]))
        for _ in range(rng.randrange(0, 3)):
            r, h = rng.choice(self.requests), rng.choice(HASHES)
            rest.append(rng.choice([FreeEncoderInputOp(r, h), GetCachedMmHashesOp(r)]))
        await self.run(rest, batched=batched)
        end: list[EncoderOp] = [GetFreedMmHashesOp()]  # the step's end: drained
        if rng.random() < 0.7:  # the oldest request finished; a new one starts
            end.insert(0, FreeOp(self.requests.pop(0)))
            self.requests.append(f"req-{self.started}")
            self.started += 1
        await self.run(end, batched=batched)


@pytest.mark.parametrize("seed", range(2))
async def test_random_schedule_keeps_the_invariants_through_the_server(
    client: MMCacheClient, seed: int
) -> None:
    book = client.encoder_cache("engine-random")
    await book.create(cache_size=CACHE)
    schedule = Schedule(book, seed)
    observed, sizes = schedule.observed, schedule.sizes
    verifying_hits = 0
    while schedule.ops < 500:
        await schedule.step()
        # Every entry a request references is still there (a check: one more reference).
        before = observed.hits
        held = [CheckAndUpdateCacheOp(r, h) for r, hs in observed.refs.items() for h in hs]
        assert all(await schedule.run(held, batched=True, count=False))
        verifying_hits += observed.hits - before

        st = await book.stats()
        assert st.free_tokens + st.evictable_tokens + st.referenced_tokens == st.cache_size == CACHE
        assert min(st.free_tokens, st.evictable_tokens, st.referenced_tokens) >= 0
        live = {h for h, n in observed.live.items() if n}
        assert st.entries == sum(observed.live.values()) == len(live)  # drained: exact
        assert st.free_tokens == CACHE - sum(sizes[h] for h in live)
        assert st.referenced_tokens == sum(sizes[h] for h in observed.referenced())
        assert st.requests == sum(1 for hs in observed.refs.values() if hs)
        # Every eviction reported, exactly once (never twice: live stays >= 0).
        assert st.evictions == len(observed.reported)
        assert (st.hits, st.allocations) == (observed.hits, observed.allocations)
    # The schedule exercised what it is meant to check.
    assert st.evictions > 20
    assert observed.hits - verifying_hits > 50
    assert {AlreadyExistsError, ResourceExhaustedError} <= schedule.errors


# ---------------------------------------------------------------- metrics


async def test_metrics_per_engine_follow_the_books(
    server: MMCacheServer, client: MMCacheClient
) -> None:
    book, other = client.encoder_cache("e0"), client.encoder_cache("e1")
    await book.create(cache_size=100)
    await other.create(cache_size=7)
    await book.allocate("r1", "a", 30)
    await book.allocate("r2", "b", 20)
    await book.free("r2")  # b evictable
    assert await book.check_and_update_cache("r3", "a") is True  # a hit
    assert await book.check_and_update_cache("r3", "zz") is False  # not a hit
    assert await book.can_allocate("r4", "c", 60, 100) is True  # evicts b
    await book.allocate("r4", "c", 60)
    await book.free("r1")
    await book.free("r3")  # a evictable
    samples = await scrape(server.metrics_port)
    expected = {
        "mmcache_encoder_cache_size_tokens": (100, 7),
        "mmcache_encoder_free_tokens": (10, 7),
        "mmcache_encoder_evictable_tokens": (30, 0),
        "mmcache_encoder_referenced_tokens": (60, 0),
        "mmcache_encoder_entries": (2, 0),
        "mmcache_encoder_allocations_total": (3, 0),
        "mmcache_encoder_evictions_total": (1, 0),
        "mmcache_encoder_hits_total": (1, 0),
    }
    actual = {
        name: (sample(samples, name, engine="e0"), sample(samples, name, engine="e1"))
        for name in expected
    }
    assert actual == expected
    await other.delete()
    samples = await scrape(server.metrics_port)
    assert sample(samples, "mmcache_encoder_entries", engine="e1") is None
    assert sample(samples, "mmcache_encoder_entries", engine="e0") == 2
