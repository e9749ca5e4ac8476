"""vLLM's cache semantics, on the plugin's P0 and P1 caches and a real server.

The semantics of vLLM's own cache tests (tests/multimodal/test_cache.py in
vLLM's repository), written anew for mmcache's classes with vLLM's real
`MultiModalKwargsItem`, field types and `ResolvedPromptUpdate`s: `is_cached`
without reordering, hits without data, P1 misses as vLLM's typed error naming
every hash in order, sent data over a stale entry, oversize items served
uncached, touches of missing keys, exact stats, fail-open.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY
from vllm.multimodal.cache import MultiModalCacheMissError
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.multimodal.processing.processor import (
    PromptIndex,
    PromptIndexTargets,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    UpdateMode,
)

from mmcache.client import CacheMissError
from mmcache.client.vllm import Settings
from mmcache.client.vllm._caches import MMCacheProcessorCache
from mmcache.client.vllm._receiver import MMCacheReceiverCache
from mmcache.client.vllm.convert import (
    decode_updates,
    encode_updates,
    from_vllm,
    to_vllm,
    undescribed,
)
from mmcache.client.vllm.runtime import SyncClient

from ..redis_cluster import redis_available, redis_cluster
from .conftest import Sidecar, sidecars
from .serve import metrics

SCOPE = "test-scope"
ROOT = Path(__file__).resolve().parents[2]
IMAGE_PAD = 151655


def item(seed: int, numel: int = 1024) -> MultiModalKwargsItem:
    gen = torch.Generator().manual_seed(seed)
    return MultiModalKwargsItem(
        {
            "pixel_values": MultiModalFieldElem(
                data=torch.randn(numel, generator=gen),
                field=MultiModalFlatField(slices=[slice(0, numel)], dim=0),
            ),
            "image_grid_thw": MultiModalFieldElem(
                data=torch.tensor([1, 2, seed + 1]), field=MultiModalBatchedField()
            ),
            "shared": MultiModalFieldElem(
                data=torch.tensor([seed]),
                field=MultiModalSharedField(batch_size=1, keep_on_cpu=True),
            ),
        }
    )


def updates(n_tokens: int = 4) -> list[ResolvedPromptUpdate]:
    full = [151652, *[IMAGE_PAD] * n_tokens, 151653]
    return [
        ResolvedPromptUpdate(
            modality="image",
            item_idx=0,
            mode=UpdateMode.REPLACE,
            target=[IMAGE_PAD],
            content=PromptUpdateDetails.select_token_id(full, IMAGE_PAD),
        )
    ]


def same_updates(a: list[ResolvedPromptUpdate], b: list[ResolvedPromptUpdate]) -> bool:
    def described(u: ResolvedPromptUpdate) -> tuple[object, ...]:
        mask = None if u.content.is_embed is None else u.content.is_embed(u.content.full).tolist()
        return (u.modality, u.item_idx, u.mode, u.target, u.content.full, mask)

    return [described(u) for u in a] == [described(u) for u in b]


def feature(mm_hash: str, data: MultiModalKwargsItem | None) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=data,
        modality="image",
        identifier=mm_hash,
        mm_position=PlaceholderRange(offset=0, length=4),
        mm_hash=mm_hash,
    )


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s")
        time.sleep(0.005)


def request(
    cache: MMCacheProcessorCache,
    pairs: list[tuple[str, MultiModalKwargsItem]],
    is_cached_calls: int = 1,
) -> list[tuple[MultiModalKwargsItem | None, list[ResolvedPromptUpdate]]]:
    """One request through P0, the calls in vLLM's order (processor.py)."""
    hashes = [h for h, _ in pairs]
    for _ in range(is_cached_calls):  # vLLM may ask more than once
        cached = cache.is_cached(hashes)
    for h in hashes:
        cache.touch_sender_cache_item(h)
    try:
        return [
            cache.get_and_update_item(None if hit else (data, updates()), h)
            for (h, data), hit in zip(pairs, cached, strict=True)
        ]
    finally:
        cache.release_sender_touches()


@pytest.fixture
def clients(sidecar: Sidecar) -> Iterator[Callable[[], SyncClient]]:
    made: list[SyncClient] = []

    def make() -> SyncClient:
        sync = SyncClient(sidecar.target, deadline_s=1.0)
        sync.call(sync.client.wait_following())
        made.append(sync)
        return sync

    yield make
    for sync in made:
        sync.close()


def test_items_and_prompt_updates_convert_both_ways() -> None:
    original = item(3)
    back = to_vllm(from_vllm(original, "image"))
    assert back == original
    assert [type(e.field) for e in back.values()] == [type(e.field) for e in original.values()]
    assert back["shared"].field.keep_on_cpu and back["pixel_values"].field.dim == 0
    blob = encode_updates(updates())
    assert blob is not None and b"pickle" not in blob
    decoded = decode_updates(blob)
    assert decoded is not None and same_updates(decoded, updates())
    # Decoded once per blob (images of one size share one), but each caller
    # gets a list of its own: changing it changes no other hit's.
    again = decode_updates(blob)
    assert again is not None and again is not decoded and same_updates(again, decoded)
    again.clear()
    assert same_updates(decode_updates(blob) or [], updates())
    assert decode_updates(b"not json") is None and decode_updates(b'{"v": 99}') is None


def masked(content: PromptUpdateDetails) -> list[ResolvedPromptUpdate]:
    return [ResolvedPromptUpdate("image", 0, UpdateMode.REPLACE, [IMAGE_PAD], content)]


def embed_of(blob: bytes | None) -> list[int]:
    decoded = decode_updates(blob or b"")
    assert decoded is not None
    is_embed = decoded[0].content.is_embed
    assert is_embed is not None
    return [int(x) for x in is_embed(decoded[0].content.full).tolist()]


def test_an_embed_mask_is_reused_only_where_nothing_but_the_tokens_decides_it() -> None:
    """`is_embed(full)` is reused for a plain function of the tokens and the
    values it captured (vLLM's `select_token_id`: the token id), never for one
    that captured an object (a list that may change) or reads a global."""
    full = [1, IMAGE_PAD, IMAGE_PAD, 2, 3]
    first = encode_updates(masked(PromptUpdateDetails.select_token_id(full, IMAGE_PAD)))
    again = encode_updates(masked(PromptUpdateDetails.select_token_id(list(full), IMAGE_PAD)))
    assert first == again and embed_of(first) == [0, 1, 1, 0, 0]
    other = encode_updates(masked(PromptUpdateDetails.select_token_id(full, 2)))  # another id
    assert embed_of(other) == [0, 0, 0, 1, 0]
    ids = [3]
    listed = PromptUpdateDetails.select_token_ids(full, ids)  # captures a list
    assert embed_of(encode_updates(masked(listed))) == [0, 0, 0, 0, 1]
    ids[0] = 1
    assert embed_of(encode_updates(masked(listed))) == [1, 0, 0, 0, 0]
    chosen[0] = 2
    by_global = PromptUpdateDetails(full=full, is_embed=_by_global)
    assert embed_of(encode_updates(masked(by_global))) == [0, 0, 0, 1, 0]
    chosen[0] = IMAGE_PAD
    assert embed_of(encode_updates(masked(by_global))) == [0, 1, 1, 0, 0]


