"""Never fewer hits than vLLM alone: generated traces through the plugin's P0.

Hypothesis draws traces (image sizes from a 64x64 icon's to a 1920x1080
photo's, in any order, small first among them; repeat structures; 1-4 API
processes; vLLM's `--mm-processor-cache-gb` from nothing to all the images)
and drives real `MMCacheProcessorCache`s, one per API process, each with its
own client, against ONE real sidecar, in vLLM's order of calls
(processor.py: is_cached, the processor on the misses, a touch of every
item, get_and_update_item). Beside them runs `VllmAlone`: each process's
cache as vLLM alone keeps it, written here from vLLM's LRU semantics (bytes,
least recently used out first, an item over the whole cache never kept). Per
request, every item vLLM alone hits is a hit with the plugin; with the
sidecar serving every process and holding every image, the processor runs at
most 1.1x the unique images it shares, and on the icons it keeps in their
process (client/vllm/_small.py, on as by default) at most as often as vLLM
alone; with the sidecar small or stopped mid-trace,
still never fewer hits than vLLM alone (single flight on throughout, as
with several API servers). And four processes that get one new image at
the same moment process it once. No engine: the items are vLLM's real
types, and the sidecar is a real server process.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

try:  # vLLM 0.32 and later: a package
    from vllm.multimodal.cache.base import MultiModalCache, MultiModalProcessorCacheItem
except ImportError:  # 0.31: a module
    from vllm.multimodal.cache import (  # type: ignore[attr-defined,no-redef]
        MultiModalCache,
        MultiModalProcessorCacheItem,
    )
from vllm.multimodal.inputs import MultiModalKwargsItem

from mmcache.client.vllm._caches import MMCacheProcessorCache
from mmcache.client.vllm._digests import Shape
from mmcache.client.vllm.runtime import SyncClient

from .conftest import Sidecar
from .serve import metrics
from .test_caches import eventually, item, updates

# Values per image (float32): one per 64 pixels of a 64x64, 448x448,
# 1024x1024 and 1920x1080 image, so that sizes keep their ratios (a
# 1920x1080 is 500x an icon) and a trace runs in about a second.
SIZES = {"64x64": 64, "448x448": 3_136, "1024x1024": 16_384, "1920x1080": 32_400}
ICON = "64x64"  # the one size of these the plugin keeps in its process (_small.py)
MOST_PROCESSES = 4


class VllmAlone:
    """One API process's cache in vLLM alone (vllm.utils.cache.LRUCache as
    its processor caches use it): `capacity` bytes; `get` reorders; a touch
    reorders a held key only; an item larger than the whole cache is not
    kept; the least recently used go first until a new item fits. A hit
    that an earlier item of the same request evicted is put back: vLLM's
    processor asserts there and fails the request, and the plugin is held to
    the stricter bar of a vLLM alone that did not."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.held: OrderedDict[str, int] = OrderedDict()

    def request(self, images: list[tuple[str, int]]) -> set[str]:
        """One request's items (hash, size): the hashes it hits."""
        hits = {h for h, _ in images if h in self.held}
        for h, _ in images:
            if h in self.held:
                self.held.move_to_end(h)
        for h, size in images:
            if h in self.held:
                self.held.move_to_end(h)
            elif size <= self.capacity:
                while sum(self.held.values()) + size > self.capacity:
                    self.held.popitem(last=False)
                self.held[h] = size
        return hits


@dataclass
class Trace:
    sizes: list[str]  # per image, a key of SIZES
    local_share: float  # vLLM's cache as a share of the images' total bytes
    requests: list[tuple[int, list[int]]]  # (process, images)

    def __str__(self) -> str:
        return f"sizes={self.sizes} local_share={self.local_share:.2f} requests={self.requests}"


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    sizes = draw(st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=8))
    if draw(st.booleans()):  # small first: the order that locked the old admission out
        sizes.sort(key=SIZES.__getitem__)
    processes = draw(st.integers(1, MOST_PROCESSES))
    images = st.lists(st.integers(0, len(sizes) - 1), min_size=1, max_size=3, unique=True)
    requests = draw(st.lists(st.tuples(st.integers(0, processes - 1), images), max_size=24))
    share = draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.2]))
    return Trace(sizes, share, requests)