chosen = [IMAGE_PAD]


def _by_global(full: list[int]) -> torch.Tensor:
    return torch.tensor(full) == chosen[0]


def index_update(target: PromptIndex) -> list[ResolvedPromptUpdate]:
    return [
        ResolvedPromptUpdate("image", 0, UpdateMode.INSERT, target,
                             PromptUpdateDetails.from_seq([IMAGE_PAD] * 3))
    ]  # fmt: skip


@pytest.mark.parametrize(
    "target",
    [PromptIndexTargets.start(), PromptIndexTargets.end(), PromptIndexTargets.prefix([2, 7])],
    ids=["start", "end", "prefix"],
)
def test_a_position_vllm_made_travels_as_data(target: PromptIndex) -> None:
    """PaliGemma, BLIP-2, ...: updates at a position (PromptIndexTargets)."""
    blob = encode_updates(index_update(target))
    assert blob is not None and undescribed(index_update(target)) is None
    (decoded,) = decode_updates(blob) or []
    rebuilt = decoded.target
    assert isinstance(rebuilt, PromptIndex)
    for prompt in ([2, 7, 5, 9], [1, 2, 3], []):  # the same position on every prompt
        assert rebuilt.get_match_index(prompt, 0) == target.get_match_index(prompt, 0)
    assert rebuilt.get_match_index([2, 7, 5], 1) == target.get_match_index([2, 7, 5], 1)
    # Equal descriptions share one index, as vLLM groups updates by its identity.
    again = decode_updates(blob)
    assert again is not None and again[0].target is rebuilt


def test_a_position_of_another_kind_stays_local_and_says_why() -> None:
    mine = PromptIndex(lambda prompt, start_idx=0: 1, lambda tok, prompt, start_idx=0: 1)
    assert encode_updates(index_update(mine)) is None
    assert "PromptIndex" in (undescribed(index_update(mine)) or "")


def leases(sync: SyncClient) -> int:
    return sync.call(sync.client.transport.info()).leases


def test_a_hit_in_a_process_that_never_processed_the_item(
    clients: Callable[[], SyncClient],
) -> None:
    p0_a = MMCacheProcessorCache(clients(), SCOPE)
    p0_b = MMCacheProcessorCache(clients(), SCOPE)  # another API server
    p1 = MMCacheReceiverCache(clients(), SCOPE)
    red = item(1, numel=1 << 20)  # 4 MiB: in the sidecar's shared memory
    (out,) = request(p0_a, [("red", red)])
    assert out[0] is red  # a miss: the data goes to the engine inline
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key("red")]) == [True])
    (out,) = request(p0_b, [("red", red)])
    assert out[0] is None and same_updates(list(out[1]), updates())  # no tensor re-shipped
    assert leases(p1.sync) == 1  # held for the engine's read
    features = p1.get_and_update_features([feature("red", None)])
    assert features[0].data == red  # the engine read through
    stats_a, stats_b = p0_a.make_stats(), p0_b.make_stats()
    assert (stats_a.hits, stats_a.total, stats_b.hits, stats_b.total) == (0, 1, 1, 1)
    eventually(lambda: leases(p1.sync) == 0)


def engine_lru(gb: float = 1.0) -> Any:
    """vLLM alone's engine LRU (its `lru` cache type), of `gb`."""
    from types import SimpleNamespace

    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

    multimodal = SimpleNamespace(mm_processor_cache_gb=gb)
    return LruKeyReplicatedReceiverCache(SimpleNamespace(get_multimodal_config=lambda: multimodal))


def test_an_engine_that_keeps_vllm_alones_lru_reads_a_hit_it_holds_no_more(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """Where vLLM alone's engine keeps an LRU of items (one API server), the
    plugin's engine keeps that very one in front of the sidecar: an item that
    came inline, or that it read once, is a hit there, with no copy out of the
    sidecar's shared memory (12.7 MB for a 1920x1080 image), as vLLM
    alone's P1 hit costs none; the lease P0 took for the read is given back
    all the same. An item it lacks is read, then kept."""
    p0 = MMCacheProcessorCache(clients(), SCOPE)  # one API server
    other = MMCacheProcessorCache(clients(), SCOPE)  # another frontend on the sidecar
    p1 = MMCacheReceiverCache(clients(), SCOPE, engine_lru())
    eventually(lambda: p1.sync.client.region is not None)
    red, blue = item(1, numel=1 << 20), item(2, numel=1 << 20)  # 4 MiB: resident
    (out,) = request(p0, [("red", red)])  # processed: inline to the engine
    assert p1.get_and_update_features([feature("red", out[0])])[0].data is red
    request(other, [("blue", blue)])  # processed elsewhere: never sent to this engine
    eventually(lambda: p0.sync.client.is_cached([p0.key("red"), p0.key("blue")]) == [True] * 2)

    def read() -> float:  # bytes copied out of the sidecar's region, by anyone
        return steady(lambda: shm_bytes(sidecar, "read"))

    for first in (True, False):
        hits = request(p0, [("red", red), ("blue", blue)])
        assert [data for data, _ in hits] == [None, None]  # the sidecar's hits: keys only
        assert leases(p1.sync) == 2  # taken for the engine's reads
        before = read()
        features = p1.get_and_update_features([feature("red", None), feature("blue", None)])
        assert features[0].data is red  # kept when it came inline: no read
        assert features[1].data == blue
        eventually(lambda: leases(p1.sync) == 0)  # both given back
        engine_read = read() - before
        if first:
            assert 4 << 20 <= engine_read < 5 << 20  # blue, 4 MiB, once
        else:
            assert engine_read == 0  # kept since
    p1.clear_cache()  # vLLM's reset_mm_cache: the engine reads again
    request(p0, [("red", red)])
    before = read()
    assert p1.get_and_update_features([feature("red", None)])[0].data == red
    assert 4 << 20 <= read() - before < 5 << 20
    eventually(lambda: leases(p1.sync) == 0)


@pytest.mark.parametrize("first_here", [False, True])
def test_a_small_hit_goes_inline_read_here_or_held_here(
    clients: Callable[[], SyncClient], sidecar: Sidecar, first_here: bool
) -> None:
    """Under 1 MiB the sidecar keeps an item outside its shared memory, so
    the engine's read of it would be a call on the engine's thread. A hit
    read into this process's cache (it lacked it) goes with that data, as
    vLLM's processor-only cache sends it, and leaves no lease; one this
    process held already is asked of no one (a lookup would be a call): it
    goes inline from its own cache. Counted alike, as vLLM does."""
    p0_a = MMCacheProcessorCache(clients(), SCOPE)
    p0_b = MMCacheProcessorCache(clients(), SCOPE)
    icon = item(1, numel=4096)  # 16 KiB
    request(p0_a, [("icon", icon)])
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key("icon")]) == [True])
    if first_here:  # B has it too (processed before the sidecar had it)
        p0_b.get_and_update_item((icon, updates()), "icon")
        eventually(lambda: p0_b.uploads_in_flight == 0)
    looked_up = sidecar_batches(sidecar)
    (out,) = request(p0_b, [("icon", item(9, numel=4096))])
    assert same_updates(list(out[1]), updates())
    assert out[0] == icon  # the sidecar's data read here, or B's own
    assert leases(p0_b.sync) == 0  # none taken: the engine reads nothing
    # Read here: one lookup, and the read; held here: no call at all.
    assert sidecar_batches(sidecar) - looked_up == (0 if first_here else 1)
    stats = p0_b.make_stats()
    assert (stats.hits, stats.total) == ((1, 2) if first_here else (1, 1))
    eventually(lambda: sidecar_counts(sidecar) == (2 + first_here, 1))