def vllm_item(image: int, size: str) -> MultiModalKwargsItem:
    return item(image, numel=SIZES[size])


def item_bytes(data: MultiModalKwargsItem) -> int:
    """The size vLLM's processor cache charges for an item (its own function)."""
    return int(MultiModalCache.get_item_size(MultiModalProcessorCacheItem(data, updates())))


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[Sidecar, list[SyncClient]]]:
    """One sidecar (256 MiB: every trace's images) and one client per API process."""
    server = Sidecar()
    server.start()
    made = [SyncClient(server.target, deadline_s=1.0) for _ in range(MOST_PROCESSES)]
    for sync in made:
        sync.call(sync.client.wait_following())
    try:
        yield server, made
    finally:
        for sync in made:
            sync.close()
        server.stop()


@dataclass
class Runs:
    """Processor runs over a trace, with mmcache and with vLLM alone, and
    those of them on icons."""

    mmcache: int = 0
    alone: int = 0
    icons: int = 0
    icons_alone: int = 0


def run_trace(
    trace: Trace, syncs: list[SyncClient], *, settle: bool, stop: int = -1, sidecar: Sidecar
) -> tuple[Runs, tuple[int, int]]:
    """Drive `trace` through one P0 per process and through vLLM alone; assert
    per request that vLLM alone's hits are hits. Returns the processor runs
    and vLLM's counts with mmcache (queries, hits, over every process).
    `settle`: each upload reaches every process's mirror before the next
    request. `stop`: the sidecar stops before request number `stop`."""
    scope = uuid.uuid4().hex  # a fresh key space per trace, on the one sidecar
    data = [vllm_item(i, size) for i, size in enumerate(trace.sizes)]
    total = sum(item_bytes(d) for d in data)
    local_gb = trace.local_share * total / 2**30
    # Each image's dimensions, as vLLM's hasher records them (_digests.py).
    shapes: dict[str, Shape] = {}
    for i, size in enumerate(trace.sizes):
        width, height = map(int, size.split("x"))
        shapes[f"img{i}"] = (width, height, "")
    # Single flight on, as with several API servers: its waits and claims
    # must not cost a hit either; nor must keeping icons in their process.
    p0s = [
        MMCacheProcessorCache(
            sync, scope, local_gb=local_gb, single_flight=True, shape_of=shapes.get
        )
        for sync in syncs
    ]
    alone = [VllmAlone(local_gb * 2**30) for _ in syncs]
    runs = Runs()
    knows_icons = [False] * len(syncs)  # processed one: keeps the next ones
    for n, (process, images) in enumerate(trace.requests):
        if n == stop:
            sidecar.stop()
        hashes = [f"img{i}" for i in images]
        p0 = p0s[process]
        cached = p0.is_cached(hashes)
        for h in hashes:
            p0.touch_sender_cache_item(h)
        for h, i, hit in zip(hashes, images, cached, strict=True):
            p0.get_and_update_item(None if hit else (data[i], updates()), h)
        p0.release_sender_touches()
        hits = {h for h, hit in zip(hashes, cached, strict=True) if hit}
        expected = alone[process].request([(f"img{i}", item_bytes(data[i])) for i in images])
        assert expected <= hits, f"request {n}: vLLM alone hit {expected - hits} too"
        icons = {f"img{i}" for i in images if trace.sizes[i] == ICON}
        runs.mmcache += len(hashes) - len(hits)
        runs.alone += len(hashes) - len(expected)
        runs.icons += len(icons - hits)
        runs.icons_alone += len(icons - expected)
        if settle:  # icons this process kept may never reach the sidecar
            kept = icons if knows_icons[process] else set()
            settled(p0, syncs, [p0.key(h) for h in hashes if h not in kept])
        knows_icons[process] |= bool(icons - hits)
    stats = [p0.make_stats() for p0 in p0s]
    return runs, (sum(s.total for s in stats), sum(s.hits for s in stats))