def sidecar_batches(sidecar: Sidecar) -> float:
    """GetAndUpdate batches the sidecar has served (lookups and uploads), by
    whichever of its methods they came."""
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    methods = ("GetAndUpdate", "GetAndUpdateOne", "UpdateSession")
    return sum(metrics(url, grpc_method=m).get("grpc_server_handled_total", 0.0) for m in methods)


def test_p1_names_every_missing_hash_in_request_order(clients: Callable[[], SyncClient]) -> None:
    p1 = MMCacheReceiverCache(clients(), SCOPE)
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    request(p0, [("held", item(1))])
    eventually(lambda: p0.sync.client.is_cached([p0.key("held")]) == [True])
    with pytest.raises(MultiModalCacheMissError) as info:
        p1.get_and_update_features(
            [feature("z", None), feature("held", None), feature("a", None), feature("x", item(2))]
        )
    assert info.value.mm_hashes == ["z", "a"]


def test_p1_takes_a_hash_no_server_takes_for_a_miss_not_an_error(
    clients: Callable[[], SyncClient],
) -> None:
    # Read first with no call (shared memory), then by call: either refuses the
    # hash (too long); the engine sees vLLM's miss, never mmcache's error.
    p1 = MMCacheReceiverCache(clients(), SCOPE)
    eventually(lambda: p1.sync.client.region is not None)
    with pytest.raises(MultiModalCacheMissError) as info:
        p1.get_and_update_features([feature("x" * 300, None)])
    assert info.value.mm_hashes == ["x" * 300]


def test_is_cached_does_not_reorder_and_touching_a_missing_key_does_nothing(
    clients: Callable[[], SyncClient],
) -> None:
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    assert p0.is_cached(["ghost", "ghost"]) == [False, False]
    p0.touch_sender_cache_item("ghost")
    p0.release_sender_touches()
    assert p0.sync.client.mirror.keys() == []
    assert p0.make_stats().total == 0


def test_sent_data_overwrites_a_stale_entry(clients: Callable[[], SyncClient]) -> None:
    p0_a, p0_b = MMCacheProcessorCache(clients(), SCOPE), MMCacheProcessorCache(clients(), SCOPE)
    p1 = MMCacheReceiverCache(clients(), SCOPE)
    request(p0_a, [("h", item(1))])
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key("h")]) == [True])
    p0_b.invalidate("h")  # vLLM's retry path: P0 forgets, sends the data again
    request(p0_b, [("h", item(2))])
    eventually(lambda: p1.get_and_update_features([feature("h", None)])[0].data == item(2))


def test_an_item_larger_than_the_cache_is_served_uncached(
    clients: Callable[[], SyncClient],
) -> None:
    # Over the 256 MiB sidecar and over this process's own cache (vLLM's
    # --mm-processor-cache-gb 0.25): never a hit, as in vLLM alone.
    p0 = MMCacheProcessorCache(clients(), SCOPE, local_gb=0.25)
    big = item(1, numel=80 << 20)  # 320 MiB
    (out,) = request(p0, [("big", big)])
    assert out[0] is big
    time.sleep(0.5)
    assert p0.is_cached(["big"]) == [False]  # never a hit, and the service goes on
    (out,) = request(p0, [("small", item(2))])
    assert out[0] is not None
    # Over the sidecar but within vLLM's default 4 GiB: not shared, yet
    # a hit in its own process, with its data, as vLLM alone's cache makes it.
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    request(p0, [("big", big)])
    (out,) = request(p0, [("big", big)])
    assert out[0] is big


@pytest.mark.parametrize("is_cached_calls", [1, 3])
def test_stats_count_queries_and_hits_like_vllm(
    clients: Callable[[], SyncClient], sidecar: Sidecar, is_cached_calls: int
) -> None:
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    for name in ("red", "red", "blue", "red"):
        request(p0, [(name, item(len(name)))], is_cached_calls)
        if name == "red":
            eventually(lambda: p0.sync.client.is_cached([p0.key("red")]) == [True])
    stats = p0.make_stats(delta=True)
    assert (stats.hits, stats.total) == (2, 4)
    assert (p0.make_stats(delta=True).total, p0.make_stats().total) == (0, 4)
    # The sidecar counted the same traffic, however often vLLM asked: the
    # sidecar answers first what it holds, this process's own cache the rest.
    eventually(lambda: sidecar_counts(sidecar) == (4, 2))