def sidecar_counts(sidecar: Sidecar) -> tuple[float, float]:
    """The sidecar's queries and hits so far (mmcache_queries_total, mmcache_hits_total)."""
    served = metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    return served["mmcache_queries_total"], served["mmcache_hits_total"]


def settled(p0: MMCacheProcessorCache, syncs: list[SyncClient], keys: list[str]) -> None:
    """The request's uploads ended, and every process's mirror holds its items."""
    eventually(lambda: p0.uploads_in_flight == 0)
    for sync in syncs:
        eventually(lambda sync=sync: all(sync.client.is_cached(keys)))  # type: ignore[misc]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(trace=traces())
def test_one_sidecar_never_fewer_hits_and_each_image_processed_about_once(
    shared: tuple[Sidecar, list[SyncClient]], trace: Trace
) -> None:
    server, syncs = shared
    print(trace)
    before = sidecar_counts(server)
    runs, (queries, hits) = run_trace(trace, syncs, settle=True, sidecar=server)
    shared = {i for _, images in trace.requests for i in images if trace.sizes[i] != ICON}
    assert runs.mmcache <= runs.alone
    assert runs.mmcache - runs.icons <= 1.1 * len(shared)
    assert runs.icons <= runs.icons_alone
    # Exact counts: the sidecar's queries and hits in the trace are vLLM's
    # (its own-cache hits and the misses no call told it of arrive by report).
    expected = (before[0] + queries, before[1] + hits)
    eventually(lambda: sidecar_counts(server) == expected, timeout=10)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(trace=traces(), stop=st.integers(0, 24), capacity_mb=st.sampled_from([1, 256]))
# A hit the request's own misses evict before vLLM takes it, held here then
# confirmed by the sidecar, then the sidecar stopped; and with it down.
@example(
    trace=Trace(["1024x1024"] * 4, 0.5, [(0, [0]), (0, [1, 0, 2]), (0, [1, 0, 2]), (0, [0])]),
    stop=3,
    capacity_mb=1,
)
@example(
    trace=Trace(["1024x1024"] * 2, 0.5, [(0, [0, 1]), (0, [0, 1]), (0, [0])]),
    stop=0,
    capacity_mb=1,
)
def test_a_full_or_stopped_sidecar_never_costs_a_hit_of_vllm_alone(
    trace: Trace, stop: int, capacity_mb: int
) -> None:
    server = Sidecar(capacity_gb=capacity_mb / 1024)  # 1 MiB: evicting all the time
    server.start()
    syncs = [SyncClient(server.target, deadline_s=0.2) for _ in range(MOST_PROCESSES)]
    try:
        for sync in syncs:
            sync.call(sync.client.wait_following())
        print(trace, f"stop={stop} capacity_mb={capacity_mb}")
        runs, _ = run_trace(trace, syncs, settle=False, stop=stop, sidecar=server)
        assert runs.mmcache <= runs.alone
    finally:
        for sync in syncs:
            sync.close()
        server.stop()


def test_small_images_first_then_large_repeats_are_hits_in_every_process(
    shared: tuple[Sidecar, list[SyncClient]],
) -> None:
    """The issue's trace: each of 4 processes answers a small image first (a
    readiness probe), then 1024x1024 images come back across processes: each
    large image is processed once in all, its repeats are hits everywhere."""
    server, syncs = shared
    probe = [(p, [0]) for p in range(4)]
    chats = [(n % 4, [1 + (n % 7)]) for n in range(40)]
    trace = Trace(["64x64"] + ["1024x1024"] * 7, 0.5, probe + chats)
    before = sidecar_counts(server)
    runs, (queries, hits) = run_trace(trace, syncs, settle=True, sidecar=server)
    assert runs.mmcache == 8  # the probe's image and the 7 large ones, once each
    assert runs.alone > runs.mmcache  # vLLM alone processes each image once per process
    eventually(lambda: sidecar_counts(server) == (before[0] + queries, before[1] + hits))