def test_a_stale_mirror_entry_is_looked_up_once_however_often_vllm_asks(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    from mmcache._lru import Outcome

    p0 = MMCacheProcessorCache(clients(), SCOPE)
    mirror = p0.sync.client.mirror
    # The mirror believes the sidecar holds "gone" (drift); it does not.
    p0.sync.call(_believe(mirror, p0.key("gone"), Outcome))
    (out,) = request(p0, [("gone", item(1))], is_cached_calls=3)
    assert out[0] is not None  # processed, sent inline
    # One query (the lookup); the upload that follows is a re-send, not a second one.
    eventually(lambda: sidecar_counts(sidecar) == (1, 0))


async def _believe(mirror: object, key: str, outcome: object) -> None:
    mirror.apply_reply(  # type: ignore[attr-defined]
        mirror.instance_id, mirror.capacity, mirror.max_items, mirror.feed_seq,  # type: ignore[attr-defined]
        [key], [outcome.STORED], [1],  # type: ignore[attr-defined]
    )  # fmt: skip


def sidecar_counts(sidecar: Sidecar) -> tuple[float, float]:
    served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    return served.get("mmcache_queries_total", 0.0), served.get("mmcache_hits_total", 0.0)


def test_inject_outside_a_request_shares_the_items_and_counts_like_vllm(
    clients: Callable[[], SyncClient],
) -> None:
    worker, frontend = (
        MMCacheProcessorCache(clients(), SCOPE),
        MMCacheProcessorCache(clients(), SCOPE),
    )
    red = item(1)
    # What vLLM's inject_into_mm_cache does: get_and_update_item with data and
    # empty prompt updates, no is_cached before and no release after.
    assert worker.get_and_update_item((red, []), "red") == (red, [])
    assert (worker.make_stats().hits, worker.make_stats().total) == (0, 1)
    eventually(lambda: frontend.sync.client.is_cached([frontend.key("red")]) == [True])
    assert worker._ledgers.current().uploads == []  # nothing left queued


def test_a_stopped_sidecar_fails_open(sidecar: Sidecar, clients: Callable[[], SyncClient]) -> None:
    p0 = MMCacheProcessorCache(clients(), SCOPE)
    request(p0, [("red", item(1))])
    eventually(lambda: p0.sync.client.is_cached([p0.key("red")]) == [True])
    request(p0, [("blue", item(2))])
    other = MMCacheProcessorCache(clients(), SCOPE, local_gb=0)  # no cache of its own
    sidecar.stop()
    start = time.monotonic()
    (out,) = request(other, [("red", item(1))])
    assert out[0] is not None and time.monotonic() - start < 3  # data inline, no hang
    assert other.sync.client.fail_opens >= 1
    # With the sidecar down, what this process cached is still its hit, as in vLLM alone.
    (red, blue) = request(p0, [("red", item(1)), ("blue", item(2))])
    assert red[0] == item(1) and blue[0] == item(2)
    assert p0.make_stats().hits == 2


def test_an_image_not_shared_while_the_sidecar_was_down_is_shared_when_it_comes_back(
    sidecar: Sidecar, clients: Callable[[], SyncClient]
) -> None:
    """A refused or failed upload is no verdict: the item stays in its
    process's cache, and when it comes back (a hit there) it is offered again.
    The count of items not shared is exact."""

    def not_uploaded() -> float:
        return REGISTRY.get_sample_value("mmcache_vllm_not_uploaded_items_total") or 0.0

    p0 = MMCacheProcessorCache(clients(), SCOPE)
    before = not_uploaded()
    sidecar.stop()
    request(p0, [("red", item(1))])  # processed; its upload fails
    eventually(lambda: p0.uploads_in_flight == 0)
    assert not_uploaded() == before + 1
    sidecar.start()
    client = p0.sync.client
    eventually(lambda: client.following, timeout=10)
    (out,) = request(p0, [("red", item(1))])
    assert out[0] == item(1)  # its own cache's hit, its data inline
    eventually(lambda: client.is_cached([p0.key("red")]) == [True])  # and now shared
    other = MMCacheProcessorCache(clients(), SCOPE)
    (shared,) = request(other, [("red", item(9))])
    assert shared[0] == item(1)  # a hit in a process that never processed it (small: inline)
    assert not_uploaded() == before + 1


def options(env: dict[str, str]) -> dict[str, Any]:
    """MMCacheClient's arguments, as the plugin reads them from `env`."""
    return Settings.from_env(env).client_options()


def test_tls_tokens_and_a_namespace_from_the_environment(tmp_path: Path) -> None:
    """The plugin's settings as an operator gives them: P0 writes, P1 reads, over mTLS."""
    certs = tmp_path / "tls"
    subprocess.run([str(ROOT / "deploy/tls/make-certs.sh"), str(certs)], check=True)
    roles = dict(line.split()[:2] for line in (certs / "tokens").read_text().splitlines()[1:])
    (tmp_path / "read-token").write_text(roles["read"] + "\n")
    server = Sidecar(
        env={
            "MMCACHE_TLS_CERT": str(certs / "server.crt"),
            "MMCACHE_TLS_KEY": str(certs / "server.key"),
            "MMCACHE_TLS_CLIENT_CA": str(certs / "ca.crt"),
            "MMCACHE_TOKENS_FILE": str(certs / "tokens"),
        }
    )
    server.start()
    tls = {
        "MMCACHE_TLS_CA": str(certs / "ca.crt"),
        "MMCACHE_TLS_CERT": str(certs / "client.crt"),
        "MMCACHE_TLS_KEY": str(certs / "client.key"),
        "MMCACHE_NAMESPACE": "tiny@1",
    }
    try:
        frontend = SyncClient(server.target, **options({**tls, "MMCACHE_TOKEN": roles["write"]}))
        engine = SyncClient(
            server.target,
            **options({**tls, "MMCACHE_TOKEN_FILE": str(tmp_path / "read-token")}),
        )
        other = SyncClient(  # another model's namespace on the same sidecar
            server.target, **options({**tls, "MMCACHE_NAMESPACE": "other@1",
                                                  "MMCACHE_TOKEN": roles["admin"]})
        )  # fmt: skip
        try:
            p0 = MMCacheProcessorCache(frontend, SCOPE)
            p1 = MMCacheReceiverCache(engine, SCOPE)
            request(p0, [("red", item(1))])
            eventually(lambda: frontend.client.is_cached([p0.key("red")]) == [True])
            (features,) = p1.get_and_update_features([feature("red", None)])
            assert features.data == item(1)
            with pytest.raises(CacheMissError):
                other.call(other.client.fetch([p0.key("red")]))
        finally:
            for sync in (frontend, engine, other):
                sync.close()
    finally:
        server.stop()


def test_a_lookup_waits_for_another_processes_upload_no_longer_than_processing_takes(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """P0 waits for an upload in flight elsewhere about one processing time
    (measured on its own requests), not the server's 0.5 s: past it, it
    processes the item itself, and vLLM's thread is not held up."""
    import grpc

    from mmcache.client._codec import encode_item
    from mmcache.v1 import cache_pb2 as pb

    p0 = MMCacheProcessorCache(clients(), SCOPE)
    for n in range(5):  # this process's processor: about 20 ms an item
        p0.is_cached([f"own{n}"])
        time.sleep(0.02)
        p0.get_and_update_item((item(n), updates()), f"own{n}")
        p0.release_sender_touches()
    assert 0.015 < p0._processing.wait_for(1) < 0.1
    # Another API process's upload of "slow": its header is in, its bytes never come.
    spec = encode_item(from_vllm(item(9), "image")).spec.message
    header = pb.UpdateRequest(lease=pb.LEASE_NONE)
    header.entries.add(mm_hash=p0.key("slow"), modality="image", item=spec, num_chunks=1)
    done = threading.Event()

    def no_bytes_yet() -> Iterator[bytes]:
        done.wait(10)
        yield from ()

    with grpc.insecure_channel(sidecar.target) as channel:
        stalled = channel.stream_unary("/mmcache.v1.MMCache/GetAndUpdate").future(
            no_bytes_yet(), metadata=(("mmcache-update-header-bin", header.SerializeToString()),)
        )
        try:
            eventually(lambda: p0.sync.client.mirror.is_pending(p0.key("slow")))
            started = time.monotonic()
            assert p0.is_cached(["slow"]) == [False]  # processed here
            assert time.monotonic() - started < 0.3  # not the server's 0.5 s
        finally:
            done.set()
            stalled.cancel()
            p0.release_sender_touches()


def test_every_new_image_is_uploaded_small_first_or_not(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """No estimate decides what is shared: after small images, with every
    image new and a quick processor, each large one is uploaded; none is
    declined, and the sidecar counts every query, as vLLM does."""
    p0 = MMCacheProcessorCache(clients(), SCOPE)

    def not_uploaded() -> float:
        return REGISTRY.get_sample_value("mmcache_vllm_not_uploaded_items_total") or 0.0

    declined = not_uploaded()
    for n in range(30):
        data = item(n, numel=64 if n < 5 else 1 << 20)  # 256 B first, then 4 MiB
        p0.is_cached([f"new{n}"])
        time.sleep(0.001)  # a quick processor: hardly any CPU
        p0.get_and_update_item((data, updates()), f"new{n}")
        p0.release_sender_touches()
        eventually(lambda: p0.uploads_in_flight == 0)
    client = p0.sync.client
    eventually(lambda: all(client.is_cached([p0.key(f"new{n}") for n in range(30)])))
    assert not_uploaded() == declined
    stats = p0.make_stats()
    assert (stats.hits, stats.total) == (0, 30)
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    eventually(lambda: metrics(url)["mmcache_queries_total"] == 30)
    assert metrics(url)["mmcache_hits_total"] == 0


def test_a_hit_in_another_process_for_an_update_at_a_position(
    clients: Callable[[], SyncClient],
) -> None:
    p0_a = MMCacheProcessorCache(clients(), SCOPE)
    p0_b = MMCacheProcessorCache(clients(), SCOPE)
    bos = PromptIndexTargets.prefix([2])
    p0_a.is_cached(["pali"])
    p0_a.get_and_update_item((item(4), index_update(bos)), "pali")
    p0_a.release_sender_touches()
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key("pali")]) == [True])
    assert p0_b.is_cached(["pali"]) == [True]
    data, got = p0_b.get_and_update_item(None, "pali")
    p0_b.release_sender_touches()
    assert data == item(4) and got[0].target.get_match_index([2, 5], 0) == 1  # small: inline