def at_once(p0s: list[MMCacheProcessorCache], images: dict[str, MultiModalKwargsItem]) -> list[str]:
    """Every process requests each image, in turn, at the same moment as the
    others (a thread each, in vLLM's order of calls); the hash of each
    processing, as many times as the image was processed."""
    start = threading.Barrier(len(p0s))
    runs: list[str] = []

    def serve(p0: MMCacheProcessorCache) -> None:
        for h, data in images.items():
            start.wait()
            (hit,) = p0.is_cached([h])
            p0.touch_sender_cache_item(h)
            if not hit:
                runs.append(h)
                time.sleep(0.01)  # the processor
            p0.get_and_update_item(None if hit else (data, updates()), h)
            p0.release_sender_touches()

    threads = [threading.Thread(target=serve, args=(p0,)) for p0 in p0s]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return runs


def test_processes_that_see_a_new_image_at_once_process_it_once(
    shared: tuple[Sidecar, list[SyncClient]],
) -> None:
    """Single flight: four API processes get the same new image at the same
    moment (four chats starting together). One claims it at the sidecar and
    processes it; the others' lookups wait for its upload and hit. vLLM's
    counts stay exact: the sidecar's queries and hits are theirs."""
    server, syncs = shared
    scope = uuid.uuid4().hex
    p0s = [MMCacheProcessorCache(sync, scope, single_flight=True) for sync in syncs]
    images = {f"img{i}": vllm_item(i, "448x448") for i in range(3)}
    before = sidecar_counts(server)
    runs = at_once(p0s, images)
    assert sorted(runs) == ["img0", "img1", "img2"]  # once each, not once per process
    stats = [p0.make_stats() for p0 in p0s]
    queries, hits = sum(s.total for s in stats), sum(s.hits for s in stats)
    assert (queries, hits) == (12, 9)
    eventually(lambda: sidecar_counts(server) == (before[0] + queries, before[1] + hits))


def test_an_image_stale_mirrors_still_name_is_processed_once(sidecar: Sidecar) -> None:
    """Single flight with mirrors behind the sidecar (API processes follow the
    feed every 250 ms; here 2 s): two processes whose mirrors still list an
    image the sidecar has dropped get it at the same moment. One claims it
    and processes it; the other waits for its upload and hits."""
    syncs = [SyncClient(sidecar.target, deadline_s=1.0, feed_gap_s=2.0) for _ in range(2)]
    uploader = SyncClient(sidecar.target, deadline_s=1.0)
    try:
        for sync in syncs:
            sync.call(sync.client.wait_following())
        scope = uuid.uuid4().hex
        p0s = [MMCacheProcessorCache(sync, scope, single_flight=True) for sync in syncs]
        first = MMCacheProcessorCache(uploader, scope)  # (claims nothing)
        data, h = vllm_item(0, "448x448"), "img0"
        assert first.is_cached([h]) == [False]
        first.touch_sender_cache_item(h)
        first.get_and_update_item((data, updates()), h)
        first.release_sender_touches()
        settled(first, syncs, [first.key(h)])  # both mirrors heard of it, and now rest
        uploader.call(uploader.client.clear_cache())  # the sidecar drops it: unsaid for 2 s
        assert all(sync.client.is_cached([first.key(h)]) == [True] for sync in syncs)
        runs = at_once(p0s, {h: data})
        assert runs == [h]  # once, not once per process
        assert (
            metrics(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")["mmcache_claims_total"] == 1
        )
    finally:
        for sync in [*syncs, uploader]:
            sync.close()