def test_updates_that_cannot_travel_are_said_once_and_cost_no_lookup(
    clients: Callable[[], SyncClient], sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    mine = PromptIndex(lambda prompt, start_idx=0: 1, lambda tok, prompt, start_idx=0: 1)
    p0_a = MMCacheProcessorCache(clients(), SCOPE, model="tiny-odd")
    p0_b = MMCacheProcessorCache(clients(), SCOPE, model="tiny-odd")
    for p0 in (p0_a, p0_b):  # each learns it on its first item
        p0.is_cached(["odd0"])
        p0.get_and_update_item((item(0), index_update(mine)), "odd0")
        p0.release_sender_touches()
    warnings = [r for r in caplog.records if "targets a PromptIndex" in r.getMessage()]
    assert len(warnings) == 2 and "tiny-odd" in warnings[0].getMessage()  # once per process
    # A processes "odd1": B's mirror knows the sidecar holds it, but B cannot
    # use it: no lookup, and after processing it B does not upload it again.
    p0_a.is_cached(["odd1"])
    p0_a.get_and_update_item((item(1), index_update(mine)), "odd1")
    p0_a.release_sender_touches()
    client_b = p0_b.sync.client
    eventually(lambda: client_b.is_cached([p0_b.key("odd1")]) == [True])
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"

    def seen() -> tuple[float, float]:
        served = metrics(url)
        return served["mmcache_queries_total"], served["mmcache_received_bytes_total"]

    queries, received = seen()
    hits = metrics(url)["mmcache_hits_total"]
    assert p0_b.is_cached(["odd1"]) == [False]
    p0_b.get_and_update_item((item(1), index_update(mine)), "odd1")
    p0_b.release_sender_touches()
    # No lookup, no upload: the sidecar hears of one query (a miss, as vLLM
    # counts it), and receives nothing.
    eventually(lambda: seen() == (queries + 1, received))
    assert metrics(url)["mmcache_hits_total"] == hits
    assert p0_b.is_cached(["odd1"]) == [True]  # now processed here: a hit here


def test_a_vllm_that_never_releases_still_shares_what_it_processed(
    clients: Callable[[], SyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.31 (NVIDIA Dynamo 1.6's) has no release_sender_touches: items
    leave as vLLM takes them, and the next request on the thread ends the last."""
    monkeypatch.setattr("mmcache.client.vllm._p0_releases.ENDS_REQUESTS", False)
    p0_a = MMCacheProcessorCache(clients(), SCOPE)
    p0_b = MMCacheProcessorCache(clients(), SCOPE)

    def request_0_31(cache: MMCacheProcessorCache, pairs: list[tuple[str, int]]) -> list[bool]:
        hashes = [h for h, _ in pairs]
        cached = cache.is_cached(hashes)
        for h in hashes:
            cache.touch_sender_cache_item(h)
        for (h, seed), hit in zip(pairs, cached, strict=True):
            cache.get_and_update_item(None if hit else (item(seed), updates()), h)
        return cached

    assert request_0_31(p0_a, [("one", 1), ("two", 2)]) == [False, False]
    client_b = p0_b.sync.client
    eventually(lambda: client_b.is_cached([p0_b.key("one"), p0_b.key("two")]) == [True, True])
    assert request_0_31(p0_b, [("two", 2), ("three", 3)]) == [True, False]
    client_a = p0_a.sync.client
    eventually(lambda: client_a.is_cached([p0_a.key("three")]) == [True])
    assert request_0_31(p0_a, [("three", 3)]) == [True]  # a new request: the last one ended
    stats = p0_a.make_stats()
    assert (stats.hits, stats.total) == (1, 3)


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_behind_an_l2_tier_an_item_another_node_processed_is_a_hit() -> None:
    # Two nodes' sidecars on one Redis Cluster. B's mirror follows B alone, so
    # its "no" is not the fleet's: behind a shared tier P0 asks about every
    # item, and B reads A's upload through from L2.
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(redis_cluster())
        env = {"MMCACHE_L2": cluster.url, "MMCACHE_L2_ADMIT": "first"}
        nodes = stack.enter_context(sidecars(2, env))
        syncs = [SyncClient(node.target, deadline_s=1.0) for node in nodes]
        for sync in syncs:
            stack.callback(sync.close)
        p0_a, p0_b = (MMCacheProcessorCache(sync, SCOPE) for sync in syncs)
        assert syncs[1].client.shared_tier
        red = item(1)
        (out,) = request(p0_a, [("red", red)])
        assert out[0] is red  # processed on A, uploaded, written behind to L2
        first = f"http://127.0.0.1:{nodes[0].metrics_port}/metrics"
        eventually(lambda: metrics(first).get("mmcache_l2_written_bytes_total", 0) > 0)
        (out,) = request(p0_b, [("red", item(9))])
        # A hit on B: read through from L2 into B's cache, and sent inline (small).
        assert out[0] == red and same_updates(list(out[1]), updates())
        eventually(lambda: leases(syncs[1]) == 0)  # its lease given back
        (out,) = request(p0_b, [("blue", item(2))])
        assert out[0] is not None  # held nowhere: processed on B


def test_only_vllms_own_digests_reach_the_sidecar_a_clients_uuid_stays_here(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """Issue 43: a request's multi_modal_uuids (NVIDIA Dynamo's worker gives
    64-bit ones padded with zeros) name an item by the client's word: kept in
    this process's own cache, a hit there, and never looked up in or uploaded
    to the sidecar, where another image could share the uuid."""
    from vllm.multimodal.hasher import MultiModalHasher

    from mmcache.client.vllm._digests import is_digest, record_digests

    record_digests()
    record_digests()  # idempotent: the plugin loads more than once
    digest = MultiModalHasher.hash_kwargs("blake3", model_id="m", image=torch.ones(3))
    padded = digest[:16] + "0" * 48  # Dynamo's worker's uuid for it
    assert is_digest(digest, "blake3") and not is_digest(padded, "blake3")
    assert not is_digest("my-own-name", "blake3") and not is_digest(digest, "sha512")
    # A uuid hashed with processor settings (vLLM does so where some are set).
    salted = MultiModalHasher.hash_kwargs(
        "blake3", model_id="m", image="uuid-1", mm_processor_kwargs={"max_pixels": 9}
    )
    assert not is_digest(salted, "blake3")
    p0 = MMCacheProcessorCache(clients(), SCOPE, shareable=lambda h: is_digest(h, "blake3"))
    for _ in range(2):  # processed, then a hit of this process's own cache
        request(p0, [(padded, item(1)), (digest, item(2))])
    client = p0.sync.client
    eventually(lambda: client.is_cached([p0.key(digest)]) == [True])
    assert client.is_cached([p0.key(padded)]) == [False]
    stats = p0.make_stats()
    assert (stats.hits, stats.total) == (2, 4)  # vLLM's counts
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    eventually(lambda: metrics(url)["mmcache_queries_total"] == 4)  # the sidecar's equal them
    assert metrics(url)["mmcache_hits_total"] == 2


def digest_of(size: tuple[int, int], color: str) -> str:
    """vLLM's digest of a plain image of `size` (the shape recorded as vLLM
    hashes it: client/vllm/_digests.py)."""
    from PIL import Image
    from vllm.multimodal.hasher import MultiModalHasher

    from mmcache.client.vllm._digests import record_digests

    record_digests()
    image: Any = Image.new("RGB", size, color)
    with contextlib.suppress(ImportError):  # as vLLM 0.32's loader gives it
        from vllm.multimodal.media import MediaWithBytes

        image = MediaWithBytes(image, f"{color} {size}".encode(), None)
    return str(MultiModalHasher.hash_kwargs("blake3", model_id="m", image=image))


def kept_small() -> float:
    """Small images processed in this process and not uploaded, so far."""
    return REGISTRY.get_sample_value("mmcache_vllm_kept_small_items_total") or 0.0


def test_a_small_image_stays_in_its_process_as_vllm_alone_keeps_it(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """An image of at most 256x256 pixels whose item came out under 1 MiB the
    last time this process processed one of its dimensions is kept as vLLM
    alone keeps it (client/vllm/_small.py): with one API process on the
    sidecar, processed here, hit here, never claimed nor uploaded. The first
    of a shape is shared (nothing was known of it), and a larger image is
    shared whatever its item's size. Counted as vLLM counts them, at P0 and
    at the sidecar."""
    from PIL import Image
    from vllm.multimodal.hasher import MultiModalHasher

    from mmcache.client.vllm._digests import input_shape

    first, icon, photo, other = (
        digest_of((64, 64), "red"),
        digest_of((64, 64), "blue"),
        digest_of((512, 512), "red"),
        digest_of((512, 512), "blue"),
    )
    assert input_shape(icon) == (64, 64, "")
    # Per-request processor settings are part of the shape: they change the item.
    salted = MultiModalHasher.hash_kwargs(
        "blake3", model_id="m", image=Image.new("RGB", (64, 64)), mm_processor_kwargs={"a": 9}
    )
    assert input_shape(salted) == (64, 64, "mm_processor_kwargs={'a': 9}")
    p0 = MMCacheProcessorCache(clients(), SCOPE, shape_of=input_shape)
    client, url = p0.sync.client, f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    kept = kept_small()
    request(p0, [(first, item(1)), (photo, item(2))])  # nothing known yet: both shared
    eventually(lambda: client.is_cached([p0.key(first), p0.key(photo)]) == [True, True])
    # Known now: a 64x64 image makes a 4 KiB item here; 512x512 is too large.
    request(p0, [(icon, item(3)), (other, item(4))])
    eventually(lambda: client.is_cached([p0.key(other)]) == [True])
    (hit,) = request(p0, [(icon, item(9))])  # this process's own hit, its data inline
    assert hit[0] == item(3) and same_updates(list(hit[1]), updates())
    assert client.is_cached([p0.key(icon)]) == [False]  # never reached the sidecar
    assert kept_small() == kept + 1
    stats = p0.make_stats()
    assert (stats.hits, stats.total) == (1, 5)
    eventually(lambda: metrics(url)["mmcache_queries_total"] == 5)
    assert metrics(url)["mmcache_hits_total"] == 1
    assert metrics(url)["mmcache_items"] == 3  # first, photo, other


def shm_bytes(sidecar: Sidecar, direction: str) -> float:
    """Payload bytes through the sidecar's region so far, one way."""
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    return metrics(url, direction=direction).get("mmcache_shm_bytes_total", 0.0)


def icon_processes(
    clients: Callable[[], SyncClient], *, share_kept: bool = True
) -> tuple[MMCacheProcessorCache, MMCacheProcessorCache]:
    """Two API processes on one sidecar (single flight on, as with several API
    servers), each of which learnt from a first icon of its own that icons
    make small items."""
    from mmcache.client.vllm._digests import input_shape

    first_a, first_b = (digest_of((64, 64), c) for c in ("red", "green"))
    p0_a, p0_b = (
        MMCacheProcessorCache(
            clients(), SCOPE, shape_of=input_shape, single_flight=True, share_kept=share_kept
        )
        for _ in range(2)
    )
    for sync in (p0_a.sync, p0_b.sync):
        eventually(lambda sync=sync: sync.client.region is not None)
    request(p0_a, [(first_a, item(1))])
    request(p0_b, [(first_b, item(2))])
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key(first_a)]) == [True])
    return p0_a, p0_b


def test_a_small_image_is_shared_through_shared_memory_where_processes_share_the_sidecar(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """With several API processes on the sidecar (single flight on), a small
    image kept in its process goes up all the same, into the sidecar's shared
    memory: another process that keeps images of its shape hits it there
    with no call (leased in the region, not processed), and its engine reads
    it there. Counted as vLLM counts them."""
    p0_a, p0_b = icon_processes(clients)
    p1 = MMCacheReceiverCache(clients(), SCOPE)
    eventually(lambda: p1.sync.client.region is not None)
    icon = digest_of((64, 64), "blue")
    kept = kept_small()
    written = shm_bytes(sidecar, "write")
    (out,) = request(p0_a, [(icon, item(3))])  # kept in A, processed: goes up into the region
    assert out[0] is not None  # processed, sent inline
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key(icon)]) == [True])
    assert shm_bytes(sidecar, "write") > written  # through a write slot, resident at once
    (hit,) = request(p0_b, [(icon, item(9))])  # B keeps icons too: hit there, not processed
    assert hit[0] is None and same_updates(list(hit[1]), updates())  # the engine reads it
    assert leases(p1.sync) == 1
    assert p1.get_and_update_features([feature(icon, None)])[0].data == item(3)
    eventually(lambda: leases(p1.sync) == 0)
    assert kept_small() == kept
    stats = p0_b.make_stats()
    assert (stats.hits, stats.total) == (1, 2)
    eventually(lambda: sidecar_counts(sidecar) == (4, 1))


def test_a_small_image_shared_a_moment_ago_is_hit_before_the_feed_tells_of_it(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """B's mirror has not heard of A's icon yet (here: B's mirror dropped
    it): B finds it in the region's index all the same and leases it with no
    call, a hit rather than a second processor run."""
    p0_a, p0_b = icon_processes(clients)
    icon = digest_of((64, 64), "blue")
    kept = kept_small()
    request(p0_a, [(icon, item(3))])  # kept in A, processed: goes up into the region
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key(icon)]) == [True])

    async def forget() -> None:  # on B's loop, which owns its mirror
        p0_b.sync.client.forget([p0_b.key(icon)])

    p0_b.sync.call(forget())
    assert p0_b.sync.client.is_cached([p0_b.key(icon)]) == [False]
    (hit,) = request(p0_b, [(icon, item(9))])  # the region has it: not processed
    assert hit[0] is None and same_updates(list(hit[1]), updates())
    assert kept_small() == kept
    stats = p0_b.make_stats()
    assert (stats.hits, stats.total) == (1, 2)
    eventually(lambda: sidecar_counts(sidecar) == (4, 1))


def posted_uploads(sidecar: Sidecar) -> float:
    """Uploads the sidecar applied from its clients' report rings (no call)."""
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    return metrics(url, result="applied").get("mmcache_posted_uploads_total", 0.0)


def test_a_small_image_goes_up_with_no_call_once_its_process_holds_spare_slots(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """A's first shared icon goes by call, and its reply brings spare write
    slots of its size; A's next icon is written into a spare and posted in
    its report ring with no call. B hits it there, the engine reads it, and
    the counts are vLLM's."""
    p0_a, p0_b = icon_processes(clients)
    p1 = MMCacheReceiverCache(clients(), SCOPE)
    eventually(lambda: p1.sync.client.region is not None)
    blue, yellow = (digest_of((64, 64), c) for c in ("blue", "yellow"))
    request(p0_a, [(blue, item(3))])  # by call: spares of an icon's size come back
    eventually(lambda: p0_a.uploads_in_flight == 0)
    posted = posted_uploads(sidecar)
    (out,) = request(p0_a, [(yellow, item(4))])
    assert out[0] is not None  # processed, sent inline
    eventually(lambda: posted_uploads(sidecar) == posted + 1)  # with no call
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key(yellow)]) == [True])
    (hit,) = request(p0_b, [(yellow, item(9))])  # B hits it in the region: not processed
    assert hit[0] is None and same_updates(list(hit[1]), updates())
    assert p1.get_and_update_features([feature(yellow, None)])[0].data == item(4)
    eventually(lambda: leases(p1.sync) == 0)
    eventually(lambda: sidecar_counts(sidecar) == (5, 1))


def test_a_small_image_stays_in_its_process_where_sharing_small_images_is_off(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """MMCACHE_SHARE_SMALL=off: with several API processes too, a small image
    is kept in its process and never uploaded, as vLLM alone keeps it: its
    repeat there hits this process's own cache, another process processes
    it. Counted as vLLM counts them."""
    p0_a, p0_b = icon_processes(clients, share_kept=False)
    icon = digest_of((64, 64), "blue")
    kept, written = kept_small(), shm_bytes(sidecar, "write")
    (out,) = request(p0_a, [(icon, item(3))])  # kept in A, processed
    assert out[0] is not None
    (again,) = request(p0_a, [(icon, item(3))])  # A's own cache's hit: its data inline
    assert again[0] == item(3)
    (other,) = request(p0_b, [(icon, item(3))])  # B never heard of it: processed there
    assert other[0] is not None
    eventually(lambda: p0_a.uploads_in_flight == 0)
    assert p0_b.sync.client.is_cached([p0_b.key(icon)]) == [False]
    assert shm_bytes(sidecar, "write") == written
    assert kept_small() == kept + 2  # processed in A and in B, uploaded by neither
    stats = p0_a.make_stats()
    assert (stats.hits, stats.total) == (1, 3)
    eventually(lambda: sidecar_counts(sidecar) == (5, 1))


def small_paused() -> float:
    """Small images not shared because the sidecar paused their sharing, so far."""
    return REGISTRY.get_sample_value("mmcache_vllm_small_paused_items_total") or 0.0


def steady(read: Callable[[], float]) -> float:
    """`read()` once it gives the same value twice, 0.2 s apart."""
    last = read()
    while True:
        time.sleep(0.2)
        now = read()
        if now == last:
            return now
        last = now


def test_while_the_sidecar_pauses_small_sharing_only_its_sample_goes_up(
    clients: Callable[[], SyncClient], sidecar: Sidecar
) -> None:
    """Icons each sent once: after 32 stored and none asked for again the
    sidecar pauses small images' sharing (server/cache/_reuse.py). A then
    keeps an icon outside the one-in-8 sample in its process, counted, and B
    processes it, as vLLM alone would; an icon of the sample still goes up,
    and B hits it in the region."""
    from mmcache._shm_layout import sampled

    p0_a, p0_b = icon_processes(clients)
    region = p0_a.sync.client.region
    assert region is not None and not region.small_paused()
    colors = (f"#{n:06x}" for n in range(1, 1 << 20))
    for n in range(40):
        request(p0_a, [(digest_of((64, 64), next(colors)), item(n))])
        eventually(lambda: p0_a.uploads_in_flight == 0)
    eventually(region.small_paused)
    out_of, of = "", ""
    while not (out_of and of):
        icon = digest_of((64, 64), next(colors))
        if sampled(p0_a.key(icon)):
            of = of or icon
        else:
            out_of = out_of or icon
    # The loop's last posts are applied by now (a post is no upload in flight).
    written = steady(lambda: shm_bytes(sidecar, "write"))
    paused = small_paused()
    (out,) = request(p0_a, [(out_of, item(50))])  # kept in A, not shared
    assert out[0] is not None
    eventually(lambda: p0_a.uploads_in_flight == 0)
    assert small_paused() == paused + 1 and shm_bytes(sidecar, "write") == written
    (other,) = request(p0_b, [(out_of, item(50))])  # B processes it, as vLLM alone would
    assert other[0] is not None
    request(p0_a, [(of, item(51))])  # in the sample: goes up all the same
    eventually(lambda: p0_b.sync.client.is_cached([p0_b.key(of)]) == [True])
    (hit,) = request(p0_b, [(of, item(52))])
    assert hit[0] is None  # leased in the region: not processed
    assert small_paused() == paused + 2  # B's processing of the first, not shared either


def test_the_engine_cache_follows_no_feed_unless_its_process_has_a_client_that_does(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's P1 cache only reads (the region, or `fetch`): alone in its
    process its client does not follow the feed, so the fleet's uploads wake
    no thread of the engine's; beside a P0 cache (one process: vLLM's
    in-process engine) it shares that one's client."""
    from types import SimpleNamespace

    from mmcache.client.vllm import _factories, runtime

    monkeypatch.setenv("MMCACHE_TARGET", sidecar.target)
    multimodal = SimpleNamespace(
        mm_processor_cache_gb=1.0, mm_hasher_algorithm="blake3", mm_processor_cache_type="lru"
    )

    def config(api_servers: int) -> SimpleNamespace:  # the fields of vLLM's config read
        return SimpleNamespace(
            model_config=SimpleNamespace(
                model="tiny",
                supports_multimodal_inputs=True,
                get_multimodal_config=lambda: multimodal,
            ),
            parallel_config=SimpleNamespace(
                _api_process_count=api_servers,
                data_parallel_size=1,
                data_parallel_external_lb=False,
            ),
        )

    try:
        engine = _factories.engine_receiver_cache_from_config(config(1))
        assert engine.sync.client.feed is None
        # vLLM alone's engine keeps an LRU with one API server, none with four.
        assert engine._own is not None
        assert _factories.engine_receiver_cache_from_config(config(4))._own is None
        processor = _factories.processor_cache_from_config(config(1))
        following = processor._lookup._p0.sync
        assert following is not engine.sync and following.client.feed is not None
        assert _factories.engine_receiver_cache_from_config(config(1)).sync is following
    finally:
        for follow in (False, True):
            made = runtime._process_clients.pop((sidecar.target, follow), None)
            if made is not None:
                made.close()


@pytest.mark.parametrize(
    ("setting", "keeps", "shares_kept"),
    [(None, True, True), ("auto", True, True), ("off", True, False), ("on", False, True)],
)
def test_the_factory_reads_the_small_image_setting(
    sidecar: Sidecar,
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    keeps: bool,
    shares_kept: bool,
) -> None:
    """vLLM's P0 cache as the plugin builds it, with 4 API servers: single
    flight on; small images kept (their shapes known) but with `on`, and those
    kept uploaded into the region but with `off`."""
    from types import SimpleNamespace

    from mmcache.client.vllm import _factories, runtime
    from mmcache.client.vllm._small import no_shape

    monkeypatch.setenv("MMCACHE_TARGET", sidecar.target)
    if setting is None:
        monkeypatch.delenv("MMCACHE_SHARE_SMALL", raising=False)
    else:
        monkeypatch.setenv("MMCACHE_SHARE_SMALL", setting)
    multimodal = SimpleNamespace(mm_processor_cache_gb=1.0, mm_hasher_algorithm="blake3")
    config = SimpleNamespace(  # the fields of vLLM's config the factory reads
        model_config=SimpleNamespace(
            model="tiny", supports_multimodal_inputs=True, get_multimodal_config=lambda: multimodal
        ),
        parallel_config=SimpleNamespace(_api_process_count=4),
    )
    try:
        cache = _factories.processor_cache_from_config(config)
        context = cache._lookup._p0
        assert context.single_flight
        # Its mirror need not be fresh (docs/vllm.md): fewer feed wake-ups.
        assert context.sync.client.feed_gap_s == _factories.SINGLE_FLIGHT_FEED_GAP_S > 0.05
        assert (context.small._shape_of is not no_shape) == keeps
        assert context.share_kept == shares_kept
    finally:
        made = runtime._process_clients.pop((sidecar.target, True), None)
        if made is not None:
            made.close()
